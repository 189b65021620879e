"""What a changed file looks like to the cheat-signal rules: its language, each line with comments and string
bodies blanked, its string and number literals (a small lexer per language, Python's own tokenizer for
Python), and the changed source as the rules are given it. It never raises on odd text: what does not lex
is read as far as it goes.
"""

from __future__ import annotations

import io
import math
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import PurePosixPath

LANGUAGES = {".py": "python", ".pyw": "python", ".js": "js", ".mjs": "js", ".cjs": "js", ".jsx": "js",
             ".ts": "js", ".tsx": "js", ".mts": "js", ".cts": "js", ".go": "go", ".rs": "rust"}
# Test data read for literals beside test code (a table of expected values often lives in JSON).
DATA = {".json": "js"}


def language(path: str) -> str | None:
    return LANGUAGES.get(PurePosixPath(path).suffix.lower())


@dataclass(frozen=True)
class Literal:
    """A string or number literal: its line, its columns there (end: past it, or the line's end when it
    runs on), and its value (a number's canonical spelling; `decimal` False for 0x/0o/0b masks and modes)."""
    line: int
    start: int
    end: int
    value: str
    decimal: bool = True


@dataclass(frozen=True)
class Scanned:
    """One file's text as the rules read it: each line with comments and string bodies blanked (a `"`
    marks where a string was), and its string and number literals."""
    code: list[str]
    strings: list[Literal] = field(default_factory=list)
    numbers: list[Literal] = field(default_factory=list)

    def line(self, n: int) -> str:
        return self.code[n - 1] if 0 < n <= len(self.code) else ""

    def strings_on(self, n: int) -> list[str]:
        return [lit.value for lit in self.strings if lit.line == n]


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"', "`": "`", "\n": ""}


def unescape(body: str) -> str:
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), body, flags=re.S)


NUMBER = re.compile(r"(?<![\w.$])(0[xXbBoO][0-9a-fA-F_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)"
                    r"(?:_?(?:[iu](?:8|16|32|64|128|size)|f32|f64)|n|[lLuU])?(?![\w.])")


def canonical_number(text: str) -> str | None:
    """A number literal as one spelling across languages (`0x10`, `16`, `16u32` and `1.6e1` are "16")."""
    t = text.replace("_", "")
    try:
        return str(int(t, 0))
    except ValueError:
        pass
    try:
        return str(int(t, 10))  # leading zeros
    except ValueError:
        pass
    try:
        f = float(t)
    except ValueError:
        return None
    if not math.isfinite(f):
        return None
    return str(int(f)) if f.is_integer() else repr(f)


def _is_decimal(text: str) -> bool:
    return not text[:2].lower() in ("0x", "0o", "0b")


def _numbers(lines: list[str]) -> list[Literal]:
    out = []
    for n, line in enumerate(lines, 1):
        for m in NUMBER.finditer(line):
            value = canonical_number(m.group(1))
            if value is not None:
                out.append(Literal(n, m.start(), m.end(), value, _is_decimal(m.group(1))))
    return out


# Where a comment or a string may start, per language; a raw Rust string is matched before a plain one.
SPECIAL = {
    "python": re.compile(r"#|\"|'"),
    "js": re.compile(r"//|/\*|[\"'`]"),
    "go": re.compile(r"//|/\*|[\"'`]"),
    "rust": re.compile(r"//|/\*|(?<![\w])b?r#*\"|[\"']"),
}
RUNE = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]{1,6}\}|x[0-9a-fA-F]{2}|[0-7]{1,3}|u[0-9a-fA-F]{4}|.)|[^\\'\n])'")


def _quoted_end(text: str, i: int, quote: str, multiline: bool) -> int:
    """The index past the closing quote of the string opening at `i` (escapes honoured)."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == quote:
            return j + 1
        if c == "\n" and not multiline:
            return j
        j += 1
    return n


def _string_at(text: str, i: int, lang: str) -> tuple[int, str | None] | None:
    """(end, value) of the string literal at `i`, value None when it is not a plain constant."""
    c = text[i]
    if lang == "rust" and c in "br" and c != '"':
        m = re.compile(r"b?r(#*)\"").match(text, i)
        if m:
            close = text.find('"' + m.group(1), m.end())
            end = len(text) if close < 0 else close + 1 + len(m.group(1))
            return end, text[m.end():close] if close >= 0 else None
        return None
    if c == "'" and lang in ("go", "rust"):
        m = RUNE.match(text, i)
        return (m.end(), unescape(m.group(0)[1:-1])) if m else None  # else a Rust lifetime: code
    if lang == "python" and text.startswith(c * 3, i):
        close = text.find(c * 3, i + 3)
        end = len(text) if close < 0 else close + 3
        return end, unescape(text[i + 3:close]) if close >= 0 else None
    if c == "`":
        end = text.find("`", i + 1)
        end = len(text) if end < 0 else end + 1
        body = text[i + 1:end - 1]
        return end, (None if lang == "js" and "${" in body else body)
    end = _quoted_end(text, i, c, multiline=(lang == "rust"))
    return end, unescape(text[i + 1:end - 1])


def scan_generic(text: str, lang: str) -> Scanned:
    """Comments and strings blanked by a small lexer: enough to keep a rule off a comment or a message."""
    chars = list(text)
    strings: list[Literal] = []

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, len(chars))):
            if chars[k] != "\n":
                chars[k] = " "

    special = SPECIAL[lang]
    i, line, n = 0, 1, len(text)
    while i < n:
        m = special.search(text, i)
        if m is None:
            break
        line += text.count("\n", i, m.start())
        i, tok = m.start(), m.group(0)
        if tok in ("#", "//"):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif tok == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        else:
            found = _string_at(text, i, lang)
            if found is None:
                i += 1
                continue
            j, value = found
            if value is not None:
                col = i - text.rfind("\n", 0, i) - 1
                nl = text.find("\n", i, j)
                strings.append(Literal(line, col, col + (j - i) if nl < 0 else col + (nl - i), value))
            blank(i + 1, j - 1)
            line += text.count("\n", i, j)
            i = max(j, i + 1)
            continue
        blank(i, j)
        line += text.count("\n", i, j)
        i = j
    code = "".join(chars).split("\n")
    return Scanned(code, strings, _numbers(code))


def _py_string(token: str) -> str | None:
    m = re.match(r"([A-Za-z]*)('''|\"\"\"|'|\")", token)
    if not m or "f" in m.group(1).lower():
        return None  # an f-string is code, not a constant
    body = token[m.end():len(token) - len(m.group(2))]
    return body if "r" in m.group(1).lower() else unescape(body)


def scan_python(text: str) -> Scanned:
    """Python through `tokenize`, exact about strings and comments; the lexer when it does not tokenize."""
    rows = [list(r) for r in text.split("\n")]
    strings: list[Literal] = []
    numbers: list[Literal] = []

    def blank(start: tuple[int, int], end: tuple[int, int], mark: bool) -> None:
        (sr, sc), (er, ec) = start, end
        for r in range(sr, min(er, len(rows)) + 1):
            row = rows[r - 1]
            a = sc if r == sr else 0
            b = ec if r == er else len(row)
            for k in range(a, min(b, len(row))):
                row[k] = " "
        if mark and sr <= len(rows) and sc < len(rows[sr - 1]):
            rows[sr - 1][sc] = '"'

    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                blank(tok.start, tok.end, mark=False)
            elif tok.type == tokenize.STRING:
                value = _py_string(tok.string)
                if value is not None:
                    (sr, sc), (er, ec) = tok.start, tok.end
                    strings.append(Literal(sr, sc, ec if er == sr else len(rows[sr - 1]), value))
                blank(tok.start, tok.end, mark=True)
            elif tok.type == tokenize.NUMBER and not tok.string.lower().endswith("j"):
                value = canonical_number(tok.string)
                if value is not None:
                    numbers.append(Literal(tok.start[0], tok.start[1], tok.end[1], value, _is_decimal(tok.string)))
    except (tokenize.TokenError, SyntaxError, ValueError):
        return scan_generic(text, "python")
    return Scanned(["".join(r) for r in rows], strings, numbers)


def scan(text: str, lang: str) -> Scanned:
    return scan_python(text) if lang == "python" else scan_generic(text, lang)


@dataclass(frozen=True)
class Source:
    """One changed source file: its path, language, both versions as read, and the lines the agent added."""
    path: str
    lang: str
    new: str
    old: str
    added: frozenset[int]

    @property
    def new_lines(self) -> list[str]:
        return self.new.split("\n")
