"""Soak (issue 35): sessions at bounded concurrency through one real cluster (toy pair),
both daemons' memory, file descriptors and threads sampled as sessions finish, every
session's tokens equal to its prompt's lone run (`muser_app.bench.soak`).

The default suite runs a short soak (its bounds on descriptors and threads, and exactness);
`slow` runs 1,000 sessions and holds memory too (`soak.Bounds`). `scripts/soak.py` is the
same soak with a receipt and the memory curve (docs/soak-memory.png)."""

from __future__ import annotations

import dataclasses

import pytest

from muser.sampling import SamplingParams
from muser_app.bench.sample import Sample
from muser_app.bench.soak import Bounds, Point, Usage, soak, verdict
from muser_app.fixtures import natural_prompts
from tests.cluster.conftest import make_cluster

PARAMS = SamplingParams(temperature=1.0, max_tokens=16, seed=11)


def soak_cluster(tmp_path, pair, tokenizer, sessions: int, concurrency: int):
    from muser_app.cli.cluster_client import stream_generate

    c = make_cluster(tmp_path, pair)
    c.start()
    try:
        address = c.config.proposer.address

        def lane(prompt: list[int], max_tokens: int) -> Sample:
            params = dataclasses.replace(PARAMS, max_tokens=max_tokens)
            return Sample("cluster", 0, 0, stream_generate(address, prompt, params)["tokens"], 0)

        prompts = [list(tokenizer.encode(t, add_special_tokens=False)) for t in natural_prompts(6)]
        pids = {"proposer": c.proposer.proc.pid, "verifier": c.verifier.proc.pid}
        return soak(
            lane, pids, prompts, sessions=sessions, concurrency=concurrency,
            max_tokens=PARAMS.max_tokens, every=max(1, sessions // 20),
        )  # fmt: skip
    finally:
        c.stop()


@pytest.fixture(scope="module")
def tokenizer(fixture_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixture_pair.target))


def test_a_short_soak_leaks_no_descriptors_or_threads_and_every_text_is_its_lone_runs(
    tmp_path, fixture_pair, tokenizer
):
    points, mismatches = soak_cluster(tmp_path, fixture_pair, tokenizer, 48, 8)
    assert mismatches == []
    assert points[-1].sessions == 48
    lenient = Bounds(rss_growth_mb=float("inf"))  # 48 sessions say nothing about memory
    assert verdict(points, lenient) == []


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="issue 35, open: the verifier's resident memory grows ~0.9 MB a session (430 -> "
    "1,343 MB over 1,000; docs/benchmarks.md 'Soak'); descriptors, threads and exactness hold",
)
def test_a_thousand_sessions_hold_memory_descriptors_and_threads(tmp_path, fixture_pair, tokenizer):
    points, mismatches = soak_cluster(tmp_path, fixture_pair, tokenizer, 1000, 16)
    assert mismatches == []
    assert verdict(points) == []


def test_the_verdict_names_each_bound_a_soak_broke():
    def point(n, rss, fds, threads):
        return Point(n, float(n), {"verifier": Usage(rss, fds, threads)})

    steady = [point(n, 500.0, 30, 12) for n in range(0, 101, 10)]
    assert verdict(steady) == []
    growing = [*steady[:3], point(30, 520.0, 30, 12), point(100, 600.0, 40, 15)]
    assert verdict(growing) == [
        "verifier: resident memory rose to 600 MB after the warm-up, over its 500 MB + 64 MB",
        "verifier: 40 fds at the end, over the warm-up's 30 + 4",
        "verifier: 15 threads at the end, over the warm-up's 12 + 2",
    ]
