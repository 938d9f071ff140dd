"""A canonical record's text field that is not UTF-8 is malformed input (CanonicalError,
INVALID_ARGUMENT 'malformed' on the wire), not a UnicodeDecodeError: a resume point whose
verifier key id held such bytes reached the verifier's open as UNKNOWN."""

from __future__ import annotations

import pytest

from muser.canonical import CanonicalError, Reader, Writer


def test_a_text_field_that_is_not_utf8_is_malformed():
    data = Writer("test-domain").blob(b"key-\xff\xfe").bytes()
    with pytest.raises(CanonicalError, match=r"a text field is not UTF-8 \(byte 0xff at 4\)"):
        Reader(data, "test-domain").text()
    assert Reader(Writer("test-domain").text("ключ").bytes(), "test-domain").text() == "ключ"
