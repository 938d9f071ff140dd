"""Cluster lanes for the bench: real daemons on loopback, optionally behind a delay proxy.

One verifier serves every lane; each injected delay gets its own proposer daemon whose
verifier address is a `TcpProxy` adding half the round-trip delay in each direction. The
daemons are started once and stopped when the harness exits (also on Ctrl-C). The lane is
qualified for real (`muser qualify`) once per run, before the verifier starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from muser.affinity import pinned
from muser.sampling import SamplingParams
from muser_app.bench.sample import LaneFn, Sample
from muser_app.procs import cpu_since


@contextlib.contextmanager
def cluster_lanes(
    target_dir: Path,
    draft_dir: Path,
    params: SamplingParams,
    *,
    draft_len: int,
    delays_ms: list[float],
    draft_backend: str | None = None,
    draft_range: tuple[int, int] | None = None,
    target_device: str = "cpu",
    pin: bool = True,
    settings: dict[str, str] | None = None,
    tolerance: float | None = None,
):
    """Yield {lane name: LaneFn} for the cluster at each injected RTT (ms). With
    `draft_range` the lane may move D in it: `cluster@Xms` sessions still ask for draft_len
    (fixed), and `cluster@Xms-adaptive` sessions ask for none, so the lane's adaptive width
    chooses (the same proposer serves both). `target_device`: the verifier's `device`.
    `pin`: keep `config init`'s CPUs for each daemon (and run each run's client on the
    proposer's); False lets the OS place both daemons and the client. `settings`: a variant's
    `{"SECTION.KEY": TOML value}` written into the cluster file (`with_settings`); its
    `code` (a checkout, `parse_variant`) is what both daemons run, on their PYTHONPATH.
    `tolerance`: the qualification's row tolerance (`muser qualify --tolerance`)."""
    from cluster_config import load_config
    from muser_app.cli.cluster_client import stream_generate
    from muser_app.cli.config import free_port, init_cluster
    from muser_app.cli.qualify import qualify
    from muser_app.netproxy import TcpProxy
    from muser_app.procs import Daemon

    with tempfile.TemporaryDirectory(prefix="muser-bench-") as tmp, contextlib.ExitStack() as stack:
        base = init_cluster(
            Path(tmp),
            target=target_dir,
            draft=None if draft_backend == "ngram" else draft_dir,
            draft_backend=draft_backend,
            draft_len=draft_len,
            draft_kind={"ngram": "ngram", "conditioned": "conditioned"}.get(
                draft_backend, "trained"
            ),
        )
        if draft_range is not None:
            lo, hi = draft_range
            text = base.read_text()
            line = f"draft_len = {draft_len}\n"
            base.write_text(
                text.replace(line, f"{line}draft_len_min = {lo}\ndraft_len_max = {hi}\n", 1)
            )
        base.write_text(with_target_device(base.read_text(), target_device))
        if not pin:
            base.write_text(unpinned(base.read_text()))
        settings = dict(settings or {})
        code = settings.pop(CODE, None)
        env = {"PYTHONPATH": code} if code else None
        if settings:
            base.write_text(with_settings(base.read_text(), settings))
        config = load_config(base)
        cpus = {"proposer": config.proposer.cpus, "verifier": config.verifier.cpus}
        # once per run: every lane shares it (`tolerance`: qualify's, default its own)
        qualify(config, tolerance=tolerance, progress=sys.stderr.isatty())
        verifier = Daemon("verifier", base, Path(tmp), env)
        verifier.start()
        stack.callback(verifier.stop)
        host, port = config.verifier.address.rsplit(":", 1)
        lanes: dict[str, LaneFn] = {}
        for delay in delays_ms:
            text = base.read_text()
            proposer_addr = f"127.0.0.1:{free_port()}"
            text = text.replace(
                f'address = "{config.proposer.address}"', f'address = "{proposer_addr}"'
            )
            text = text.replace('wal_dir = "wal/proposer"', f'wal_dir = "wal/proposer-{delay:g}ms"')
            text = text.replace(f'http = "{config.proposer.http}"\n', "")  # one proposer per RTT
            if delay > 0:
                text = as_remote(text)
                proxy = TcpProxy((host, int(port)), delay_s=delay / 2000)
                proxy.start()
                stack.callback(proxy.close)
                text = text.replace(
                    f'address = "{config.verifier.address}"',
                    f'address = "127.0.0.1:{proxy.port}"\nbind = "{config.verifier.address}"',
                )
            path = Path(tmp) / f"cluster-{delay:g}ms.toml"
            path.write_text(text)
            proposer = Daemon("proposer", path, Path(tmp) / f"logs-{delay:g}ms", env)
            proposer.start()
            stack.callback(proposer.stop)
            name = f"cluster@{delay:g}ms"
            daemons = {"proposer": proposer, "verifier": verifier}
            rtt = delay / 1000
            lanes[name] = _lane(
                stream_generate, proposer_addr, params, draft_len, daemons, cpus, rtt
            )
            if draft_range is not None:
                adaptive = _lane(stream_generate, proposer_addr, params, 0, daemons, cpus, rtt)
                lanes[f"{name}-adaptive"] = adaptive
        yield lanes


AHEAD = ("rounds", "hits", "guess_hits", "on_decision", "sent_ahead", "ahead_void")
"""What a cluster run's `Sample.ahead` keeps of the proposer's `speculation` stats."""


def as_remote(text: str) -> str:
    """`config init`'s cluster.toml for a verifier behind an injected delay: that verifier
    stands for another machine's, so lane.lookahead is on (auto would see the delay
    proxy's loopback address and leave it off)."""
    line = 'lookahead = "auto"\n'
    if line not in text:
        raise ValueError('cluster.toml: no `lookahead = "auto"` line in the [lane] section')
    return text.replace(line, 'lookahead = "on"\n', 1)


def unpinned(text: str) -> str:
    """`config init`'s cluster.toml without its `cpus` settings: the OS places each daemon."""
    return with_settings(text, {"proposer.cpus": "none", "verifier.cpus": "none"})


SECTIONS = ("verifier", "proposer", "lane", "limits")
CODE = "code"
"""A variant's `code=PATH`: its daemons run the checkout at PATH (an A/B of two trees'
code in one run, interleaved like any other lane)."""
PACKAGES = ("muser", "proposer_mac", "verifier_gx", "wal", "cluster_config")
"""What a checkout given as `code=PATH` must hold: the daemons import all of these."""


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME: SECTION.KEY=VALUE ... [code=PATH]` (a bench `--cluster-variant`) as (name,
    settings); each VALUE is TOML written without spaces (`2`, `false`, `"on"`, `[0,1]`), or
    `none` to remove the key (its default applies). `code=PATH`: the variant's daemons run
    the checkout at PATH instead of this one (settings["code"], made absolute); this process
    still qualifies the lane and runs the clients, so the two trees must speak the same
    protocol and receipt."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    expected = "expected 'NAME: SECTION.KEY=VALUE ...' (e.g. 'b2: lane.speculate_branches=2')"
    if not sep or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"--cluster-variant {text!r}: {expected}, with a NAME of letters, "
                         "digits, - and _")  # fmt: skip
    settings: dict[str, str] = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if key == CODE and eq:
            settings[CODE] = _checkout(text, value)
            continue
        section, dot, field = key.partition(".")
        if not eq or not value or not dot or not field or section not in SECTIONS:
            raise ValueError(
                f"--cluster-variant {text!r}: {item!r} is not SECTION.KEY=VALUE with SECTION "
                f"one of {', '.join(SECTIONS)}, or code=PATH"
            )
        settings[key] = value
    if not settings:
        raise ValueError(f"--cluster-variant {text!r}: no settings; {expected}")
    return name, settings


def _checkout(text: str, path: str) -> str:
    """`code=PATH`'s PATH, absolute, once it holds every package the daemons import."""
    root = Path(path).expanduser().resolve() if path else None
    missing = [p for p in PACKAGES if root is None or not (root / p / "__init__.py").is_file()]
    if missing:
        raise ValueError(
            f"--cluster-variant {text!r}: code={path!r} is not a checkout of this project "
            f"(no {', '.join(p + '/__init__.py' for p in missing)} there)"
        )
    return str(root)


def with_settings(text: str, settings: dict[str, str]) -> str:
    """`config init`'s cluster.toml with each `SECTION.KEY` set to its TOML value (a line
    replaced, or added under the section's header), or removed when the value is `none`."""
    lines = text.splitlines(True)
    for key, value in settings.items():
        section, _, field = key.partition(".")
        try:
            start = lines.index(f"[{section}]\n") + 1
        except ValueError:
            raise ValueError(f"cluster.toml has no [{section}] section (setting {key})") from None
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
        at = [i for i in range(start, end) if lines[i].split("=")[0].strip() == field]
        new = [] if value == "none" else [f"{field} = {value}\n"]
        if at:
            lines[at[0] : at[0] + 1] = new
        else:
            lines[start:start] = new
    return "".join(lines)


def with_target_device(text: str, device: str) -> str:
    """`config init`'s cluster.toml with the verifier's target on `device`."""
    if device == "cpu":  # the default: the file stays as written
        return text
    head, sep, rest = text.partition("\n[proposer]")
    if 'backend = "torch"\n' not in head:
        raise ValueError("cluster.toml: no torch backend line in the [verifier] section")
    line = 'backend = "torch"\n'
    return head.replace(line, f'{line}device = "{device}"\n', 1) + sep + rest


def _lane(
    stream_generate,
    address: str,
    params: SamplingParams,
    draft_len: int,
    daemons: dict,
    cpus: dict | None = None,
    rtt_s: float = 0.0,
) -> LaneFn:
    """Sessions that ask for `draft_len` (0: the lane's width policy decides); each run also
    records the CPU seconds each of `daemons` ({role: Daemon}) spent during it. `cpus`: each
    daemon's `cpus` setting ({role: list or None}); with the proposer's, the harness runs as
    the client on those CPUs for the run, where a client of the proposer's machine would
    run, and on its own CPUs again after. `rtt_s`: the round trip injected between the
    proposer and the verifier (read by `summarise` as the lane's `rtt_s`)."""
    client_cpus = (cpus or {}).get("proposer")

    def run(prompt: list[int], max_tokens: int) -> Sample:
        p = dataclasses.replace(params, max_tokens=max_tokens)
        spent = cpu_since(daemons)
        with pinned(client_cpus, "proposer.cpus"):
            start = time.perf_counter()
            r = stream_generate(address, prompt, p, draft_len=draft_len)
            wall = time.perf_counter() - start
        cpu = spent()
        s = r["stats"]
        return Sample(
            "cluster",
            0,
            0,
            r["tokens"],
            wall,
            s["drafted"],
            s["accepted"],
            s["rounds"],
            s["split_s"],
            cpu,
            {k: s["speculation"][k] for k in AHEAD},
        )

    run.daemons = daemons  # what the sessions suite reads around a wave of concurrent runs
    run.cpus = cpus or {}  # where the daemons run, and where the clients of a wave run
    run.rtt_s = rtt_s
    return run
