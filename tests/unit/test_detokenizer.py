"""The incremental detokenizer: UTF-8 never broken, invalid bytes released, stop strings cut."""
from __future__ import annotations

import pytest

from server.detok import IncrementalDetokenizer
from common.model_files import ModelFiles
from common.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelFiles("hf", tiny_model_dir))


def test_detok_never_emits_broken_utf8_and_flushes_last_token(tok):
    text = "héllo 😀!"
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.add(t) for t in tok.encode(text)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.finish() == text
    assert pieces[-1] == "!"  # the last token's text is emitted with it


def _byte_token(tok, b: int) -> int:
    """Id of the byte-level token of one raw byte (GPT-2's bytes_to_unicode mapping)."""
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = chr(b) if b in shown else chr(256 + sorted(set(range(256)) - set(shown)).index(b))
    return tok.tok.token_to_id(char)


def test_detok_invalid_bytes_are_released_not_held_to_the_end(tok):
    """A model may emit bytes that never form UTF-8 (random weights do): they stream as U+FFFD
    at most MAX_PENDING tokens late, and a valid character right after them is not broken."""
    bad = [_byte_token(tok, 0xFF)] * 6
    good = [_byte_token(tok, b) for b in "中!".encode()]
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.add(t) for t in bad + good]
    assert "".join(pieces[:6]) == "\ufffd" * 3  # the first bad bytes already streamed
    assert "".join(pieces) + d.finish() == "\ufffd" * 6 + "中!"
    assert pieces[-1].endswith("!")


def test_detok_stop_string_is_cut_and_never_streamed(tok):
    d = IncrementalDetokenizer(tok, ["END"])
    out = ""
    for t in tok.encode("abc ENDxyz"):
        out += d.add(t)
        if d.stop_hit():
            break
    out += d.finish()
    assert out == "abc "
