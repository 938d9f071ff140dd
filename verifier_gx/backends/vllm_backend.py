"""Target backend on vLLM's engine: full witness rows, with the committed KV reused.

Implements `muser.backend.ModelBackend` (same evaluate / rollback / reset semantics as
`TorchBackend`). vLLM serves requests, not an open KV cursor, so each `evaluate(tokens)`
submits the whole sequence (held tokens + `tokens`) as one prompt and asks for one greedy
token that nobody reads. The engine's prefix cache holds the KV of every full block of the
held sequence, so the engine computes only the positions after the last cached block
boundary: the new tokens plus at most `block_size - 1` held ones, never the whole context.

Where the rows come from. vLLM computes logits only for the positions it samples, and its
prompt-logprob path (which does return every prompt row) skips the prefix cache, so neither
gives D + 1 rows with KV reuse. Instead `RowCapture` (`vllm_worker.py`), a worker extension
(`worker_extension_cls`, driven through `collective_rpc`, both public vLLM interfaces), puts a
forward hook on the model that keeps the final hidden row of every position the engine
computes, tagged with its position and token id. After the request finishes,
`muser_take_rows` turns the rows of the requested positions into logits with the model's own
`compute_logits` (the head vLLM samples from) and returns them as float32. The host widens
them to float64; normalisation happens there (`muser.sampling`), as for every backend.

Capture (`evaluate_capture`): the extension hooks every decoder layer too; the layers a
request names (`muser_capture`) keep their outputs — vLLM's `hidden + residual`, the residual
stream transformers' layer returns — for the positions the forward computes, and come back
beside the logits as float32.

When a position that is needed was served from the cache (the same tokens were evaluated,
rolled back, and are evaluated again across a full block), its row was never computed: the
request is repeated with the prefix cache bypassed, a full O(context) recompute, counted in
`full_recomputes`. The speculative lanes never do this: a round's new tokens start at the
next frontier, which either follows the last accepted draft or replaced a rejected one.

The hook needs the model's Python forward to run, so the engine runs eagerly (no CUDA graphs
or torch.compile). By default the engine core and its worker run inside this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, read by vLLM when the engine is built); `engine_process`
puts them in their own processes, and rows then cross the process boundary as bytes.

An in-process engine lives until the process exits: when one shuts down, vLLM tears down
its process-wide distributed state, which would break every other engine in the process
(a verifier holds one; the tests hold several).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from muser.backend import Geometry, HeldTokens, ModelIdentity
from muser.errors import (
    CaptureLayerError,
    InvalidOverrideError,
    ModelLoadError,
    UnknownBackendError,
)
from muser.geometry import check_rollback, check_room, check_tokens, read_geometry
from muser.identity import config_value, model_identity, read_config
from muser.tree import tree_depths
from muser_torch.backend import DTYPES, set_rope_theta
from verifier_gx.backends.vllm_worker import RowCapture

Dtype = Literal["float32", "bfloat16", "float16"]

_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_IN_PROCESS_ENGINES: list[object] = []  # never shut down before exit (module docstring)
KV_SEQUENCES = 4
"""Default KV pool: room for this many full-context sequences (the held one, the rolled-back
tails the prefix cache keeps, and slack). vLLM's own CPU default takes most of the RAM."""


def default_kv_cache_bytes(path: str | os.PathLike[str], context_length: int) -> int:
    """KV bytes for `KV_SEQUENCES` sequences of `context_length + 1` tokens, counted at 4 bytes
    a value from the checkpoint's own config (an overestimate for narrower dtypes or MLA)."""
    config = read_config(Path(path).expanduser())
    layers = int(config_value(config, "num_hidden_layers"))
    heads = int(config_value(config, "num_attention_heads"))
    kv_heads = int(config_value(config, "num_key_value_heads") or heads)
    head_dim = int(config_value(config, "head_dim") or config_value(config, "hidden_size") // heads)
    per_token = 2 * layers * kv_heads * head_dim * 4
    return max(64 << 20, KV_SEQUENCES * (context_length + 1) * per_token)


def _override_config(hf_config, *, rope_theta: float | None, max_positions: int | None):
    """vLLM `hf_overrides` hook: the overrides take effect in the model vLLM builds."""
    if rope_theta is not None:
        set_rope_theta(hf_config, rope_theta)
    if max_positions is not None:
        hf_config.max_position_embeddings = max_positions
    return hf_config


class VllmBackend(HeldTokens):
    """A causal LM under vLLM's engine, holding one sequence (`ModelBackend`).

    `block_size` is the prefix-cache granularity: a round recomputes at most
    `block_size - 1` held tokens besides its new ones (vLLM's CPU attention takes multiples
    of 32). `kv_cache_bytes` sizes the KV pool (default: `default_kv_cache_bytes`).
    """

    label = "vllm"
    identity: ModelIdentity
    geometry: Geometry

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "auto",
        dtype: Dtype = "float32",
        context_length: int | None = None,
        rope_theta: float | None = None,
        block_size: int = 32,
        kv_cache_bytes: int | None = None,
        engine_process: bool = False,
    ) -> None:
        # vLLM logs to stdout unless told otherwise; stdout belongs to the CLI (`--json`).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise UnknownBackendError(
                f"target backend 'vllm' needs the vllm package, which this environment lacks "
                f"({exc}); build .venv-vllm with `make vllm-env` and run from it"
            ) from exc
        if dtype not in DTYPES:
            raise InvalidOverrideError(f"dtype {dtype!r} is not one of {DTYPES}")
        for name, value in (("block_size", block_size), ("kv_cache_bytes", kv_cache_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidOverrideError(f"{name} {value!r} is invalid: expected an integer")
            if value is not None and value < 1:
                raise InvalidOverrideError(f"{name} {value!r} is invalid: expected ≥ 1")
        self.identity = model_identity(path)
        self.geometry = read_geometry(path, context_length=context_length, rope_theta=rope_theta)
        self.dtype = dtype
        self.block_size = block_size
        self.device = self._check_device(device)
        self.engine_tokens = 0
        """Positions the engine computed (all requests): the cost the prefix cache saves."""
        self.engine_calls = 0
        """Engine steps asked for (`generate` calls): one per evaluate, one per tree when
        its paths' rows all come from it."""
        self.full_recomputes = 0
        """Requests repeated with the prefix cache bypassed (see the module docstring)."""
        self._tokens: list[int] = []
        self._tree: tuple[int, list[int]] | None = None
        """The last `evaluate_tree`'s (held length, root and nodes) until `keep_path`."""
        if kv_cache_bytes is None:
            kv_cache_bytes = default_kv_cache_bytes(path, self.geometry.context_length)
        self.kv_cache_bytes = kv_cache_bytes
        self._llm = self._start(path, rope_theta, kv_cache_bytes, engine_process)

    @staticmethod
    def _check_device(device: str) -> str:
        from vllm.platforms import current_platform

        built = current_platform.device_type
        if device not in ("auto", built, f"{built}:0"):
            raise InvalidOverrideError(
                f"device {device!r} refused: this vLLM build runs on {built!r} "
                f"(use 'auto' or {built!r}; pick a GPU with CUDA_VISIBLE_DEVICES)"
            )
        return built

    def _start(self, path, rope_theta, kv_cache_bytes, engine_process: bool):
        from vllm import LLM

        # One position past the context: vLLM wants room for the token each request samples.
        max_model_len = self.geometry.context_length + 1
        configured = read_geometry(path).context_length
        overrides = functools.partial(
            _override_config,
            rope_theta=None if rope_theta is None else float(rope_theta),
            max_positions=max_model_len if max_model_len > configured else None,
        )
        os.environ[_MULTIPROCESSING_ENV] = "1" if engine_process else "0"
        try:
            llm = LLM(
                model=str(path),
                dtype=self.dtype,
                max_model_len=max_model_len,
                enable_prefix_caching=True,
                block_size=self.block_size,
                enforce_eager=True,
                seed=0,
                hf_overrides=overrides,
                kv_cache_memory_bytes=kv_cache_bytes,
                worker_extension_cls=f"{RowCapture.__module__}.{RowCapture.__qualname__}",
                disable_log_stats=True,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{path}: vLLM could not load the checkpoint ({exc})") from exc
        if not engine_process:
            _IN_PROCESS_ENGINES.append(llm)
        llm.collective_rpc("muser_install_row_hook")
        return llm

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; float64 logits (len(tokens), vocab_size), positions from `length`."""
        return self._evaluate(tokens, [])[0]

    def evaluate_capture(
        self, tokens: Sequence[int], layers: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`evaluate`, plus the float32 (n, hidden) output of each requested decoder layer
        (what layer i hands to layer i+1, before the final norm: `TorchBackend`'s capture),
        kept by the worker's layer hooks in the same forward."""
        return self._evaluate(tokens, self._capture_layers(layers))

    def _capture_layers(self, layers: Sequence[int]) -> list[int]:
        count = self.num_layers
        wanted = sorted({int(i) for i in layers})
        for i in wanted:
            if not 0 <= i < count:
                raise CaptureLayerError(f"capture layer {i} outside [0, {count}) decoder layers")
        return wanted

    def _evaluate(self, tokens: Sequence[int], layers: list[int]):
        ids = check_tokens(tokens, self.vocab_size)
        check_room(self.length, len(ids), self.geometry.context_length)
        if not ids:
            width = self.geometry.hidden_size
            return np.zeros((0, self.vocab_size)), {
                i: np.zeros((0, width), np.float32) for i in layers
            }
        self._tree = None
        sequence = self._tokens + ids
        start = len(self._tokens)
        if layers:
            self._llm.collective_rpc("muser_capture", args=(layers,))
        try:
            # From position 0 every row is needed, so a cache hit could only force a second
            # pass.
            got = self._run(sequence, start, use_cache=start > 0)
            if got is None:
                self.full_recomputes += 1
                got = self._run(sequence, start, use_cache=False)
                if got is None:
                    raise RuntimeError("vLLM computed no rows although the prefix cache was off")
        finally:
            if layers:
                self._llm.collective_rpc("muser_capture", args=([],))
        logits, captured = got
        self._tokens = sequence
        return logits[:, : self.vocab_size].astype(np.float64), captured

    def _run(self, sequence: list[int], start: int, *, use_cache: bool):
        """One engine request over `sequence`: the logits of [start, end) and the captured
        layers' rows there, None if a needed position was served from the cache."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            skip_reading_prefix_cache=not use_cache,
        )
        prompt = TokensPrompt(prompt_token_ids=sequence)
        (out,) = self._llm.generate([prompt], params, use_tqdm=False)
        self.engine_calls += 1
        self.engine_tokens += len(sequence) - (out.num_cached_tokens or 0)
        replies = self._llm.collective_rpc("muser_take_rows", args=(start, sequence))
        first, data, shape, layers = next(r for r in replies if r is not None)
        if first > start:
            return None
        rows = np.frombuffer(data, dtype=np.float32).reshape(shape)
        n = shape[0]
        return rows, {
            i: np.frombuffer(blob, dtype=np.float32).reshape(n, -1).copy()
            for i, blob in layers.items()
        }

    trees_on_held = True
    """Token trees are evaluated on the held sequence itself (`evaluate_tree(self, ...)`):
    the verifier judges tree rounds on this backend although it holds one KV."""

    def evaluate_tree(
        self, seq: VllmBackend, tokens: Sequence[int], parents: Sequence[int]
    ) -> np.ndarray:
        """`_tree` capturing nothing."""
        return self._tree_rows(seq, tokens, parents, [])[0]

    def evaluate_tree_capture(
        self, seq: VllmBackend, tokens: Sequence[int], parents: Sequence[int],
        layers: Sequence[int],
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:  # fmt: skip
        """`evaluate_tree`, plus each of `layers`' float32 (len(tokens), hidden) rows at every
        entry, from the same requests (a capturing session's tree round)."""
        return self._tree_rows(seq, tokens, parents, self._capture_layers(layers))

    def _tree_rows(
        self, seq: VllmBackend, tokens: Sequence[int], parents: Sequence[int], layers: list[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """A token tree after the held tokens (docs/design.md §3; `TorchBackend.evaluate_tree`'s
        contract, `seq` this backend): `tokens[0]` is the root (the frontier), `tokens[i + 1]`
        node i, whose parent is `parents[i]`. vLLM takes requests, not masks, so each
        root-to-leaf path is one request over the held tokens plus the path, all in one
        engine step (`muser_take_paths` splits its rows by request); the prefix cache serves
        the held blocks. A path whose rows did not come (a run the worker could not tell
        apart) goes again alone, keeping the rows of the entries no path reached yet. Every
        row is the row of its own path, as a linear forward gives it, and so are the rows of
        the capture `layers` (from the same requests). Float64 logits (len(tokens), vocab)
        and the captured rows; the held tokens are unchanged until `keep_path(path)`."""
        if seq is not self:
            raise TypeError(f"{seq!r} is not this backend (a vLLM backend holds one sequence)")
        ids = check_tokens(tokens, self.vocab_size)
        depths = tree_depths(parents, len(ids))
        check_room(self.length, max(depths) + 1, self.geometry.context_length)
        up = [-1, *(p + 1 for p in parents)]  # each entry's parent entry
        has_child = set(up[1:])
        rows: list[np.ndarray | None] = [None] * len(ids)
        kept: dict[int, list] = {i: [None] * len(ids) for i in layers}
        base = list(self._tokens)
        self._tree = None
        paths = []
        for leaf in (e for e in range(len(ids)) if e not in has_child):
            path = [leaf]
            while up[path[-1]] >= 0:
                path.append(up[path[-1]])
            paths.append(path[::-1])

        def place(entries, got_rows, got_layers) -> None:
            for k, e in enumerate(entries):
                rows[e] = got_rows[k]
                for i in layers:
                    kept[i][e] = got_layers[i][k]

        if layers:
            self._llm.collective_rpc("muser_capture", args=(layers,))
        try:
            # every path in one engine step; a path whose rows did not all come goes alone
            for path, got in zip(paths, self._run_paths(base, paths, ids), strict=True):
                if got is not None:
                    first, got_rows, got_layers = got
                    place(path[first - len(base) :], got_rows, got_layers)
            for path in paths:
                if all(rows[e] is not None for e in path):
                    continue
                fresh = next(k for k, e in enumerate(path) if rows[e] is None)
                sequence = base + [ids[e] for e in path]
                start = len(base) + fresh
                got = self._run(sequence, start, use_cache=True)
                if got is None:
                    self.full_recomputes += 1
                    got = self._run(sequence, start, use_cache=False)
                    if got is None:
                        raise RuntimeError(
                            "vLLM computed no rows although the prefix cache was off"
                        )
                place(path[fresh:], *got)
        finally:
            if layers:
                self._llm.collective_rpc("muser_capture", args=([],))
        self._tree = (len(base), ids)
        logits = np.stack(rows)[:, : self.vocab_size].astype(np.float64)  # type: ignore[arg-type]
        return logits, {i: np.stack(kept[i]) for i in layers}

    def _run_paths(self, base: list[int], paths: list[list[int]], ids: list[int]):
        """One engine step over every path (held tokens + the path's tokens): per path
        (first, its rows of positions first.. to its end, its captured layers' rows there),
        or None where the worker could not tell them apart."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sequences = [base + [ids[e] for e in path] for path in paths]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=seq) for seq in sequences], params, use_tqdm=False
        )
        self.engine_calls += 1
        self.engine_tokens += sum(
            len(seq) - (out.num_cached_tokens or 0)
            for seq, out in zip(sequences, outs, strict=True)
        )
        replies = self._llm.collective_rpc("muser_take_paths", args=(len(base), sequences))
        got = next((r for r in replies if r is not None), [None] * len(paths))
        return [
            None if g is None else (
                g[0],
                np.frombuffer(g[1], dtype=np.float32).reshape(g[2]),
                {i: np.frombuffer(b, dtype=np.float32).reshape(g[2][0], -1) for i, b in g[3].items()},
            )
            for g in got
        ]  # fmt: skip

    def keep_path(self, path: Sequence[int]) -> None:
        """After `evaluate_tree`: hold its root and the nodes of `path` (root's child first)."""
        if self._tree is None:
            raise ValueError("keep_path: no tree is held (evaluate_tree first)")
        length, ids = self._tree
        if length != len(self._tokens) or any(not 0 <= i < len(ids) - 1 for i in path):
            raise ValueError(f"keep_path: nodes {list(path)} outside the tree's {len(ids) - 1}")
        self._tree = None
        self._tokens = [*self._tokens, ids[0], *(ids[i + 1] for i in path)]

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens (refuses n < 0 or n > length).

        Only the held list shrinks: the engine's cached blocks are addressed by the hash of
        their whole prefix, so blocks past the new end are never read for other tokens.
        """
        check_rollback(n, self.length)
        self._tree = None
        if n:
            del self._tokens[-n:]

    def reset(self) -> None:
        """Drop the whole sequence (the engine's prefix cache stays warm)."""
        self._tree = None
        self._tokens.clear()
