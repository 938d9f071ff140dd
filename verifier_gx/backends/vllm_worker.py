"""vLLM's worker extension for `VllmBackend` (`worker_extension_cls`, driven through
`collective_rpc`): it runs inside vLLM's worker, beside the model, and is the only code
that touches the engine's tensors. Hooks keep the final hidden row of every position a
forward computes (tagged with its position and token id) and, for the layers a request
names, the decoder layers' outputs; the `muser_take_*` calls turn the rows a request needs
into logits with the model's own head and hand them back as bytes (they cross a process
boundary when the engine runs in its own). docs/backends.md, "vLLM"."""

from __future__ import annotations


class RowCapture:
    """Worker extension: keep the final hidden rows the engine computes, and the outputs of
    the decoder layers a request asks to capture; turn the requested final rows into logits.
    Mixed into vLLM's worker class, so `self` is the worker."""

    def muser_install_row_hook(self) -> str:
        """Hook the model's forward and its decoder layers (once); drop rows kept so far.
        Returns the model class."""
        import torch

        model = self.model_runner.get_model()
        self._muser_kept = []
        self._muser_layers, self._muser_wanted = {}, frozenset()
        if getattr(self, "_muser_hook", None) is None:

            def keep(_module, _args, kwargs, output) -> None:
                hidden = output[0] if isinstance(output, tuple) else output
                positions, ids = kwargs.get("positions"), kwargs.get("input_ids")
                if positions is None or ids is None or positions.dim() != 1:
                    raise RuntimeError("row capture needs 1-D positions and token ids")
                n = min(len(positions), len(ids), len(hidden))
                layers, self._muser_layers = self._muser_layers, {}
                self._muser_kept.append(
                    (positions[:n].tolist(), ids[:n].tolist(), hidden[:n].detach().clone(),
                     {i: rows[:n] for i, rows in layers.items()})
                )  # fmt: skip

            def keeper(index: int):
                def keep_layer(_module, _args, output) -> None:
                    if index not in self._muser_wanted:
                        return
                    # vLLM's decoder layer hands on (hidden, residual) and adds them in the
                    # next layer's norm: their sum is the layer's output, the residual stream
                    # transformers' layer returns
                    if isinstance(output, tuple):
                        hidden, residual = output[0], output[1]
                        out = hidden if residual is None else hidden + residual
                    else:
                        out = output
                    self._muser_layers[index] = out.detach().to(torch.float32).clone()

                return keep_layer

            self._muser_hook = model.register_forward_hook(keep, with_kwargs=True)
            for i, layer in enumerate(model.model.layers):
                layer.register_forward_hook(keeper(i))
        return type(model).__name__

    def muser_capture(self, layers: list[int]) -> None:
        """Capture these decoder layers' outputs in the requests that follow (none: [])."""
        self._muser_wanted = frozenset(int(i) for i in layers)

    def _muser_logits(self, hidden):
        """The model's own head (`compute_logits`, what vLLM samples from) over final hidden
        rows, as float32 numpy; None on a rank whose `compute_logits` returns None (a
        tensor-parallel rank other than the first)."""
        import torch

        with torch.inference_mode():
            logits = self.model_runner.get_model().compute_logits(hidden)
        return None if logits is None else logits.to("cpu", torch.float32).contiguous().numpy()

    def muser_take_paths(
        self, base: int, sequences: list[list[int]]
    ) -> list[tuple[int, bytes, tuple[int, int], dict[int, bytes]] | None] | None:
        """After one step of requests that share their first `base` tokens (a token tree's
        paths): for each request, (first, its logits of positions [first, len(sequence)) as
        float32 bytes, their shape, each captured layer's rows of the same positions as
        float32 bytes: `muser_capture`) with first >= base, or None where none of its rows
        can be told apart (the caller evaluates it alone). The forward's rows are split into runs of
        consecutive positions (each request's scheduled tokens); a run is a request's when
        that request is the only sequence the run ends and spells. A run may start past
        `base` when the engine served the request's first tree block from another path's
        (the same tokens after the same prefix: the same tree nodes, whose rows that path
        brings)."""
        import torch

        kept, self._muser_kept = self._muser_kept, []
        found: list[tuple[int, torch.Tensor, dict] | None] = [None] * len(sequences)
        for positions, ids, hidden, layers in kept:
            i = 0
            while i < len(positions):
                j = i + 1
                while j < len(positions) and positions[j] == positions[j - 1] + 1:
                    j += 1
                first, end = positions[i], positions[i] + (j - i)
                spelled = [
                    r for r, seq in enumerate(sequences)
                    if len(seq) == end and seq[first:end] == ids[i:j]
                ]  # fmt: skip
                whole = {tuple(sequences[r]) for r in spelled}
                free = [r for r in spelled if found[r] is None]
                if len(whole) == 1 and free:  # (one sequence, sent once or more)
                    at = slice(i + max(first, base) - first, j)
                    found[free[0]] = (
                        max(first, base),
                        hidden[at],
                        {k: rows[at] for k, rows in layers.items()},
                    )
                i = j
        wanted = [f[1] for f in found if f is not None]
        if not wanted:
            return [None] * len(sequences)
        rows = self._muser_logits(torch.cat(wanted))
        if rows is None:
            return None
        out: list[tuple[int, bytes, tuple[int, int], dict[int, bytes]] | None] = []
        at = 0
        for f in found:
            if f is None:
                out.append(None)
                continue
            part = rows[at : at + len(f[1])]
            at += len(f[1])
            layers = {
                k: f[2][k].cpu().contiguous().numpy().tobytes() for k in sorted(self._muser_wanted)
            }
            out.append((f[0], part.tobytes(), part.shape, layers))
        return out

    def muser_take_rows(
        self, start: int, tokens: list[int]
    ) -> tuple[int, bytes, tuple[int, int], dict[int, bytes]] | None:
        """Logits of positions [start, len(tokens)) as float32 bytes, each captured layer's
        rows of the same positions as float32 bytes, and the kept rows dropped.

        Returns (first, data, shape, layers): `first` is the lowest position from which every
        position up to the end was computed; when `first > start`, `data` is empty and the
        caller must recompute. A rank whose `compute_logits` returns None (a tensor-parallel
        rank other than the first) answers None.
        """
        import torch

        kept, self._muser_kept = self._muser_kept, []
        end = len(tokens)
        found: dict[int, tuple[int, int]] = {}
        for c, (positions, ids, _, _) in enumerate(kept):
            for r, (p, t) in enumerate(zip(positions, ids, strict=True)):
                if start <= p < end and p not in found:
                    if t != tokens[p]:
                        raise RuntimeError(f"captured token {t} at position {p}, sent {tokens[p]}")
                    found[p] = (c, r)
        first = end
        while first > start and first - 1 in found:
            first -= 1
        if first > start:
            return first, b"", (0, 0), {}
        where = [found[p] for p in range(start, end)]
        rows = self._muser_logits(torch.stack([kept[c][2][r] for c, r in where]))
        if rows is None:
            return None
        layers = {
            i: torch.stack([kept[c][3][i][r] for c, r in where])
            .cpu()
            .contiguous()
            .numpy()
            .tobytes()
            for i in sorted(self._muser_wanted)
        }
        return start, rows.tobytes(), rows.shape, layers
