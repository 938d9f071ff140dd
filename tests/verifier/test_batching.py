"""Many sessions on one verifier: per-session target KV (bounded, LRU), rounds of different
sessions batched into one target forward, a bounded fair round queue.

Backend level: a ragged batch's rows equal the one-sequence rows within the qualification
tolerance (1e-4 in log-prob), a failed batch moves no sequence, a sliding-window model keeps
the one shared KV. Verifier level (real grpc.aio daemon on loopback): evicted sessions
rebuild to the same decisions, a full queue refuses with RESOURCE_EXHAUSTED and writes
nothing, batches are first-in first-out, one round's failure does not fail its batch, and
concurrent sessions emit exactly the local lane's tokens.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from muser.backend import ModelBackend, MultiSequenceBackend, batches, evaluate_batch
from muser.errors import ContextOverflowError, ModelLoadError, TokenOutOfVocabularyError
from muser.sampling import SamplingParams
from muser_app.lanes.local import run_local
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import PROMPT, Verifier, make_config
from verifier_gx.batcher import RoundBatcher, RoundQueueFullError
from verifier_gx.executor import TargetExecutor, witness_batch
from verifier_gx.kvpool import KvPool

C = grpc.StatusCode
TOLERANCE = 1e-4
"""The qualification tolerance on log-probabilities (docs/design.md §8)."""
GREEDY = SamplingParams(temperature=0.0, max_tokens=30)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=30, seed=5)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from muser_app.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("batch-ckpt")
    return make_tiny_checkpoint(root / "llama", seed=0, layers=2)


@pytest.fixture(scope="module")
def torch_target(tiny):
    from muser_torch.backend import TorchBackend

    return TorchBackend(tiny)


# ---- backend: ragged batches ----------------------------------------------------------------


def test_ragged_batch_rows_equal_one_sequence_rows_within_tolerance(torch_target):
    target = torch_target
    assert isinstance(target, MultiSequenceBackend) and batches(target)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 300, size=n))) for n in (3, 41, 17, 1, 60)]
    rounds = [list(map(int, rng.integers(1, 300, size=n))) for n in (5, 1, 3, 5, 2)]
    seqs = [target.sequence() for _ in prompts]
    assert all(isinstance(s, ModelBackend) for s in seqs)
    prefill = target.evaluate_batch(list(zip(seqs, prompts, strict=True)))  # ragged prefill
    batched = target.evaluate_batch(list(zip(seqs, rounds, strict=True)))  # ragged round
    assert [s.length for s in seqs] == [
        len(p) + len(r) for p, r in zip(prompts, rounds, strict=True)
    ]
    worst = 0.0
    for p, r, got_prefill, got in zip(prompts, rounds, prefill, batched, strict=True):
        target.reset()  # the unbatched reference: the one-sequence DynamicCache path
        want_prefill, want = target.evaluate(p), target.evaluate(r)
        assert got.shape == (len(r), target.vocab_size) and got.dtype == np.float64
        for a, b in ((got_prefill, want_prefill), (got, want)):
            worst = max(worst, float(np.abs(log_softmax(a) - log_softmax(b)).max()))
    assert worst < TOLERANCE, f"batched rows differ from unbatched by {worst} in log-prob"


def test_rewind_and_rebatch_gives_the_same_rows(torch_target):
    a, b = torch_target.sequence(), torch_target.sequence()
    first = torch_target.evaluate_batch([(a, [5, 6, 7, 8]), (b, [9, 10])])
    a.rollback(2)
    again = torch_target.evaluate_batch([(a, [7, 8]), (b, [])])
    np.testing.assert_allclose(again[0], first[0][2:], atol=1e-5)
    assert again[1].shape == (0, torch_target.vocab_size) and b.length == 2
    alone = torch_target.sequence()
    np.testing.assert_allclose(alone.evaluate([9, 10]), first[1], atol=1e-5)


def test_a_refused_batch_moves_no_sequence(torch_target):
    a, b = torch_target.sequence(), torch_target.sequence()
    torch_target.evaluate_batch([(a, [1, 2]), (b, [3])])
    context = torch_target.geometry.context_length
    with pytest.raises(ContextOverflowError, match=f"context_length is {context}"):
        torch_target.evaluate_batch([(a, [4]), (b, [1] * context)])
    with pytest.raises(TokenOutOfVocabularyError):
        torch_target.evaluate_batch([(a, [4]), (b, [torch_target.vocab_size])])
    with pytest.raises(ValueError, match="appears twice"):
        torch_target.evaluate_batch([(a, [4]), (a, [5])])
    with pytest.raises(TypeError, match="not a sequence of this backend"):
        torch_target.evaluate_batch([(FakeBackend(), [4])])
    assert (a.length, b.length) == (2, 1)


def test_a_forward_failing_midway_moves_no_sequence(tiny, torch_target, monkeypatch):
    """Refused in the second layer, after the first stored its keys past each length: the
    lengths stay, and the next forward gives the rows of sequences that never failed."""
    from muser_torch.backend import TorchBackend
    from muser_torch.batched import TorchSequence

    fresh = TorchBackend(tiny)
    seqs = [torch_target.sequence() for _ in range(2)]
    refs = [fresh.sequence() for _ in range(2)]
    for backend, pair in ((torch_target, seqs), (fresh, refs)):
        backend.evaluate_batch([(pair[0], [1, 2, 3, 4, 5]), (pair[1], [6, 7])])
    write = TorchSequence._write

    def fail_at_one(self, layer, k, v):
        if layer == 1:
            raise RuntimeError("out of memory")
        return write(self, layer, k, v)

    with monkeypatch.context() as m:
        m.setattr(TorchSequence, "_write", fail_at_one)
        with pytest.raises(RuntimeError, match="out of memory"):
            torch_target.evaluate_batch([(seqs[0], [8, 9, 10]), (seqs[1], [11])])
    assert [s.length for s in seqs] == [5, 2]
    got = torch_target.evaluate_batch([(seqs[0], [12, 13]), (seqs[1], [14, 15, 16])])
    want = fresh.evaluate_batch([(refs[0], [12, 13]), (refs[1], [14, 15, 16])])
    for x, y in zip(got, want, strict=True):
        assert np.array_equal(x, y)


def test_capture_on_a_sequence_equals_the_backend_capture(torch_target):
    seq = torch_target.sequence()
    rows, hidden = seq.evaluate_capture([3, 4, 5], [0, 1])
    torch_target.reset()
    want_rows, want_hidden = torch_target.evaluate_capture([3, 4, 5], [0, 1])
    np.testing.assert_allclose(rows, want_rows, atol=1e-5)
    assert sorted(hidden) == [0, 1]
    for layer in (0, 1):
        np.testing.assert_allclose(hidden[layer], want_hidden[layer], atol=1e-5)


def test_sliding_window_model_keeps_the_shared_kv(tmp_path):
    from muser_app.testing import make_tiny_checkpoint
    from muser_torch.backend import TorchBackend

    path = make_tiny_checkpoint(tmp_path / "mistral", arch="mistral", sliding_window=4)
    target = TorchBackend(path)
    assert not target.can_batch and not batches(target)
    with pytest.raises(ModelLoadError, match="keeps one KV"):
        target.sequence()
    pool = KvPool(target, 4)
    assert not pool.per_session and pool.executor(b"a").cursor.backend is target


def test_evaluate_batch_without_the_capability_runs_in_turn():
    shared = FakeBackend()
    rows = evaluate_batch(shared, [(shared, [1, 2]), (shared, [3])])
    assert [r.shape[0] for r in rows] == [2, 1] and shared.length == 3


# ---- the KV pool ----------------------------------------------------------------------------


def test_kv_pool_evicts_the_least_recently_used(torch_target):
    evicted = []
    pool = KvPool(torch_target, 2, on_evict=lambda: evicted.append(1))
    a = pool.executor(b"a")
    pool.executor(b"b")
    assert pool.executor(b"a") is a  # a is now the most recently used
    pool.executor(b"c")
    assert pool.held() == [b"a", b"c"] and pool.evictions == 1 and evicted == [1]
    assert pool.executor(b"b") is not None and pool.held() == [b"c", b"b"]
    pool.drop(b"c")
    assert pool.held() == [b"b"] and len(pool) == 1
    with pytest.raises(ValueError, match="at least one session"):
        KvPool(torch_target, 0)


def test_witness_batch_rebuilds_an_evicted_session_to_the_same_rows(torch_target):
    transcript = [2, 9, 4, 7, 1]
    kept = TargetExecutor(torch_target.sequence())
    first = witness_batch(torch_target, [(kept, transcript, [3, 3])])[0]
    kept.settle(len(transcript), 1)
    rebuilt = TargetExecutor(torch_target.sequence())  # as after an eviction: empty KV
    assert rebuilt.prepare(transcript, [3, 3])[0] == len(transcript) - 1
    again = witness_batch(torch_target, [(rebuilt, transcript, [3, 3])])[0]
    np.testing.assert_allclose(again, first, atol=1e-5)
    assert kept.prepare(transcript, [3, 3])[0] == 0  # held: nothing re-evaluated


# ---- the round queue ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_batches_are_first_in_first_out_and_bounded():
    gate = threading.Event()
    seen: list[list[str]] = []

    def run(items: list[str]) -> list[object]:
        seen.append(list(items))
        gate.wait(5)
        return [ValueError(i) if i == "boom" else i.upper() for i in items]

    sizes: list[tuple[int, int]] = []
    batcher = RoundBatcher(run, max_batch=2, max_queue=3, on_batch=lambda *a: sizes.append(a))
    first = asyncio.ensure_future(batcher.enqueue("a"))
    await asyncio.sleep(0.05)  # "a" computes alone: nothing waits for a batch to fill
    rest = [asyncio.ensure_future(batcher.enqueue(x)) for x in ("b", "boom", "d")]
    await asyncio.sleep(0.05)
    assert batcher.depth == 3
    with pytest.raises(RoundQueueFullError) as refused:
        await batcher.enqueue("e")
    assert str(refused.value).startswith(
        "the verifier's round queue is full: 3 rounds waiting, limits.round_queue is 3"
    )
    gate.set()
    assert await first == "A"
    assert await rest[0] == "B" and await rest[2] == "D"
    with pytest.raises(ValueError, match="boom"):
        await rest[1]
    assert seen == [["a"], ["b", "boom"], ["d"]]
    assert sizes == [(1, 0), (2, 1), (1, 0)]


@pytest.mark.asyncio
async def test_a_batch_that_raises_refuses_each_of_its_rounds():
    def run(items):
        raise RuntimeError("target down")

    batcher = RoundBatcher(run, max_batch=4, max_queue=4)
    with pytest.raises(RuntimeError, match="target down"):
        await batcher.enqueue(1)
    with pytest.raises(ValueError, match="must be >= 1"):
        RoundBatcher(run, max_batch=0, max_queue=1)


# ---- the verifier: many sessions --------------------------------------------------------------


class SequencedFake(FakeBackend):
    """The fake target with per-sequence KV and a batched evaluate (`MultiSequenceBackend`):
    each sequence is a FakeBackend with the same rows. `gate` holds every forward until set;
    `entered` is set when a forward waits; `batches` records each forward's sequences;
    a sequence in `poisoned` refuses to evaluate (ContextOverflowError)."""

    can_batch = True

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.batches: list[list[FakeBackend]] = []
        self.poisoned: set[int] = set()

    def sequence(self) -> FakeBackend:
        seq = FakeBackend()
        seq.identity = self.identity
        owner = self

        def evaluate(tokens, _plain=seq.evaluate):
            if id(seq) in owner.poisoned:
                raise ContextOverflowError("injected: this sequence refuses to evaluate")
            return _plain(tokens)

        seq.evaluate = evaluate
        return seq

    def evaluate_batch(self, work):
        self.entered.set()
        self.gate.wait(10)
        self.batches.append([seq for seq, _ in work])
        return [seq.evaluate(tokens) for seq, tokens in work]


async def started(key_set, tmp_path, factory, **limits) -> Verifier:
    v = Verifier(make_config(key_set, tmp_path / "wal", **limits), key_set, factory)
    return await v.start()


async def until(condition, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def local_tokens(params: SamplingParams) -> list[int]:
    return run_local(
        FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, draft_len=3, q_top_k=5
    ).tokens


def error_of(msg) -> tuple[grpc.StatusCode, str, str]:
    assert msg.WhichOneof("kind") == "error", msg
    code = next(c for c in C if c.value[0] == msg.error.code)
    return code, msg.error.reason, msg.error.message


@pytest.mark.asyncio
async def test_full_queue_refuses_with_resource_exhausted_and_writes_nothing(key_set, tmp_path):
    from muser.metrics import exposition
    from verifier_gx.servicer import metrics_view, status_json

    v = await started(key_set, tmp_path, SequencedFake, round_queue=1, max_batch=1)
    try:
        clients = [v.client(SAMPLED) for _ in range(3)]
        streams = []
        for c in clients:
            await c.open_session()
            streams.append(await c.attach())
        a, b, c = clients
        v.backend.gate.clear()
        requests = [cl.draft_request() for cl in clients]
        signed = [cl.sign(r) for cl, r in zip(clients, requests, strict=True)]
        first = asyncio.ensure_future(streams[0].round_trip(signed[0]))
        await until(v.backend.entered.is_set)  # a computes (and holds the target)
        second = asyncio.ensure_future(streams[1].round_trip(signed[1]))
        await until(lambda: v.manager.rounds.batcher.depth == 1)  # b waits: the queue is full
        before = v.snapshot(c.session_id)
        msg, fragments = await streams[2].round_trip(signed[2])
        code, reason, message = error_of(msg)
        assert (code, reason, msg.error.round, fragments) == (
            C.RESOURCE_EXHAUSTED,
            "round_queue_full",
            0,
            [],
        )
        assert message == (
            "the verifier's round queue is full: 1 rounds waiting, limits.round_queue is 1; "
            "send the same request again after a backoff"
        )
        assert v.snapshot(c.session_id) == before  # nothing written, nothing moved
        stats = v.manager.stats
        assert stats.queue_full == 1 and stats.refusals == {"round_queue_full": 1}
        assert stats.refusal_codes == {"round_queue_full": "RESOURCE_EXHAUSTED"}
        status = status_json(v.manager)["batching"]
        assert (status["queue_depth"], status["queue_full"], status["round_queue"]) == (1, 1, 1)
        v.backend.gate.set()
        a.accept(requests[0], (await first)[0])
        b.accept(requests[1], (await second)[0])
        msg, _ = await streams[2].round_trip(signed[2])  # the same request, after the backoff
        c.accept(requests[2], msg)
        for cl, st in zip(clients, streams, strict=True):
            await cl.run(st)
            await st.close()
            assert cl.out == local_tokens(SAMPLED)
        text = exposition(lambda: metrics_view(v.manager)).decode()
        assert "muser_round_queue_full_total 1.0" in text
        assert "muser_round_queue_depth 0.0" in text
        assert f'muser_batch_size_bucket{{le="1.0"}} {float(stats.batches)}' in text
        assert f"muser_batch_size_count {float(stats.batches)}" in text
        assert "muser_kv_sessions 0.0" in text  # every session finished: its KV dropped
        assert stats.batch_sizes == {1: stats.rounds} and stats.queue_depth_max == 1
    finally:
        await v.stop()


@pytest.mark.asyncio
async def test_rounds_waiting_together_run_in_one_forward_in_arrival_order(key_set, tmp_path):
    v = await started(key_set, tmp_path, SequencedFake, max_batch=2)
    try:
        clients = [v.client(GREEDY) for _ in range(4)]
        streams = []
        for c in clients:
            await c.open_session()
            streams.append(await c.attach())
        v.backend.gate.clear()
        requests = [cl.draft_request() for cl in clients]
        pending = []
        for i, (cl, st, r) in enumerate(zip(clients, streams, requests, strict=True)):
            pending.append(asyncio.ensure_future(st.round_trip(cl.sign(r))))
            if i == 0:
                await until(v.backend.entered.is_set)
            else:
                await until(lambda n=i: v.manager.rounds.batcher.depth == n)
        v.backend.gate.set()
        for cl, r, p in zip(clients, requests, pending, strict=True):
            cl.accept(r, (await p)[0])
        executors = {sid: v.manager.kv.executor(sid).cursor.backend for sid in
                     (cl.session_id for cl in clients)}  # fmt: skip
        order = [[executors[cl.session_id] for cl in group] for group in
                 ([clients[0]], clients[1:3], clients[3:])]  # fmt: skip
        assert v.backend.batches[:3] == order  # first in, first out; at most max_batch
        assert v.manager.stats.batch_sizes == {1: 2, 2: 1}
        for cl, st in zip(clients, streams, strict=True):
            await cl.run(st)
            assert cl.out == local_tokens(GREEDY)
    finally:
        await v.stop()


@pytest.mark.asyncio
async def test_one_rounds_failure_does_not_fail_its_batch(key_set, tmp_path):
    v = await started(key_set, tmp_path, SequencedFake)
    try:
        blocker, good, bad = v.client(SAMPLED), v.client(SAMPLED), v.client(SAMPLED)
        streams = []
        for c in (blocker, good, bad):
            await c.open_session()
            streams.append(await c.attach())
            await c.step(streams[-1])  # every session holds a KV sequence now
        v.backend.poisoned.add(id(v.manager.kv.executor(bad.session_id).cursor.backend))
        v.backend.gate.clear()
        v.backend.entered.clear()
        requests = [c.draft_request() for c in (blocker, good, bad)]
        signed = [c.sign(r) for c, r in zip((blocker, good, bad), requests, strict=True)]
        pending = [asyncio.ensure_future(streams[0].round_trip(signed[0]))]
        await until(v.backend.entered.is_set)  # the blocker computes; good and bad queue up
        pending += [
            asyncio.ensure_future(st.round_trip(s))
            for st, s in zip(streams[1:], signed[1:], strict=True)
        ]
        await until(lambda: v.manager.rounds.batcher.depth == 2)
        before = v.snapshot(bad.session_id)
        v.backend.gate.set()
        blocker.accept(requests[0], (await pending[0])[0])
        good.accept(requests[1], (await pending[1])[0])
        code, reason, message = error_of((await pending[2])[0])
        assert (code, reason) == (C.OUT_OF_RANGE, "context_overflow")
        assert message == "injected: this sequence refuses to evaluate"
        good_seq = v.manager.kv.executor(good.session_id).cursor.backend
        bad_seq = v.manager.kv.executor(bad.session_id).cursor.backend
        # good and bad reach the queue concurrently, in either order: the batch holds both,
        # and each is then evaluated again alone, in the batch's order
        both, first, second = v.backend.batches[-3:]
        assert sorted(map(id, both)) == sorted(map(id, (good_seq, bad_seq)))
        assert [first, second] == [[seq] for seq in both]
        assert v.snapshot(bad.session_id)[1:] == before[1:]  # the others moved the WAL only
        v.backend.poisoned.clear()
        msg, _ = await streams[2].round_trip(signed[2])
        bad.accept(requests[2], msg)
        for name, c, st in zip(
            ("blocker", "good", "bad"), (blocker, good, bad), streams, strict=True
        ):
            await c.run(st)
            assert c.out == local_tokens(SAMPLED), name
    finally:
        await v.stop()


@pytest.mark.asyncio
async def test_a_stalled_session_does_not_hold_the_others(key_set, tmp_path):
    v = await started(key_set, tmp_path, SequencedFake, max_batch=2)
    try:
        slow, *fast = [v.client(GREEDY) for _ in range(3)]
        streams = {}
        for c in (slow, *fast):
            await c.open_session()
            streams[c.session_id] = await c.attach()
        await slow.step(streams[slow.session_id])  # one round, then it stalls mid-session
        await asyncio.wait_for(
            asyncio.gather(*(c.run(streams[c.session_id]) for c in fast)), timeout=30
        )
        assert all(c.done and c.out == local_tokens(GREEDY) for c in fast)
        assert slow.next_round == 1 and not slow.done
        await slow.run(streams[slow.session_id])
        assert slow.out == local_tokens(GREEDY)
    finally:
        await v.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["fake", "torch"])
async def test_evicted_sessions_rebuild_to_the_same_decisions(key_set, tmp_path, kind, tiny):
    from muser_torch.backend import TorchBackend

    factory = SequencedFake if kind == "fake" else (lambda: TorchBackend(tiny))
    ids = [bytes([i]) * 16 for i in range(3)]
    runs = {}
    for name, limits in (("evicting", {"kv_sessions": 1, "max_batch": 1}), ("held", {})):
        v = await started(key_set, tmp_path / name, factory, **limits)
        try:
            draft = FakeBackend(order=1, salt=1) if kind == "fake" else TorchBackend(tiny)
            clients = [v.client(SAMPLED, session_id=sid, draft=draft) for sid in ids]
            streams = []
            for c in clients:
                await c.open_session()
                streams.append(await c.attach())
            while not all(c.done for c in clients):  # interleaved: a, b, c, a, b, c, ...
                for c, st in zip(clients, streams, strict=True):
                    if not c.done:
                        await c.step(st)
            runs[name] = [[r.encode() for r in c.results] for c in clients], v.manager.stats
        finally:
            await v.stop()
    (evicting, ev_stats), (held, held_stats) = runs["evicting"], runs["held"]
    assert evicting == held  # byte-identical signed results: the same decisions
    assert ev_stats.kv_evictions >= ev_stats.rounds - 3 > 0
    assert ev_stats.kv_rebuilt_tokens > 0
    assert (held_stats.kv_evictions, held_stats.kv_rebuilt_tokens) == (0, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_concurrent_sessions_on_torch_equal_the_local_lane(key_set, tmp_path, tiny, params):
    from muser_torch.backend import TorchBackend

    v = await started(key_set, tmp_path, lambda: TorchBackend(tiny))
    try:
        prompts = [PROMPT[: 1 + i % 4] + [3 + i] * (i + 1) for i in range(6)]  # ragged
        clients = [
            v.client(params, prompt=p, draft=TorchBackend(tiny, threads=None)) for p in prompts
        ]
        streams = []
        for c in clients:
            await c.open_session()
            streams.append(await c.attach())
        await asyncio.gather(*(c.run(st) for c, st in zip(clients, streams, strict=True)))
        for c, p in zip(clients, prompts, strict=True):
            local = run_local(
                TorchBackend(tiny), TorchBackend(tiny), p, params, draft_len=3, q_top_k=5
            )
            assert c.out == local.tokens
        stats = v.manager.stats
        assert stats.batches < stats.rounds and max(stats.batch_sizes) > 1  # batched for real
        assert sum(k * n for k, n in stats.batch_sizes.items()) == stats.rounds
    finally:
        await v.stop()


def test_batches_answers_per_object_for_proxies_and_once_per_class_otherwise():
    """`batches` keeps its structural answer per class, except for a class that forwards
    attributes (`__getattr__`): two proxies of one class may wrap a batching backend and
    one that is not."""

    class Proxy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Single:
        identity = geometry = vocab_size = length = None

        def evaluate(self, tokens): ...
        def rollback(self, n): ...
        def reset(self): ...

    multi = FakeBackend()
    multi.can_batch = True
    multi.sequence = lambda: None
    multi.evaluate_batch = lambda work: []
    assert batches(Proxy(multi)) and not batches(Proxy(Single()))
    assert batches(Proxy(multi))  # the first answer was not kept for the class
    assert not batches(Single()) and not batches(Single())
    from muser import backend as backend_module

    assert backend_module._MULTI[Single] is False and Proxy not in backend_module._MULTI
