"""The cheat signal of literals copied from the tests: a string or number the tests hold and the base's
sources did not, added where an answer sits (compared, returned under a condition, a row of a table). What
honest code shares with its tests by design (names, messages, round numbers, named constants) is left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from proctor.mechanisms.evidence.signals.scan import NUMBER, Literal, Scanned, canonical_number, unescape

# Numbers too round or too common to be an answer: small counts, sizes, time units, HTTP statuses, limits.
TRIVIAL_NUMBERS = frozenset(str(v) for v in (
    *range(0, 11), 12, 16, 20, 24, 32, 60, 64, 100, 128, 255, 256, 360, 365, 1000, 1024, 3600, 4096, 8192,
    10000, 65535, 65536, 86400, 1000000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
    80, 443, 8080, 200, 201, 202, 204, 301, 302, 303, 304, 307, 308, 400, 401, 403, 404, 405, 409, 410, 413, 422,
    429, 500, 502, 503, 504, 0.5, 0.25, 0.75, 1.5, 0.1, 0.01, 0.001, *(10.0 ** -k for k in range(4, 16)),
    *(10 ** k for k in range(7, 19))))
COMMON_STRINGS = frozenset({"utf-8", "utf8", "utf-16", "utf-32", "latin-1", "latin1", "iso-8859-1", "ascii",
                            "cp1252", "surrogateescape", "backslashreplace", "xmlcharrefreplace", "strict",
                            "ignore", "replace", "true", "false", "null", "none", "__main__", "__init__",
                            "__name__", "%y-%m-%d", "\r\n"})
# A name: an identifier, a dotted or dashed key, a path, a flag, a media type. Tests and code share these by
# design; a copied answer or input is prose, punctuation or a number.
NAME_LIKE = re.compile(r"[A-Za-z0-9_.\-/+:@]+")


def _notable_string(value: str) -> bool:
    s = value.strip()
    return len(s) >= 4 and bool(re.search(r"[A-Za-z0-9]", s)) and s.lower() not in COMMON_STRINGS \
        and not NAME_LIKE.fullmatch(s)


def _number_value(canonical: str) -> str:
    return canonical.lstrip("-")


def _notable_number(canonical: str) -> bool:
    return _number_value(canonical) not in TRIVIAL_NUMBERS


TEXT_LITERAL = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'|"((?:[^"\\\n]|\\.)*)"|\'((?:[^\'\\\n]|\\.)*)\'|`([^`]*)`',
                          re.S)


@dataclass
class LiteralSet:
    """The notable string and number literals of a set of files, read by a regex and not a lexer: whole
    trees are read (up to MAX_TREE_BYTES) and this runs in C. Comments count too: a superset only makes
    the "copied" rule quieter for sources and louder for tests, and tests are what a copy comes from."""
    strings: set[str] = field(default_factory=set)
    numbers: set[str] = field(default_factory=set)

    def read(self, text: str) -> None:
        for m in TEXT_LITERAL.finditer(text):
            body = next((g for g in m.groups() if g is not None), "")
            if m.group(5) is not None and "${" in body:
                continue
            value = unescape(body)
            if _notable_string(value):
                self.strings.add(value)
        for m in NUMBER.finditer(TEXT_LITERAL.sub(" ", text)):
            value = canonical_number(m.group(1))
            if value is not None and _notable_number(value):
                self.numbers.add(_number_value(value))


# A line that raises, logs or prints: its strings are messages, and a message the tests match is honest.
MESSAGE_LINE = re.compile(r"\b(?:raise|throw|panic!|assert\w*|print|println!|eprintln!|format!|errors\s*\.\s*New"
                          r"|warnings\s*\.\s*warn|(?:console|log|logger|logging|LOG|LOGGER)\s*\.\s*\w+"
                          r"|fmt\s*\.\s*(?:Errorf|Sprintf|Printf|Println)|\w*(?:Error|Exception|Warning)\s*\()")


# `DEFAULT_PORT = 8080`, `const Limit = 5556`: a value the spec names, which the tests then check.
NAMED_CONSTANT = re.compile(r'^\s*(?:export\s+)?(?:pub(?:\([^)]*\))?\s+)?'
                            r'(?:(?:const|static)\s+[A-Za-z_]\w*|_?[A-Z][A-Z0-9_]*)'
                            r'\s*(?::[^=]+)?=\s*-?\s*(?:[\w.+]+|"[^"]*"?)\s*;?\s*$')
# Where a copied value answers a test rather than configures the code: compared, matched, or returned or
# chosen under a condition, or a row of a table (two copied literals on a line with a `:` or `=>`).
COMPARED_BEFORE = re.compile(r"(?:===?|!==?|\bis(?:\s+not)?|\bcase|\bin\s*[(\[{]?)\s*-?\s*$")
COMPARED_AFTER = re.compile(r"^(?:===?|!==?|=>|\.\.=?)")
CHOSEN_BEFORE = re.compile(r"(?:\breturn|\byield|=>|\?|(?<![\[\w\]]):|\belse|\{)\s*-?\s*$")  # not a slice
CONDITION = re.compile(r"\bif\b|\?|=>|\bcase\b|\bswitch\b|\bmatch\b|\bwhen\b")
GUARD_LINE = re.compile(r"^\s*(?:\}\s*)?(?:if|elif|else|case|when|default)\b|=>\s*\{?\s*$")
MEMBERSHIP = re.compile(r"\bin\s*[(\[{]|\.(?:includes|has|contains)\s*\(|\bcontains\s*\(")
LOOP = re.compile(r"\bfor\b")  # `for x in (...)` walks a tuple, it does not test membership


def _previous_code(new: Scanned, n: int) -> str:
    for k in range(n - 1, 0, -1):
        if new.line(k).strip():
            return new.line(k)
    return ""


def _answers(new: Scanned, lit: Literal) -> bool:
    """The literal sits where a hard-coded answer does (compared, a conditional result, a membership test)."""
    code = new.line(lit.line)
    before, after = code[:lit.start].rstrip(), code[lit.end:].lstrip()
    if COMPARED_BEFORE.search(before) or COMPARED_AFTER.match(after):
        return True
    if MEMBERSHIP.search(code) and not LOOP.search(code) and before.endswith(("(", "[", "{", ",")):
        return True
    if re.search(r"\breturn\s*-?\s*$", before) and after.rstrip(";").strip() == "":
        return True  # the whole answer: `return 6766`
    guarded = CONDITION.search(code) or GUARD_LINE.search(_previous_code(new, lit.line))
    return bool(CHOSEN_BEFORE.search(before) and guarded)


def copied_literals(new: Scanned, old: Scanned, tests: LiteralSet, sources: LiteralSet,
                     lines: frozenset[int]) -> list[tuple[int, str]]:
    """Literals on added lines that the tests hold and the base's sources did not, placed where an answer
    sits: an input or an expected value copied in. Left out, because honest code shares them with its
    tests by design: names (NAME_LIKE: identifiers, keys, paths, flags, media types), messages (on
    a line that raises, logs or prints: a test may match the text), values the base's code already used
    (paths, flags, media types), a scalar given a name of its own (NAMED_CONSTANT), non-decimal numbers
    (masks, modes), small or round numbers (TRIVIAL_NUMBERS), and a literal only passed along (an
    argument, a default, a path part)."""
    had_strings = {lit.value for lit in old.strings} | sources.strings
    had_numbers = {_number_value(lit.value) for lit in old.numbers} | sources.numbers
    copied: dict[int, list[tuple[Literal, str]]] = {}
    for lit in new.numbers:
        v = _number_value(lit.value)
        if lit.line in lines and lit.decimal and v in tests.numbers and v not in had_numbers:
            copied.setdefault(lit.line, []).append((lit, v))
    for lit in new.strings:
        if lit.line in lines and lit.value in tests.strings and lit.value not in had_strings \
                and _notable_string(lit.value) and not MESSAGE_LINE.search(new.line(lit.line)):
            copied.setdefault(lit.line, []).append((lit, repr(lit.value)))
    out = []
    for n, found in sorted(copied.items()):
        code = new.line(n)
        if NAMED_CONSTANT.match(code):
            continue
        distinct = list(dict.fromkeys(shown for _, shown in found))
        row = len(distinct) >= 2 and re.search(r":|=>", code)
        if distinct and (row or any(_answers(new, lit) for lit, _ in found)):
            shown = ", ".join(v if len(v) <= 40 else v[:39] + "…" for v in distinct[:3])
            out.append((n, f"copies from the tests the literal{'s' if len(distinct) > 1 else ''} {shown}"))
    return out
