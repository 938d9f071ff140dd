"""What one target call costs on each torch forward (`TorchBackend(forward=...)`): one-token
decode and 2/3/5/9/17/33 positions after a prefix, in milliseconds and in one-token decodes of
the same forward, for a pair's target and trained draft; all in one process, one thread,
the forwards interleaved call by call so that the machine's drift lands on all alike.
Writes a JSON receipt (raw samples and their SHA-256) and a PNG.

    python scripts/forward_costs.py --pair smollm2 \\
        --receipt docs/receipts/forward-costs-smollm2-session36.json \\
        --png docs/forward-costs-smollm2.png

Each entry is the median of `--runs` calls (after `--warm`), the cache cropped back after
each. Rows are not compared here: tests/backends/test_packed_forward.py holds them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTHS = (1, 2, 3, 5, 9, 17, 33)
FORWARDS = ("transformers", "lean", "packed")


def measure(path: Path, forwards, widths, prefix: int, warm: int, runs: int) -> dict:
    from muser_torch.backend import TorchBackend

    backends = {f: TorchBackend(path, forward=f) for f in forwards}
    vocab = next(iter(backends.values())).vocab_size
    ids = [(7919 * i + 11) % vocab for i in range(prefix + max(widths))]
    samples: dict[str, dict[int, list[float]]] = {f: {w: [] for w in widths} for f in forwards}
    for backend in backends.values():
        backend.evaluate(ids[:prefix])
    for i in range(warm + runs):
        for width in widths:
            for name, backend in backends.items():
                start = time.perf_counter()
                backend.evaluate(ids[prefix : prefix + width])
                took = time.perf_counter() - start
                backend.rollback(width)
                if i >= warm:
                    samples[name][width].append(took)
    return {
        name: {
            "forward_kind": backends[name].forward_kind,
            "ms": {w: 1e3 * statistics.median(s) for w, s in by_width.items()},
            "samples_s": {w: s for w, s in by_width.items()},
        }
        for name, by_width in samples.items()
    }


def table(title: str, result: dict) -> str:
    lines = [f"{title}", "| forward | " + " | ".join(f"{w} pos" for w in WIDTHS) + " |"]
    lines.append("|---|" + "---|" * len(WIDTHS))
    for name, r in result.items():
        one = r["ms"][1]
        cells = [f"{r['ms'][w]:.1f} ms ({r['ms'][w] / one:.2f})" for w in WIDTHS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2))
    axes = axes if len(results) > 1 else [axes]
    for ax, (model, result) in zip(axes, results.items(), strict=True):
        for name, r in result.items():
            ax.plot(WIDTHS, [r["ms"][w] for w in WIDTHS], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(WIDTHS, [str(w) for w in WIDTHS])
        ax.set_xlabel("positions in one call (a round's D + 1, or a tree's nodes + 1)")
        ax.set_ylabel("ms per call (median, one thread)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("One target call's cost by forward (scripts/forward_costs.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="smollm2", help="pair whose models are timed")
    parser.add_argument("--prefix", type=int, default=128, help="tokens of KV before each call")
    parser.add_argument("--warm", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--runs", type=int, default=15, help="timed calls per entry")
    parser.add_argument("--receipt", type=Path, help="write the JSON receipt here")
    parser.add_argument("--png", type=Path, help="write the plot here")
    args = parser.parse_args(argv)

    import torch

    from muser_app.pairs import resolve

    torch.set_num_threads(1)
    models = resolve(args.pair, "trained", progress=True)
    results = {}
    for role, path in (("target", models.target), ("draft", models.draft)):
        results[f"{args.pair} {role}"] = measure(
            Path(path), FORWARDS, WIDTHS, args.prefix, args.warm, args.runs
        )
        print(table(f"{args.pair} {role} ({path})", results[f"{args.pair} {role}"]), flush=True)
    raw = json.dumps(results, sort_keys=True).encode()
    receipt = {
        "script": "scripts/forward_costs.py",
        "argv": sys.argv[1:],
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "torch": torch.__version__,
        "results": results,
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    if args.receipt:
        args.receipt.write_text(json.dumps(receipt, indent=1) + "\n")
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
