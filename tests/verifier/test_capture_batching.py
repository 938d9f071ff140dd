"""Capturing sessions' rounds in the batch (issue 32): a round that captures hidden rows
goes into the same target forward as other sessions' rounds, each with its own layers
(`TorchBackend.evaluate_batch_capture`), and a lookahead captures too. Each round's rows and
captured rows are those it gets alone (within a batch's float rounding), on the real torch
forward; a capturing cluster of sessions emits the local lane's tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from muser.capture import result_rows
from muser.sampling import SamplingParams
from muser_app.lanes.local import run_local
from tests.verifier.conftest import PROMPT, Verifier, make_config
from verifier_gx.executor import Capture, TargetExecutor, Witness, witness_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from muser_app.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("capture-batch") / "llama", layers=2)


@pytest.fixture(scope="module")
def torch_target(tiny):
    from muser_torch.backend import TorchBackend

    return TorchBackend(tiny)


def alone(target, transcript, drafts, capture, held=()):
    """The round on an executor of its own: (rows, captured)."""
    ex = TargetExecutor(target.sequence())
    if held:
        ex.cursor.hold(list(held))
        ex.cursor.extend(list(held))
    rows = ex.witness_logits(transcript, drafts, capture)
    return rows, ex.captured


def close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_capturing_rounds_share_the_forward_and_each_gets_its_own_rows(torch_target, monkeypatch):
    """Three rounds, one forward: one capturing from position 0 (after an open: the whole
    transcript again), one capturing nothing, one capturing from its frontier with its KV
    held; each as alone, each executor left holding its round's tokens."""
    calls = []
    real = torch_target.evaluate_batch_capture
    monkeypatch.setattr(torch_target, "evaluate_batch_capture",
                        lambda work: calls.append(len(work)) or real(work))  # fmt: skip
    a_t, b_t, c_t = [2, 9, 4, 7, 1], [5, 3], [8, 8, 1, 6, 2, 2]
    a, b, c = (TargetExecutor(torch_target.sequence()) for _ in range(3))
    c.cursor.extend(c_t[:-1])  # c's KV holds its transcript but the frontier
    caps = {"a": Capture(0, (1, 0)), "c": Capture(len(c_t) - 1, (1,))}
    rounds = [
        Witness(a, a_t, [3, 3], None, caps["a"]),
        Witness(b, b_t, [4]),
        Witness(c, c_t, [1, 2, 3], None, caps["c"]),
    ]
    got = witness_batch(torch_target, rounds)
    assert calls == [3]  # one forward for the three
    for (ex, transcript, drafts, _, capture), rows in zip(rounds, got, strict=True):
        held = c_t[:-1] if ex is c else ()
        ref_rows, ref_captured = alone(torch_target, transcript, drafts, capture, held)
        close(rows, ref_rows)
        assert rows.shape[0] == len(drafts) + 1
        assert sorted(ex.captured) == sorted(capture.layers if capture else ())
        for layer, kept in ex.captured.items():  # from `first` through the drafts
            assert kept.shape[0] == len(transcript) + len(drafts) - capture.first
            close(kept, ref_captured[layer])
        assert ex.cursor.holds([*transcript, *drafts])


def test_a_lookahead_captures_and_the_round_takes_it(torch_target):
    transcript, drafts, capture = [2, 9, 4, 7, 1], [3, 5], Capture(4, (0, 1))
    ex = TargetExecutor(torch_target.sequence())
    ex.cursor.extend(transcript[:-1])
    ref_rows, ref_captured = alone(torch_target, transcript, drafts, capture, transcript[:-1])
    assert ex.look_ahead(transcript, drafts, lambda: 0.0, capture.layers) is not None
    ex._ahead = (*ex._ahead[:4], 0.25)  # (the seconds its forward took, as the clock said)
    rows = witness_batch(torch_target, [Witness(ex, transcript, drafts, None, capture)])[0]
    assert ex.ahead_s == 0.25  # taken: no forward of its own
    close(rows, ref_rows)
    for layer in capture.layers:
        close(ex.captured[layer], ref_captured[layer])


@pytest.mark.parametrize(
    "asked",
    [Capture(0, (0, 1)), Capture(4, (1,)), None],
    ids=["rows-from-0", "other-layers", "no-capture"],
)
def test_a_lookahead_with_other_capture_is_not_taken(torch_target, asked):
    """A round that must capture from further back, other layers, or nothing, evaluates
    again: the lookahead's rows are not its rows."""
    transcript, drafts = [2, 9, 4, 7, 1], [3, 5]
    ex = TargetExecutor(torch_target.sequence())
    ex.cursor.extend(transcript[:-1])
    ex.look_ahead(transcript, drafts, lambda: 0.0, (0, 1))
    rows = witness_batch(torch_target, [Witness(ex, transcript, drafts, None, asked)])[0]
    assert ex.ahead_s == 0.0
    ref_rows, ref_captured = alone(torch_target, transcript, drafts, asked)
    close(rows, ref_rows)
    assert sorted(ex.captured) == sorted(ref_captured)
    for layer in ref_captured:
        close(ex.captured[layer], ref_captured[layer])


@pytest.mark.asyncio
async def test_capturing_and_plain_sessions_batch_and_equal_the_local_lane(key_set, tmp_path, tiny):
    """Four sessions, two capturing, on a torch verifier: capturing rounds went into
    forwards with other rounds, every session emits the local lane's tokens, and each
    capturing session's rows are the target's own at every position it was sent."""
    from muser_torch.backend import TorchBackend

    sizes: list[int] = []

    class Counting(TorchBackend):
        def evaluate_batch_capture(self, work):
            sizes.append(len(work))
            return super().evaluate_batch_capture(work)

    v = await Verifier(make_config(key_set, tmp_path / "wal"), key_set,
                       lambda: Counting(tiny)).start()  # fmt: skip
    try:
        prompts = [PROMPT[: 2 + i] + [3 + i] * (i + 1) for i in range(4)]
        layers = [(1, 0), (), (0,), ()]
        clients = [
            v.client(GREEDY, prompt=p, draft=TorchBackend(tiny, threads=None), capture_layers=c)
            for p, c in zip(prompts, layers, strict=True)
        ]
        streams = []
        for c in clients:
            await c.open_session()
            streams.append(await c.attach())
        seen: dict[int, dict[int, dict[int, np.ndarray]]] = {0: {}, 2: {}}

        async def run(i: int) -> None:
            c, st = clients[i], streams[i]
            while not c.done:
                request = c.draft_request()
                msg, fragments = await st.round_trip(c.sign(request))
                result = c.accept(request, msg)
                if layers[i]:
                    end = len(c.transcript) - 1
                    first, rows = result_rows(result.capture_digests,
                                              {f.digest: f.data for f in fragments},
                                              c.session_id, result.round, sorted(layers[i]), end)  # fmt: skip
                    for layer, r in rows.items():
                        for j, row in enumerate(r):
                            seen[i].setdefault(layer, {})[first + j] = row

        await asyncio.gather(*(run(i) for i in range(4)))
        assert max(sizes) > 1, sizes  # capturing rounds shared forwards
        reference = TorchBackend(tiny)
        for i, (c, p) in enumerate(zip(clients, prompts, strict=True)):
            local = run_local(
                TorchBackend(tiny), TorchBackend(tiny), p, GREEDY, draft_len=3, q_top_k=5
            )
            assert c.out == local.tokens
            if not layers[i]:
                continue
            reference.reset()
            _, full = reference.evaluate_capture(c.transcript, layers[i])
            for layer in layers[i]:
                got = seen[i][layer]
                assert sorted(got) == list(range(len(c.transcript) - 1))  # every position sent
                for pos, row in got.items():  # float16 on the wire
                    np.testing.assert_allclose(row, full[layer][pos], rtol=2e-3, atol=2e-3)
    finally:
        await v.stop()
