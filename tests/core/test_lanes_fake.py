"""Lane logic on fake backends: greedy local = plain, seeded reproducibility, accounting."""

import numpy as np
import pytest

from muser.sampling import SamplingParams
from muser_app.lanes.local import run_local
from muser_app.lanes.plain import run_plain
from tests.core.fake_backend import FakeBackend

PROMPT = [1, 5, 7, 2]


@pytest.mark.parametrize("draft_len", [0, 1, 3, 6])
def test_greedy_local_equals_plain(draft_len):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = run_plain(FakeBackend(), PROMPT, params, record_rows=True)
    local = run_local(
        FakeBackend(),
        FakeBackend(order=1, salt=1),
        PROMPT,
        params,
        draft_len=draft_len,
        record_rows=True,
    )
    assert local.tokens == plain.tokens
    assert len(local.tokens) == 60
    assert local.rows.keys() == plain.rows.keys()
    for pos, row in plain.rows.items():
        np.testing.assert_array_equal(local.rows[pos], row)


def test_sampled_local_lane_is_reproducible_and_seed_sensitive():
    params = SamplingParams(temperature=1.0, max_tokens=50, seed=11)
    a = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, q_top_k=5)
    b = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, q_top_k=5)
    c = run_local(
        FakeBackend(),
        FakeBackend(order=1, salt=1),
        PROMPT,
        SamplingParams(temperature=1.0, max_tokens=50, seed=12),
        q_top_k=5,
    )
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_identical_draft_accepts_everything():
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3)
    result = run_local(FakeBackend(), FakeBackend(), PROMPT, params, draft_len=4, q_top_k=24)
    assert result.stats.acceptance == 1.0
    assert result.stats.tokens_per_round == 5.0


def test_stop_token_ends_generation_and_is_kept():
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = run_plain(FakeBackend(), PROMPT, params)
    stop = plain.tokens[10]
    first = plain.tokens.index(stop)
    params_stop = SamplingParams(temperature=0.0, max_tokens=60, stop_tokens=(stop,))
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params_stop)
    assert local.tokens == plain.tokens[: first + 1]
    assert run_plain(FakeBackend(), PROMPT, params_stop).tokens == local.tokens


def test_stats_account_for_every_token():
    params = SamplingParams(temperature=1.0, max_tokens=37, seed=5)
    result = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, draft_len=3)
    s = result.stats
    assert s.emitted == len(result.tokens) == 37
    assert s.emitted == s.accepted + s.rounds  # every round emits a + 1
    assert sum(k * v for k, v in s.tokens_per_round_hist.items()) == 37


def test_two_cursors_sharing_one_backend_stay_correct():
    from muser.cursor import KvCursor

    shared = FakeBackend()
    a, b = KvCursor(shared), KvCursor(shared)
    row_a = a.sync([1, 2, 3])
    b.sync([4, 5])
    assert a.sync([1, 2, 3]).tolist() == row_a.tolist()  # rebuilt after b took the cache
    assert shared.length == 3
    assert a.sync([1, 2, 3, 9]).tolist() == FakeBackend().evaluate([1, 2, 3, 9])[-1].tolist()


def test_a_dropped_cursor_and_its_backend_are_freed_without_the_collector():
    """A session's KV (its forked backend) goes when the session lets go of it, not at the
    garbage collector's next full pass: the backend names its cursor weakly (issue 35's
    soak held every finished session's target KV in a backend <-> cursor cycle)."""
    import gc
    import weakref

    from muser.cursor import KvCursor, owner

    backend = FakeBackend()
    cursor = KvCursor(backend)
    cursor.sync([1, 2, 3])
    assert owner(backend) is cursor
    gone = weakref.ref(backend)
    gc.disable()
    try:
        del backend, cursor
        assert gone() is None
    finally:
        gc.enable()


def test_common_prefix_equals_the_token_by_token_count():
    """The C-speed prefix search (`KvCursor._common_prefix`) against the plain loop, on
    held/given lists that agree for any length, differ anywhere, or are empty."""
    import random

    from muser.cursor import KvCursor

    def loop(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(7)
    cursor = KvCursor(FakeBackend())
    for _ in range(2000):
        held = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        given = held[: rng.randrange(0, len(held) + 1)] + [
            rng.randrange(3) for _ in range(rng.randrange(0, 8))
        ]
        if given and rng.random() < 0.3:
            given[rng.randrange(len(given))] = 9  # one token that differs, anywhere
        cursor.tokens = held
        assert cursor._common_prefix(given) == loop(held, given), (held, given)
        assert cursor._common_prefix(tuple(given)) == loop(held, given)
