"""The typed, strict schema of `cluster.toml`.

Every section refuses unknown keys and values of the wrong type (strict: `true` is no
integer, `"yes"` no boolean, `1.0` no integer; an integer is taken where a float is expected);
every error quotes the offending value and its path in the file (`verifier.address: ...`).
Relative paths are resolved against the file's folder.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from muser.errors import RefusedError
from muser.round import DEFAULT_Q_TOP_K


class ConfigError(RefusedError):
    """The cluster file is missing, unparsable, or violates the schema or a refusal rule."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


FilePath = Annotated[Path, Field(strict=False)]
"""A path: TOML gives it as a string (strict mode alone would want a Path instance)."""

GRPC_INT_MAX = 2**31 - 1
"""gRPC channel and server options are C ints (message sizes, keepalive milliseconds)."""
KEEPALIVE_MAX_S = 86_400.0
"""A day: a longer keepalive never notices a dead peer in time; in ms it fits a C int."""
SESSION_IDLE_MAX_S = 365 * 86_400.0
"""A year; 0, not a huge value, is how a cluster file says never."""


def _check_address(value: str | None) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return value


def _check_cpus(value: list[int] | None) -> list[int] | None:
    if value is None:
        return None
    if not value or len(set(value)) != len(value) or min(value) < 0:
        raise ValueError(f"expected distinct CPU numbers (0, 1, ...), at least one, got {value!r}")
    return value


CPUS_HELP = (
    "CPUs the daemon runs on (Linux; every thread pinned at start); default: those the "
    "machine gives it. `config init` splits a machine's CPUs between the two daemons."
)

TARGET_BACKENDS = ("torch", "vllm")


def _check_target_backend(value: object) -> object:
    """The verifier judges drafts against full target rows; refuse a draft-only backend."""
    if value not in TARGET_BACKENDS:
        raise ValueError(
            f"the verifier needs a backend producing full probability rows "
            f"({' or '.join(map(repr, TARGET_BACKENDS))}), got {value!r}; mlx is a draft "
            "backend: set it as proposer.backend"
        )
    return value


Dtype = Literal["float32", "bfloat16", "float16"]


NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
"""A verifier's name in a pool: lower-case letters, digits, '-' and '_', 1-32 characters."""


class VerifierNode(_Strict):
    name: str = Field(
        "verifier",
        pattern=NAME_PATTERN,
        description="The verifier's name in the proposer's pool (logs, status, metrics).",
    )
    address: str = Field(description="HOST:PORT proposers reach the verifier at.")
    bind: str | None = Field(
        None, description="HOST:PORT the verifier's server binds (default: address)."
    )
    key: FilePath = Field(description="The verifier's Ed25519 private key (PEM, 0600).")
    public_key: FilePath = Field(description="Its public key; proposers enrol it.")
    wal_dir: FilePath = Field(description="Commit WAL directory (the log lives in WAL_DIR/commit).")
    commit_compact_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Snapshot the commit log once this many bytes of segments have "
        "accumulated since the last snapshot (checked as sessions close); the log then drops "
        "what the snapshot covers. 0 = never (the log grows with every round).",
    )
    target: FilePath = Field(description="Target checkpoint directory (Hugging Face format).")
    backend: Literal["torch", "vllm"] = Field(
        "torch", description="Target backend; it must produce full probability rows."
    )
    dtype: Dtype = Field(
        "float32", description="Target weights dtype; rows are always float64 on the host."
    )
    device: str = Field("cpu", description="torch device for the target (cpu, cuda, cuda:1).")
    forward: Literal["auto", "packed", "lean", "transformers"] = Field(
        "auto",
        description="The torch target's forward: packed (Llama-family on a CPU in float32: "
        "large weights reordered once for oneDNN, a 5-position verify at about one decode's "
        "cost; rows within rounding of transformers'), lean (bit-equal to transformers, less "
        "Python), transformers (the module tree); auto takes the first that holds for the "
        "model, and a named one that does not is refused at start (docs/backends.md).",
    )
    http: str | None = Field(
        None, description="HOST:PORT of the verifier's HTTP server: GET /metrics (default: none)."
    )
    cpus: list[int] | None = Field(None, description=CPUS_HELP)

    _addr = field_validator("address", "bind", "http")(_check_address)
    _cpus = field_validator("cpus")(_check_cpus)
    _backend = field_validator("backend", mode="before")(_check_target_backend)

    @property
    def bind_address(self) -> str:
        return self.bind or self.address


class ProposerNode(_Strict):
    address: str = Field(description="HOST:PORT clients reach the proposer's gRPC server at.")
    bind: str | None = Field(
        None, description="HOST:PORT the proposer's server binds (default: address)."
    )
    key: FilePath = Field(description="The proposer's Ed25519 private key (signs round requests).")
    public_key: FilePath = Field(description="Its public key; verifiers enrol it.")
    wal_dir: FilePath = Field(description="Session journal directory (PREPARED/COMMITTED).")
    journal_compact_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Snapshot the session journal once this many bytes of segments have "
        "accumulated since the last snapshot (checked as sessions end); the commit log then "
        "drops what the snapshot covers. 0 = never (the journal grows with every request).",
    )
    failover_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="With a [[pool]] of other verifiers: seconds a session's verifier may "
        "stay unreachable (or its open unanswered) before the session moves to the next "
        "verifier of the pool at a higher epoch. Unused without a pool.",
    )
    journal_retry_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="After the session journal failed a write or an fsync (a full disk, say), "
        "seconds between the proposer's attempts to reopen it; meanwhile it reports "
        "NOT_SERVING and refuses new sessions.",
    )
    draft: FilePath = Field(
        description="Draft checkpoint directory (same tokenizer as the target)."
    )
    backend: Literal["torch", "mlx", "conditioned", "ngram"] = Field(
        "torch",
        description="Draft backend: torch or mlx run the `draft` checkpoint; conditioned runs "
        "a feature-conditioned draft checkpoint, which reads the target's capture rows "
        "(docs/conditioned.md); ngram is prompt lookup with no model (`draft` is then the "
        "target's checkpoint, for its tokenizer).",
    )
    dtype: Dtype = Field(
        "float32",
        description="Draft weights dtype (torch backend; the mlx draft runs in the dtype its "
        "checkpoint stores, and this stays float32).",
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="mlx device: auto picks Metal when available, else CPU."
    )
    http: str | None = Field(
        None,
        description="HOST:PORT of the OpenAI-compatible HTTP API and GET /metrics "
        "(default: not served).",
    )
    cpus: list[int] | None = Field(None, description=CPUS_HELP)

    _addr = field_validator("address", "bind", "http")(_check_address)
    _cpus = field_validator("cpus")(_check_cpus)

    @property
    def bind_address(self) -> str:
        return self.bind or self.address


class Lane(_Strict):
    draft_len: int = Field(
        4, ge=0, le=64, description="Drafts per round D of a session that does not ask for one."
    )
    draft_len_min: int = Field(
        None,
        ge=0,
        le=64,
        description="Smallest D a session may ask for; the proposer refuses others "
        "(default: draft_len).",
    )
    draft_len_max: int = Field(
        None, ge=0, le=64, description="Largest D a session may ask for (default: draft_len)."
    )
    width: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="How a session that asks for no D gets one: `adaptive` chooses each "
        "round's D in [draft_len_min, draft_len_max] from the session's measured acceptance "
        "and costs (starting at draft_len; D = 0 is the singleton mode); `fixed` runs "
        "draft_len. A range of one value is fixed either way.",
    )
    decode_len: int = Field(
        8,
        ge=1,
        le=256,
        description="Tokens a round without drafts (D = 0) asks the verifier to sample itself, "
        "one target step each (verifier-side decode: the wire is paid once per decode_len "
        "tokens; the text is that of decode_len singleton rounds). The verifier refuses more.",
    )
    lookup_stop: bool = Field(
        True,
        description="With the n-gram draft, a round without drafts also ends after the first "
        "token prompt lookup would extend (the verifier runs the draft's lookup over the "
        "tokens it decodes), so the next round drafts from that match instead of the "
        "verifier decoding past it: a round per match rather than a round per token "
        "(decode_len 1) or matches missed (decode_len 8). Needs a verifier that offers "
        "`lookup-stop`; ignored for model drafts. Greedy text is the same either way and "
        "sampled text has the same distribution (a seed gives the local lane's text at "
        "decode_len 1 with it, at lane.decode_len without).",
    )
    tree_nodes: int = Field(
        0,
        ge=0,
        le=64,
        description="Token trees (docs/trees.md): each round drafts a tree of at most this "
        "many nodes, draft_len deep, and the verifier judges every branch in one target "
        'call. With width = "fixed" every tree has the budget\'s uniform shape; with '
        '"adaptive" each session learns its size (no draft, the chain, trees of 2, 4 and 7 '
        "times draft_len nodes, the budget) from its results and round times, and draws each "
        "tree best first from the acceptance by rank it measured (docs/trees.md). 0: chains. "
        "Both daemons read it: the verifier judges trees of at most this many nodes (torch or "
        "vLLM target); the proposer drafts them with a torch, conditioned or n-gram draft.",
    )
    q_top_k: int = Field(
        DEFAULT_Q_TOP_K,
        ge=1,
        le=4096,
        description="Sparse draft row width: the most probable q_top_k tokens of each draft "
        "row travel (the whole row when the vocabulary is no wider). Narrower rows are "
        "smaller on the wire and accept less at T > 0.",
    )
    capture_layers: list[int] = Field(
        default_factory=list,
        description="Target decoder layers (0-based) whose hidden rows results attach.",
    )
    speculate: bool = Field(
        True,
        description="Draft round r+1 while round r is at the verifier, on the guess that r is "
        "fully accepted (latency hiding; never changes the tokens).",
    )
    speculate_branches: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto",
        description="Greedy: speculate on more outcomes than full acceptance at once: the "
        "rejection of each of the first N drafts, with the draft's runner-up there as the "
        "target's pick, each on a clone of the draft KV, drafted together with the "
        "full-acceptance guess in one batched forward per step, when the draft thread has "
        "nothing else to draft (a torch draft with draft_batch, or the conditioned draft; 0: "
        "full acceptance only; never changes the tokens). auto: 2, except 0 with the "
        "conditioned draft, whose branches measured slower than none (their guesses hold "
        "too seldom to pay for the draft work: docs/conditioned.md).",
    )
    send_on_decision: bool = Field(
        True,
        description="Journal and send round r+1's request as soon as round r's early "
        "decision is in and the draft on it is ready, before r's signed result: its head is "
        "the one r's result must carry, so the verifier takes it right after committing r. "
        "A result that differs from its decision voids it (refused there, nothing written) "
        "and r+1 is drafted again. Never changes the tokens.",
    )
    lookahead: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Name each round drafted ahead to the verifier before its request "
        "(Lookahead hints), so the verifier can evaluate it while the request is on its way "
        "and use those rows when the request names the same tokens (never changes the "
        "tokens). auto: on unless the verifier's address is a loopback one (on one machine "
        "that early forward competes with the draft for the same cores).",
    )
    draft_batch: bool = Field(
        True,
        description="Draft the rounds of sessions waiting in the proposer's draft thread "
        "together, one batched forward per draft step (torch drafts that batch; mlx and "
        "windowed drafts draft each alone). A session drafting alone is unaffected; sampled "
        "text of concurrent sessions keeps its distribution but may differ from the local "
        "lane's in the last float bits of q.",
    )
    receipt: FilePath = Field(
        Path("qualification.json"),
        description="The lane's qualification receipt (`muser qualify` writes it; the verifier "
        "refuses to serve without a matching one). Default: beside the cluster file.",
    )
    acceptance_floor: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Least acceptance on natural prompts that qualifies the lane (the fixture "
        "pair measures about 0.48 at D=4).",
    )

    @model_validator(mode="before")
    @classmethod
    def _range_defaults_to_draft_len(cls, data: object) -> object:
        """An unset bound pins D there: a lane without a range runs at a fixed D."""
        d = data.get("draft_len", 4) if isinstance(data, dict) else None
        if type(d) is int and 0 <= d <= 64:  # else draft_len's own error is the message
            data = {"draft_len_min": d, "draft_len_max": d, **data}
        return data

    @model_validator(mode="after")
    def _draft_len_in_range(self) -> Lane:
        lo, d, hi = self.draft_len_min, self.draft_len, self.draft_len_max
        if not lo <= d <= hi:
            raise ValueError(
                f"expected draft_len_min <= draft_len <= draft_len_max, got {lo} <= {d} <= {hi}"
            )
        return self

    @field_validator("capture_layers")
    @classmethod
    def _distinct_layers(cls, layers: list[int]) -> list[int]:
        bad = [x for x in layers if x < 0]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"expected distinct layer indices >= 0, got {layers!r}")
        return layers


class Enrolment(_Strict):
    verifiers: list[FilePath] = Field(
        description=(
            "Enrolled verifier public keys (PEM): the proposer accepts results they sign, a "
            "verifier resumes sessions from rounds they signed."
        )
    )
    proposers: list[FilePath] = Field(description="Enrolled proposer public keys (PEM).")


class Limits(_Strict):
    max_sessions: int = Field(64, ge=1, description="Open sessions a verifier holds at once.")
    max_message_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        le=GRPC_INT_MAX,
        description="Largest gRPC message either daemon accepts (gRPC takes at most 2**31 - 1); "
        "also the most fragment bytes one session may keep staged on the verifier, not yet "
        "acknowledged.",
    )
    max_tokens: int = Field(4096, ge=1, description="Largest max_tokens a session may ask for.")
    finished_sessions: int = Field(
        1024,
        ge=1,
        description="Finished sessions a proposer keeps in memory for clients that reconnect "
        "for the rest of their stream; older ones are forgotten (their counts stay in the "
        "metrics), and a reconnect to one is answered NOT_FOUND. Each kept takes some 45 KB "
        "(its tokens and stats; its drafter is let go at its end).",
    )
    kv_sessions: int = Field(
        16,
        ge=1,
        description="Sessions whose target KV the verifier keeps at once; beyond it the least "
        "recently used session's KV is dropped and re-evaluated from its transcript on its next "
        "round (memory per session: layers x 2 x kv heads x head dim x tokens).",
    )
    max_batch: int = Field(
        8,
        ge=1,
        description="Most rounds (of different sessions) the verifier evaluates in one target "
        "forward; at most kv_sessions.",
    )
    round_queue: int = Field(
        64,
        ge=1,
        description="Rounds that may wait for the target at once; a round that finds the queue "
        "full is refused (RESOURCE_EXHAUSTED, round_queue_full) with nothing written, to be "
        "sent again after a backoff.",
    )
    keepalive_s: float = Field(
        10.0,
        ge=0,
        le=KEEPALIVE_MAX_S,
        allow_inf_nan=False,
        description="Seconds a connection with a call open may stay quiet before its side "
        "pings the other (every daemon channel and server, and the Generate client); 0: no "
        "pings (gRPC's default), and a peer that lost power is never noticed. At most a day.",
    )
    keepalive_timeout_s: float = Field(
        10.0,
        gt=0,
        le=KEEPALIVE_MAX_S,
        allow_inf_nan=False,
        description="Seconds a ping may go unanswered before the connection is closed and "
        "its calls fail UNAVAILABLE (the proposer and the client then reconnect). At most a "
        "day.",
    )
    session_idle_s: float = Field(
        3600.0,
        ge=0,
        le=SESSION_IDLE_MAX_S,
        allow_inf_nan=False,
        description="Seconds a verifier keeps a session that nothing opens, attaches to or "
        "sends a round for (its proposer gone for good, or finished without closing it); "
        "then it closes the session, freeing its max_sessions slot, its KV and its state. A "
        "proposer that comes back later is refused (session_closed). 0: never; at most a year.",
    )

    @model_validator(mode="after")
    def _batch_fits_the_kv(self) -> Limits:
        if self.max_batch > self.kv_sessions:
            raise ValueError(
                f"expected max_batch <= kv_sessions (a batch keeps every member's KV), got "
                f"max_batch {self.max_batch} > kv_sessions {self.kv_sessions}"
            )
        return self


TLS_ROLES = ("verifier", "proposer", "client")


class TlsPair(_Strict):
    cert: FilePath = Field(description="PEM certificate, signed by tls.ca.")
    key: FilePath = Field(description="PEM private key of that certificate (0600).")


class Tls(_Strict):
    """Mutual TLS under one cluster CA; absent, every channel is insecure (loopback only)."""

    ca: FilePath = Field(
        description="PEM certificate of the cluster CA; every server requires a client "
        "certificate it signed, every client checks the server's against it."
    )
    verifier: TlsPair = Field(description="What the verifier's server presents.")
    proposer: TlsPair = Field(
        description="What the proposer presents: as its clients' server and as the verifier's "
        "client (serverAuth and clientAuth)."
    )
    client: TlsPair = Field(
        description="What `muser status` and `muser generate --lane cluster` present."
    )

    @model_validator(mode="before")
    @classmethod
    def _all_or_nothing(cls, data: object) -> object:
        """Half-configured TLS would fail at the first handshake; name every missing file."""
        if not isinstance(data, dict):
            return data
        missing = [] if "ca" in data else ["tls.ca"]
        for role in TLS_ROLES:
            pair = data.get(role)
            if pair is None:
                missing.append(f"tls.{role}")
            elif isinstance(pair, dict):
                missing += [f"tls.{role}.{f}" for f in ("cert", "key") if f not in pair]
        if missing:
            raise ValueError(
                f"TLS is half-configured, missing {', '.join(missing)}: give tls.ca and a "
                "cert and key for each of verifier, proposer and client (`muser keygen --out "
                "DIR --tls` writes them all), or remove the [tls] section to run insecure on "
                "loopback"
            )
        return data

    def pair(self, role: str) -> TlsPair:
        return getattr(self, role)


class PoolVerifier(_Strict):
    """Another verifier a proposer may move its sessions to (`[[pool]]`): same target,
    qualified on the same target identity, its key enrolled."""

    name: str = Field(pattern=NAME_PATTERN, description="Its name (logs, status, metrics).")
    address: str = Field(description="HOST:PORT the proposer reaches it at.")
    public_key: FilePath = Field(
        description="Its public key; it must be in enrolment.verifiers too (results it signs, "
        "and resume points other verifiers take from it)."
    )
    receipt: FilePath = Field(
        description="Its qualification receipt (signed by its key): the pool refuses a "
        "verifier qualified on another target identity."
    )

    _addr = field_validator("address")(_check_address)


API_KEY_MIN_CHARS = 16


def check_api_key(key: str) -> None:
    """ValueError unless `key` is visible ASCII (it travels in an HTTP header) and long
    enough not to guess; the message never quotes the key."""
    bad = [c for c in key if not "!" <= c <= "~"]
    if len(key) < API_KEY_MIN_CHARS or bad:
        what = (
            f"a {'space' if bad[0] == ' ' else 'character outside visible ASCII'}"
            if bad
            else f"{len(key)} characters"
        )
        raise ValueError(
            f"has {what}; expected at least {API_KEY_MIN_CHARS} visible ASCII characters, "
            "no spaces (`python -c 'import secrets; print(secrets.token_urlsafe(32))'` "
            "makes one)"
        )


def _check_api_keys(value: object) -> object:
    """Each key as `check_api_key` wants it. No message quotes a key (`load_config` hides
    the values of http.api_keys too)."""
    if not isinstance(value, list):
        raise ValueError(f"expected a list of key strings, got a {type(value).__name__}")
    for i, key in enumerate(value):
        if not isinstance(key, str):
            raise ValueError(f"key {i}: expected a string, got a {type(key).__name__}")
        try:
            check_api_key(key)
        except ValueError as exc:
            raise ValueError(f"key {i} {exc}") from None
    return value


class Http(_Strict):
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Keys the HTTP endpoints (the OpenAI-compatible API, and /metrics on both "
        "daemons) accept as `Authorization: Bearer KEY`; any other request gets 401 and "
        "starts nothing. Empty (the default): anyone who reaches them may call. Never shown "
        "or logged.",
    )

    served_model_name: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Names the proposer's OpenAI-compatible API serves the target under, as "
        "`vllm serve --served-model-name`: /v1/models lists each, a request may name any, and "
        "responses carry the first. Empty (the default): the target checkpoint's folder name.",
    )
    max_n: int = Field(
        16,
        ge=1,
        le=1024,
        description="The most choices one API request may ask for (its prompts times n); each "
        "choice is a session of its own.",
    )

    _keys = field_validator("api_keys", mode="before")(_check_api_keys)

    def secrets(self) -> list[str]:
        return [k.get_secret_value() for k in self.api_keys]


class ClusterConfig(_Strict):
    verifier: VerifierNode = Field(description="The verifier node (target, commit WAL).")
    proposer: ProposerNode = Field(description="The proposer node (draft, session journal).")
    lane: Lane = Field(default_factory=Lane, description="Round geometry of the linear lane.")
    enrolment: Enrolment = Field(description="Public keys each side accepts signatures from.")
    limits: Limits = Field(default_factory=Limits, description="Resource limits.")
    tls: Tls | None = Field(None, description="Mutual TLS on every channel (default: none).")
    http: Http = Field(
        default_factory=Http,
        description="The HTTP endpoints: their API keys, and the OpenAI-compatible API's "
        "served names and bounds.",
    )
    pool: list[PoolVerifier] = Field(
        default_factory=list,
        description="Other verifiers the proposer moves a session to when its verifier is "
        "unreachable past proposer.failover_s (default: none, the [verifier] alone).",
    )
    path: FilePath | None = Field(None, exclude=True, description="Where this file was read from.")

    @model_validator(mode="after")
    def _distinct_pool(self) -> ClusterConfig:
        """Each verifier of the pool has its own name and address."""
        for what in ("name", "address"):
            seen = [getattr(self.verifier, what), *(getattr(v, what) for v in self.pool)]
            twice = sorted({x for x in seen if seen.count(x) > 1})
            if twice:
                raise ValueError(
                    f"the verifier pool names {what} {twice[0]!r} twice; each verifier "
                    f"([verifier] and every [[pool]]) needs its own {what}"
                )
        return self

    def verifiers(self) -> list[tuple[str, str]]:
        """(name, address) of every verifier the proposer may use, [verifier] first."""
        return [(self.verifier.name, self.verifier.address)] + [
            (v.name, v.address) for v in self.pool
        ]


PATH_KEYS = {
    "key",
    "public_key",
    "wal_dir",
    "target",
    "draft",
    "ca",
    "cert",
    "receipt",
}
PATH_LIST_KEYS = {"verifiers", "proposers"}


def _absolute(value: object, base: Path) -> object:
    if not isinstance(value, str):
        return value  # the schema quotes the wrong type
    return str((base / Path(value).expanduser()).resolve())


def _resolve(raw: dict, base: Path) -> dict:
    """Resolve relative paths of path-typed fields (at any depth) against the file's folder."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            value = _resolve(value, base)
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            value = [_resolve(v, base) for v in value]  # [[pool]] tables
        elif key in PATH_KEYS:
            value = _absolute(value, base)
        elif key in PATH_LIST_KEYS and isinstance(value, list):
            value = [_absolute(v, base) for v in value]
        out[key] = value
    return out


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "expected a TOML file in UTF-8: save it as UTF-8"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        cfg = ClusterConfig.model_validate(_resolve(raw, path.parent.resolve()))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            got = "<not shown>" if where.startswith("http.api_keys") else repr(err.get("input"))
            problems.append(f"{where}: {err['msg']} (got {got})")
        raise ConfigError(f"{path}: " + "; ".join(problems)) from exc
    if not cfg.lane.receipt.is_absolute():  # the default, also beside this file
        lane = cfg.lane.model_copy(update={"receipt": path.parent.resolve() / cfg.lane.receipt})
        cfg = cfg.model_copy(update={"lane": lane})
    return cfg.model_copy(update={"path": path.resolve()})
