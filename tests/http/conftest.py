"""One live cluster (real daemons on loopback, the fixture pair) shared by the HTTP tests."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import Cluster, make_cluster


@pytest.fixture(scope="module")
def fixture_pair():
    from muser_app.fixtures import build_fixtures

    return build_fixtures(progress=False).natural


@pytest.fixture(scope="module")
def http_cluster(tmp_path_factory, fixture_pair) -> Cluster:
    c = make_cluster(tmp_path_factory.mktemp("http-cluster"), fixture_pair)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def base_url(http_cluster) -> str:
    return f"http://{http_cluster.config.proposer.http}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(fixture_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixture_pair.target))
