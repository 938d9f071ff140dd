"""The lanes and peers `muser bench --suite lanes` runs on one pair (docs/design.md §10): our plain
and local lanes in this process, and the speculative peers on the same pair and draft —
transformers assisted generation, mlx-lm speculative, vLLM's speculative decoding (in its own
environment, `muser_app.bench.vllm_peer`). A peer that cannot run is a note, never silent.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from muser.sampling import SamplingParams
from muser.tree_width import TreePolicy
from muser.width import AdaptiveWidth, WidthPolicy
from muser_app.bench.sample import LaneFn, Sample


def _ours(
    kind: str,
    target,
    draft,
    params: SamplingParams,
    draft_len: int,
    q_top_k: int,
    width: Callable[[], WidthPolicy] | None = None,
    tree: Callable[[], TreePolicy] | None = None,
) -> LaneFn:
    """Our plain or local lane; `width` makes each run's width policy (default: fixed D);
    `tree` each run's tree policy (the local tree lane)."""
    from muser_app.lanes.local import run_local
    from muser_app.lanes.plain import run_plain
    from muser_app.lanes.tree import run_local_tree

    def run(prompt: list[int], max_tokens: int) -> Sample:
        p = replace(params, max_tokens=max_tokens)
        target.reset()
        cpu = time.process_time()  # this process, every thread: the lane runs alone in it
        if kind == "plain":
            r = run_plain(target, prompt, p)
        elif tree is not None:
            draft.reset()
            r = run_local_tree(target, draft, prompt, p, policy=tree(), q_top_k=q_top_k)
        else:
            draft.reset()
            policy = width() if width is not None else None
            r = run_local(
                target, draft, prompt, p, draft_len=draft_len, q_top_k=q_top_k, width=policy
            )
        s = r.stats
        return Sample(
            kind,
            0,
            0,
            r.tokens,
            s.wall_s,
            s.drafted,
            s.accepted,
            s.rounds,
            {"draft": s.draft_s, "verify": s.verify_s},
            {"lane": time.process_time() - cpu},
        )

    return run


def _transformers_assisted(target_dir: Path, draft_dir: Path, draft_len: int) -> LaneFn:
    """transformers' assisted generation with the pair's draft model."""
    import torch
    from transformers import AutoModelForCausalLM

    assistant = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = draft_len
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return _transformers_generate("hf-assisted", target_dir, assistant_model=assistant)


def _transformers_generate(name: str, target_dir: Path, **speculation) -> LaneFn:
    """The target's own `generate`, greedy, exactly `max_tokens` tokens, with `speculation`
    (an assistant model, or prompt lookup) as transformers runs it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()

    def run(prompt: list[int], max_tokens: int) -> Sample:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                **speculation,
            )
        wall = time.perf_counter() - start
        return Sample(name, 0, 0, out[0, len(prompt) :].tolist(), wall)

    return run


def _add_llama(lanes, notes, kind, target_dir, draft_dir, draft_len) -> None:
    """llama.cpp's lane of `kind` (muser_app/bench/llama_peer.py), or the note why not."""
    from transformers import AutoTokenizer

    from muser_app.bench.llama_peer import llama_lane

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    lane, note = llama_lane(kind, target_dir, draft_dir, draft_len, tokenizer)
    notes[f"llama.cpp-{kind}"] = note
    if lane is not None:
        lanes[f"llama.cpp-{kind}"] = lane


def _transformers_prompt_lookup(target_dir: Path, draft_len: int) -> LaneFn:
    """transformers' prompt lookup decoding (`prompt_lookup_num_tokens`): the n-gram peer."""
    return _transformers_generate(
        "hf-prompt-lookup", target_dir, prompt_lookup_num_tokens=draft_len
    )


def _mlx_speculative(target_dir: Path, draft_dir: Path, draft_len: int) -> LaneFn:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import speculative_generate_step

    model, _ = load(str(target_dir))
    draft_model, _ = load(str(draft_dir))

    def run(prompt: list[int], max_tokens: int) -> Sample:
        tokens: list[int] = []
        accepted = 0
        start = time.perf_counter()
        steps = speculative_generate_step(
            mx.array(prompt),
            model,
            draft_model,
            num_draft_tokens=draft_len,
            max_tokens=max_tokens,
        )
        for token, _, from_draft in steps:
            tokens.append(int(token))
            accepted += bool(from_draft)
            if len(tokens) >= max_tokens:
                break
        wall = time.perf_counter() - start
        return Sample("mlx-lm-speculative", 0, 0, tokens, wall, accepted=accepted)

    return run


def vllm_speculative_lane(
    python: Path | None, target_dir: Path, draft_dir: Path | None, draft_len: int
) -> tuple[LaneFn | None, str]:
    """vLLM's draft-model speculative decoding (`draft_dir` None: its ngram method) in a
    child process under `python` (a vLLM environment's interpreter; None when there is none),
    and its note: why it was skipped, or what it cost to start (engine start is never in its
    tokens/s)."""
    import atexit

    from muser_app.bench.vllm_peer import (
        ENV_PYTHON,
        VllmPeerError,
        VllmSpeculativePeer,
        vllm_distribution,
    )

    if python is None:
        return None, (
            f"skipped: no vLLM python (no --vllm-python, ${ENV_PYTHON} unset, and no "
            ".venv-vllm/bin/python; `make vllm-env` builds one)"
        )
    if not python.exists():
        return None, f"skipped: the vLLM python {python} does not exist"
    dist = vllm_distribution(python)
    if dist is None:
        return None, f"skipped: {python} runs no Python with a vLLM distribution installed"
    try:
        peer = VllmSpeculativePeer(python, target_dir, draft_dir, draft_len)
    except VllmPeerError as exc:
        return None, f"skipped: {dist} under {python} could not run speculative decoding: {exc}"
    atexit.register(peer.close)
    info = peer.info
    return peer, (
        f"ran in a child process under {python} ({info['vllm']}, "
        f"{'ngram' if draft_dir is None else 'draft_model'} method, "
        f"{draft_len} speculative tokens, {info['threads']} torch thread(s), prefix cache off); "
        f"engine start {info['import_s'] + info['engine_s']:.1f} s (import "
        f"{info['import_s']:.1f} s + engine {info['engine_s']:.1f} s), not in tokens/s, which "
        "the child times around LLM.generate"
    )


def build_lanes(
    target_dir: Path,
    draft_dir: Path,
    params: SamplingParams,
    *,
    draft_len: int,
    q_top_k: int,
    draft_backend: str,
    peers: bool,
    vllm_python: Path | None = None,
    draft_range: tuple[int, int] | None = None,
    decode_len: int = 8,
    target_device: str = "cpu",
    tree_nodes: int = 0,
) -> tuple[dict[str, LaneFn], dict[str, str]]:
    """The lanes to run, and a note per lane that could not be built (never silent) or whose
    set-up cost is kept out of its samples. `vllm_python`: the vLLM peer's interpreter
    (default: `muser_app.bench.vllm_peer.default_vllm_python`). `draft_range`: add `local-adaptive`,
    the local lane with `AdaptiveWidth` in that range (draftless rounds decode `decode_len`).
    `target_device`: where the plain and local lanes run the target (the peers run on CPU,
    so they are skipped, with a note, on any other device). `tree_nodes`: add `local-tree`,
    the local tree lane with trees of at most that many nodes, draft_len deep, in the
    budget's shape, and `local-tree-adaptive`, learning size and shape (`muser.tree_width`)."""
    from muser_app.bench.vllm_peer import PEER, default_vllm_python
    from proposer_mac.backends import load_draft_backend
    from verifier_gx.backends import load_target_backend

    target = load_target_backend("torch", target_dir, device=target_device)
    draft = load_draft_backend(draft_backend, draft_dir)
    lanes: dict[str, LaneFn] = {
        "plain": _ours("plain", target, None, params, draft_len, q_top_k),
        "local": _ours("local", target, draft, params, draft_len, q_top_k),
    }
    if draft_range is not None:  # the adaptive width beside the fixed one, same prompts
        lo, hi = draft_range
        lanes["local-adaptive"] = _ours(
            "local",
            target,
            draft,
            params,
            draft_len,
            q_top_k,
            lambda: AdaptiveWidth(draft_len, lo, hi, decode_len),
        )
    notes: dict[str, str] = {}
    if tree_nodes:  # the tree lanes beside the chain, same D, same prompts
        from muser.tree_width import tree_policy

        drafts_trees = hasattr(draft, "evaluate_tree") or hasattr(draft, "candidates")
        if not 1 <= draft_len <= tree_nodes or not drafts_trees:
            notes["local-tree"] = (
                f"skipped: trees need 1 <= --draft-len <= --tree-nodes and a torch, "
                f"conditioned or n-gram draft ({draft_backend})"
            )
        else:
            for name, mode in (("local-tree", "fixed"), ("local-tree-adaptive", "adaptive")):
                policy = functools.partial(tree_policy, mode, tree_nodes, draft_len)
                lanes[name] = _ours("local", target, draft, params, draft_len, q_top_k,
                                    tree=policy)  # fmt: skip
    if peers and target_device != "cpu":
        notes["peers"] = f"peers run the target on CPU; skipped with the target on {target_device}"
    elif peers and params.greedy and draft_backend == "ngram":
        lanes["hf-prompt-lookup"] = _transformers_prompt_lookup(target_dir, draft_len)
        _add_llama(lanes, notes, "lookup", target_dir, None, draft_len)
        notes["mlx-lm-speculative"] = "mlx-lm drafts with a model only; no n-gram peer there"
        python = default_vllm_python(vllm_python)
        lane, notes[PEER] = vllm_speculative_lane(python, target_dir, None, draft_len)
        if lane is not None:
            lanes[PEER] = lane
    elif peers and params.greedy:
        lanes["hf-assisted"] = _transformers_assisted(target_dir, draft_dir, draft_len)
        _add_llama(lanes, notes, "speculative", target_dir, draft_dir, draft_len)
        lanes["mlx-lm-speculative"] = _mlx_speculative(target_dir, draft_dir, draft_len)
        python = default_vllm_python(vllm_python)
        lane, notes[PEER] = vllm_speculative_lane(python, target_dir, draft_dir, draft_len)
        if lane is not None:
            lanes[PEER] = lane
    elif peers:
        notes["peers"] = "peers run greedy only in this version; skipped at T > 0"
    return lanes, notes
