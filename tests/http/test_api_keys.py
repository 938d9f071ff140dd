"""API keys on the HTTP endpoints (issue 34): the OpenAI-compatible API and both daemons'
/metrics answer only `Authorization: Bearer KEY` for a key of http.api_keys; anything else
gets 401 with nothing started, and no key is ever echoed, logged or shown."""

from __future__ import annotations

import logging
import stat

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from cluster_config import load_config
from muser.errors import RefusedError
from muser.http_auth import refusal
from muser.metrics import serve_metrics
from tests.http.test_http_failures import Core, app_of

KEY = "k3y-0f-the-cluster-31415926"
OTHER = "an0ther-k3y-of-the-cluster-2718"
HEADER_CASES = {
    "missing": None,
    "not bearer": f"Basic {KEY}",
    "empty bearer": "Bearer ",
    "wrong key": "Bearer wrong-key-wrong-key-0000",
    "a prefix of the key": f"Bearer {KEY[:-1]}",
    "the key and more": f"Bearer {KEY}x",
}


@pytest.mark.parametrize("header", list(HEADER_CASES.values()), ids=list(HEADER_CASES))
def test_each_header_without_a_configured_key_is_refused_naming_what_is_expected(header):
    why = refusal(header, [KEY.encode(), OTHER.encode()])
    assert why is not None and "Authorization: Bearer <key>" in why and "http.api_keys" in why
    assert KEY not in why and "wrong-key" not in why  # nothing received is echoed


def test_any_configured_key_passes_and_no_keys_means_open():
    keys = [KEY.encode(), OTHER.encode()]
    assert refusal(f"Bearer {KEY}", keys) is None
    assert refusal(f"bearer  {OTHER} ", keys) is None  # the scheme is case-insensitive
    assert refusal(None, []) is None


@pytest.mark.asyncio
@pytest.mark.parametrize("header", list(HEADER_CASES.values()), ids=list(HEADER_CASES))
async def test_the_api_refuses_a_request_without_a_key_with_401_and_starts_nothing(
    tokenizer, header, caplog
):
    core = Core(script=[[5, 6]])
    client = TestClient(TestServer(app_of(core, tokenizer, api_keys=(KEY, OTHER))))
    await client.start_server()
    caplog.set_level(logging.DEBUG)
    try:
        headers = {} if header is None else {"Authorization": header}
        body = {"model": "target", "prompt": "x" * 100_000, "max_tokens": 2}
        resp = await client.post("/v1/completions", json=body, headers=headers)
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        error = (await resp.json())["error"]
        assert error["type"] == "authentication_error" and "http.api_keys" in error["message"]
        models = await client.get("/v1/models", headers=headers)
        assert models.status == 401
    finally:
        await client.close()
    assert core.runners == []  # nothing started
    assert KEY not in caplog.text and "wrong-key" not in caplog.text


@pytest.mark.asyncio
async def test_the_api_serves_a_request_with_a_configured_key(tokenizer):
    core = Core(script=[[5, 6]])
    client = TestClient(TestServer(app_of(core, tokenizer, api_keys=(KEY, OTHER))))
    await client.start_server()
    try:
        for key in (KEY, OTHER):
            resp = await client.post(
                "/v1/completions",
                json={"model": "target", "prompt": "hello", "max_tokens": 2},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert resp.status == 200, await resp.text()
    finally:
        await client.close()
    assert len(core.runners) == 2


@pytest.mark.asyncio
async def test_metrics_take_the_same_keys():
    runner, port = await serve_metrics("127.0.0.1:0", lambda: None, api_keys=[KEY])
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as resp:
                assert resp.status == 401
                assert "http.api_keys" in (await resp.json())["error"]["message"]
            async with http.get(url, headers={"Authorization": f"Bearer {OTHER}"}) as resp:
                assert resp.status == 401
    finally:
        await runner.cleanup()


def test_config_init_writes_the_key_readable_by_its_owner_only_and_show_hides_it(tmp_path, capsys):
    from muser_app.cli.main import main

    assert main(["config", "init", "--dir", str(tmp_path), "--pair", "toy", "--api-key", KEY]) == 0
    path = tmp_path / "cluster.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_config(path).http.secrets() == [KEY]
    capsys.readouterr()
    assert main(["config", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "api_keys" in shown and KEY not in shown


def test_config_init_without_a_key_leaves_the_endpoints_open(tmp_path):
    from muser_app.cli.config import init_cluster

    path = init_cluster(tmp_path, pair="toy")
    assert load_config(path).http.secrets() == []
    assert "[http]" not in path.read_text()


def test_a_short_key_is_refused_before_anything_is_written(tmp_path):
    from muser_app.cli.config import init_cluster

    with pytest.raises(RefusedError, match="--api-key: it has 5 characters; expected at least 16"):
        init_cluster(tmp_path / "c", pair="toy", api_key="short")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('"k3y-as-a-string-not-a-list"', "expected a list of key strings, got a str"),
        ("[3]", "key 0: expected a string, got a int"),
        ('["with a space in the middle"]', "key 0 has a space; expected at least 16"),
        ('["tab\\there-in-the-middle"]', "key 0 has a character outside visible ASCII"),
        ('["tiny"]', "key 0 has 4 characters"),
    ],
)
def test_a_bad_key_in_the_cluster_file_is_refused_without_quoting_it(tmp_path, value, expected):
    from muser_app.cli.config import init_cluster

    path = init_cluster(tmp_path, pair="toy")
    path.write_text(path.read_text() + f"\n[http]\napi_keys = {value}\n")
    with pytest.raises(RefusedError) as err:
        load_config(path)
    message = str(err.value)
    assert "http.api_keys" in message and expected in message
    for secret in ("k3y-as-a-string", "with a space", "tiny", "there-in"):
        assert secret not in message
