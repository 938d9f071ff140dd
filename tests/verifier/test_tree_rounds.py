"""Tree rounds on the wire (docs/design.md §3): a verifier on a tiny torch target judges token
trees a client drafts with the proposer's `Drafter.tree_steps`. Greedy tree sessions equal
plain decode; sampled ones repeat for a seed and their log replays; a retry is the stored
bytes; every malformed tree is refused with its status and nothing written; a verifier
restarted on its log goes on from the tree rounds it committed; a verifier that judges
chains only says so at open and refuses a tree."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import pytest_asyncio

from muser.records import RoundRequest, RoundResult
from muser.sampling import SamplingParams, SparseRow
from muser.wire import convert
from muser_app.lanes.plain import run_plain
from tests.verifier.conftest import PROMPT, Verifier, make_config
from tests.verifier.test_refusals import expect_refused
from verifier_gx.journal_check import VerifierJournal

pytestmark = pytest.mark.asyncio

C = grpc.StatusCode
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=32, seed=7)
SHAPE = [3, 2, 1]  # 3 + 6 + 6 = 15 nodes
NODES = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from muser_app.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tree-pair")
    return make_tiny_checkpoint(root / "target", seed=0), make_tiny_checkpoint(
        root / "draft", seed=1, layers=1
    )


def tree_config(key_set, wal, nodes: int = NODES):
    config = make_config(key_set, wal)
    return config.model_copy(update={"lane": config.lane.model_copy(update={"tree_nodes": nodes})})


@pytest_asyncio.fixture
async def tree_verifier(key_set, tmp_path, pair):
    from muser_torch.backend import TorchBackend

    v = Verifier(tree_config(key_set, tmp_path / "wal"), key_set, lambda: TorchBackend(pair[0]))
    await v.start()
    yield v
    await v.stop()


def tree_client(v: Verifier, pair, params: SamplingParams, shape=SHAPE, **kw):
    from muser_torch.backend import TorchBackend

    return v.client(params, draft=TorchBackend(pair[1]).sequence(), tree_shape=list(shape), **kw)


async def run_session(v: Verifier, pair, params: SamplingParams, shape=SHAPE):
    client = tree_client(v, pair, params, shape)
    reply = await client.open_session()
    assert list(reply.features) == ["tree-rounds", "capture-decode", "lookup-stop", "capture-trees"]
    stream = await client.attach()
    await client.run(stream)
    await stream.close()
    return client


def plain(pair, params: SamplingParams) -> list[int]:
    from muser_torch.backend import TorchBackend

    return run_plain(TorchBackend(pair[0]), PROMPT, params).tokens


def replays(v: Verifier, client) -> None:
    """The commit log, tree rounds and all, verifies offline (signatures, heads, draws)."""
    report = VerifierJournal().verify(
        v.manager.log.records(),
        verifier_keys={v.manager.key_id: v.key_set.verifier.public_key()},
        proposer_keys={client.key_id: client.key.public_key()},
    )
    assert report.ok, report.first_bad


@pytest.mark.parametrize("shape", [SHAPE, [4, 1, 1, 1], [1, 1, 1]], ids=lambda s: str(s))
async def test_greedy_tree_session_equals_plain_decode(tree_verifier, pair, shape):
    client = await run_session(tree_verifier, pair, GREEDY, shape)
    assert client.out == plain(pair, GREEDY)
    results = [RoundResult.decode(s.body) for s in client.results]
    assert all(r.is_tree and r.accepted == len(r.path) for r in results if r.drafts)
    assert sum(len(r.drafts) for r in results) > len(results)  # trees, not chains, went out
    replays(tree_verifier, client)


async def test_sampled_tree_session_repeats_for_a_seed_and_replays(tree_verifier, pair):
    first = await run_session(tree_verifier, pair, SAMPLED)
    second = await run_session(tree_verifier, pair, SAMPLED)
    assert first.out == second.out and len(first.out) == SAMPLED.max_tokens
    assert [s.body for s in first.results] != []
    replays(tree_verifier, first)


async def test_a_tree_retry_is_the_stored_bytes_and_another_tree_is_equivocation(
    tree_verifier, pair
):
    client = tree_client(tree_verifier, pair, SAMPLED)
    await client.open_session()
    stream = await client.attach()
    request = client.draft_request()
    sent = client.sign(request)
    msg, _ = await stream.round_trip(sent)
    client.accept(request, msg)
    seq = tree_verifier.wal_seq
    again, _ = await stream.round_trip(sent)
    assert convert.result_from_pb(again.result).encode() == client.results[0].encode()
    assert tree_verifier.wal_seq == seq
    pruned = dataclasses.replace(request, drafts=request.drafts[:1], parents=request.parents[:1],
                                 q_rows=request.q_rows[:1])  # fmt: skip
    await expect_refused(
        tree_verifier, client, stream, client.sign(pruned), C.ALREADY_EXISTS, "equivocation"
    )


def rebuilt(request: RoundRequest, parents, tokens, rows) -> RoundRequest:
    return dataclasses.replace(
        request, parents=tuple(parents), drafts=tuple(tokens), q_rows=tuple(rows)
    )


def cyclic(r: RoundRequest) -> RoundRequest:
    parents = list(r.parents)
    parents[1] = 2  # a later node: parents come first, so this is how a cycle is written
    return dataclasses.replace(r, parents=tuple(parents))


def orphan(r: RoundRequest) -> RoundRequest:
    return dataclasses.replace(r, parents=(*r.parents[:-1], 99))


def twins(r: RoundRequest) -> RoundRequest:
    tokens = list(r.drafts)
    tokens[1] = tokens[0]  # the root's first two children, the same token
    return dataclasses.replace(r, drafts=tuple(tokens))


def oversized(r: RoundRequest) -> RoundRequest:
    """65 root children (a node budget of 64), each with q > 0 in the root's row."""
    ids = list(range(NODES + 1))
    return rebuilt(r, [-1] * len(ids), ids, [SparseRow(ids, [1.0] * len(ids))])


def swapped(r: RoundRequest) -> RoundRequest:
    """The first child another token of its row: one the replayed draws did not select."""
    row, taken = r.q_rows[0], set(r.drafts[i] for i, p in enumerate(r.parents) if p == -1)
    other = next(int(t) for t in row.ids if int(t) not in taken)
    return dataclasses.replace(r, drafts=(other, *r.drafts[1:]))


def rows_short(r: RoundRequest) -> RoundRequest:
    return dataclasses.replace(r, q_rows=r.q_rows[:-1])


def too_deep(r: RoundRequest) -> RoundRequest:
    """A chain of 40 nodes as a tree: deeper than the 32 tokens the session may emit."""
    row = SparseRow([5], [1.0])
    return rebuilt(r, range(-1, 39), [5] * 40, [row] * 40)


TREE_MUTATIONS = {
    "cycle": (cyclic, C.INVALID_ARGUMENT, "malformed_tree"),
    "orphan": (orphan, C.INVALID_ARGUMENT, "malformed_tree"),
    "duplicate_siblings": (twins, C.INVALID_ARGUMENT, "malformed_tree"),
    "too_many_nodes": (oversized, C.INVALID_ARGUMENT, "malformed_tree"),
    "not_selected_by_the_draws": (swapped, C.FAILED_PRECONDITION, "draft_mismatch"),
    "rows_do_not_fit": (rows_short, C.INVALID_ARGUMENT, "row_count"),
    "deeper_than_what_remains": (too_deep, C.INVALID_ARGUMENT, "too_many_drafts"),
    "decode_len": (lambda r: dataclasses.replace(r, decode_len=2),
                   C.INVALID_ARGUMENT, "decode_len"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TREE_MUTATIONS))
async def test_malformed_tree_is_refused_and_writes_nothing(tree_verifier, pair, case):
    mutate, code, reason = TREE_MUTATIONS[case]
    client = tree_client(tree_verifier, pair, SAMPLED, epoch=3)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=2)
    request = client.draft_request()
    assert len(request.parents) > 3  # a real tree to spoil
    err = await expect_refused(
        tree_verifier, client, stream, client.sign(mutate(request)), code, reason
    )
    assert "tree" in err.message or "node" in err.message or "draft" in err.message
    await client.run(stream)  # the session goes on as if nothing had come
    twin = await run_session(tree_verifier, pair, SAMPLED)
    assert client.out == twin.out


async def test_a_parent_below_the_root_is_refused_off_the_wire(tree_verifier, pair):
    """A sint32 parent below -1 has no canonical encoding: refused as a malformed tree
    before the request is re-derived (the signature cannot be checked over it)."""
    client = tree_client(tree_verifier, pair, SAMPLED)
    await client.open_session()
    stream = await client.attach()
    request_pb = client.sign(client.draft_request())
    request_pb.parents[0] = -7
    err = await expect_refused(
        tree_verifier, client, stream, request_pb, C.INVALID_ARGUMENT, "malformed_tree"
    )
    assert "node 0: parent -7 is no node" in err.message


async def test_tree_rounds_survive_a_verifier_restart(key_set, tmp_path, pair):
    from muser_torch.backend import TorchBackend

    v = Verifier(tree_config(key_set, tmp_path / "wal"), key_set, lambda: TorchBackend(pair[0]))
    await v.start()
    try:
        client = tree_client(v, pair, GREEDY)
        await client.open_session()
        stream = await client.attach()
        await client.run(stream, rounds=3)
        await stream.close()
        await v.stop()
        await v.start()  # recovery replays the tree rounds from the commit log
        state = v.manager.replay.sessions[client.session_id]
        assert (state.head, state.next_round) == (client.head, 3)
        client.stub = v.stub  # the proposer reconnects and re-opens (idempotent)
        reply = await client.open_session()
        assert reply.head == client.head
        stream = await client.attach()
        await client.run(stream)
        await stream.close()
        assert client.out == plain(pair, GREEDY)
    finally:
        await v.stop()


async def test_a_chains_only_verifier_says_so_and_refuses_a_tree(key_set, tmp_path, pair):
    from muser_torch.backend import TorchBackend

    v = Verifier(tree_config(key_set, tmp_path / "wal", nodes=0), key_set,
                 lambda: TorchBackend(pair[0]))  # fmt: skip
    await v.start()
    try:
        client = tree_client(v, pair, GREEDY)
        reply = await client.open_session()
        assert list(reply.features) == ["capture-decode", "lookup-stop"]
        stream = await client.attach()
        err = await expect_refused(
            v, client, stream, client.sign(client.draft_request()),
            C.FAILED_PRECONDITION, "tree_rounds_unsupported",
        )  # fmt: skip
        assert "chains only" in err.message
    finally:
        await v.stop()


async def test_capturing_tree_rounds_send_the_rows_of_the_committed_path(tree_verifier, pair):
    """A capturing session's tree rounds (a conditioned draft's) go in one forward with a
    chain session's capturing rounds and a plain tree session's
    (`TorchBackend.evaluate_mixed_capture`); each result's fragments hold the rows of every
    position committed since the last ones sent, the frontier's and the accepted path's,
    never a rejected node's: the target's own rows at every position of the transcript.
    Greedy text is plain decode's."""
    import asyncio

    import numpy as np

    from muser.capture import result_rows
    from muser_torch.backend import TorchBackend

    prompts = [PROMPT, PROMPT[:3] + [9, 4], PROMPT[:4] + [5]]
    clients = [
        tree_client(tree_verifier, pair, GREEDY, prompt=prompts[0], capture_layers=(1, 0)),
        tree_verifier.client(GREEDY, prompt=prompts[1], draft=TorchBackend(pair[1]).sequence(),
                             draft_len=3, capture_layers=(0,)),
        tree_client(tree_verifier, pair, GREEDY, prompt=prompts[2]),
    ]  # fmt: skip
    streams = []
    for c in clients:
        reply = await c.open_session()
        assert "capture-trees" in reply.features
        streams.append(await c.attach())
    seen: list[dict] = [{}, {}, {}]
    while not all(c.done for c in clients):  # in lockstep: the rounds wait together
        live = [i for i, c in enumerate(clients) if not c.done]
        requests = [clients[i].draft_request() for i in live]
        answers = await asyncio.gather(*(
            streams[i].round_trip(clients[i].sign(r)) for i, r in zip(live, requests, strict=True)
        ))  # fmt: skip
        for i, request, (msg, fragments) in zip(live, requests, answers, strict=True):
            c = clients[i]
            result = c.accept(request, msg)
            end = len(c.transcript) - 1  # the next frontier's rows do not exist yet
            first, rows = result_rows(result.capture_digests,
                                      {f.digest: f.data for f in fragments},
                                      c.session_id, result.round, sorted(c.capture_layers), end)  # fmt: skip
            for layer, r in rows.items():
                for j, row in enumerate(r):
                    assert first + j not in seen[i].get(layer, {})  # each position once
                    seen[i].setdefault(layer, {})[first + j] = row
    batches = tree_verifier.manager.stats.batch_sizes
    assert max(batches) == 3  # all three shared forwards
    reference = TorchBackend(pair[0])
    for i, c in enumerate(clients):
        assert c.out == run_plain(TorchBackend(pair[0]), prompts[i], GREEDY).tokens
        if not c.capture_layers:
            assert seen[i] == {}
            continue
        reference.reset()
        _, full = reference.evaluate_capture(c.transcript, c.capture_layers)
        for layer in c.capture_layers:
            got = seen[i][layer]
            assert sorted(got) == list(range(len(c.transcript) - 1))  # every position sent
            for pos, row in got.items():  # float16 on the wire
                np.testing.assert_allclose(row, full[layer][pos], rtol=2e-3, atol=2e-3)
    trees = [RoundResult.decode(s.body) for s in clients[0].results]
    assert any(r.is_tree and len(r.drafts) > len(r.path) for r in trees)  # nodes were rejected


async def test_a_verifier_that_captures_chains_only_refuses_a_capturing_tree(
    key_set, tmp_path, pair
):
    """A target that judges trees but cannot keep a tree's capture rows (vLLM's) offers no
    `capture-trees` and refuses a capturing session's tree round, naming why."""
    from muser_torch.backend import TorchBackend

    class ChainsCapture(TorchBackend):
        @property
        def evaluate_mixed_capture(self):
            raise AttributeError("evaluate_mixed_capture")

    v = Verifier(tree_config(key_set, tmp_path / "wal"), key_set, lambda: ChainsCapture(pair[0]))
    await v.start()
    try:
        client = tree_client(v, pair, GREEDY, capture_layers=(0,))
        reply = await client.open_session()
        assert list(reply.features) == ["tree-rounds", "capture-decode", "lookup-stop"]
        stream = await client.attach()
        err = await expect_refused(
            v, client, stream, client.sign(client.draft_request()),
            C.FAILED_PRECONDITION, "tree_rounds_unsupported",
        )  # fmt: skip
        assert "captures layers [0]" in err.message and "chains only" in err.message
    finally:
        await v.stop()


async def test_tree_and_chain_rounds_of_two_sessions_share_one_forward(tree_verifier, pair):
    """Rounds that wait together go in one target forward, trees beside chains
    (`TorchBackend.evaluate_mixed`); each session's greedy text is still plain decode."""
    import asyncio

    from muser_torch.backend import TorchBackend

    tree = tree_client(tree_verifier, pair, GREEDY)
    chain = tree_verifier.client(GREEDY, draft=TorchBackend(pair[1]).sequence(), draft_len=3)
    streams = []
    for c in (tree, chain):
        await c.open_session()
        streams.append(await c.attach())
    while not (tree.done and chain.done):
        live = [(c, s) for c, s in zip((tree, chain), streams, strict=True) if not c.done]
        requests = [c.draft_request() for c, _ in live]
        answers = await asyncio.gather(
            *(s.round_trip(c.sign(r)) for (c, s), r in zip(live, requests, strict=True))
        )
        for (c, _), r, (msg, _) in zip(live, requests, answers, strict=True):
            c.accept(r, msg)
    want = plain(pair, GREEDY)
    assert tree.out == want and chain.out == want
    assert max(tree_verifier.manager.stats.batch_sizes) == 2  # they did share forwards


class HeldTorch:
    """A torch target holding one sequence that evaluates trees on it, as the vLLM backend
    does (`trees_on_held`): no `sequence()`, so the verifier's sessions share its KV."""

    trees_on_held = True

    def __init__(self, path) -> None:
        from muser_torch.backend import TorchBackend

        self._owner = TorchBackend(path)
        self._seq = self._owner.sequence()
        self.identity, self.geometry = self._owner.identity, self._owner.geometry
        self.label, self.device = self._owner.label, self._owner.device

    @property
    def vocab_size(self) -> int:
        return self._owner.vocab_size

    @property
    def device_label(self) -> str:
        return self._owner.device_label

    @property
    def length(self) -> int:
        return self._seq.length

    def evaluate(self, tokens):
        return self._seq.evaluate(tokens)

    def rollback(self, n: int) -> None:
        self._seq.rollback(n)

    def reset(self) -> None:
        self._seq.reset()

    def evaluate_tree(self, seq, tokens, parents):
        assert seq is self
        return self._owner.evaluate_tree(self._seq, tokens, parents)

    def keep_path(self, path) -> None:
        self._seq.keep_path(path)


async def test_trees_on_a_target_that_holds_one_sequence(key_set, tmp_path, pair):
    """A target with one held sequence that evaluates trees on it (vLLM's way, here on
    torch): the verifier offers tree rounds, two tree sessions take turns on the shared KV
    (`TargetExecutor.witness_tree`), and each one's greedy text is plain decode."""
    import asyncio

    v = Verifier(tree_config(key_set, tmp_path / "wal"), key_set, lambda: HeldTorch(pair[0]))
    await v.start()
    try:
        assert v.manager.rounds.judges_trees and not v.manager.kv.per_session
        clients = [tree_client(v, pair, GREEDY) for _ in range(2)]
        streams = []
        for c in clients:
            assert "tree-rounds" in (await c.open_session()).features
            streams.append(await c.attach())
        while not all(c.done for c in clients):
            live = [(c, s) for c, s in zip(clients, streams, strict=True) if not c.done]
            requests = [c.draft_request() for c, _ in live]
            answers = await asyncio.gather(
                *(s.round_trip(c.sign(r)) for (c, s), r in zip(live, requests, strict=True))
            )
            for (c, _), r, (msg, _) in zip(live, requests, answers, strict=True):
                c.accept(r, msg)
        want = plain(pair, GREEDY)
        assert all(c.out == want for c in clients)
        assert max(v.manager.stats.batch_sizes) == 2  # they took turns within one batch
    finally:
        await v.stop()


def test_a_tree_round_on_a_shared_kv_that_cannot_hold_trees_is_refused(pair) -> None:
    from muser.tree import Tree
    from muser_torch.backend import TorchBackend
    from verifier_gx.executor import TargetExecutor, Witness, witness_batch

    target = TorchBackend(pair[0])
    tree = Tree((-1, -1), (3, 5), (None, None, None))
    with pytest.raises(ValueError, match="a tree round needs a sequence of its own"):
        witness_batch(target, [Witness(TargetExecutor(target), [2, 9, 4], [3, 5], tree)])
    assert target.length == 0  # nothing evaluated
