"""Batched drafting (lane.draft_batch): rounds of several sessions drafted in lockstep, one
batched forward per draft step, each on its own sequence.

What is guaranteed, and tested here: a batched draft's q rows equal the lone draft's within
float rounding, and its drafts are exactly what the sampler picks from the q rows it sends,
with the session's own draws in order (so the verifier's replay accepts it); ragged sessions
(lengths, D, one done early) and a failing session leave the others' drafts and KV intact;
a session drafting alone takes the lone path (the local lane's); the knob turns it off.
Greedy text of concurrent sessions equal to plain decode runs on real daemons in
tests/cluster/test_cluster_sessions.py."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from muser.errors import ContextOverflowError
from muser.mt19937 import Mt19937
from muser.round import DEFAULT_Q_TOP_K
from muser.sampling import SamplingParams, argmax_lowest, draft_row, sample_ordered
from muser.wire import muser_v2_pb2 as pb
from muser_app.lanes.local import run_local
from proposer_mac.drafting import Draft, Drafter, run_together
from tests.core.fake_backend import FakeBackend
from tests.proposer.test_generate_service import start, stop
from tests.verifier.conftest import PROMPT
from tests.verifier.test_batching import until

SAMPLED = SamplingParams(temperature=1.0, max_tokens=64, seed=3)


def sampler_picks(draft: Draft, state: Mt19937, greedy: bool) -> list[int]:
    """What the verifier's replay of draw step 1 selects from the q rows a request carries."""
    rng = state.copy()
    out = []
    for q in draft.q_rows:
        i = argmax_lowest(q.weights) if greedy else sample_ordered(q.weights, rng.uniform_f64())
        out.append(int(q.ids[i]))
    return out


def lone_q_rows(backend, transcript, drafts, params) -> list:
    """The q rows a lone forward gives for `drafts` after `transcript` (fresh KV)."""
    rows = backend.fork().evaluate([*transcript, *drafts[:-1]])[len(transcript) - 1 :]
    return [draft_row(r, params, DEFAULT_Q_TOP_K) for r in rows]  # the drafters' width


def assert_rows_close(batched, lone):
    for i, (a, b) in enumerate(zip(batched, lone, strict=True)):
        assert np.array_equal(a.ids, b.ids), f"row {i}: q ids differ"
        assert np.abs(a.weights - b.weights).max() < 1e-5, f"row {i}: q weights differ"


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=64)])
def test_batched_drafts_are_the_samplers_picks_from_rows_equal_to_lone_rows(natural, params):
    backend, prompts = natural
    depths = [4, 1, 6, 0]  # ragged: lengths and D differ, one drafts nothing, one ends early
    drafters = [Drafter(backend.sequence(), params) for _ in prompts]
    states = [Mt19937.from_seed(100 + i) for i in range(len(prompts))]
    transcripts = [list(p) for p in prompts]
    for _ in range(3):  # later rounds reuse each KV after a partial acceptance
        work = [
            (d.cursor, d.draft_steps(t, s, depth))
            for d, t, s, depth in zip(drafters, transcripts, states, depths, strict=True)
        ]
        results = run_together(backend, work)
        for i, (got, t, s) in enumerate(zip(results, transcripts, states, strict=True)):
            assert isinstance(got, Draft), f"session {i}: {got!r}"
            assert len(got.drafts) == depths[i]
            assert got.drafts == sampler_picks(got, s, params.greedy)
            if got.drafts:
                assert_rows_close(got.q_rows, lone_q_rows(backend, t, got.drafts, params))
                assert drafters[i].cursor.tokens == [*t, *got.drafts[:-1]]
                assert drafters[i].cursor.backend.length == len(drafters[i].cursor.tokens)
            # half the drafts accepted, then a token of the target's: the next round's frontier
            t += [*got.drafts[: len(got.drafts) // 2], (7 * len(t)) % backend.vocab_size]
            states[i] = Mt19937.from_seed(200 + len(t))


def test_a_lone_session_drafts_bit_for_bit_what_the_fork_drafts(natural):
    """A session drafting alone on its sequence (lane.draft_batch on, the local lane) makes
    the very draft it made on its own fork before batching (lane.draft_batch off)."""
    backend, prompts = natural
    on_seq, on_fork = Drafter(backend.sequence(), SAMPLED), Drafter(backend.fork(), SAMPLED)
    state = Mt19937.from_seed(5)
    for prompt in prompts:
        a, b = on_seq.draft(prompt, state, 5), on_fork.draft(prompt, state, 5)
        assert a.drafts == b.drafts
        for qa, qb in zip(a.q_rows, b.q_rows, strict=True):
            assert np.array_equal(qa.ids, qb.ids) and np.array_equal(qa.weights, qb.weights)


def test_batched_speculations_join_drafts_and_a_stopped_one_ends_alone(natural):
    backend, prompts = natural
    params = SamplingParams(temperature=0.0, max_tokens=64)
    drafters = [Drafter(backend.sequence(), params) for _ in prompts[:3]]
    state = Mt19937.from_seed(0)
    first = [d.draft(p, state, 4) for d, p in zip(drafters, prompts[:3], strict=True)]
    stopped = threading.Event()
    stopped.set()
    work = [
        (drafters[0].cursor, drafters[0].speculate_steps(prompts[0], state, first[0], 4, ())),
        (drafters[1].cursor, drafters[1].speculate_steps(prompts[1], state, first[1], 3, (), stopped)),
        (drafters[2].cursor, drafters[2].draft_steps(prompts[2], state, 2)),
    ]  # fmt: skip
    spec, halted, fresh = run_together(backend, work)
    emitted = spec.emitted
    assert emitted[:-1] == first[0].drafts and spec.proposal is not None
    assert spec.proposal.drafts == sampler_picks(spec.proposal, state, True)
    assert drafters[0].cursor.tokens == [*prompts[0], *emitted, *spec.proposal.drafts[:-1]]
    assert halted.proposal is None  # stopped between two forwards
    assert fresh.drafts == sampler_picks(fresh, state, True) and len(fresh.drafts) == 2
    # after the stopped guess its drafter drafts from where its last real draft left it
    again = drafters[1].draft(prompts[1], state, 4)
    assert again.drafts == first[1].drafts


def test_one_sessions_failure_leaves_the_others_drafts_and_kv_intact(natural):
    backend, prompts = natural
    ctx = backend.geometry.context_length
    full = [(5 * i + 1) % backend.vocab_size for i in range(ctx - 2)]  # room for two drafts
    drafters = [Drafter(backend.sequence(), SAMPLED) for _ in range(3)]
    state = Mt19937.from_seed(9)
    transcripts = [prompts[0], full, prompts[1]]
    work = [
        (d.cursor, d.draft_steps(t, state, 5)) for d, t in zip(drafters, transcripts, strict=True)
    ]
    ok0, failed, ok2 = run_together(backend, work)
    assert isinstance(failed, ContextOverflowError)
    for d, t, got in ((drafters[0], prompts[0], ok0), (drafters[2], prompts[1], ok2)):
        assert isinstance(got, Draft) and len(got.drafts) == 5
        assert got.drafts == sampler_picks(got, state, False)
        assert_rows_close(got.q_rows, lone_q_rows(backend, t, got.drafts, SAMPLED))
        assert d.cursor.tokens == [*t, *got.drafts[:-1]]
        assert d.cursor.backend.length == len(d.cursor.tokens)
    cursor = drafters[1].cursor  # the failed one holds only what it evaluated
    assert cursor.backend.length == len(cursor.tokens) <= ctx


# ---- the daemon: the draft thread groups what waits, and the knob ------------------------------


class SequencedDraft(FakeBackend):
    """The fake draft with per-sequence KV and a batched evaluate (`MultiSequenceBackend`):
    rows exactly a lone sequence's, so sampled text must equal the local lane's. `sizes`
    records each batched forward's number of sequences; one in `poisoned` refuses."""

    can_batch = True

    def __init__(self) -> None:
        super().__init__(order=1, salt=1)
        self.sizes: list[int] = []
        self.poisoned: set[int] = set()

    def sequence(self) -> FakeBackend:
        seq = FakeBackend(order=1, salt=1)
        seq.identity = self.identity
        plain = seq.evaluate

        def evaluate(tokens):
            if id(seq) in self.poisoned:
                raise ContextOverflowError("injected: this sequence refuses to evaluate")
            return plain(tokens)

        seq.evaluate = evaluate
        return seq

    def evaluate_batch(self, work):
        self.sizes.append(len(work))
        if any(id(seq) in self.poisoned for seq, _ in work):
            raise ContextOverflowError("injected: one sequence refuses; so does the forward")
        return [seq.evaluate(tokens) for seq, tokens in work]


async def held(core, n: int, then=lambda: None) -> list:
    """Start `n` sessions while the draft thread is held; once all their first drafts wait
    there, call `then` and release it. Returns the runners."""
    gate = threading.Event()
    core.context.draft_pool.submit(gate.wait, 10)
    runners = [await core.start_session(PROMPT, SAMPLED) for _ in range(n)]
    await until(lambda: core.context.drafts.waiting == n)
    then()
    gate.set()
    return runners


async def run_sessions(key_set, tmp_path, draft, n: int, **lane):
    """Start `n` sessions while the draft thread is held, so their first drafts wait there
    together; returns the runners (finished) and the proposer's status JSON."""
    c = await start(key_set, tmp_path, draft=draft, lane=lane)
    try:
        runners = await held(c.server.core, n)
        await asyncio.gather(*(r.task for r in runners))
        status = json.loads((await c.stub.Status(pb.StatusRequest())).json)
    finally:
        await stop(c)
    return runners, status


@pytest.mark.asyncio
async def test_sessions_waiting_together_are_drafted_together(key_set, tmp_path):
    draft = SequencedDraft()
    runners, status = await run_sessions(key_set, tmp_path, draft, 4)
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, SAMPLED, q_top_k=32)
    for r in runners:
        assert r.error is None and r.session.emitted == local.tokens
    sizes = {int(k): n for k, n in status["drafting"]["batch_sizes"].items()}
    assert status["drafting"]["batch"] is True
    assert max(sizes) == 4 and max(draft.sizes) == 4  # the first drafts, at least
    assert draft.evaluated == 0  # the shared KV never drafted: every session on a sequence


@pytest.mark.asyncio
async def test_with_draft_batch_off_no_batch_is_larger_than_one(key_set, tmp_path):
    draft = SequencedDraft()
    draft.fork = draft.sequence  # today's path: each session on a KV of its own, alone
    runners, status = await run_sessions(key_set, tmp_path, draft, 4, draft_batch=False)
    assert all(r.error is None for r in runners)
    assert status["drafting"]["batch"] is False
    assert set(status["drafting"]["batch_sizes"]) == {"1"} and draft.sizes == []


@pytest.mark.asyncio
async def test_a_failing_session_in_a_batch_fails_alone(key_set, tmp_path):
    draft = SequencedDraft()
    made = []
    sequence = draft.sequence

    def tracked():
        made.append(sequence())
        return made[-1]

    draft.sequence = tracked
    c = await start(key_set, tmp_path, draft=draft)
    try:
        runners = await held(c.server.core, 3, then=lambda: draft.poisoned.add(id(made[1])))
        await asyncio.gather(*(r.task for r in runners))
    finally:
        await stop(c)
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, SAMPLED, q_top_k=32)
    assert isinstance(runners[1].error, ContextOverflowError)
    assert runners[0].error is None and runners[0].session.emitted == local.tokens
    assert runners[2].error is None and runners[2].session.emitted == local.tokens
    assert max(draft.sizes) == 3  # they were batched when session 1 refused


@pytest.mark.asyncio
async def test_a_sessions_second_job_runs_after_its_first_never_beside_it(monkeypatch):
    """A draft on the verifier's decision may be submitted while the speculation it replaces
    still waits: the two share one cursor, so they run one after the other; the second jobs
    of several sessions run together."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from proposer_mac import draft_queue

    order: list[str] = []

    class Lone:
        def __init__(self, name):
            self.name, self.cursor = name, SimpleNamespace(name=name)

        def run(self, steps):
            order.append(f"{self.name}:{steps} alone")
            return steps

    def together(backend, work):
        order.append("+".join(f"{c.name}:{s}" for c, s in work))
        return [s for _, s in work]

    monkeypatch.setattr(draft_queue, "run_together", together)
    a, b, c = Lone("a"), Lone("b"), Lone("c")
    pool = ThreadPoolExecutor(max_workers=1)

    async def drain(batch_with, jobs) -> list[str]:
        gate = threading.Event()
        pool.submit(gate.wait)  # the draft thread is busy: the jobs wait together
        queue = draft_queue.DraftQueue(pool, batch_with=batch_with)
        futures = [queue.draft(drafter, steps) for drafter, steps in jobs]
        gate.set()
        results = [r for r, _ in await asyncio.gather(*futures)]
        assert results == [steps for _, steps in jobs]
        ran, order[:] = list(order), []
        return ran

    jobs = [(a, "spec"), (b, "draft"), (a, "follow")]
    assert await drain(object(), jobs) == ["a:spec+b:draft", "a:follow alone"]
    # the second jobs of several sessions are drafted together too, after every first one
    jobs = [(a, "spec"), (b, "spec"), (a, "follow"), (c, "draft"), (b, "follow"), (a, "again")]
    assert await drain(object(), jobs) == [
        "a:spec+b:spec+c:draft", "a:follow+b:follow", "a:again alone"
    ]  # fmt: skip
    assert await drain(None, jobs) == [  # lane.draft_batch off: each alone, in that order
        "a:spec alone", "b:spec alone", "c:draft alone", "a:follow alone", "b:follow alone",
        "a:again alone",
    ]  # fmt: skip
    pool.shutdown()
