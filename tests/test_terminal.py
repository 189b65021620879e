"""`terminal.visible` / `json_safe`: no input, however hostile, leaves a control or format character raw."""

from __future__ import annotations

import json
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.mechanisms.terminal import is_safe, json_safe, visible

# The set named in the issue, spelled out independently of the implementation.
DANGEROUS = (
    {chr(c) for c in range(0x20)} | {"\x7f"} | {chr(c) for c in range(0x80, 0xA0)}
    | {chr(c) for c in range(0x202A, 0x202F)} | {chr(c) for c in range(0x2066, 0x206A)}
    | {"\u200e", "\u200f", "\u061c", "\u2028", "\u2029", "\ufeff", "\u200b"}
)
HOSTILE = ["\x1b", "\x1b]0;", "\x07", "\x9b", "\x9d", "\u202e", "\u2066", "\x1b]52;c;", "\x1b]8;;", "\x1b[2J",
           "\r", "\n", "\\", "\x00", "\U000e0041", "\ud800", "é", "😀", "\x7f"]
texts = st.one_of(st.text(), st.lists(st.sampled_from(HOSTILE) | st.text(max_size=3)).map("".join),
                  st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x3000)))


def _bad(ch: str) -> bool:
    return ch in DANGEROUS or unicodedata.category(ch) in {"Cc", "Cf", "Cs", "Zl", "Zp"}


@settings(max_examples=400)
@given(texts)
def test_visible_leaves_no_dangerous_character(text):
    shown = visible(text)
    assert not any(_bad(ch) for ch in shown)
    assert is_safe(shown)
    shown.encode("utf-8")  # no lone surrogate survives: printing it can never raise


@given(texts, texts)
def test_visible_is_injective_enough_to_tell_escape_text_from_a_real_escape(a, b):
    # The backslash is doubled, so distinct inputs never render alike (the escape is reversible).
    if a != b:
        assert visible(a) != visible(b)


@settings(max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers() | texts,
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
                    max_leaves=8))
def test_json_safe_keeps_the_document_and_drops_every_raw_control(value):
    for ensure_ascii in (False, True):
        try:
            raw = json.dumps(value, ensure_ascii=ensure_ascii, indent=2)
        except UnicodeEncodeError:  # pragma: no cover - json never raises on surrogates
            continue
        safe = json_safe(raw)
        assert json.loads(safe) == value
        assert not any(_bad(ch) for ch in safe if ch not in "\n")  # indentation newlines are structure


def test_visible_examples():
    assert visible("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert visible("a\tb\r\nc") == "a\\tb\\r\\nc"
    assert visible("\x9b2J \u202egnp.exe \u2066x\u2069") == "\\x9b2J \\u202egnp.exe \\u2066x\\u2069"
    assert visible("C:\\x1b") == "C:\\\\x1b"  # typed text, not an ESC
    assert visible("naïve 😀 日本") == "naïve 😀 日本"
    assert visible("\U000e0041") == "\\U000e0041"
    assert visible(None) == "None" and visible(3) == "3"


def test_json_safe_escapes_what_pydantic_leaves_raw():
    from pydantic import BaseModel

    class M(BaseModel):
        s: str

    raw = M(s="a\x1b\x7f\x9b\u202eé😀").model_dump_json()
    assert "\x9b" in raw and "\u202e" in raw and "\x7f" in raw  # the gap this closes
    safe = json_safe(raw)
    assert safe == '{"s":"a\\u001b\\u007f\\u009b\\u202eé😀"}'
    assert M.model_validate_json(safe).s == "a\x1b\x7f\x9b\u202eé😀"
