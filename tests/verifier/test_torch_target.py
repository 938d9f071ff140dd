"""The daemon loading a real (tiny, locally built) torch checkpoint through the config,
with hidden-row capture: cluster tokens equal the local lane. Marked slow (builds models)."""

from __future__ import annotations

import pytest

from muser.sampling import SamplingParams
from muser_app.lanes.local import run_local
from tests.verifier.conftest import PROMPT, Verifier, make_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from muser_app.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_checkpoint(root / "target", seed=0), make_tiny_checkpoint(
        root / "draft", seed=1, layers=1
    )


async def test_torch_target_through_the_config(key_set, tmp_path, pair, monkeypatch):
    from muser_torch.backend import TorchBackend

    monkeypatch.setenv("MUSER_CACHE_DIR", str(tmp_path / "cache"))
    target_dir, draft_dir = pair
    config = make_config(key_set, tmp_path / "wal")
    config = config.model_copy(
        update={"verifier": config.verifier.model_copy(update={"target": target_dir})}
    )
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=3)
    v = Verifier(config, key_set, lambda: None)
    await v.start()  # backend=None: loaded from config.verifier.target
    try:
        v.backend = v.manager.backend
        assert isinstance(v.backend, TorchBackend)
        client = v.client(params, draft=TorchBackend(draft_dir), capture_layers=(0, 1))
        await client.open_session()
        stream = await client.attach()
        captured = 0
        while not client.done:
            request = client.draft_request()
            msg, fragments = await stream.round_trip(client.sign(request))
            result = client.accept(request, msg)
            assert [f.digest for f in fragments] == list(result.capture_digests)
            captured += len(fragments)
        assert captured == 2 * len(client.results)
        local = run_local(
            TorchBackend(target_dir), TorchBackend(draft_dir), PROMPT, params,
            draft_len=3, q_top_k=5,
        )  # fmt: skip
        assert client.out == local.tokens
    finally:
        await v.stop()
