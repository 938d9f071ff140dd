from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_tokens", "stop_tokens", "seed", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("model_digest", "tokenizer_digest", "vocab_size")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    tokenizer_digest: str
    vocab_size: int
    def __init__(self, model_digest: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "target", "draft", "params", "prompt_digest", "proposer_key_id", "epoch", "capture_layers", "genesis_head", "fragments", "signature", "resume", "resume_transcript")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    GENESIS_HEAD_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RESUME_TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    target: ModelIdentity
    draft: ModelIdentity
    params: SamplingParams
    prompt_digest: bytes
    proposer_key_id: str
    epoch: int
    capture_layers: _containers.RepeatedScalarFieldContainer[int]
    genesis_head: bytes
    fragments: _containers.RepeatedCompositeFieldContainer[Fragment]
    signature: bytes
    resume: bytes
    resume_transcript: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[bytes] = ..., target: _Optional[_Union[ModelIdentity, _Mapping]] = ..., draft: _Optional[_Union[ModelIdentity, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_digest: _Optional[bytes] = ..., proposer_key_id: _Optional[str] = ..., epoch: _Optional[int] = ..., capture_layers: _Optional[_Iterable[int]] = ..., genesis_head: _Optional[bytes] = ..., fragments: _Optional[_Iterable[_Union[Fragment, _Mapping]]] = ..., signature: _Optional[bytes] = ..., resume: _Optional[bytes] = ..., resume_transcript: _Optional[_Iterable[bytes]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "genesis_head", "head", "next_round", "epoch", "verifier_key_id", "resumed", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENESIS_HEAD_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    genesis_head: bytes
    head: bytes
    next_round: int
    epoch: int
    verifier_key_id: str
    resumed: bool
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[bytes] = ..., genesis_head: _Optional[bytes] = ..., head: _Optional[bytes] = ..., next_round: _Optional[int] = ..., epoch: _Optional[int] = ..., verifier_key_id: _Optional[str] = ..., resumed: _Optional[bool] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "signature")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    epoch: int
    signature: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., epoch: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Fragment(_message.Message):
    __slots__ = ("digest", "data")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    data: bytes
    def __init__(self, digest: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class SparseRow(_message.Message):
    __slots__ = ("ids", "weights")
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    weights: bytes
    def __init__(self, ids: _Optional[bytes] = ..., weights: _Optional[bytes] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("session_id", "round", "epoch", "expected_head", "frontier", "drafts", "q_rows", "pre_state_digest", "transcript_digests", "proposer_key_id", "signature", "decode_len", "parents", "lookup")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HEAD_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    Q_ROWS_FIELD_NUMBER: _ClassVar[int]
    PRE_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DECODE_LEN_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    round: int
    epoch: int
    expected_head: bytes
    frontier: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    q_rows: _containers.RepeatedCompositeFieldContainer[SparseRow]
    pre_state_digest: bytes
    transcript_digests: _containers.RepeatedScalarFieldContainer[bytes]
    proposer_key_id: str
    signature: bytes
    decode_len: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    lookup: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., round: _Optional[int] = ..., epoch: _Optional[int] = ..., expected_head: _Optional[bytes] = ..., frontier: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., q_rows: _Optional[_Iterable[_Union[SparseRow, _Mapping]]] = ..., pre_state_digest: _Optional[bytes] = ..., transcript_digests: _Optional[_Iterable[bytes]] = ..., proposer_key_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., decode_len: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ..., lookup: _Optional[_Iterable[int]] = ...) -> None: ...

class RoundResult(_message.Message):
    __slots__ = ("session_id", "round", "epoch", "prev_head", "request_digest", "frontier", "drafts", "accepted", "next_frontier", "post_state_digest", "transcript_digest", "capture_digests", "head", "verifier_key_id", "signature", "verify_s", "wal_s", "sign_s", "decoded", "parents", "path", "logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREV_HEAD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_FRONTIER_FIELD_NUMBER: _ClassVar[int]
    POST_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    WAL_S_FIELD_NUMBER: _ClassVar[int]
    SIGN_S_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    round: int
    epoch: int
    prev_head: bytes
    request_digest: bytes
    frontier: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    next_frontier: int
    post_state_digest: bytes
    transcript_digest: bytes
    capture_digests: _containers.RepeatedScalarFieldContainer[bytes]
    head: bytes
    verifier_key_id: str
    signature: bytes
    verify_s: float
    wal_s: float
    sign_s: float
    decoded: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    path: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, session_id: _Optional[bytes] = ..., round: _Optional[int] = ..., epoch: _Optional[int] = ..., prev_head: _Optional[bytes] = ..., request_digest: _Optional[bytes] = ..., frontier: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., next_frontier: _Optional[int] = ..., post_state_digest: _Optional[bytes] = ..., transcript_digest: _Optional[bytes] = ..., capture_digests: _Optional[_Iterable[bytes]] = ..., head: _Optional[bytes] = ..., verifier_key_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., verify_s: _Optional[float] = ..., wal_s: _Optional[float] = ..., sign_s: _Optional[float] = ..., decoded: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., path: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("session_id", "round")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    round: int
    def __init__(self, session_id: _Optional[bytes] = ..., round: _Optional[int] = ...) -> None: ...

class Attach(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    epoch: int
    def __init__(self, session_id: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class RoundError(_message.Message):
    __slots__ = ("round", "code", "reason", "message", "missing")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    round: int
    code: int
    reason: str
    message: str
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, round: _Optional[int] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Lookahead(_message.Message):
    __slots__ = ("round", "after", "drafts")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    after: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., after: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposerMessage(_message.Message):
    __slots__ = ("attach", "request", "fragment", "ack", "lookahead")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    attach: Attach
    request: RoundRequest
    fragment: Fragment
    ack: Ack
    lookahead: Lookahead
    def __init__(self, attach: _Optional[_Union[Attach, _Mapping]] = ..., request: _Optional[_Union[RoundRequest, _Mapping]] = ..., fragment: _Optional[_Union[Fragment, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., lookahead: _Optional[_Union[Lookahead, _Mapping]] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("round", "accepted", "next_frontier", "decoded", "capture_digests", "path")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_FRONTIER_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    round: int
    accepted: int
    next_frontier: int
    decoded: _containers.RepeatedScalarFieldContainer[int]
    capture_digests: _containers.RepeatedScalarFieldContainer[bytes]
    path: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., accepted: _Optional[int] = ..., next_frontier: _Optional[int] = ..., decoded: _Optional[_Iterable[int]] = ..., capture_digests: _Optional[_Iterable[bytes]] = ..., path: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifierMessage(_message.Message):
    __slots__ = ("result", "fragment", "error", "decision")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    result: RoundResult
    fragment: Fragment
    error: RoundError
    decision: Decision
    def __init__(self, result: _Optional[_Union[RoundResult, _Mapping]] = ..., fragment: _Optional[_Union[Fragment, _Mapping]] = ..., error: _Optional[_Union[RoundError, _Mapping]] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("role", "key_id", "sessions", "json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    key_id: str
    sessions: int
    json: str
    def __init__(self, role: _Optional[str] = ..., key_id: _Optional[str] = ..., sessions: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_tokens", "params", "session_id", "offset", "draft_len")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    session_id: bytes
    offset: int
    draft_len: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., draft_len: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("session_id", "offset", "tokens", "text", "done", "stats_json", "prompt_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    offset: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    done: bool
    stats_json: str
    prompt_tokens: int
    def __init__(self, session_id: _Optional[bytes] = ..., offset: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., done: _Optional[bool] = ..., stats_json: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
