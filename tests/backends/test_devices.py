"""Where each backend computes (docs/design.md §9): the device is explicit in the config, chosen
once at load ("auto" takes Metal when MLX has it), refused by name when this machine lacks
it, recorded on the backend and reported by the daemons' Status (`muser status`).

This machine has no Metal and no CUDA: the GPU paths are checked by simulating an MLX GPU
(every computation must ask for the chosen device's stream) and by the refusals."""

from __future__ import annotations

import asyncio
import tomllib

import mlx.core as mx
import numpy as np
import pytest
import torch

from muser.errors import InvalidOverrideError
from muser_torch.backend import TorchBackend, check_device
from proposer_mac.backends import load_draft_backend
from proposer_mac.backends.mlx_draft import MlxBackend, choose_device
from tests.backends.backend_helpers import PROMPT, float64_rows
from tests.verifier.conftest import key_set  # noqa: F401  (a fixture, re-exported)

HAS_MLX_GPU = mx.is_available(mx.gpu)
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def streams(monkeypatch) -> list:
    """Every device the MLX backend asks `mx.stream` for; the work still runs on the CPU."""
    asked: list = []
    real = mx.stream

    def recording(device):
        asked.append(device)
        return real(mx.cpu)

    monkeypatch.setattr(mx, "stream", recording)
    return asked


# --- the mlx draft -------------------------------------------------------------------------


def test_explicit_cpu_runs_on_the_cpu_stream_with_unchanged_rows(llama, streams) -> None:
    backend = MlxBackend(llama, device="cpu")
    assert (backend.device, backend.device_label) == ("cpu", "mlx:cpu")
    rows = backend.evaluate(PROMPT[:10])
    rows = np.concatenate([rows, backend.evaluate(PROMPT[10:])])
    backend.rollback(3)
    again = backend.evaluate(PROMPT[-3:])
    assert streams and all(d == mx.cpu for d in streams)
    np.testing.assert_allclose(rows, float64_rows(llama, PROMPT), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(again, rows[-3:])


def test_auto_takes_the_gpu_when_mlx_has_one_else_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(mx, "is_available", lambda device: True)
    assert choose_device("auto") == "gpu"
    monkeypatch.setattr(mx, "is_available", lambda device: False)
    assert choose_device("auto") == "cpu"
    assert choose_device("cpu") == "cpu"


def test_a_gpu_draft_asks_for_the_gpu_stream_everywhere(llama, monkeypatch, streams) -> None:
    """Nothing in the draft path assumes CPU: with a GPU chosen (simulated here), loading,
    evaluating and rolling back all run on the GPU stream, and the rows are the CPU rows."""
    cpu_rows = MlxBackend(llama, device="cpu").evaluate(PROMPT)
    streams.clear()
    monkeypatch.setattr(mx, "is_available", lambda device: True)
    backend = MlxBackend(llama, device="auto")
    assert (backend.device, backend.device_label) == ("gpu", "mlx:gpu")
    rows = backend.evaluate(PROMPT)
    backend.rollback(4)
    backend.evaluate(PROMPT[-4:])
    assert len(streams) >= 3 and all(d == mx.gpu for d in streams)
    np.testing.assert_array_equal(rows, cpu_rows)


@pytest.mark.skipif(HAS_MLX_GPU, reason="MLX has a GPU here")
def test_gpu_without_one_is_refused_naming_the_setting(llama) -> None:
    for load in (
        lambda: MlxBackend(llama, device="gpu"),
        lambda: load_draft_backend("mlx", llama, device="gpu"),
    ):
        with pytest.raises(InvalidOverrideError) as err:
            load()
        message = str(err.value)
        assert "'gpu' requested (proposer.device)" in message
        assert 'set proposer.device = "cpu"' in message and '"auto"' in message


def test_auto_resolves_to_what_this_machine_has(llama) -> None:
    backend = MlxBackend(llama, device="auto")
    assert backend.device_label == ("mlx:gpu" if HAS_MLX_GPU else "mlx:cpu")


# --- the torch backend ---------------------------------------------------------------------


def test_torch_backend_records_its_device(llama) -> None:
    backend = TorchBackend(llama)
    assert (backend.device, backend.device_label) == ("cpu", "torch:cpu")
    windowed = load_draft_backend("torch", llama, window=3)
    assert windowed.device_label == "torch:cpu"


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused_naming_the_setting(device: str, llama) -> None:
    with pytest.raises(InvalidOverrideError, match=rf"'{device}' requested \(verifier.device\)"):
        TorchBackend(llama, device=device)
    with pytest.raises(InvalidOverrideError, match='set verifier.device = "cpu"'):
        check_device(device)


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu", "not a torch device"), ("mps", "runs on cpu or cuda"), ("", "not a torch device")],
)
def test_devices_the_torch_backend_does_not_run_on_are_refused(device: str, message: str) -> None:
    with pytest.raises(InvalidOverrideError, match=message):
        check_device(device)


# --- the config check and the daemons' Status ----------------------------------------------


@pytest.fixture
def cluster_file(tmp_path, checkpoint):
    from muser_app.cli.config import init_cluster

    pair = checkpoint("llama", seed=1), checkpoint("llama", seed=2)
    return init_cluster(tmp_path / "c", target=pair[0], draft=pair[1], draft_backend="mlx")


def _set(path, section: str, **values) -> None:
    from muser_app.cli.config import to_toml

    data = tomllib.loads(path.read_text())
    data[section].update(values)
    path.write_text(to_toml(data))


def _check(path, capsys, role: str) -> tuple[int, str]:
    from muser_app.cli.main import main

    capsys.readouterr()
    code = main(["config", "check", str(path), "--role", role])
    return code, capsys.readouterr().err


@pytest.mark.skipif(HAS_MLX_GPU or HAS_CUDA, reason="this machine has a GPU")
def test_config_check_refuses_a_gpu_this_machine_lacks(cluster_file, capsys) -> None:
    assert _check(cluster_file, capsys, "proposer")[0] == 0  # device "auto": always resolves
    _set(cluster_file, "proposer", device="gpu")
    code, message = _check(cluster_file, capsys, "proposer")
    assert code == 2 and 'set proposer.device = "cpu"' in message
    _set(cluster_file, "proposer", backend="torch")
    code, message = _check(cluster_file, capsys, "proposer")
    assert code == 2 and "applies to the mlx draft" in message
    _set(cluster_file, "verifier", device="cuda")
    code, message = _check(cluster_file, capsys, "verifier")
    assert code == 2 and 'set verifier.device = "cpu"' in message


@pytest.mark.asyncio
async def test_status_reports_where_draft_and_target_run(key_set, tmp_path, llama) -> None:  # noqa: F811
    """The proposer loads its mlx draft from the config ("auto": the CPU here) and reports
    it through the Status RPC; `muser status` prints it, and the verifier's target too."""
    from muser_app.cli.status import probe, summary
    from proposer_mac.daemon import create_server
    from tests.verifier.conftest import Verifier, make_config

    config = make_config(key_set, tmp_path / "wal")
    verifier = Verifier(config, key_set, lambda: TorchBackend(llama))
    await verifier.start()
    proposer = config.proposer.model_copy(
        update={"address": "127.0.0.1:0", "draft": llama, "backend": "mlx", "device": "auto"}
    )
    config = config.model_copy(
        update={
            "verifier": config.verifier.model_copy(
                update={"address": f"127.0.0.1:{verifier.port}", "target": llama}
            ),
            "proposer": proposer,
        }
    )
    server, port = await create_server(config)
    try:
        got = await asyncio.to_thread(probe, f"127.0.0.1:{port}", "proposer")
        seen = await asyncio.to_thread(probe, f"127.0.0.1:{verifier.port}", "verifier")
    finally:
        await server.stop(None)
        await server.core.close()
        await verifier.stop()
    expected = "mlx:gpu" if HAS_MLX_GPU else "mlx:cpu"
    assert got["serving"] and got["status"]["draft_device"] == expected
    assert f"draft on {expected}" in summary(got["status"])
    assert seen["status"]["target"]["device"] == "torch:cpu"
    assert seen["status"]["target"]["forward"] == "lean"  # a Llama under sdpa: the lean forward
    assert got["status"]["draft_forward"] is None  # mlx has no such choice
    assert "target on torch:cpu, lean forward" in summary(seen["status"])
    assert summary(got["status"]).count("forward") == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("forward", "runs"), [("auto", "lean"), ("transformers", "transformers"), ("packed", "packed")]
)
async def test_the_cluster_files_forward_is_the_verifiers_target_forward(
    key_set,  # noqa: F811
    tmp_path,
    llama,
    forward,
    runs,
) -> None:
    """verifier.forward takes effect: the daemon loads its target with it ("auto" runs the
    tiny checkpoint lean: it is below the packing threshold), and Status reports it."""
    from muser_app.cli.status import probe
    from tests.verifier.conftest import make_config
    from verifier_gx.daemon import create_server

    config = make_config(key_set, tmp_path / "wal")
    verifier = config.verifier.model_copy(
        update={"address": "127.0.0.1:0", "target": llama, "forward": forward}
    )
    server, port = create_server(
        config.model_copy(update={"verifier": verifier}), unqualified="a tiny random target"
    )
    await server.start()
    try:
        seen = await asyncio.to_thread(probe, f"127.0.0.1:{port}", "verifier")
    finally:
        await server.stop(None)
    assert server.manager.backend.forward_kind == runs
    assert seen["status"]["target"]["forward"] == runs
