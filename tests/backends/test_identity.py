"""Model identity: stable, cached, changed by any model file, shared-tokenizer check."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from muser import identity as identity_mod
from muser.errors import ModelLoadError, ModelMismatchError
from muser.identity import model_identity, require_shared_vocabulary
from muser_app.testing import resave_tokenizer, swap_tokens

HOUR_NS = 3600 * 10**9


@pytest.fixture
def copy(llama: Path, tmp_path: Path) -> Path:
    """A private copy of the llama fixture whose files the test may change."""
    return Path(shutil.copytree(llama, tmp_path / "ckpt"))


def _age(path: Path) -> None:
    """Back-date every file, so the racy-mtime rule lets the result be cached."""
    old = os.stat(path / "config.json").st_mtime_ns - HOUR_NS
    for f in path.iterdir():
        os.utime(f, ns=(old, old))


def _rewrite_one_weight(path: Path) -> None:
    """Same size, one value changed: only the bytes differ."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].copy()
    weights[name].flat[0] += 1.0
    before = (path / "model.safetensors").stat().st_size
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert (path / "model.safetensors").stat().st_size == before


def test_identity_is_stable_and_names_the_checkpoint(llama: Path, copy: Path) -> None:
    first = model_identity(llama)
    assert model_identity(llama) == first
    assert first.vocab_size == 320
    assert first.architecture == "LlamaForCausalLM"
    assert first.path == str(llama.resolve())
    assert len(first.model_digest) == len(first.tokenizer_digest) == 64
    moved = model_identity(copy)  # the digest is over content, not location
    assert (moved.model_digest, moved.tokenizer_digest) == (
        first.model_digest,
        first.tokenizer_digest,
    )


def test_weight_change_changes_model_digest_not_tokenizer(copy: Path) -> None:
    before = model_identity(copy)
    _rewrite_one_weight(copy)  # immediately: same size, possibly the same mtime tick
    after = model_identity(copy)
    assert after.model_digest != before.model_digest
    assert after.tokenizer_digest == before.tokenizer_digest


def test_config_and_tokenizer_changes_change_the_digests(copy: Path) -> None:
    before = model_identity(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-5)))
    after_config = model_identity(copy)
    assert after_config.model_digest != before.model_digest
    assert after_config.tokenizer_digest == before.tokenizer_digest
    resave_tokenizer(copy)  # other bytes, the same vocabulary
    resaved = model_identity(copy)
    assert resaved.tokenizer_digest == before.tokenizer_digest
    assert resaved.model_digest != after_config.model_digest  # the exact files, still
    swap_tokens(copy, 7, 8)  # another vocabulary
    after_tokenizer = model_identity(copy)
    assert after_tokenizer.tokenizer_digest != before.tokenizer_digest
    assert after_tokenizer.model_digest != resaved.model_digest


def test_identity_is_cached_until_a_file_changes(copy: Path, monkeypatch) -> None:
    _age(copy)
    first = model_identity(copy)

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed again although nothing changed")

    monkeypatch.setattr(identity_mod, "_hash_files", no_hashing)
    assert model_identity(copy) == first  # from the cache
    os.utime(copy / "model.safetensors")  # touched: mtime changes, cache key changes
    with pytest.raises(AssertionError, match="hashed again"):
        model_identity(copy)


def test_fresh_files_are_not_cached(copy: Path, _identity_cache: Path) -> None:
    """A file modified within the racy window may change again inside one mtime tick."""
    for f in copy.iterdir():
        os.utime(f)  # modified just now
    entries = set(_identity_cache.joinpath("identity").glob("*.json"))
    model_identity(copy)
    assert set(_identity_cache.joinpath("identity").glob("*.json")) == entries


def test_file_framing_separates_names_and_boundaries(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root, first, second in ((a, b"ab", b"c"), (b, b"a", b"bc")):
        root.mkdir()
        (root / "merges.txt").write_bytes(first)
        (root / "vocab.json").write_bytes(second)
    names = ["merges.txt", "vocab.json"]
    digest_a = identity_mod._hash_files(a, names, b"t")
    assert digest_a != identity_mod._hash_files(b, names, b"t")
    (b / "merges.txt").write_bytes(b"ab")
    (b / "vocab.json").write_bytes(b"c")
    assert digest_a == identity_mod._hash_files(b, names, b"t")


def test_missing_checkpoint_pieces_refused(tmp_path: Path, copy: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a checkpoint directory"):
        model_identity(tmp_path / "absent")
    (copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        model_identity(copy)
    (copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        model_identity(copy)


def test_shared_tokenizer_accepted_for_a_draft_target_pair(checkpoint) -> None:
    target = model_identity(checkpoint("llama", seed=1, layers=3))
    draft = model_identity(checkpoint("qwen3", seed=2))
    assert target.model_digest != draft.model_digest
    require_shared_vocabulary(target, draft)


def test_a_resaved_tokenizer_and_a_padded_embedding_are_the_same_vocabulary(
    checkpoint, tmp_path
) -> None:
    """Compatibility is the vocabulary's, not the files': a tokenizer.json re-saved in other
    bytes keeps the digest, and an embedding padded past the tokenizer changes nothing."""
    target = model_identity(checkpoint("llama", seed=1))
    draft_dir = Path(shutil.copytree(checkpoint("qwen2", seed=2, vocab_size=384,
                                                tokenizer_size=320), tmp_path / "draft"))  # fmt: skip
    before = (draft_dir / "tokenizer.json").read_bytes()
    resave_tokenizer(draft_dir)
    assert (draft_dir / "tokenizer.json").read_bytes() != before
    draft = model_identity(draft_dir)
    assert draft.tokenizer_digest == target.tokenizer_digest
    assert (draft.vocab_size, target.vocab_size) == (384, 320)
    require_shared_vocabulary(target, draft)
    require_shared_vocabulary(draft, target)  # either side may be the padded one


def test_a_conflicting_vocabulary_is_refused_naming_the_id_and_both_tokens(
    checkpoint, tmp_path
) -> None:
    target = model_identity(checkpoint("llama"))
    draft_dir = Path(shutil.copytree(checkpoint("llama", seed=3), tmp_path / "draft"))
    at_100, at_200 = swap_tokens(draft_dir, 100, 200)
    draft = model_identity(draft_dir)
    assert draft.tokenizer_digest != target.tokenizer_digest
    with pytest.raises(ModelMismatchError) as info:
        require_shared_vocabulary(target, draft)
    message = str(info.value)
    assert f"id 100 is {at_200!r} in the target and {at_100!r} in the draft" in message
    assert str(draft_dir) in message and "use a draft trained with the target's" in message


def test_a_draft_whose_embedding_cannot_read_the_targets_tokens_is_refused(checkpoint) -> None:
    """A smaller vocabulary that agrees on every id it defines is no conflict, but the draft
    reads the target's tokens: its embedding must hold every id the target's tokenizer does."""
    target = model_identity(checkpoint("llama"))
    small = model_identity(checkpoint("llama", vocab_size=300))
    assert small.tokenizer_digest != target.tokenizer_digest
    require_shared_vocabulary(small, target)  # the other way round: the draft covers it
    with pytest.raises(ModelMismatchError, match=r"embeds 300 token ids .* ids up to 31\d"):
        require_shared_vocabulary(target, small)
