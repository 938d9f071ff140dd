"""Bench peer: llama.cpp, the seed's own baseline: its draft-model speculative decoding
(`llama-speculative`) and its prompt lookup (`llama-lookup`), on the same pair.

llama.cpp is not packaged for this machine's Debian; the `llama-cpp-python` sdist vendors its
full source, converter included. `make llama-env` downloads that sdist and builds the two
tools with cmake into `.llama/` (kept out of `.venv`, like `.venv-vllm`); `$MUSER_LLAMA_DIR`
names another such folder. The target and the draft are converted once to GGUF F32 with the
vendored `convert_hf_to_gguf.py` (`PYTHONPATH=gguf-py`), cached beside each checkpoint.

Each run is one process: the tool loads both models, decodes `max_tokens` greedy tokens
with one thread and the lane's draft length, and reports its own decode time and its
drafted/accepted counts on stderr; the bench's rate is the tool's (load time is never in
it). The tool prints text, not token ids: a run's tokens are its text put back through the
pair's tokenizer, so its `exact` column compares text, and its rate is the tool's own
(tokens it decoded over the seconds it took).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from muser_app.bench.sample import LaneFn, Sample

LLAMA_ENV = "MUSER_LLAMA_DIR"
SDIST_VERSION = "0.3.36"
RUN_TIMEOUT_S = 900.0


def llama_dir() -> Path:
    from muser_app.bench.vllm_peer import PROJECT

    return Path(os.environ.get(LLAMA_ENV) or PROJECT / ".llama")


def _tool(name: str) -> Path:
    return llama_dir() / "build" / "bin" / name


def _source() -> Path:
    return llama_dir() / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"


def gguf_f32(model_dir: Path) -> Path:
    """`model_dir` as GGUF F32, converted once (cached beside it, keyed by its digest)."""
    from muser.identity import model_identity

    digest = model_identity(model_dir).model_digest[:16]
    out = model_dir.parent / f".{model_dir.name}-{digest}.f32.gguf"
    if out.is_file():
        return out
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(_source() / "gguf-py"))
    cmd = [sys.executable, str(_source() / "convert_hf_to_gguf.py"), str(model_dir),
           "--outtype", "f32", "--outfile", str(tmp)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}: {tail}")
    tmp.rename(out)
    return out


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNT = re.compile(r"n_(drafted|accept)\s*=\s*(\d+)")


def parse_report(stderr: str) -> tuple[int, float, int, int]:
    """(tokens decoded, seconds, drafted, accepted) from a tool's closing report."""
    decoded = _DECODED.findall(stderr)
    if not decoded:
        raise RuntimeError(f"no 'decoded N tokens in S seconds' line in: {stderr[-400:]!r}")
    counts = dict(_COUNT.findall(stderr))
    n, seconds = decoded[-1]
    return int(n), float(seconds), int(counts.get("drafted", 0)), int(counts.get("accept", 0))


def llama_lane(
    kind: str, target_dir: Path, draft_dir: Path | None, draft_len: int, tokenizer
) -> tuple[LaneFn | None, str]:
    """llama.cpp's `speculative` (with `draft_dir`) or `lookup` lane, and its note: why it was
    skipped, or how its tokens are read."""
    tool = _tool("llama-speculative" if kind == "speculative" else "llama-lookup")
    if not tool.is_file():
        return None, f"skipped: {tool} is not built (`make llama-env` builds it)"
    try:
        target = gguf_f32(target_dir)
        draft = gguf_f32(draft_dir) if draft_dir is not None else None
    except RuntimeError as exc:
        return None, f"skipped: {exc}"
    name = f"llama.cpp-{kind}"

    def run(prompt: list[int], max_tokens: int) -> Sample:
        cmd = [str(tool), "-m", str(target), "-p", tokenizer.decode(prompt), "-n",
               str(max_tokens), "--temp", "0", "--top-k", "1", "-t", "1", "-tb", "1",
               "-s", "0", "-c", "4096", "--ignore-eos", "--spec-draft-n-max", str(draft_len)]  # fmt: skip
        if draft is not None:
            cmd += ["-md", str(draft), "-td", "1", "-tbd", "1"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{tool.name} exited {done.returncode}: {done.stderr[-400:]}")
        n, seconds, drafted, accepted = parse_report(done.stderr)
        # the tool echoes the prompt, may decode a few tokens past -n (a round's drafts), and
        # ends its output with blank lines of its own
        text = done.stdout.split(tokenizer.decode(prompt), 1)[-1].removesuffix("\n\n")
        tokens = list(tokenizer.encode(text, add_special_tokens=False))[:max_tokens]
        wall = seconds * len(tokens) / n if n else seconds  # the tool's own rate
        return Sample(name, 0, 0, tokens, wall, drafted, accepted)

    return run, "tokens re-read from the tool's text through the pair's tokenizer"
