"""The ragged batched KV of `muser_torch.backend.TorchBackend` (its module note): each
sequence's own KV buffers (`TorchSequence`), the cache object a batched forward writes
through (`BatchKv`), and the token rows, positions and additive mask of a batch
(`batch_inputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from muser.geometry import check_rollback


class BatchKv:
    """The KV of the sequences in one forward, in the shape the model's attention calls.

    `update` writes each row's new keys/values into its sequence's own buffers (after the
    sequence's committed length) and returns every row's keys/values [0, length + new),
    right-padded with zeros to the longest: the mask hides the padding. One sequence reads
    its buffers in place (no copy), and so do clones that are consecutive rows of one group
    (`TorchSequence.clones`), their padding what their rows hold there. Lengths move only
    once the whole forward succeeded (`TorchSequence._commit`), so a failed forward leaves
    every sequence as it was."""

    def __init__(self, seqs: list[TorchSequence], counts: list[int]) -> None:
        self.seqs, self.counts = seqs, counts
        self.total = max(s.length + n for s, n in zip(seqs, counts, strict=True))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        rows = []
        for i, (seq, n) in enumerate(zip(self.seqs, self.counts, strict=True)):
            rows.append(seq._write(layer_idx, key_states[i, :, :n], value_states[i, :, :n]))
        if len(rows) == 1:
            k, v = rows[0]
            return k.unsqueeze(0), v.unsqueeze(0)
        group = self._group()
        if group is not None:  # the rows of one tensor, in order: read in place
            keys, values, first = group
            rows_of = slice(first, first + len(rows))
            keys, values = keys[layer_idx][rows_of], values[layer_idx][rows_of]
            return keys[:, :, : self.total], values[:, :, : self.total]
        b, h, _, d = key_states.shape
        keys = key_states.new_zeros((b, h, self.total, d))
        values = value_states.new_zeros((b, h, self.total, d))
        for i, (k, v) in enumerate(rows):
            keys[i, :, : k.shape[1]] = k
            values[i, :, : v.shape[1]] = v
        return keys, values

    def _group(self) -> tuple | None:
        """(keys, values, first row) when the sequences are consecutive rows of one group
        (`TorchSequence.clones`), in order, each still on its row's buffers; else None."""
        first = self.seqs[0]._row
        if first is None:
            return None
        group, row = first
        for i, seq in enumerate(self.seqs):
            if seq._row is None or seq._row[0] is not group or seq._row[1] != row + i:
                return None
        return group[0], group[1], row


class TorchSequence:
    """One sequence's KV over a `TorchBackend`'s weights (`ModelBackend`; made by
    `TorchBackend.sequence()`). Dropping it frees its KV."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.identity, self.geometry = owner.identity, owner.geometry
        self._tokens: list[int] = []
        self._keys: list = []
        self._values: list = []
        self._block: list[int] | None = None
        """A tree block written after `length` and not kept yet (`keep_path`)."""
        self._row: tuple | None = None
        """(group, row) while this sequence's buffers are row `row` of a group's tensors
        (`clones`); None once it has buffers of its own."""

    @property
    def vocab_size(self) -> int:
        return self.owner.vocab_size

    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def num_layers(self) -> int:
        return self.owner.num_layers

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; float64 logits (len(tokens), vocab_size)."""
        return self.owner.evaluate_batch([(self, tokens)])[0]

    def evaluate_capture(
        self, tokens: Sequence[int], layers: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`TorchBackend.evaluate_capture` on this sequence."""
        wanted = self.owner._check_layers(layers)
        rows, captured = self.owner._forward_batch([(self, tokens)], [wanted])
        return rows[0], captured[0]

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens (refuses n < 0 or n > length); the buffers are kept."""
        check_rollback(n, self.length)
        if n:
            del self._tokens[-n:]

    def reset(self) -> None:
        """Drop the whole KV, buffers included."""
        self._tokens.clear()
        self._block = None
        self._keys, self._values = [], []
        self._row = None

    def clones(self, n: int) -> list[TorchSequence]:
        """`n` clones (`clone`) whose buffers are the rows of one tensor per layer, keys and
        values: a forward over all of them, in this order, reads their KV in place instead of
        copying it into a padded batch (the proposer drafts its guesses on such clones).
        Beyond each clone's length its row holds zeros or keys it rolled back: the mask
        hides them, as it hides the padding of a copied batch."""
        if n < 1:
            raise ValueError(f"clones({n!r}): expected n >= 1")
        twins = [TorchSequence(self.owner) for _ in range(n)]
        group: tuple[list, list] = ([], [])
        for buffers, mine in zip(group, (self._keys, self._values), strict=True):
            for buf in mine:
                rows = buf.new_zeros((n, *buf.shape))
                rows[:, :, : self.length] = buf[:, : self.length]
                buffers.append(rows)
        for i, twin in enumerate(twins):
            twin._tokens = list(self._tokens)
            twin._keys = [rows[i] for rows in group[0]]
            twin._values = [rows[i] for rows in group[1]]
            twin._row = (group, i) if self._keys else None
        return twins

    def leave_group(self) -> None:
        """Copy this clone's row out of its group (`clones`) into buffers of its own, so the
        group's tensors are freed once its other clones are dropped (the proposer keeps the
        clone whose guess held); nothing for a sequence that has buffers of its own."""
        if self._row is not None:
            self._keys = [k.clone() for k in self._keys]
            self._values = [v.clone() for v in self._values]
            self._row = None

    def clone(self) -> TorchSequence:
        """A new sequence of the same backend holding a copy of this one's KV: the two then
        grow and roll back independently (the proposer drafts several guesses at once on
        clones of one session's draft KV)."""
        twin = TorchSequence(self.owner)
        twin._tokens = list(self._tokens)
        twin._keys = [k.clone() for k in self._keys]  # whole buffers: room to grow as before
        twin._values = [v.clone() for v in self._values]
        return twin

    def _write(self, layer: int, k, v):
        """Store new keys/values (heads, n, dim) after `length`; return [0, length + n)."""
        start, end = self.length, self.length + k.shape[1]
        if layer == len(self._keys):
            self._row = None  # buffers of its own from here on
            cap = max(64, 1 << (end - 1).bit_length())
            shape = (k.shape[0], cap, k.shape[2])
            self._keys.append(k.new_empty(shape))
            self._values.append(v.new_empty(shape))
        buf_k, buf_v = self._keys[layer], self._values[layer]
        if end > buf_k.shape[1]:
            cap = 1 << (end - 1).bit_length()
            grown_k = buf_k.new_empty((buf_k.shape[0], cap, buf_k.shape[2]))
            grown_v = buf_v.new_empty(grown_k.shape)
            grown_k[:, :start] = buf_k[:, :start]
            grown_v[:, :start] = buf_v[:, :start]
            self._keys[layer], self._values[layer] = buf_k, buf_v = grown_k, grown_v
            self._row = None  # off its group's row
        buf_k[:, start:end] = k
        buf_v[:, start:end] = v
        return buf_k[:, :end], buf_v[:, :end]

    def _commit(self, ids: list[int]) -> None:
        self._tokens.extend(ids)
        self._block = None  # a forward wrote over any tree block held

    def _hold_block(self, ids: list[int]) -> None:
        """A tree's block was written after `length` (`TorchBackend.evaluate_tree`): held
        there, not committed, until `keep_path`."""
        self._block = list(ids)

    def keep_path(self, path: Sequence[int]) -> None:
        """Keep the tree block's root and the accepted nodes `path` (node indices, root's
        child first: each the child of the one before) as this sequence's next tokens, and
        drop the rest of the block. The path's keys move down to sit right after the root;
        their rotary positions were already length + depth, which is where they land."""
        block = self._block
        if block is None:
            raise ValueError("keep_path: no tree block is held (evaluate_tree first)")
        if any(not 0 <= i < len(block) - 1 for i in path):
            raise ValueError(f"keep_path: nodes {list(path)} outside the block's {len(block) - 1}")
        start = self.length
        rows = [start + 1 + i for i in path]
        if rows != list(range(start + 1, start + 1 + len(rows))):  # else already in place
            with self.owner._torch.inference_mode():  # (the buffers are inference tensors)
                for bufs in (self._keys, self._values):
                    for buf in bufs:
                        buf[:, start + 1 : start + 1 + len(rows)] = buf[:, rows].clone()
        self._tokens.extend([block[0], *(block[1 + i] for i in path)])
        self._block = None


def batch_inputs(torch, seqs: list[TorchSequence], ids: list[list[int]], counts: list[int],
                 total: int, mask_dtype, mask_lowest):  # fmt: skip
    """The token rows (B, W), positions (B, W) and additive mask (B, W, total) of a batch:
    query j of row i sees keys [0, length_i + j] (mask 0, else `mask_lowest`, the mask
    dtype's lowest); padded queries repeat the last real one. Built in numpy (a few
    microseconds an operation on arrays this small, where each torch call costs several
    times that); one token of one sequence, a draft step, takes three torch calls to the
    same tensors."""
    if counts == [1]:  # one query: it sees every key
        return (
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor([[seqs[0].length]], dtype=torch.int64),
            torch.zeros((1, 1, total), dtype=mask_dtype),
        )
    return ragged_inputs(torch, seqs, ids, counts, total, mask_dtype, mask_lowest)


def ragged_inputs(torch, seqs: list[TorchSequence], ids: list[list[int]], counts: list[int],
                  total: int, mask_dtype, mask_lowest):  # fmt: skip
    """`batch_inputs` for any batch."""
    width = max(counts)
    rows = np.zeros((len(ids), width), dtype=np.int64)
    for i, x in enumerate(ids):
        rows[i, : len(x)] = x
    lengths = np.array([s.length for s in seqs], dtype=np.int64)[:, None]
    steps = np.arange(width)[None, :]
    positions = lengths + steps
    last = lengths + np.minimum(steps, np.array(counts)[:, None] - 1)
    visible = np.arange(total)[None, None, :] <= last[:, :, None]
    mask = np.where(visible, np.float32(0), mask_lowest)
    mask = torch.from_numpy(mask).to(mask_dtype)
    return torch.from_numpy(rows), torch.from_numpy(positions), mask


def mixed_inputs(torch, seqs: list[TorchSequence], ids: list[list[int]],
                 parents: list[Sequence[int] | None], depths: list[list[int] | None],
                 total: int, mask_dtype, mask_lowest):  # fmt: skip
    """`ragged_inputs` for a batch whose rows are chains (parents None: query j sees keys
    [0, length + j]) or tree blocks (parents given: an entry sees the committed keys and the
    block entries on its own path, itself and its ancestors, at position length + its depth);
    padded queries repeat the last real one."""
    counts = [len(x) for x in ids]
    width = max(counts)
    rows = np.zeros((len(ids), width), dtype=np.int64)
    positions = np.zeros((len(ids), width), dtype=np.int64)
    visible = np.zeros((len(ids), width, total), dtype=bool)
    for i, (seq, x, tree, depth) in enumerate(zip(seqs, ids, parents, depths, strict=True)):
        n, length = len(x), seq.length
        rows[i, :n] = x
        if tree is None:
            positions[i] = length + np.arange(width)
            last = length + np.minimum(np.arange(width), n - 1)
            visible[i] = np.arange(total)[None, :] <= last[:, None]
            continue
        positions[i, :n] = length + np.asarray(depth, dtype=np.int64)
        positions[i, n:] = positions[i, n - 1]
        visible[i, :, :length] = True
        for j in range(n):
            k = j
            while True:
                visible[i, j, length + k] = True
                if k == 0:
                    break
                k = tree[k - 1] + 1
        visible[i, n:] = visible[i, n - 1]
    mask = torch.from_numpy(np.where(visible, np.float32(0), mask_lowest)).to(mask_dtype)
    return torch.from_numpy(rows), torch.from_numpy(positions), mask
