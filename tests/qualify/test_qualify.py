"""`muser qualify` and the refusals it backs (docs/design.md §8): the receipt verifies; the
verifier daemon and `muser config check` refuse a lane without a matching one; a lane that
does not reproduce the oracle, or accepts too little, is not qualified.

Receipts here are real: `qualified_receipt` signs evidence measured by a real qualification
on the fixture pair (tests/qualify/receipts.py), once per test process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from cluster_config import load_config
from cluster_config import qualification as q
from muser import keys
from muser.errors import RefusedError
from muser.identity import model_identity
from muser.round import DEFAULT_Q_TOP_K
from muser_app.cli.main import main
from muser_app.fixtures import natural_prompts
from tests.qualify.receipts import qualified_receipt

REPO = Path(__file__).resolve().parents[2]
HINT = "run `muser qualify --config "


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def serve_subprocess(config: Path) -> subprocess.CompletedProcess:
    """`muser verifier serve` as a real process; a refusal exits long before the timeout."""
    return subprocess.run(
        [sys.executable, "-m", "muser_app.cli.main", "verifier", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def one_prompt_file(directory: Path) -> Path:
    path = directory / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": natural_prompts(1)[0]}) + "\n\n")
    return path


# --- qualify writes a receipt that verifies ---------------------------------------------------


def test_qualify_writes_a_receipt_bound_to_the_models_lane_and_version(
    new_cluster, fixture_pair, tmp_path, capsys
):
    path = new_cluster()
    rc, out, err = cli(
        capsys, "qualify", "--config", str(path), "--prompts", str(one_prompt_file(tmp_path)),
        "--json",
    )  # fmt: skip
    assert rc == 0, err
    assert "qualify" in err and "tok" in err  # the progress bar, on stderr
    config = load_config(path)
    receipt = q.require_receipt(config)
    shown = json.loads(out)
    assert shown["path"] == str(config.lane.receipt) == str(path.parent / "qualification.json")
    assert shown["signature"] == receipt.signature.hex()
    assert receipt.verifier_key == keys.key_id(keys.load_public(config.verifier.public_key))
    e = receipt.evidence
    assert (e.prompts, e.tokens_per_prompt, e.rows_compared) == (1, 256, 256)
    assert e.tolerance == q.DEFAULT_TOLERANCE and e.worst_logprob_diff <= e.tolerance
    assert e.acceptance >= config.lane.acceptance_floor and e.drafted > 0
    b = receipt.binding
    target, draft = model_identity(fixture_pair.target), model_identity(fixture_pair.draft)
    assert (b.target.model_digest, b.target.tokenizer_digest) == (
        target.model_digest,
        target.tokenizer_digest,
    )
    assert b.draft.model_digest == draft.model_digest != target.model_digest
    assert (b.target.backend, b.target.dtype, b.draft.backend) == ("torch", "float32", "torch")
    assert (b.lane["draft_len"], b.lane["q_top_k"], b.lane["capture_layers"]) == (
        4,
        DEFAULT_Q_TOP_K,
        [],
    )
    assert "receipt" not in b.lane and "acceptance_floor" not in b.lane
    assert b.version == version("muser-cluster")
    assert cli(capsys, "config", "check", str(path))[0] == 0


def test_signed_fields_cannot_be_edited(tmp_path):
    """Every signed field of the file is covered: editing any one breaks the signature."""
    signer = keys.generate()
    model = q.ModelBinding(
        "ab" * 32, "cd" * 32, 2048, "LlamaForCausalLM", "torch", "float32", "cpu", "auto"
    )
    binding = q.Binding("0.1.0", model, model, {"draft_len": 4, "capture_layers": [1]})
    evidence = q.Evidence(4, "ef" * 32, 256, 1e-4, 1024, 9e-6, 1400, 650)
    path = tmp_path / "receipt.json"
    q.write_receipt(path, q.sign(binding, evidence, signer))
    q.verify_signature(q.read_receipt(path), signer.public_key())
    original = json.loads(path.read_text())
    edits = [
        ("software", "version", "0.2.0"),
        ("target", "model_digest", "00" * 32),
        ("draft", "dtype", "bfloat16"),
        ("target", "device", "cuda"),
        ("target", "forward", "lean"),
        ("lane", "draft_len", 5),
        ("lane", "capture_layers", [2]),
        ("evidence", "accepted", 1300),
        ("evidence", "worst_logprob_diff", 0.0),
        ("evidence", "tokens_per_prompt", 512),
    ]
    for section, field, value in edits:
        data = json.loads(json.dumps(original))
        data[section][field] = value
        path.write_text(json.dumps(data))
        with pytest.raises(keys.SignatureError):
            q.verify_signature(q.read_receipt(path), signer.public_key())
    data = dict(original, qualified_at=original["qualified_at"] + 1)
    path.write_text(json.dumps(data))
    with pytest.raises(keys.SignatureError):
        q.verify_signature(q.read_receipt(path), signer.public_key())
    path.write_text(json.dumps({**original, "format": "something else"}))
    with pytest.raises(q.QualificationError, match="not a valid qualification receipt"):
        q.read_receipt(path)
    v1 = {**original, "format": "muser.qualification-receipt.v1"}  # bound no device
    path.write_text(json.dumps(v1))
    with pytest.raises(q.QualificationError, match="did not bind the device: re-qualify"):
        q.read_receipt(path)
    v2 = {**original, "format": "muser.qualification-receipt.v2"}  # bound no forward
    path.write_text(json.dumps(v2))
    with pytest.raises(q.QualificationError, match="did not bind the target's forward: re-qual"):
        q.read_receipt(path)


def test_a_receipt_binds_the_kind_of_device_not_which_one():
    assert [q.device_kind(d) for d in ("cpu", "cuda", "cuda:1", "auto")] == [
        "cpu",
        "cuda",
        "cuda",
        "auto",
    ]


# --- the verifier refuses to start without a matching receipt --------------------------------


def test_verifier_process_refuses_to_start_without_a_receipt(new_cluster):
    path = new_cluster()
    result = serve_subprocess(path)
    assert result.returncode == 2, result.stderr
    assert "listening" not in result.stderr
    assert "the lane is not qualified: no qualification receipt at" in result.stderr
    assert f"{HINT}{path}`" in result.stderr


def test_verifier_process_refuses_after_a_weight_changed(new_cluster, fixture_pair, tmp_path):

    target = tmp_path / "target-copy"
    shutil.copytree(fixture_pair.target, target)
    path = new_cluster(target=target)
    qualified_receipt(load_config(path))  # same bytes as the fixture: same digests
    q.require_receipt(load_config(path))
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the low mantissa bit of the last weight: a valid, different checkpoint
    weights.write_bytes(bytes(data))
    result = serve_subprocess(path)
    assert result.returncode == 2, result.stderr
    assert "is for another lane: target model_digest (a file under verifier.target changed" in (
        result.stderr
    )
    assert f"{HINT}{path}`" in result.stderr


@pytest.fixture
def qualified(new_cluster) -> Path:
    path = new_cluster()
    qualified_receipt(load_config(path))
    return path


def refused_serve(capsys, path: Path) -> str:
    """`muser verifier serve` in process: exit 2 and the message (it never serves here),
    the process's CPUs and GIL switch interval as they were (the daemon pins itself to
    verifier.cpus while it serves, and puts them back)."""
    cpus, interval = os.sched_getaffinity(0), sys.getswitchinterval()
    rc, _, err = cli(capsys, "verifier", "serve", "--config", str(path))
    assert rc == 2, err
    assert f"{HINT}{path}`" in err
    assert (os.sched_getaffinity(0), sys.getswitchinterval()) == (cpus, interval)
    return err


@pytest.mark.timeout(120)
def test_verifier_refuses_a_tampered_receipt(qualified, capsys):
    receipt_path = qualified.parent / "qualification.json"
    original = receipt_path.read_text()
    data = json.loads(original)
    data["evidence"]["accepted"] = data["evidence"]["drafted"]  # claim a perfect draft
    receipt_path.write_text(json.dumps(data))
    assert "was altered after signing" in refused_serve(capsys, qualified)
    # a lane param edited in both files is caught the same way
    data = json.loads(original)
    data["lane"]["q_top_k"] = 16
    receipt_path.write_text(json.dumps(data))
    edit(qualified, f"q_top_k = {DEFAULT_Q_TOP_K}", "q_top_k = 16")
    assert "was altered after signing" in refused_serve(capsys, qualified)


@pytest.mark.timeout(120)
def test_verifier_refuses_a_receipt_signed_by_another_key(qualified, capsys):
    config = load_config(qualified)
    genuine = q.read_receipt(config.lane.receipt)
    stranger = keys.generate()
    q.write_receipt(config.lane.receipt, q.sign(genuine.binding, genuine.evidence, stranger))
    err = refused_serve(capsys, qualified)
    ours = keys.key_id(keys.load_public(config.verifier.public_key))
    theirs = keys.key_id(stranger.public_key())
    assert f"is signed by key {theirs}, not by this verifier's key {ours}" in err


@pytest.mark.timeout(120)
def test_verifier_refuses_after_the_target_config_changed(
    new_cluster, fixture_pair, tmp_path, capsys
):

    target = tmp_path / "target-copy"
    shutil.copytree(fixture_pair.target, target)
    path = new_cluster(target=target)
    qualified_receipt(load_config(path))
    config_json = json.loads((target / "config.json").read_text())
    config_json["rope_theta"] = float(config_json.get("rope_theta") or 10000.0) * 2
    (target / "config.json").write_text(json.dumps(config_json))
    assert "target model_digest (a file under verifier.target changed" in refused_serve(
        capsys, path
    )


K = DEFAULT_Q_TOP_K


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (f"q_top_k = {K}", "q_top_k = 16", f"lane.q_top_k: qualified {K}, now 16"),
        ("draft_len = 4", "draft_len = 3", "lane.draft_len: qualified 4, now 3"),
        (f"q_top_k = {K}", f"q_top_k = {K}\ncapture_layers = [0]", "lane.capture_layers:"),
        ('wal_dir = "wal/verifier"\n', 'wal_dir = "wal/verifier"\ndtype = "bfloat16"\n',
         "target dtype: qualified 'float32', now 'bfloat16'"),
        ('forward = "auto"', 'forward = "lean"', "target forward: qualified 'auto', now 'lean'"),
    ],
)  # fmt: skip
def test_verifier_refuses_after_lane_params_changed(qualified, capsys, old, new, expected):
    edit(qualified, old, new)
    assert expected in refused_serve(capsys, qualified)


@pytest.mark.timeout(120)
def test_a_receipt_made_on_a_cpu_does_not_admit_a_cuda_target(qualified):
    """The receipt check (config check, daemon start) on the binding alone: this machine's
    daemon would refuse `cuda` earlier, for want of a GPU."""
    edit(qualified, 'wal_dir = "wal/verifier"\n', 'wal_dir = "wal/verifier"\ndevice = "cuda:0"\n')
    with pytest.raises(q.QualificationError, match="target device: qualified 'cpu', now 'cuda'"):
        q.require_receipt(load_config(qualified))
    edit(qualified, 'device = "cuda:0"\n', 'device = "cpu"\n')
    q.require_receipt(load_config(qualified))  # the device it was made on: admitted


@pytest.mark.timeout(120)
def test_verifier_refuses_a_receipt_from_another_software_version(qualified, capsys, monkeypatch):
    monkeypatch.setattr(q, "software_version", lambda: "99.0.0")
    err = refused_serve(capsys, qualified)
    assert f"software version: qualified {version('muser-cluster')}, installed 99.0.0" in err


@pytest.mark.timeout(120)
def test_verifier_refuses_when_the_floor_is_raised_above_the_evidence(qualified, capsys):
    edit(qualified, "acceptance_floor = 0.25", "acceptance_floor = 0.99")
    assert "is under lane.acceptance_floor 0.99" in refused_serve(capsys, qualified)


def test_config_check_refuses_an_unqualified_lane(new_cluster, capsys):
    path = new_cluster()
    rc, _, err = cli(capsys, "config", "check", str(path))
    assert rc == 2
    assert "no qualification receipt" in err and f"{HINT}{path}`" in err
    qualified_receipt(load_config(path))
    assert cli(capsys, "config", "check", str(path))[0] == 0


def test_create_server_refuses_without_a_receipt_before_loading_the_target(new_cluster):
    from verifier_gx.daemon import create_server

    with pytest.raises(q.QualificationError, match="no qualification receipt"):
        create_server(load_config(new_cluster()))


# --- qualification fails closed --------------------------------------------------------------


class Perturbed:
    """A target whose multi-token forwards (the lane's witness rows) are wrong by `how`."""

    def __init__(self, inner, how: str) -> None:
        self.inner, self.how = inner, how

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def evaluate(self, tokens):
        rows = self.inner.evaluate(tokens)
        if len(tokens) < 2:
            return rows
        rows = rows.copy()
        if self.how == "rows":
            rows[:, 0] += 1e-3  # tokens stay the same; log-probs move by ~1e-3
        else:  # "shift": every row one position late, an off-by-one witness
            rows[1:] = rows[:-1].copy()
        return rows


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("rows", "target row at position"),
        ("shift", "the lane's greedy token"),
    ],
)
def test_qualification_fails_when_the_lane_does_not_match_the_oracle(
    new_cluster, tmp_path, capsys, monkeypatch, how, expected
):
    import verifier_gx.backends

    real = verifier_gx.backends.load_target_backend
    monkeypatch.setattr(
        verifier_gx.backends,
        "load_target_backend",
        lambda *a, **kw: Perturbed(real(*a, **kw), how),
    )
    path = new_cluster()
    rc, out, err = cli(
        capsys, "qualify", "--config", str(path), "--prompts", str(one_prompt_file(tmp_path))
    )
    assert rc == 1, err
    assert "the lane is not qualified: prompt 1/1: " in err and expected in err
    assert "no receipt written" in err and out == ""
    assert not (path.parent / "qualification.json").exists()


def test_qualification_fails_under_the_acceptance_floor_and_removes_the_old_receipt(
    new_cluster, tmp_path, capsys
):
    path = new_cluster()
    qualified_receipt(load_config(path))
    receipt_path = path.parent / "qualification.json"
    assert receipt_path.exists()
    edit(path, "acceptance_floor = 0.25", "acceptance_floor = 0.99")
    rc, _, err = cli(
        capsys, "qualify", "--config", str(path), "--prompts", str(one_prompt_file(tmp_path))
    )
    assert rc == 1, err
    assert "is under lane.acceptance_floor 0.99" in err
    assert f"no receipt written (removed the previous {receipt_path})" in err
    assert not receipt_path.exists()


def test_qualify_refuses_bad_arguments_before_loading_models(new_cluster, tmp_path, capsys):
    path = new_cluster()
    rc, _, err = cli(capsys, "qualify", "--config", str(path), "--tokens", "64")
    assert rc == 2 and "at least 256" in err
    rc, _, err = cli(capsys, "qualify", "--config", str(path), "--tolerance", "nan")
    assert rc == 2 and "--tolerance" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n[1, 2]\n')
    rc, _, err = cli(capsys, "qualify", "--config", str(path), "--prompts", str(bad))
    assert rc == 2 and f"{bad}:2: expected a JSON string" in err
    assert not (path.parent / "qualification.json").exists()


def test_prompts_file_is_jsonl_of_strings_or_objects(tmp_path):
    from muser_app.cli.qualify import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('"one\\nline two"\n\n{"prompt": "three"}\n')
    assert read_prompts(path) == ["one\nline two", "three"]
    path.write_text("\n")
    with pytest.raises(RefusedError, match="holds no prompt"):
        read_prompts(path)


# --- split hosts: the verifier's machine holds no draft ---------------------------------------


def test_a_verifier_without_the_draft_files_binds_the_receipts_draft_at_open(
    qualified, fixture_pair, tmp_path
):
    from types import SimpleNamespace

    from muser.errors import ModelMismatchError
    from verifier_gx.admission import check_identities
    from verifier_gx.daemon import create_server

    edit(qualified, f'draft = "{fixture_pair.draft}"', f'draft = "{tmp_path / "on-the-mac"}"')
    config = load_config(qualified)
    receipt = q.require_receipt(config)  # the files are elsewhere: the receipt's draft stands
    draft = receipt.binding.draft

    async def built():  # grpc.aio wants a running loop to build its server in
        server, _ = create_server(config)
        server.manager.log.close()
        return server.manager

    manager = asyncio.run(built())
    assert manager.qualified_draft == (draft.model_digest, draft.tokenizer_digest)

    target = manager.target

    def opened_with(model_digest: str):
        ident = SimpleNamespace(
            model_digest=model_digest,
            tokenizer_digest=draft.tokenizer_digest,
            vocab_size=draft.vocab_size,
        )
        own = SimpleNamespace(
            model_digest=target.model_digest,
            tokenizer_digest=target.tokenizer_digest,
            vocab_size=target.vocab_size,
        )
        return SimpleNamespace(target=own, draft=ident)

    check_identities(opened_with(draft.model_digest), target, manager.qualified_draft)
    with pytest.raises(ModelMismatchError, match="not the draft this lane was qualified with"):
        check_identities(opened_with("0" * 64), target, manager.qualified_draft)
    # the backend/dtype the proposer runs are still the config's, and still bound
    head, sep, rest = qualified.read_text().partition("\n[proposer]\n")
    qualified.write_text(head + sep + rest.replace('backend = "torch"\n', 'backend = "mlx"\n', 1))
    with pytest.raises(q.QualificationError, match="draft backend"):
        q.require_receipt(load_config(qualified))


# --- a conditioned lane: the receipt binds the layers its draft reads ---------------------------


def test_a_conditioned_lane_binds_the_capture_layers_its_draft_reads(fixture_pair, tmp_path):
    """lane.capture_layers is empty; the conditioned draft's checkpoint declares the layers
    its sessions ask for, and the receipt binds those: the verifier refuses a session that
    asks for others, a verifier without the draft's files takes the receipt's, and a
    receipt for other layers is for another lane."""
    from types import SimpleNamespace

    from muser.errors import CaptureLayerError
    from muser.identity import declared_capture_layers
    from muser_app.cli.config import init_cluster
    from muser_app.pairs import pair_conditioned_draft
    from verifier_gx.admission import check_qualified_capture

    draft = pair_conditioned_draft("toy", progress=False)
    path = init_cluster(tmp_path / "c", target=fixture_pair.target, draft=draft)
    config = load_config(path)
    assert config.proposer.backend == "conditioned" and config.lane.capture_layers == []
    declared = list(declared_capture_layers(draft))
    assert declared and q.binding_of(config).lane["capture_layers"] == declared
    evidence = q.Evidence(1, "00" * 32, 256, 1e-4, 256, 1e-6, 100, 80)
    q.write_receipt(config.lane.receipt, q.sign(q.binding_of(config), evidence,
                                                keys.load_private(config.verifier.key)))  # fmt: skip
    assert q.require_receipt(config).binding.lane["capture_layers"] == declared

    from verifier_gx.daemon import _qualified_lane

    _, qualified = _qualified_lane(config)
    assert list(qualified) == declared
    check_qualified_capture(SimpleNamespace(capture_layers=declared), qualified)
    for other in ([], declared[:1], [*declared, 0 if 0 not in declared else 1]):
        with pytest.raises(CaptureLayerError, match=re.escape(f"qualified with {declared}")):
            check_qualified_capture(SimpleNamespace(capture_layers=other), qualified)

    # the verifier's machine without the draft's files: the receipt's layers stand in
    edit(path, f'draft = "{draft}"', f'draft = "{tmp_path / "on-the-mac"}"')
    elsewhere = load_config(path)
    assert (
        q.binding_of(elsewhere, q.read_receipt(config.lane.receipt)).lane["capture_layers"]
        == declared
    )
    assert _qualified_lane(elsewhere)[1] == tuple(declared)
    with pytest.raises(q.QualificationError, match="cannot digest proposer.draft"):
        q.binding_of(elsewhere)  # (no receipt to stand in: the files must be here)

    # a checkpoint whose declared layers are no list of layer ids: refused, naming them
    broken = tmp_path / "broken"
    shutil.copytree(draft, broken)
    meta = json.loads((broken / "config.json").read_text())
    meta["muser_conditioned"]["capture_layers"] = "2,4"
    (broken / "config.json").write_text(json.dumps(meta))
    edit(path, f'draft = "{tmp_path / "on-the-mac"}"', f'draft = "{broken}"')
    with pytest.raises(q.QualificationError, match=r"cannot read the capture layers .*'2,4'"):
        q.binding_of(load_config(path))

    # lane.capture_layers naming other layers than the receipt's: another lane
    edit(path, f'draft = "{broken}"', f'draft = "{draft}"')
    edit(path, "\n[lane]\n", f"\n[lane]\ncapture_layers = {declared[:1]}\n")
    with pytest.raises(q.QualificationError, match=r"lane.capture_layers: qualified"):
        q.require_receipt(load_config(path))
