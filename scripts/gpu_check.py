#!/usr/bin/env python
"""GPU check of the torch target backend: contract, greedy exactness, round latency.

Run it from the repository root on the machine with the GPU (the fixtures are built and
cached by `muser fixtures build`; the first run builds them, 2–5 minutes on CPU):

    python scripts/gpu_check.py                          # the fixture target on cuda
    python scripts/gpu_check.py --device cuda:1 --receipt bench-receipts/gpu.json
    python scripts/gpu_check.py --dtype bfloat16         # reduced precision: wider tolerance
    python scripts/gpu_check.py --target DIR             # another checkpoint (its tokenizer)
    python scripts/gpu_check.py --device cpu --quick     # rehearse every check on CPU (~15 s)

Three parts, each printed as a markdown table and written to one JSON receipt
(default `bench-receipts/gpu-check-<time>.json`; the timing samples are hashed, as `muser
bench` does):

1. **contract** — the torch target backend (`muser_torch.backend`) on the
   device: float64 host rows, softmax sums to 1, rows equal a float64 recomputation of the
   same checkpoint on CPU within the tolerance (largest |Δ log p|), incremental evaluation
   equals one shot, rewind-regenerate gives the same rows, refused rollbacks and
   out-of-vocabulary tokens change nothing.
2. **greedy exactness** — plain decode (`muser_app.lanes.plain`, the oracle of docs/design.md §8)
   of a few natural prompts on the device against the same decode on CPU (float32, the
   project's qualified oracle): every token must be equal. Where float32 GPU kernels make
   one differ, the table says where and how close the two candidates were in each row (the
   top-2 logit gap), instead of hiding it.
3. **round latency** — after a context of 256 tokens, the wall time of one `evaluate` of
   D+1 tokens (a round's witness rows) for D = 0, 1, 2, 4, 8, then the rollback, repeated.
   Rows come back to the host as numpy, so each sample includes the device sync.

Sized for < 5 minutes on one GPU with the fixture target (4 prompts × 128 tokens on each
side, 20 repeats per D). Exit codes: 0 every check passed; 1 a check failed (the tables say
which and by how much); 2 refused: CUDA is not available (pass `--device cpu` to rehearse
on CPU), or a bad argument.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing

from muser.errors import MuserError, RefusedError, RollbackError, TokenOutOfVocabularyError

FORMAT = "muser.gpu-check.v1"
DEPTHS = (0, 1, 2, 4, 8)
FULL = {"prompts": 4, "tokens": 128, "context": 256, "repeats": 20, "contract_tokens": 48}
QUICK = {"prompts": 1, "tokens": 16, "context": 64, "repeats": 3, "contract_tokens": 24}
FLOAT32_TOLERANCE = 1e-4
"""As qualification's default (cluster_config.qualification.DEFAULT_TOLERANCE)."""
HALF_TOLERANCE = 0.1
"""bfloat16/float16 rows against float64: a loose bound, reported as measured."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Contract, greedy exactness and round latency of the torch target on a GPU.",
    )
    p.add_argument("--device", default="cuda", help="torch device (default cuda; cpu rehearses)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--target", type=Path, help="target checkpoint (default: the fixture target)")
    p.add_argument("--quick", action="store_true", help="1 prompt × 16 tokens, context 64")
    p.add_argument("--prompts", type=int, help="natural prompts to decode (default 4)")
    p.add_argument("--tokens", type=int, help="greedy tokens per prompt (default 128)")
    p.add_argument("--context", type=int, help="context before the timed rounds (default 256)")
    p.add_argument("--repeats", type=int, help="timed evaluations per D (default 20)")
    p.add_argument("--tolerance", type=float, help="largest |Δ log p| (default by dtype)")
    p.add_argument("--receipt", type=Path, help="JSON receipt path")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.tolerance is None:
        args.tolerance = FLOAT32_TOLERANCE if args.dtype == "float32" else HALF_TOLERANCE
    for name in ("prompts", "tokens", "context", "repeats"):
        if getattr(args, name) < 1:
            raise RefusedError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def resolve_device(name: str) -> str:
    """The torch device to check; RefusedError (exit 2) when this machine cannot run it."""
    import torch

    from muser_torch.backend import check_device

    try:
        return check_device(name)
    except RefusedError as exc:
        if name.startswith("cuda") and not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise RefusedError(
                f"CUDA is not available on this machine (torch {torch.__version__}, {build}): "
                "run this on a CUDA machine, or pass --device cpu to rehearse every check on CPU"
            ) from None
        raise RefusedError(f"--device {name!r}: {exc}") from None


# --- helpers -------------------------------------------------------------------------------


def log_softmax(rows: np.ndarray) -> np.ndarray:
    x = np.asarray(rows, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def logprob_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |log p_a − log p_b| over every entry (NaN when either holds a NaN)."""
    return float(np.abs(log_softmax(a) - log_softmax(b)).max()) if len(a) else 0.0


def float64_rows(path: Path, tokens: list[int]) -> np.ndarray:
    """The slow reference: the checkpoint in float64 on CPU, whole sequence, no cache."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].numpy()


def refused_without_change(backend, call, error: type[MuserError]) -> bool:
    """`call()` raises `error` and leaves the cache as it was."""
    length = backend.length
    try:
        call()
    except error:
        return backend.length == length
    return False


@dataclass
class Check:
    check: str
    ok: bool
    measured: float | None
    limit: float | None
    note: str = ""


# --- 1. contract ---------------------------------------------------------------------------


def contract(backend, path: Path, tokens: list[int], tolerance: float) -> list[Check]:
    """The backend contract on the device, against a float64 CPU recomputation."""
    backend.reset()
    rows = backend.evaluate(tokens)
    shape_ok = rows.shape == (len(tokens), backend.vocab_size) and rows.dtype == np.float64
    checks = [
        Check(
            "evaluate: float64 host rows",
            shape_ok and bool(np.isfinite(rows).all()),
            None,
            None,
            f"{rows.shape} {rows.dtype} from {backend.device_label}",
        )
    ]
    sums = np.exp(log_softmax(rows)).sum(axis=1)
    checks.append(Check("softmax sums to 1", *_within(np.abs(sums - 1).max(), 1e-12)))
    reference = float64_rows(path, tokens)
    diff = logprob_diff(rows, reference)
    note = f"largest logit difference {np.abs(rows - reference).max():.3g}"
    checks.append(Check("rows = float64 CPU recomputation", *_within(diff, tolerance), note))
    backend.reset()
    parts = [backend.evaluate(tokens[:9])] + [backend.evaluate([t]) for t in tokens[9:]]
    diff = logprob_diff(np.concatenate(parts), rows)
    checks.append(Check("incremental = one shot", *_within(diff, tolerance)))
    checks.append(_rollback(backend, tokens, tolerance))
    too_far = refused_without_change(
        backend, lambda: backend.rollback(backend.length + 1), RollbackError
    )
    checks.append(Check("refused rollback changes nothing", too_far, None, None))
    vocab = backend.vocab_size
    outside = refused_without_change(
        backend, lambda: backend.evaluate([1, vocab]), TokenOutOfVocabularyError
    )
    checks.append(Check("out-of-vocabulary token refused, nothing changed", outside, None, None))
    return checks


def _within(measured: float, limit: float) -> tuple[bool, float, float]:
    return bool(measured <= limit), float(measured), limit  # NaN fails


def _rollback(backend, tokens: list[int], tolerance: float) -> Check:
    """Rewind, regenerate, same rows (after a rejected continuation was evaluated)."""
    k = len(tokens) - 4
    backend.reset()
    backend.evaluate(tokens[:k])
    before = backend.evaluate(tokens[k:])
    backend.rollback(4)
    backend.evaluate([1, 2, 3])
    backend.rollback(3)
    again = backend.evaluate(tokens[k:])
    diff = float(np.abs(again - before).max())
    note = "bitwise equal" if diff == 0 else f"not bitwise: logits differ by up to {diff:.3g}"
    ok, measured, limit = _within(logprob_diff(again, before), tolerance)
    ok = ok and backend.length == len(tokens)
    return Check("rollback, regenerate: same rows", ok, measured, limit, note)


# --- 2. greedy exactness -------------------------------------------------------------------


def exactness(device_backend, oracle, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Greedy plain decode on the device vs on the CPU oracle, prompt by prompt."""
    from muser.sampling import SamplingParams
    from muser_app.lanes.plain import run_plain

    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    out = []
    for i, prompt in enumerate(prompts):
        device_backend.reset()
        oracle.reset()
        got = run_plain(device_backend, prompt, params, record_rows=True)
        want = run_plain(oracle, prompt, params, record_rows=True)
        out.append(_compare(i, prompt, got, want))
    return out


def _compare(i: int, prompt: list[int], got, want) -> dict:
    n = min(len(got.tokens), len(want.tokens))
    differ = [k for k in range(n) if got.tokens[k] != want.tokens[k]]
    first = differ[0] if differ else (n if len(got.tokens) != len(want.tokens) else None)
    compared = n if first is None else first + 1
    positions = [len(prompt) + k for k in range(min(compared, n))]
    worst = logprob_diff(
        np.array([got.rows[p] for p in positions]), np.array([want.rows[p] for p in positions])
    )
    entry = {
        "prompt": i,
        "prompt_tokens": len(prompt),
        "tokens": len(want.tokens),
        "equal": first is None,
        "worst_logprob_diff": worst,
        "first_difference": None,
    }
    if first is not None and first < n:
        at = len(prompt) + first
        g, w = got.rows[at], want.rows[at]
        a, b = int(want.tokens[first]), int(got.tokens[first])
        entry["first_difference"] = {
            "index": first,
            "oracle_token": a,
            "device_token": b,
            "oracle_gap": float(w[a] - w[b]),  # ≥ 0: how far the oracle preferred its token
            "device_gap": float(g[b] - g[a]),  # ≥ 0: how far the device preferred its token
            "oracle_top2_gap": float(np.diff(np.sort(w)[-2:])[0]),
            "device_top2_gap": float(np.diff(np.sort(g)[-2:])[0]),
        }
    return entry


# --- 3. round latency ----------------------------------------------------------------------


def timing(backend, stream: list[int], context: int, repeats: int) -> list[dict]:
    """Seconds of one `evaluate` of D+1 tokens after `context` tokens, per D (interleaved)."""
    backend.reset()
    backend.evaluate(stream[:context])
    samples: dict[int, list[float]] = {d: [] for d in DEPTHS}
    for r in range(repeats + 1):  # the first pass warms up and is dropped
        for d in DEPTHS if r % 2 else DEPTHS[::-1]:
            ids = stream[context : context + d + 1]
            t0 = time.perf_counter()
            backend.evaluate(ids)  # rows land on the host: the device work is done
            elapsed = time.perf_counter() - t0
            backend.rollback(len(ids))
            if r:
                samples[d].append(elapsed)
    rows = []
    for d in DEPTHS:
        s = sorted(samples[d])
        rows.append(
            {
                "D": d,
                "evaluated": d + 1,
                "median_ms": 1e3 * statistics.median(s),
                "min_ms": 1e3 * s[0],
                "p90_ms": 1e3 * s[min(len(s) - 1, int(0.9 * len(s)))],
                "samples_s": samples[d],
            }
        )
    return rows


# --- report --------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def _difference(entry: dict) -> str:
    f = entry["first_difference"]
    if f is None:
        return "–" if entry["equal"] else "lengths differ (one side stopped early)"
    return (
        f"token {f['index']}: oracle {f['oracle_token']} (by {f['oracle_gap']:.3g}), "
        f"device {f['device_token']} (by {f['device_gap']:.3g}); top-2 logit gap "
        f"oracle {f['oracle_top2_gap']:.3g}, device {f['device_top2_gap']:.3g}"
    )


def markdown(meta: dict, checks: list[Check], exact: list[dict], rounds: list[dict]) -> str:
    lines = [
        f"## torch target on {meta['device_label']} ({meta['dtype']}; {meta['device_name']})",
        "",
        "| contract check | ok | measured | limit | note |",
        "|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.check} | {'yes' if c.ok else '**NO**'} | {_num(c.measured)} "
            f"| {_num(c.limit)} | {c.note} |"
        )
    lines += [
        "",
        f"Greedy plain decode, {meta['device_label']} vs the CPU oracle (float32):",
        "",
        "| prompt | prompt tokens | tokens | equal | worst Δ log p | first difference |",
        "|---|---|---|---|---|---|",
    ]
    for e in exact:
        lines.append(
            f"| {e['prompt']} | {e['prompt_tokens']} | {e['tokens']} "
            f"| {'yes' if e['equal'] else '**NO**'} | {e['worst_logprob_diff']:.3g} "
            f"| {_difference(e)} |"
        )
    lines += [
        "",
        f"Round latency: one `evaluate` of D+1 tokens after {meta['context']} tokens "
        f"({meta['repeats']} repeats):",
        "",
        "| D | tokens evaluated | median ms | min ms | p90 ms | median ms / token |",
        "|---|---|---|---|---|---|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['D']} | {r['evaluated']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} "
            f"| {r['p90_ms']:.2f} | {r['median_ms'] / r['evaluated']:.2f} |"
        )
    return "\n".join(lines)


def environment(device: str) -> dict:
    import torch

    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_name": name,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def load_prompts(target: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from muser_app.cli._common import encode_prompt
    from muser_app.fixtures import natural_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return [encode_prompt(tokenizer, text) for text in natural_prompts(n)]


def run(args: argparse.Namespace) -> int:
    from muser_torch.backend import TorchBackend

    device = resolve_device(args.device)  # before anything slow: exit 2 at once without CUDA
    target = args.target
    if target is None:
        from muser_app.fixtures import build_fixtures

        target = build_fixtures(progress=sys.stderr.isatty()).natural.target
    started = time.time()
    backend = TorchBackend(target, device=device, dtype=args.dtype, threads=None)
    oracle = TorchBackend(target, device="cpu", dtype="float32", threads=None)
    prompts = load_prompts(target, args.prompts)
    needed = args.context + max(DEPTHS) + 1
    if backend.geometry.context_length < needed:
        raise RefusedError(
            f"--context {args.context} + {max(DEPTHS) + 1} tokens do not fit {target}'s "
            f"context window of {backend.geometry.context_length}"
        )
    every = itertools.cycle([t for p in prompts for t in p])  # natural text, repeated
    stream = list(itertools.islice(every, max(needed, args.contract_tokens)))
    checks = contract(backend, target, stream[: args.contract_tokens], args.tolerance)
    exact = exactness(backend, oracle, prompts, args.tokens)
    rounds = timing(backend, stream, args.context, args.repeats)
    meta = {
        "command": " ".join(sys.argv),
        "target": str(target),
        "model_digest": backend.identity.model_digest,
        "device": device,
        "device_label": backend.device_label,
        "dtype": args.dtype,
        "tolerance": args.tolerance,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "context": args.context,
        "repeats": args.repeats,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
        **environment(device),
    }
    if backend.device_label.startswith("torch:cuda"):
        import torch

        meta["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    ok = all(c.ok for c in checks) and all(e["equal"] for e in exact)
    print(markdown(meta, checks, exact, rounds))
    raw = json.dumps({str(r["D"]): r["samples_s"] for r in rounds}, sort_keys=True)
    receipt = {
        "format": FORMAT,
        "ok": ok,
        "meta": meta,
        "contract": [asdict(c) for c in checks],
        "exactness": exact,
        "timing": rounds,
        "samples_sha256": hashlib.sha256(raw.encode()).hexdigest(),
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.receipt or Path("bench-receipts") / f"gpu-check-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt, indent=1))
    print(f"\n{'every check passed' if ok else 'SOME CHECKS FAILED'}; receipt: {path}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except MuserError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
