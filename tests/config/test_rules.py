"""Every refusal rule, fed to `muser config check` (exit 2 and a message saying what to change),
and the daemons refusing the same file before they serve."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from cluster_config import load_config
from cluster_config.schema import ConfigError
from muser_app.cli.config import init_cluster, to_toml
from muser_app.cli.main import main
from muser_app.testing import make_tiny_checkpoint, resave_tokenizer, swap_tokens


@pytest.fixture
def cluster_file(tmp_path, tiny_pair) -> Path:
    """A loopback cluster with mutual TLS; each test breaks one thing in it."""
    return init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1], tls=True)


def rewrite(path: Path, change) -> None:
    """Apply `change` to the file's TOML tables and write them back."""
    data = tomllib.loads(path.read_text())
    change(data)
    path.write_text(to_toml(data))


def set_value(path: Path, dotted: str, value) -> None:
    def change(data):
        *tables, key = dotted.split(".")
        for t in tables:
            data = data.setdefault(t, {})
        data[key] = value

    rewrite(path, change)


def refused(path: Path, capsys, *args: str) -> str:
    """Run `muser config check`; it must refuse (exit 2). Returns the message."""
    capsys.readouterr()
    assert main(["config", "check", str(path), *args]) == 2
    return capsys.readouterr().err


def test_the_tls_cluster_from_init_checks_for_every_role(cluster_file, unqualified, capsys):
    for role in ([], ["--role", "verifier"], ["--role", "proposer"]):
        assert main(["config", "check", str(cluster_file), *role]) == 0
    assert "ok" in capsys.readouterr().out


# --- models ----------------------------------------------------------------------------------


def test_verifier_backend_without_full_rows_refused(cluster_file, capsys):
    set_value(cluster_file, "verifier.backend", "mlx")
    err = refused(cluster_file, capsys)
    assert "verifier.backend" in err and "got 'mlx'" in err
    assert "the verifier needs a backend producing full probability rows" in err


def test_vllm_verifier_backend_is_accepted(cluster_file):
    set_value(cluster_file, "verifier.backend", "vllm")
    assert load_config(cluster_file).verifier.backend == "vllm"


def test_draft_with_a_conflicting_vocabulary_refused(cluster_file, tiny_pair, tmp_path, capsys):
    draft = tmp_path / "draft-other-tokenizer"
    shutil.copytree(tiny_pair[1], draft)
    at_40, at_41 = swap_tokens(draft, 40, 41)
    set_value(cluster_file, "proposer.draft", str(draft))
    err = refused(cluster_file, capsys)
    assert "do not share a vocabulary" in err and str(draft) in err
    assert f"id 40 is {at_41!r} in the target and {at_40!r} in the draft" in err


def test_draft_with_a_resaved_tokenizer_and_a_padded_embedding_accepted(
    cluster_file, tmp_path, unqualified
):
    """Other tokenizer bytes and a larger embedding, one vocabulary: the pair is fine."""
    draft = make_tiny_checkpoint(
        tmp_path / "padded", arch="qwen2", vocab_size=384, tokenizer_size=320, seed=4
    )
    resave_tokenizer(draft)
    set_value(cluster_file, "proposer.draft", str(draft))
    assert main(["config", "check", str(cluster_file)]) == 0


def test_draft_without_a_vocab_size_refused(cluster_file, tiny_pair, tmp_path, capsys):
    draft = Path(shutil.copytree(tiny_pair[1], tmp_path / "no-vocab-size"))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": "big"}))
    set_value(cluster_file, "proposer.draft", str(draft))
    assert "vocab_size is 'big', expected an int >= 1" in refused(cluster_file, capsys)


def test_draft_whose_embedding_misses_target_tokens_refused(cluster_file, tmp_path, capsys):
    draft = make_tiny_checkpoint(tmp_path / "small-vocab", vocab_size=300, seed=3)
    set_value(cluster_file, "proposer.draft", str(draft))
    assert "embeds 300 token ids (config vocab_size)" in refused(cluster_file, capsys)


def test_capture_layer_the_target_lacks_refused(cluster_file, unqualified, capsys):
    set_value(cluster_file, "lane.capture_layers", [0, 1])
    assert main(["config", "check", str(cluster_file)]) == 0  # the tiny target has 2 layers
    set_value(cluster_file, "lane.capture_layers", [0, 2])
    err = refused(cluster_file, capsys)
    assert "lane.capture_layers [0, 2] names layer 2" in err
    assert "has 2 decoder layers: use indices in [0, 2)" in err


def test_capture_layers_with_a_backend_that_cannot_capture_refused(
    cluster_file, unqualified, capsys, monkeypatch
):
    # every target kind captures since session 32 (vLLM's worker keeps layer rows too):
    # the rule stands for a kind that does not, played here by vllm
    import verifier_gx.backends

    set_value(cluster_file, "lane.capture_layers", [0])
    set_value(cluster_file, "verifier.backend", "vllm")
    with monkeypatch.context() as patch:
        patch.setattr(verifier_gx.backends, "CAPTURE_KINDS", ("torch",))
        err = refused(cluster_file, capsys)
    assert "lane.capture_layers [0] needs a target backend that captures hidden rows" in err
    assert "(torch), but verifier.backend is 'vllm'" in err
    assert main(["config", "check", str(cluster_file)]) == 0  # vllm captures


@pytest.mark.parametrize("layers", [[-1], [1, 1]])
def test_capture_layers_negative_or_repeated_refused(cluster_file, layers, capsys):
    set_value(cluster_file, "lane.capture_layers", layers)
    err = refused(cluster_file, capsys)
    assert "lane.capture_layers: Value error, expected distinct layer" in err


def test_mlx_draft_in_another_dtype_refused(cluster_file, capsys):
    set_value(cluster_file, "proposer.backend", "mlx")
    set_value(cluster_file, "proposer.dtype", "bfloat16")
    assert "the mlx draft runs in the dtype its checkpoint stores" in refused(cluster_file, capsys)


@pytest.mark.asyncio
async def test_draft_dtype_takes_effect(cluster_file):
    from proposer_mac.core import ProposerCore

    set_value(cluster_file, "proposer.dtype", "bfloat16")
    core = ProposerCore(load_config(cluster_file))
    try:
        assert core.draft.dtype == "bfloat16"
        assert str(next(core.draft._model.parameters()).dtype) == "torch.bfloat16"
    finally:
        await core.pool.close()
        core.log.close()


# --- lane ------------------------------------------------------------------------------------


def test_draft_len_range_defaults_to_a_fixed_draft_len(cluster_file):
    set_value(cluster_file, "lane.draft_len", 6)
    lane = load_config(cluster_file).lane
    assert (lane.draft_len_min, lane.draft_len, lane.draft_len_max) == (6, 6, 6)
    set_value(cluster_file, "lane.draft_len_min", 1)
    set_value(cluster_file, "lane.draft_len_max", 12)
    lane = load_config(cluster_file).lane
    assert (lane.draft_len_min, lane.draft_len, lane.draft_len_max) == (1, 6, 12)


@pytest.mark.parametrize(("lo", "hi"), [(5, 8), (1, 3)])
def test_draft_len_outside_its_range_refused(cluster_file, lo, hi, capsys):
    set_value(cluster_file, "lane.draft_len_min", lo)
    set_value(cluster_file, "lane.draft_len_max", hi)
    err = refused(cluster_file, capsys)
    assert f"draft_len_min <= draft_len <= draft_len_max, got {lo} <= 4 <= {hi}" in err


# --- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dotted",
    ["verifier.speed", "proposer.colour", "lane.speculate_harder", "limits.max_joy",
     "enrolment.observers", "tls.strict", "tls.verifier.password", "tls.client.chain",
     "fragments"],
)  # fmt: skip
def test_unknown_key_anywhere_is_refused(cluster_file, dotted, capsys):
    set_value(cluster_file, dotted, "x")
    err = refused(cluster_file, capsys)
    assert f"{dotted}: Extra inputs are not permitted (got 'x')" in err


def test_unknown_section_is_refused(cluster_file, capsys):
    set_value(cluster_file, "wal.dir", "x")
    assert "wal: Extra inputs are not permitted (got {'dir': 'x'})" in refused(cluster_file, capsys)


# --- addresses -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "taken_from"),
    [
        ("proposer.address", "verifier.address"),
        ("proposer.bind", "verifier.address"),
        ("verifier.bind", "proposer.address"),
        ("proposer.http", "verifier.address"),
        ("proposer.http", "proposer.address"),
    ],
)
def test_two_servers_on_one_address_refused(cluster_file, field, taken_from, capsys):
    cfg = load_config(cluster_file)
    role, key = taken_from.split(".")
    taken = getattr(getattr(cfg, role), key)
    set_value(cluster_file, field, taken)
    err = refused(cluster_file, capsys)
    assert f"both use '{taken}'" in err and "give each server its own HOST:PORT" in err


def test_localhost_and_127_0_0_1_are_one_address(cluster_file, capsys):
    port = load_config(cluster_file).verifier.address.rpartition(":")[2]
    set_value(cluster_file, "proposer.bind", f"localhost:{port}")
    assert f"both use '127.0.0.1:{port}'" in refused(cluster_file, capsys)


# --- keys ------------------------------------------------------------------------------------


def test_unenrolled_proposer_key_refused(cluster_file, capsys):
    set_value(cluster_file, "enrolment.proposers", ["keys/verifier.pub"])
    err = refused(cluster_file, capsys)
    assert "is not in enrolment.proposers; add" in err and "proposer.pub there" in err


def test_a_daemon_checks_only_its_own_private_keys(cluster_file, unqualified, capsys):
    (cluster_file.parent / "keys" / "proposer.key").unlink()
    (cluster_file.parent / "keys" / "tls" / "proposer.key").unlink()
    assert main(["config", "check", str(cluster_file), "--role", "verifier"]) == 0
    assert "proposer.key" in refused(cluster_file, capsys, "--role", "proposer")
    assert "proposer.key" in refused(cluster_file, capsys)


# --- TLS -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "missing"),
    [
        (("client",), "tls.client"),
        (("verifier", "key"), "tls.verifier.key"),
        (("proposer", "cert"), "tls.proposer.cert"),
        (("ca",), "tls.ca"),
    ],
)
def test_half_configured_tls_refused(cluster_file, drop, missing, capsys):
    def change(data):
        table = data["tls"]
        for key in drop[:-1]:
            table = table[key]
        del table[drop[-1]]

    rewrite(cluster_file, change)
    err = refused(cluster_file, capsys)
    assert f"TLS is half-configured, missing {missing}" in err
    assert "or remove the [tls] section" in err


def test_tls_file_that_does_not_exist_refused(cluster_file, capsys):
    set_value(cluster_file, "tls.proposer.cert", "keys/tls/nope.pem")
    err = refused(cluster_file, capsys)
    assert "cannot read tls.proposer.cert" in err and "nope.pem" in err


def test_tls_cert_from_another_ca_refused(cluster_file, tmp_path, capsys):
    from muser.tls import write_tls

    other = write_tls(tmp_path / "other-ca", ["verifier", "proposer"])
    set_value(cluster_file, "tls.verifier.cert", other["verifier"]["cert"])
    set_value(cluster_file, "tls.verifier.key", other["verifier"]["key"])
    err = refused(cluster_file, capsys)
    assert "tls.verifier.cert" in err and "is not signed by tls.ca" in err


def test_tls_key_that_is_not_the_certs_refused(cluster_file, capsys):
    set_value(cluster_file, "tls.verifier.key", "keys/tls/proposer.key")
    assert "is not the key of tls.verifier.cert" in refused(cluster_file, capsys)


def test_tls_cert_not_valid_for_the_nodes_address_refused(cluster_file, unqualified, capsys):
    port = load_config(cluster_file).verifier.address.rpartition(":")[2]
    set_value(cluster_file, "verifier.address", f"gx10.lan:{port}")
    err = refused(cluster_file, capsys)
    assert "is not valid for 'gx10.lan' (verifier.address)" in err
    assert "--host gx10.lan" in err
    keys = cluster_file.parent / "keys"
    assert main(["keygen", "--out", str(keys), "--tls", "--host", "gx10.lan", "--force"]) == 0
    assert main(["config", "check", str(cluster_file)]) == 0


# --- the daemons check the same rules before serving -----------------------------------------


@pytest.fixture
def serves(monkeypatch) -> list[str]:
    """Record which daemons got as far as serving (instead of serving)."""
    import muser.logs
    import proposer_mac.daemon
    import verifier_gx.daemon

    served: list[str] = []
    monkeypatch.setattr(muser.logs, "configure", lambda *args, **kwargs: None)
    monkeypatch.setattr(verifier_gx.daemon, "serve", lambda config: served.append("verifier"))
    monkeypatch.setattr(proposer_mac.daemon, "serve", lambda config: served.append("proposer"))
    return served


@pytest.mark.parametrize("role", ["verifier", "proposer"])
def test_daemon_refuses_a_file_the_rules_refuse(cluster_file, role, serves, capsys):
    set_value(cluster_file, "lane.capture_layers", [7])
    assert main([role, "serve", "--config", str(cluster_file)]) == 2
    assert "names layer 7" in capsys.readouterr().err
    assert serves == []


@pytest.mark.parametrize("role", ["verifier", "proposer"])
def test_daemon_serves_a_file_the_rules_pass(cluster_file, role, serves, unqualified):
    assert main([role, "serve", "--config", str(cluster_file)]) == 0
    assert serves == [role]


# --- config show -----------------------------------------------------------------------------


def test_show_prints_the_resolved_configuration(cluster_file, capsys):
    capsys.readouterr()
    assert main(["config", "show", str(cluster_file), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert main(["config", "show", str(cluster_file)]) == 0
    as_toml = tomllib.loads(capsys.readouterr().out)
    assert as_toml == as_json
    root = cluster_file.parent.resolve()
    assert as_json["verifier"]["wal_dir"] == str(root / "wal" / "verifier")
    assert as_json["verifier"]["bind"] == as_json["verifier"]["address"]
    assert as_json["tls"]["client"]["key"] == str(root / "keys" / "tls" / "client.key")
    assert as_json["lane"]["draft_len_min"] == as_json["lane"]["draft_len"] == 4


def test_relative_paths_resolve_against_the_files_folder_at_any_depth(cluster_file):
    from muser_app.checks import check_config

    set_value(cluster_file, "tls.ca", "elsewhere/ca.pem")
    cfg = load_config(cluster_file)
    assert cfg.tls.ca == cluster_file.parent.resolve() / "elsewhere" / "ca.pem"
    with pytest.raises(ConfigError, match="cannot read tls.ca .*elsewhere/ca.pem"):
        check_config(cfg, receipt=False)


def test_each_machine_needs_only_its_own_checkpoint(cluster_file, tiny_pair, unqualified, capsys):
    # the Mac holds no target weights (the proposer asks the verifier), the GPU box no draft
    set_value(cluster_file, "verifier.target", str(cluster_file.parent / "on-the-gpu-box"))
    assert main(["config", "check", str(cluster_file), "--role", "proposer"]) == 0
    assert "verifier.target" in refused(cluster_file, capsys, "--role", "verifier")
    set_value(cluster_file, "verifier.target", str(tiny_pair[0]))
    set_value(cluster_file, "proposer.draft", str(cluster_file.parent / "on-the-mac"))
    assert main(["config", "check", str(cluster_file), "--role", "verifier"]) == 0
    assert "proposer.draft" in refused(cluster_file, capsys, "--role", "proposer")


def test_a_tree_lane_needs_a_backend_that_drafts_trees(cluster_file, capsys):
    set_value(cluster_file, "lane.tree_nodes", 16)
    set_value(cluster_file, "proposer.backend", "mlx")
    err = refused(cluster_file, capsys)
    assert "lane.tree_nodes 16 needs proposer.backend 'torch', 'conditioned' or 'ngram'" in err
    assert "set lane.tree_nodes = 0" in err


def test_verifier_forward_chooses_among_the_torch_targets_forwards(cluster_file, unqualified,
                                                                    capsys) -> None:  # fmt: skip
    for forward in ("auto", "packed", "lean", "transformers"):
        set_value(cluster_file, "verifier.forward", forward)
        assert main(["config", "check", str(cluster_file)]) == 0
    set_value(cluster_file, "verifier.backend", "vllm")
    err = refused(cluster_file, capsys)
    assert "verifier.forward 'transformers' chooses the torch backend's forward, but " in err
    assert "verifier.backend is 'vllm': remove it or set forward = \"auto\"" in err
    set_value(cluster_file, "verifier.forward", "auto")
    assert main(["config", "check", str(cluster_file)]) == 0
    set_value(cluster_file, "verifier.forward", "fast")
    assert "verifier.forward" in refused(cluster_file, capsys)


@pytest.mark.parametrize("target", ["torch", "vllm"])
def test_a_capturing_tree_lane_passes_on_either_target(cluster_file, unqualified, target):
    set_value(cluster_file, "lane.tree_nodes", 16)
    set_value(cluster_file, "lane.capture_layers", [0])
    set_value(cluster_file, "verifier.backend", target)
    assert main(["config", "check", str(cluster_file)]) == 0


def test_a_tree_lane_on_a_vllm_verifier_passes(cluster_file, unqualified):
    set_value(cluster_file, "lane.tree_nodes", 16)
    set_value(cluster_file, "verifier.backend", "vllm")  # it judges trees a request per branch
    assert main(["config", "check", str(cluster_file)]) == 0


def test_tree_nodes_out_of_range_refused(cluster_file, capsys):
    set_value(cluster_file, "lane.tree_nodes", 65)
    assert "lane.tree_nodes" in refused(cluster_file, capsys)


def test_config_init_writes_tree_nodes(tmp_path, tiny_pair, capsys):
    path = init_cluster(tmp_path / "t", target=tiny_pair[0], draft=tiny_pair[1], tree_nodes=16)
    assert load_config(path).lane.tree_nodes == 16
    assert main(["config", "init", "--dir", str(tmp_path / "u"), "--target", str(tiny_pair[0]),
                 "--draft", str(tiny_pair[1]), "--tree-nodes", "65"]) == 2  # fmt: skip
    assert "--tree-nodes 65 received; expected 0 (chains) to 64" in capsys.readouterr().err
    assert not (tmp_path / "u" / "cluster.toml").exists()
