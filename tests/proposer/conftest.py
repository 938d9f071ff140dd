"""The proposer tests reuse the verifier tests' key set (keys on disk, one per role), and
share the natural fixture pair's torch draft."""

import pytest
from transformers import AutoTokenizer

from muser_app.fixtures import build_fixtures, natural_prompts
from proposer_mac.backends import load_draft_backend
from tests.verifier.conftest import key_set  # noqa: F401  (a fixture, re-exported)


@pytest.fixture(scope="module")
def natural():
    """The natural pair's torch draft and four natural prompts, tokenized."""
    pair = build_fixtures(progress=False).natural
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [list(tok.encode(t, add_special_tokens=False)) for t in natural_prompts(4)]
    return load_draft_backend("torch", pair.draft), prompts
