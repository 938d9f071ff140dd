"""Model identity: who a checkpoint is, bit for bit (docs/design.md §8, §9).

`model_digest` is SHA-256 over config.json, every *.safetensors file and the tokenizer
files: the exact checkpoint. `tokenizer_digest` names the tokenizer's vocabulary by its
content (`muser.vocabulary`: every id's token string and the special tokens), so a re-saved
or converted copy of the same tokenizer keeps it. Files are taken in sorted name order and
each is framed as

    u64be(len(name)) ‖ name (utf-8) ‖ u64be(len(data)) ‖ data

after a domain tag, so no two different file sets hash the same byte stream.

Hashing multi-gigabyte weights on every start is too slow, so the result is cached on disk
(`$MUSER_CACHE_DIR/identity/`, default `~/.cache/muser`), keyed by the absolute path and
every hashed file's (name, size, mtime_ns). Like git's "racy" index rule, a result is not
cached while any file's mtime is within `RACY_WINDOW_NS` of the hash time, because a
same-size rewrite inside one timestamp tick would otherwise hit a stale entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from muser.backend import ModelIdentity
from muser.errors import ModelLoadError
from muser.vocabulary import require_compatible, vocabulary_digest

MODEL_DOMAIN = b"muser.model-identity.v1\x00"
TOKENIZER_DOMAIN = b"muser.tokenizer-identity.v1\x00"
RACY_WINDOW_NS = 2_000_000_000
IDENTITY_RECIPE = 2
"""What a cached identity record was computed by: 2 digests the tokenizer's vocabulary (a
record of an older recipe is computed again)."""
_CHUNK = 1 << 20

# tokenizer.json, tokenizer_config.json, tokenizer.model, special_tokens_map.json,
# added_tokens.json, vocab.json / vocab.txt, merges.txt, ...
_TOKENIZER_NAME = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab.*|merges.*)$"
)


def _tokenizer_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_file() and _TOKENIZER_NAME.match(p.name))


def _model_files(root: Path) -> list[str]:
    names = {"config.json"} if (root / "config.json").is_file() else set()
    names.update(p.name for p in root.glob("*.safetensors") if p.is_file())
    names.update(_tokenizer_files(root))
    return sorted(names)


def _hash_files(root: Path, names: list[str], domain: bytes) -> str:
    h = hashlib.sha256(domain)
    for name in names:
        encoded = name.encode("utf-8")
        path = root / name
        h.update(len(encoded).to_bytes(8, "big") + encoded)
        h.update(path.stat().st_size.to_bytes(8, "big"))
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def read_config(root: Path) -> dict:
    """The checkpoint's config.json as a dict; ModelLoadError when absent or unreadable."""
    path = root / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(
            f"{root}: no config.json (expected a Hugging Face checkpoint)"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable config ({exc})") from exc


def config_value(config: dict, key: str) -> object | None:
    """`config[key]`, falling back to a nested `text_config` (multimodal wrappers)."""
    if key in config:
        return config[key]
    return (config.get("text_config") or {}).get(key)


def _cache_dir() -> Path:
    base = os.environ.get("MUSER_CACHE_DIR") or os.path.join("~", ".cache", "muser")
    return Path(base).expanduser() / "identity"


def _cache_key(root: Path, names: list[str]) -> tuple[str, int]:
    """Digest of (path, every file's name/size/mtime) and the newest mtime among them."""
    entries = []
    newest = 0
    for name in names:
        st = (root / name).stat()
        entries.append([name, st.st_size, st.st_mtime_ns])
        newest = max(newest, st.st_mtime_ns)
    blob = json.dumps([IDENTITY_RECIPE, str(root), entries], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest(), newest


def _load_cached(key: str) -> dict | None:
    try:
        return json.loads((_cache_dir() / f"{key}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _store_cached(key: str, record: dict) -> None:
    """Write atomically (temp file + rename); a cache that cannot be written is skipped."""
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, directory / f"{key}.json")
    except OSError:
        return


def _architecture(config: dict) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    if "model_type" in config:
        return str(config["model_type"])
    raise ModelLoadError("config.json names neither `architectures` nor `model_type`")


def _compute(root: Path, names: list[str]) -> dict:
    config = read_config(root)
    vocab_size = config_value(config, "vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ModelLoadError(f"{root}/config.json: vocab_size is {vocab_size!r}, expected int ≥ 1")
    if not _tokenizer_files(root):
        raise ModelLoadError(f"{root}: no tokenizer files (tokenizer.json, vocab, merges, ...)")
    if not any(n.endswith(".safetensors") for n in names):
        raise ModelLoadError(f"{root}: no *.safetensors weight files")
    return {
        "model_digest": _hash_files(root, names, MODEL_DOMAIN),
        "tokenizer_digest": vocabulary_digest(root),
        "vocab_size": vocab_size,
        "architecture": _architecture(config),
    }


def model_identity(path: str | os.PathLike[str]) -> ModelIdentity:
    """Digest a checkpoint directory, from the on-disk cache when its files are unchanged."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ModelLoadError(f"{root}: not a checkpoint directory")
    names = _model_files(root)
    key, newest_mtime = _cache_key(root, names)
    record = _load_cached(key)
    if record is None:
        started = time.time_ns()
        record = _compute(root, names)
        if newest_mtime < started - RACY_WINDOW_NS:
            _store_cached(key, record)
    return ModelIdentity(path=str(root), **record)


NGRAM_DOMAIN = b"muser.ngram-draft.v1\x00"
NGRAM_MIN_N, NGRAM_MAX_N = 2, 3
"""The n-gram draft's default match lengths (proposer_mac/backends/ngram.py): they are part
of its identity, which both daemons and the qualification receipt must compute alike."""


def ngram_identity(
    target: ModelIdentity, min_n: int = NGRAM_MIN_N, max_n: int = NGRAM_MAX_N
) -> ModelIdentity:
    """The identity of prompt lookup over `target`'s tokenizer: the target's tokenizer and
    vocabulary, a digest of the lookup's settings, no weights of its own."""
    recipe = f"prompt-lookup min_n={min_n} max_n={max_n} most-recent".encode()
    digest = hashlib.sha256(NGRAM_DOMAIN + recipe + target.tokenizer_digest.encode())
    return replace(target, model_digest=digest.hexdigest(), architecture=f"ngram({min_n}..{max_n})")


def draft_identity(backend: str, path: str | os.PathLike[str]) -> ModelIdentity:
    """A draft's identity as the cluster file names it: its checkpoint's, or for the n-gram
    backend (whose path is the target's checkpoint) `ngram_identity` of that checkpoint."""
    ident = model_identity(path)
    return ngram_identity(ident) if backend == "ngram" else ident


CONDITIONED_META_KEY = "muser_conditioned"
"""The config.json key under which a conditioned draft declares what it reads and how
(`proposer_mac.backends.conditioned_meta`)."""


def declared_capture_layers(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The target decoder layers a conditioned draft checkpoint declares it reads (its
    config.json's `muser_conditioned.capture_layers`); () for any other checkpoint. Reads
    one JSON file (`read_config`) and loads no model; ModelLoadError when that file is
    absent or unreadable."""
    root = Path(path).expanduser()
    config = read_config(root)
    meta = config.get(CONDITIONED_META_KEY) if isinstance(config, dict) else None
    layers = meta.get("capture_layers", ()) if isinstance(meta, dict) else ()
    if not isinstance(layers, list | tuple) or not all(isinstance(x, int) for x in layers):
        raise ModelLoadError(
            f"{root}/config.json: {CONDITIONED_META_KEY}.capture_layers is {layers!r}; "
            "expected a list of decoder layer ids"
        )
    return tuple(layers)


def require_shared_vocabulary(target: ModelIdentity, draft: ModelIdentity) -> None:
    """Refuse a draft whose vocabulary conflicts with the target's (docs/design.md §9): equal
    vocabulary digests pass at once, else the two tokenizers are compared id by id and token
    by token and the first conflict is named. Embedding sizes (`vocab_size`) may differ."""
    if target.tokenizer_digest != draft.tokenizer_digest:
        require_compatible(target.path, draft.path, draft.vocab_size)
