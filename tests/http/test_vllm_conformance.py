"""The proposer's API against the real thing: the same requests to `vllm serve` (vLLM's CPU
build in .venv-vllm, on the same checkpoint) and to a live cluster, compared field by field:
keys, types, finish reasons, usage counts, logprob shapes and values, error shapes and
statuses. A field one side has and the other lacks is allowed only where it is listed below
(and in docs/api.md, "Differences from vllm serve"), so any new divergence fails here.

Runs under `make test-vllm` (the `vllm` marker): vLLM's server takes about 90 s to start on
two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 600.0
LOGPROB_TOLERANCE = 1e-3
"""Two float32 CPU forwards of one checkpoint (vLLM's kernels and our torch forward) agree
on a token's log-probability to about 1e-5 here; 1e-3 leaves room for other CPUs."""

ONLY_VLLM = {
    "completion": {"service_tier", "kv_transfer_params", "ec_transfer_params", "metrics"},
    "choice": {"token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"},
    "usage": {"prompt_tokens_details", "completion_tokens_details"},
    "chunk": {"service_tier", "kv_transfer_params", "ec_transfer_params", "metrics", "usage"},
    "chunk_choice": {"token_ids", "prompt_token_ids", "routed_experts"},
}
"""vLLM's own extensions this server does not return (nulls in vLLM's answers here)."""
ONLY_OURS = {"completion": {"muser"}, "card": {"muser"}, "chunk": {"muser", "system_fingerprint"}}
"""This server's extension (the session and its acceptance statistics, on a choice's last
chunk), and the fingerprint OpenAI's chunks carry, which vLLM's completion chunks lack."""


def _free_port() -> int:
    from muser_app.cli.config import free_port

    return free_port()


@pytest.fixture(scope="module")
def vllm_url(fixture_pair, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(fixture_pair.target), "--served-model-name", "target",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager",
    ]  # fmt: skip
    # a 1 GiB KV cache: vLLM's CPU build sizes it from free memory otherwise (22 GB here),
    # and the cluster beside it then runs the machine out of memory
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vllm serve did not answer in {START_TIMEOUT_S} s: {log.read_text()[-3000:]}"
                )
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def ours_url(http_cluster) -> str:
    return f"http://{http_cluster.config.proposer.http}"


def call(url: str, path: str, body: dict | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    text = raw.decode()
    if text.startswith("data: "):
        events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
        return status, [e if e == "[DONE]" else json.loads(e) for e in events]
    return status, json.loads(text) if text else None


def both(vllm_url: str, ours_url: str, path: str, body: dict | None = None):
    return call(vllm_url, path, body), call(ours_url, path, body)


def same_keys(theirs: dict, ours: dict, kind: str) -> None:
    missing, extra = set(theirs) - set(ours), set(ours) - set(theirs)
    assert missing == ONLY_VLLM.get(kind, set()) & set(theirs), (kind, missing)
    assert extra == ONLY_OURS.get(kind, set()) & set(ours), (kind, extra)
    for key in set(theirs) & set(ours):
        a, b = theirs[key], ours[key]
        if a is not None and b is not None:
            assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, (kind, key, a, b)


GREEDY = {"model": "target", "prompt": "def main():", "max_tokens": 8, "temperature": 0,
          "ignore_eos": True}  # fmt: skip


def test_a_greedy_completion_has_vllms_shape_and_counts(vllm_url, ours_url):
    (s1, theirs), (s2, ours) = both(vllm_url, ours_url, "/v1/completions", GREEDY)
    assert s1 == s2 == 200
    same_keys(theirs, ours, "completion")
    same_keys(theirs["choices"][0], ours["choices"][0], "choice")
    same_keys(theirs["usage"], ours["usage"], "usage")
    assert theirs["usage"] == {**ours["usage"], **{k: None for k in ONLY_VLLM["usage"]}}
    assert [c["finish_reason"] for c in theirs["choices"]] == ["length"]
    assert [c["finish_reason"] for c in ours["choices"]] == ["length"]
    assert theirs["object"] == ours["object"] == "text_completion"


def test_logprobs_have_vllms_shape_and_the_same_values(vllm_url, ours_url):
    body = {**GREEDY, "logprobs": 3}
    (_, theirs), (_, ours) = both(vllm_url, ours_url, "/v1/completions", body)
    a, b = theirs["choices"][0]["logprobs"], ours["choices"][0]["logprobs"]
    assert set(a) == set(b) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert all(len(a[k]) == len(b[k]) == 8 for k in a)
    assert all(len(d) in (3, 4) for d in a["top_logprobs"] + b["top_logprobs"])
    agreed = 0
    for i in range(8):
        if a["tokens"][: i + 1] != b["tokens"][: i + 1]:
            break  # two engines parted at a near tie: later positions are other texts
        assert abs(a["token_logprobs"][i] - b["token_logprobs"][i]) <= LOGPROB_TOLERANCE
        assert a["text_offset"][i] == b["text_offset"][i]
        agreed += 1
    assert agreed >= 1


def test_n_choices_and_a_stream_have_vllms_shape(vllm_url, ours_url):
    body = {**GREEDY, "temperature": 1, "n": 2, "seed": 3, "max_tokens": 4}
    (_, theirs), (_, ours) = both(vllm_url, ours_url, "/v1/completions", body)
    assert [c["index"] for c in theirs["choices"]] == [c["index"] for c in ours["choices"]]
    assert theirs["usage"]["completion_tokens"] == ours["usage"]["completion_tokens"] == 8
    assert theirs["usage"]["prompt_tokens"] == ours["usage"]["prompt_tokens"]
    stream = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    (s1, a), (s2, b) = both(vllm_url, ours_url, "/v1/completions", stream)
    assert s1 == s2 == 200 and a[-1] == b[-1] == "[DONE]"
    first_a, first_b = a[0], b[0]
    same_keys(first_a, first_b, "chunk")
    same_keys(first_a["choices"][0], first_b["choices"][0], "chunk_choice")
    assert a[-2]["choices"] == b[-2]["choices"] == []  # the usage chunk
    assert a[-2]["usage"]["completion_tokens"] == b[-2]["usage"]["completion_tokens"] == 8
    last_a = [c for c in a[:-2] if c["choices"][0]["finish_reason"]]
    last_b = [c for c in b[:-2] if c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in last_a] == ["length"]
    assert [c["choices"][0]["finish_reason"] for c in last_b] == ["length"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": "target", "prompt": "x", "temperature": -1}, 400,
         "temperature"),
        ("/v1/completions", {"model": "target", "prompt": "x", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {"model": "target", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ],
)  # fmt: skip
def test_errors_have_vllms_status_and_shape(vllm_url, ours_url, path, body, status, param):
    (s1, theirs), (s2, ours) = both(vllm_url, ours_url, path, body)
    assert s1 == s2 == status, (theirs, ours)
    assert set(theirs) == set(ours) == {"error"}
    assert set(theirs["error"]) == set(ours["error"]) == {"message", "type", "param", "code"}
    assert ours["error"]["param"] == param and theirs["error"]["message"]


def test_models_tokenize_detokenize_and_version_have_vllms_shape(vllm_url, ours_url):
    (_, theirs), (_, ours) = both(vllm_url, ours_url, "/v1/models")
    assert [c["id"] for c in theirs["data"]] == [c["id"] for c in ours["data"]] == ["target"]
    same_keys(theirs["data"][0], ours["data"][0], "card")
    assert theirs["data"][0]["max_model_len"] == ours["data"][0]["max_model_len"] == 2048
    body = {"model": "target", "prompt": "def main():\n    return 42"}
    (_, a), (_, b) = both(vllm_url, ours_url, "/tokenize", body)
    assert a == b  # count, max_model_len, tokens, token_strs
    (_, a), (_, b) = both(vllm_url, ours_url, "/detokenize", {"tokens": a["tokens"]})
    assert a == b == {"prompt": body["prompt"]}
    (_, a), (_, b) = both(vllm_url, ours_url, "/version")
    assert set(a) == set(b) == {"version"}
    assert call(vllm_url, "/health")[0] == call(ours_url, "/health")[0] == 200
