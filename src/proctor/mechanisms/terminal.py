"""Untrusted text made safe to show on a terminal: no byte of it can act as a control sequence.

Owns `visible(text)` for human output and `json_safe(text)` for JSON that may land on a terminal. Agent
output, ledger and job records, paths: anything the untrusted side could have written is passed through one
of them before a person's terminal renders it. rich's `escape()` escapes markup, not ESC; this escapes ESC.

`visible` shows every dangerous character as a Python-style escape: the C0 controls (tab, newline and
carriage return too, as `\\t`, `\\n`, `\\r`: a line shown is one line), DEL, the C1 controls U+0080-U+009F
(8-bit CSI/OSC/DCS), every Unicode format character (bidi embeddings, overrides and isolates U+202A-U+202E,
U+2066-U+2069, LRM/RLM/ALM, zero-width characters, the BOM, tag characters), line and paragraph separators
(U+2028/U+2029) and lone surrogates, as `\\x1b`, `\\u202e`, `\\U000e0041`. A backslash is doubled, so the
text `\\x1b` an agent typed is never mistaken for a real ESC it sent. Everything else (letters of any
script, emoji, spaces) is shown as is.
"""

from __future__ import annotations

import re
import unicodedata

# Explicit ranges: what must never reach a terminal raw, whatever the Unicode database version says.
_EXPLICIT = (
    "\x00-\x1f\x7f-\x9f"  # C0, DEL, C1
    "\u00ad\u061c\u180e"  # soft hyphen, Arabic letter mark, Mongolian vowel separator
    "\u200b-\u200f"  # zero-width space/joiners, LRM, RLM
    "\u2028-\u202e"  # line/paragraph separators, bidi embeddings and overrides
    "\u2060-\u206f"  # word joiner, invisible operators, bidi isolates, deprecated format controls
    "\ufeff\ufff9-\ufffb"  # BOM / zero-width no-break space, interlinear annotation
    "\ud800-\udfff"  # surrogates (never valid alone; cannot even be encoded)
    "\U000e0000-\U000e007f"  # tag characters (invisible "ASCII smuggling")
)
_DANGEROUS_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"}

_EXPLICIT_RE = re.compile(f"[{_EXPLICIT}]")


def is_dangerous(ch: str) -> bool:
    return bool(_EXPLICIT_RE.match(ch)) or unicodedata.category(ch) in _DANGEROUS_CATEGORIES

# Candidates: anything but printable ASCII (and the backslash, which `visible` doubles); each is then checked.
_VISIBLE_RE = re.compile(r"[^\x20-\x5b\x5d-\x7e]")
_LINES_RE = re.compile(r"[^\t\n\x20-\x5b\x5d-\x7e]")
_JSON_RE = re.compile(r"[^\x00-\x7e]")


def escape_char(ch: str) -> str:
    """One dangerous character as `visible` shows it: `\\t`, `\\x1b`, `\\u202e`."""
    short = _SHORT.get(ch)
    if short is not None:
        return short
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(text: object, *, lines: bool = False, most: int | None = None) -> str:
    """`text` (str() of it when not a str) with every control, format and bidi character escaped.

    The one way untrusted text is shown, on every surface (terminal, review page, SSE, MCP text): file and
    branch names, summaries, risks, validation output, ledger payloads. `lines`: newlines (and tabs) are
    kept, for a block of output shown as lines; every other control is still escaped. `most`: at most that
    many characters of the text are shown, and the cut is said."""
    s = text if isinstance(text, str) else str(text)
    cut = ""
    if most is not None and len(s) > most:
        s, cut = s[:most], f"… ({len(s) - most} more characters not shown)"
    return (_LINES_RE if lines else _VISIBLE_RE).sub(_visible_one, s) + cut


def _visible_one(m: re.Match[str]) -> str:
    ch = m.group()
    return escape_char(ch) if ch == "\\" or is_dangerous(ch) else ch


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_safe(text: str) -> str:
    """A JSON document with DEL, C1, format and bidi characters written as `\\uXXXX` escapes.

    Serializers escape the C0 controls in strings already (json.dumps; pydantic too) but leave DEL, U+0080-
    U+009F and U+202E raw when they do not force ASCII. Every non-ASCII character of a JSON text sits in a
    string, and DEL is never structural, so this rewrite keeps the same document; the ASCII whitespace between
    tokens is left alone. Ordinary non-ASCII letters stay readable.
    """
    return _JSON_RE.sub(_json_one, text)


def _json_one(m: re.Match[str]) -> str:
    ch = m.group()
    return _json_escape(ch) if is_dangerous(ch) else ch


def is_safe(text: str) -> bool:
    """True when `text` holds no character `visible` would escape (backslash aside)."""
    return not any(is_dangerous(ch) for ch in text)
