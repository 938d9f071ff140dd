"""Grouped clones (`TorchSequence.clones`): clones whose KV buffers are the rows of one tensor
per layer, so a batched forward over them reads their keys and values in place instead of
copying them into a padded batch. Their rows are bit-equal to those of single clones (the
padding the mask hides is then what the rows hold there, rolled-back keys or zeros) in every
batch shape: all of them, ragged counts, a subset or another order (the copying path), and a
clone that grows past its row's room (its own buffers from then on)."""

from __future__ import annotations

import numpy as np
import pytest

from muser_app.testing import ARCHES
from muser_torch.batched import BatchKv
from tests.backends.backend_helpers import PROMPT, build_backend


@pytest.fixture
def in_place(monkeypatch) -> list[bool]:
    """Whether each batched `update` found its sequences to be one group's rows, in order."""
    seen: list[bool] = []
    group = BatchKv._group

    def spy(self):
        got = group(self)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(BatchKv, "_group", spy)
    return seen


def _steps(seqs):
    a, b, c = seqs
    return [
        [(a, [PROMPT[9]]), (b, [PROMPT[10]]), (c, [PROMPT[11]])],  # one query each, in order
        [(a, [PROMPT[12]]), (b, [PROMPT[13]]), (c, [PROMPT[14]])],
        [(a, PROMPT[1:3]), (b, [PROMPT[4]]), (c, PROMPT[5:8])],  # ragged counts
        [(a, [PROMPT[15]]), (c, [PROMPT[0]])],  # a subset: not consecutive rows
        [(c, [PROMPT[2]]), (b, [PROMPT[3]])],  # another order
        [(b, [PROMPT[6]])],  # alone
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHES)
def test_grouped_clones_give_the_rows_of_single_clones_bit_for_bit(checkpoint, arch, dtype,
                                                                   in_place):  # fmt: skip
    backend = build_backend("torch", checkpoint(arch), dtype=dtype)
    base = backend.sequence()
    base.evaluate(PROMPT[:9])
    grouped, single = base.clones(3), [base.clone() for _ in range(3)]
    for seqs in (grouped, single):  # as branches: each rolled back to its own point
        seqs[1].rollback(1)
        seqs[2].rollback(3)
    in_place.clear()  # (loading checked two sequences in a batch)
    for mine, theirs in zip(_steps(grouped), _steps(single), strict=True):
        got = backend.evaluate_batch(mine)
        want = backend.evaluate_batch(theirs)
        for x, y in zip(got, want, strict=True):
            assert x.shape == y.shape and np.array_equal(x, y)
    assert base.length == 9 and [s.length for s in grouped] == [s.length for s in single]
    layers = backend.num_layers
    # the grouped path ran for the three batches of all three clones in order, every layer;
    # the subsets, the other order and every batch of single clones copied
    assert in_place.count(True) == 3 * layers
    assert len(in_place) == (3 + 2) * layers * 2


def test_a_clone_that_outgrows_its_row_takes_buffers_of_its_own(checkpoint, in_place):
    backend = build_backend("torch", checkpoint("llama"))
    ids = [(7 * i + 3) % 250 for i in range(80)]
    base = backend.sequence()
    base.evaluate(ids[:60])  # buffers of room 64
    grouped, single = base.clones(2), [base.clone() for _ in range(2)]
    read_in_place = []
    for i in range(60, 70):  # the fifth step writes key 65: past 64, each grows out of its row
        in_place.clear()
        got = backend.evaluate_batch([(s, [ids[i]]) for s in grouped])
        read_in_place.append(all(in_place))
        want = backend.evaluate_batch([(s, [ids[i]]) for s in single])
        for x, y in zip(got, want, strict=True):
            assert np.array_equal(x, y)
    assert read_in_place == [True] * 4 + [False] * 6
    assert all(s._row is None for s in grouped)
    assert base.length == 60 and all(s.length == 70 for s in grouped)


def test_clones_of_an_empty_sequence_and_a_count_below_one(checkpoint):
    backend = build_backend("torch", checkpoint("llama"))
    empty = backend.sequence().clones(2)
    assert [s.length for s in empty] == [0, 0] and all(s._row is None for s in empty)
    rows = backend.evaluate_batch([(s, PROMPT[:3]) for s in empty])
    assert np.array_equal(rows[0], rows[1])
    with pytest.raises(ValueError, match=r"clones\(0\): expected n >= 1"):
        backend.sequence().clones(0)


def test_a_clone_that_leaves_its_group_keeps_its_kv_in_buffers_of_its_own(checkpoint):
    backend = build_backend("torch", checkpoint("llama"))
    base = backend.sequence()
    base.evaluate(PROMPT[:9])
    kept, dropped = base.clones(2)
    twin = base.clone()
    kept.leave_group()
    dropped.reset()
    assert kept._row is None and all(k._base is None for k in kept._keys)  # not views
    for t in PROMPT[9:14]:
        assert np.array_equal(kept.evaluate([t]), twin.evaluate([t]))
    own = list(twin._keys)
    twin.leave_group()  # buffers of its own already: nothing changes
    assert all(a is b for a, b in zip(own, twin._keys, strict=True))
