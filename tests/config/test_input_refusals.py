"""Input the CLI and the cluster file refuse up front (exit 2, a message naming what was
received and what was expected, no traceback, nothing written), where it used to pass and
crash later: files that are not UTF-8, limits gRPC cannot take, a wal_dir that is a file,
values of the wrong type the schema used to coerce, counts the demo cannot use."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

from cluster_config import load_config
from cluster_config.schema import ConfigError, Limits
from muser.channels import channel_options, server_options
from muser.errors import RefusedError
from muser_app.checks import check_config
from muser_app.cli.config import init_cluster
from muser_app.cli.main import main

NOT_UTF8 = "héllo wörld\n".encode("latin-1")  # b"h\xe9llo": not a UTF-8 sequence
C_INT_MAX = 2**31 - 1


@pytest.fixture
def cluster_file(tmp_path, tiny_pair) -> Path:
    return init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1])


def set_key(path: Path, section: str, key: str, toml_value: str) -> None:
    """Set `key` of `[section]` to the TOML text `toml_value` (replacing any line for it)."""
    out, current, done = [], None, False
    for line in path.read_text().splitlines(keepends=True):
        if match := re.match(r"\[(.*)\]\s*$", line):
            current = match.group(1)
            out.append(line)
            if current == section:
                out.append(f"{key} = {toml_value}\n")
                done = True
            continue
        if current == section and re.match(rf"{re.escape(key)}\s*=", line):
            continue
        out.append(line)
    assert done, f"no [{section}] in {path}"
    path.write_text("".join(out))


def check(path: Path, capsys, *args: str) -> tuple[int, str]:
    """`muser config check`: (exit code, stderr)."""
    capsys.readouterr()
    code = main(["config", "check", str(path), *args])
    return code, capsys.readouterr().err


# --- 1. files that are not UTF-8 ------------------------------------------------------------


def test_config_check_refuses_a_cluster_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    path.write_bytes(b"[verifier]\naddress = '" + NOT_UTF8 + b"'\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*not UTF-8"):
        load_config(path)
    code, err = check(path, capsys)
    assert code == 2
    assert str(path) in err and "UTF-8" in err and "Traceback" not in err


def test_generate_refuses_a_prompt_file_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(NOT_UTF8)
    from muser_app.cli._common import read_prompt

    args = argparse.Namespace(prompt=None, prompt_file=bad)
    with pytest.raises(RefusedError, match=rf"--prompt-file {re.escape(str(bad))}.*UTF-8"):
        read_prompt(args)
    capsys.readouterr()
    assert main(["generate", "--prompt-file", str(bad)]) == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert str(bad) in err and "UTF-8" in err


def test_qualify_refuses_a_prompts_file_that_is_not_utf8(cluster_file, tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(b'"a prompt"\n"' + NOT_UTF8.strip() + b'"\n')
    from muser_app.cli.qualify import read_prompts

    with pytest.raises(RefusedError, match=rf"--prompts {re.escape(str(bad))}.*UTF-8"):
        read_prompts(bad)
    capsys.readouterr()
    assert main(["qualify", "--config", str(cluster_file), "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "UTF-8" in err
    assert not load_config(cluster_file).lane.receipt.exists()  # nothing written


# --- 2. limits the daemons cannot take -------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("keepalive_s", "inf"),
        ("keepalive_s", "nan"),
        ("keepalive_s", "1e10"),
        ("keepalive_timeout_s", "inf"),
        ("keepalive_timeout_s", "1e10"),
        ("session_idle_s", "inf"),
        ("session_idle_s", "1e12"),
        ("max_message_bytes", "4294967296"),
        ("max_message_bytes", "2147483648"),
    ],
)
def test_limits_without_a_bound_are_refused_quoting_the_value(cluster_file, capsys, key, value):
    set_key(cluster_file, "limits", key, value)
    got = repr(int(value) if value.isdigit() else float(value))
    with pytest.raises(ConfigError, match=rf"limits\.{key}: .*\(got {re.escape(got)}\)"):
        load_config(cluster_file)
    code, err = check(cluster_file, capsys)
    assert code == 2 and f"limits.{key}" in err and "Traceback" not in err


def test_the_largest_limits_accepted_give_grpc_options_that_fit_a_c_int():
    """What the schema accepts, the channels turn into gRPC options without overflow."""
    fields = Limits.model_fields
    top = {
        name: next(m.le for m in fields[name].metadata if getattr(m, "le", None) is not None)
        for name in ("keepalive_s", "keepalive_timeout_s", "max_message_bytes", "session_idle_s")
    }
    assert top["max_message_bytes"] == C_INT_MAX
    assert all(math.isfinite(v) for v in top.values())
    limits = Limits(**top)
    for options in (channel_options(limits), server_options(limits)):
        assert all(isinstance(v, int) and 0 <= v <= C_INT_MAX for _, v in options)


def test_keepalive_zero_and_whole_numbers_still_load(cluster_file):
    set_key(cluster_file, "limits", "keepalive_s", "0")
    set_key(cluster_file, "limits", "keepalive_timeout_s", "20")
    set_key(cluster_file, "limits", "session_idle_s", "0")
    limits = load_config(cluster_file).limits
    assert (limits.keepalive_s, limits.keepalive_timeout_s, limits.session_idle_s) == (0, 20, 0)
    assert isinstance(limits.keepalive_timeout_s, float)


# --- 3. a wal_dir that is a file ------------------------------------------------------------


@pytest.mark.parametrize("role", ["verifier", "proposer"])
@pytest.mark.parametrize("where", ["/dev/null", "cluster.toml", "cluster.toml/below"])
def test_a_wal_dir_that_is_a_file_is_refused_for_its_node(
    cluster_file, capsys, unqualified, role, where
):
    set_key(cluster_file, role, "wal_dir", f'"{where}"')
    path = getattr(load_config(cluster_file), role).wal_dir
    with pytest.raises(ConfigError, match=rf"{role}\.wal_dir {re.escape(str(path))}"):
        check_config(load_config(cluster_file), role)
    with pytest.raises(ConfigError, match=rf"{role}\.wal_dir"):
        check_config(load_config(cluster_file))  # no role: every node
    code, err = check(cluster_file, capsys, "--role", role)
    assert code == 2 and f"{role}.wal_dir" in err and "directory" in err
    other = "proposer" if role == "verifier" else "verifier"
    check_config(load_config(cluster_file), other)  # the other machine does not care


def test_a_wal_dir_to_be_created_or_already_there_passes(cluster_file, unqualified, tmp_path):
    cfg = load_config(cluster_file)
    assert not cfg.verifier.wal_dir.exists()  # init writes none: serve creates them
    check_config(cfg)
    cfg.proposer.wal_dir.mkdir(parents=True)
    set_key(cluster_file, "verifier", "wal_dir", f'"{tmp_path / "new" / "deeper" / "wal"}"')
    check_config(load_config(cluster_file))


# --- 6. a strict schema: no coercion of booleans, integers and strings ---------------------


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("limits", "max_tokens", "true"),
        ("limits", "max_sessions", "1.0"),
        ("limits", "max_message_bytes", '"8388608"'),
        ("limits", "keepalive_s", "true"),
        ("verifier", "cpus", "[true]"),
        ("verifier", "commit_compact_bytes", "false"),
        ("lane", "speculate", '"yes"'),
        ("lane", "draft_batch", "1"),
        ("lane", "draft_len", "true"),
        ("lane", "capture_layers", "[false]"),
        ("lane", "acceptance_floor", "false"),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_coerced(
    cluster_file, capsys, section, key, value
):
    set_key(cluster_file, section, key, value)
    with pytest.raises(ConfigError, match=rf"{section}\.{key}(\.0)?: Input should be a valid"):
        load_config(cluster_file)
    code, err = check(cluster_file, capsys)
    assert code == 2 and f"{section}.{key}" in err


def test_init_output_still_checks_with_a_strict_schema(tmp_path, tiny_pair, unqualified, capsys):
    path = init_cluster(tmp_path / "s", target=tiny_pair[0], draft=tiny_pair[1], tls=True)
    set_key(path, "lane", "acceptance_floor", "1")  # an integer where a float is expected
    cfg = load_config(path)
    assert cfg.lane.acceptance_floor == 1.0 and cfg.tls is not None
    assert check(path, capsys) == (0, "")


# --- 4. demo counts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--prompts", "0"], "--prompts"),
        (["--prompts", "-2"], "--prompts"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--draft-len", "-1"], "--draft-len"),
        (["--draft-len", "65"], "--draft-len"),
    ],
)
def test_demo_refuses_counts_it_cannot_use_before_any_work(monkeypatch, capsys, argv, flag):
    import muser_app.cli._common

    def no_work(*args, **kwargs):
        raise AssertionError("the demo started work on an argument it should have refused")

    monkeypatch.setattr(muser_app.cli._common, "pair_models", no_work)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected" in err and repr(argv[1]) in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
        (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
        (["--seed", "-1"], "seed must be in [0, 2**32), got -1"),
        (["--seed", str(2**32 - 2), "--prompts", "3"], f"got {2**32}"),
    ],
)
def test_demo_refuses_sampling_flags_before_any_work(monkeypatch, capsys, argv, message):
    import muser_app.cli._common

    def no_work(*args, **kwargs):
        raise AssertionError("the demo started work on an argument it should have refused")

    monkeypatch.setattr(muser_app.cli._common, "pair_models", no_work)
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err
