"""The real pair's forward costs on a GPU: a standalone device check (no project imports).

The weights cannot travel to a lent GPU machine (538 MB; it takes 64 MiB and reaches no
registry), but a forward's cost depends on the geometry, not on the values. This script
builds the SmolLM2-135M target and the trained 2-layer draft from their config.json files
with random weights, on CUDA, and times with the KV cache of a 128-token prefix:
- the target decoding one token, and evaluating 2, 3, 5, 9 and 17 positions (a round's
  witness rows at D = 1, 2, 4, 8, 16);
- the draft decoding one token.
Each is the median of 50 timed calls after 10 warm-ups, cache cropped back after each, in
float32 and bfloat16. Acceptance is a property of the models, not the hardware (greedy
rounds are deterministic), so these costs and the tokens per round measured on CPU give
the lanes' rates on this GPU (docs/benchmarks.md, "The real pair on a GPU").

    python3 scripts/gpu_pair_costs.py TARGET_DIR DRAFT_DIR > costs.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def timed(fn, warm: int = 10, runs: int = 50) -> float:
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def costs(config_path: str, dtype, positions: list[int]) -> dict[str, float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()
    prefix = torch.randint(3, config.vocab_size, (1, 128), device="cuda")
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(prefix, past_key_values=cache, use_cache=True)
        held = cache.get_seq_length()
        out = {}
        for n in positions:
            tokens = torch.randint(3, config.vocab_size, (1, n), device="cuda")

            def step(tokens=tokens, n=n):
                model(tokens, past_key_values=cache, use_cache=True)
                cache.crop(held)

            out[str(n)] = timed(step) * 1e3
    return out


def main() -> None:
    import torch

    target_config, draft_config = sys.argv[1], sys.argv[2]  # folders holding config.json
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ms": {}}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        report["ms"][name] = {
            "target": costs(target_config, dtype, [1, 2, 3, 5, 9, 17]),
            "draft": costs(draft_config, dtype, [1]),
        }
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
