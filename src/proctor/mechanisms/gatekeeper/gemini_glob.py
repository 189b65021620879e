"""Gemini's glob patterns, as its glob library reads them: `brace_expand` (a line-for-line port of the
brace-expansion bundled in gemini 0.61) and `glob_roots` (the directory each expansion walks from), so the
gemini dialect can check every place a `glob` or `read_many_files` call reaches. It never walks a file system.
"""

from __future__ import annotations

import posixpath
import re

# `glob` and `read_many_files` hand their patterns to isaacs' glob (minimatch, brace-expansion), which
# expands braces before anything else: `{/etc,x}/host*` is `/etc/host*` and `x/host*`, and
# `{../../home/.gemini,x}/*` climbs out of the workspace (issue 22, item 3). So every expansion is checked,
# each as the directory its walk starts from: the components before the first wildcard, `..` resolved
# lexically as minimatch does. What cannot be bounded that way is refused: a `..` after a wildcard, a
# backslash escape in the walked part, more expansions than MAX_EXPANSIONS.
MAX_EXPANSIONS = 256  # brace-expansion's own cap is 100,000: far past any real pattern, and slow to check
_MAGIC = re.compile(r"[*?\[\]()!@+\\]")  # a component with one is matched, not walked literally
_HAS_BRACES = re.compile("\\{(?:(?!\\{)[^\n\r\u2028\u2029])*\\}")  # minimatch's test (a JS `.`)
_ESC = {"\\\\": "\x00SLASH\x00", "\\{": "\x00OPEN\x00", "\\}": "\x00CLOSE\x00", "\\,": "\x00COMMA\x00",
        "\\.": "\x00PERIOD\x00"}
_UNESC = {"\x00SLASH\x00": "\\", "\x00OPEN\x00": "{", "\x00CLOSE\x00": "}", "\x00COMMA\x00": ",",
          "\x00PERIOD\x00": "."}
_NUMERIC_SEQ = re.compile(r"^-?\d+\.\.-?\d+(?:\.\.-?\d+)?$")
_ALPHA_SEQ = re.compile(r"^[a-zA-Z]\.\.[a-zA-Z](?:\.\.-?\d+)?$")


class GlobError(ValueError):
    """A glob pattern whose reach the gate cannot bound."""


def _range(a: str, b: str, s: str) -> tuple[int, int] | None:
    """balanced-match's `range`: the first balanced a...b pair (JS indexOf, ported as written)."""
    ai = s.find(a)
    bi = s.find(b, ai + 1)
    i = ai
    result, begs, left, right = None, [], len(s), None
    if ai >= 0 and bi > 0:
        while i >= 0 and result is None:
            if i == ai:
                begs.append(i)
                ai = s.find(a, i + 1)
            elif len(begs) == 1:
                result = (begs.pop(), bi)
            else:
                beg = begs.pop() if begs else None
                if beg is not None and beg < left:
                    left, right = beg, bi
                bi = s.find(b, i + 1)
            i = ai if ai < bi and ai >= 0 else bi
        if begs and right is not None:
            result = (left, right)
    return result


def _balanced(s: str) -> tuple[str, str, str] | None:
    r = _range("{", "}", s)
    return None if r is None else (s[:r[0]], s[r[0] + 1:r[1]], s[r[1] + 1:])


def _comma_parts(s: str) -> list[str]:
    if not s:
        return [""]
    m = _balanced(s)
    if m is None:
        return s.split(",")
    pre, body, post = m
    p = pre.split(",")
    p[-1] += "{" + body + "}"
    rest = _comma_parts(post)
    if post:
        p[-1] += rest.pop(0)
        p.extend(rest)
    return p


def _sequence(parts: list[str], alpha: bool) -> list[str]:
    def num(x: str) -> int:
        return ord(x[0]) if alpha else int(x)

    x, y = num(parts[0]), num(parts[1])
    width = max(len(parts[0]), len(parts[1]))
    incr = max(abs(int(parts[2])), 1) if len(parts) == 3 else 1
    if abs(y - x) // incr >= MAX_EXPANSIONS:
        raise GlobError(f"a brace sequence of more than {MAX_EXPANSIONS} items")
    step = -incr if y < x else incr
    pad = any(re.match(r"^-?0\d", p) for p in parts)
    out = []
    for i in range(x, y + (1 if step > 0 else -1), step):
        if alpha:
            c = chr(i)
            out.append("" if c == "\\" else c)
            continue
        c = str(i)
        need = width - len(c)
        if pad and need > 0:
            c = "-" + "0" * need + c[1:] if i < 0 else "0" * need + c
        out.append(c)
    return out


def _expand(s: str, top: bool) -> list[str]:
    """brace-expansion's `expand_`, line for line (max: MAX_EXPANSIONS, past which the pattern is refused)."""
    m = _balanced(s)
    if m is None:
        return [s]
    pre, body, post_text = m
    post = _expand(post_text, False) if post_text else [""]
    if pre.endswith("$"):
        return [pre + "{" + body + "}" + p for p in post]
    numeric, alpha = bool(_NUMERIC_SEQ.match(body)), bool(_ALPHA_SEQ.match(body))
    sequence = numeric or alpha
    if not sequence and "," not in body:
        if re.search(r",(?!,)[^\n\r\u2028\u2029]*\}", post_text):
            return _expand(pre + "{" + body + "\x00CLOSE\x00" + post_text, True)
        return [s]
    if sequence:
        n = _sequence(body.split(".."), alpha)
    else:
        n = _comma_parts(body)
        if len(n) == 1:
            n = ["{" + e + "}" for e in _expand(n[0], False)]
            if len(n) == 1:
                return [pre + n[0] + p for p in post]
    expanded = [e for part in n for e in ([part] if sequence else _expand(part, False))]
    out = [pre + e + p for e in expanded for p in post if not top or sequence or pre + e + p]
    if len(out) > MAX_EXPANSIONS:
        raise GlobError(f"more than {MAX_EXPANSIONS} brace expansions")
    return out


def brace_expand(pattern: str) -> list[str]:
    """minimatch's `braceExpand` (brace-expansion 2 as bundled in gemini 0.61): every pattern glob walks."""
    if "\x00" in pattern:
        raise GlobError("a NUL byte in a glob pattern")
    if not _HAS_BRACES.search(pattern):
        return [pattern]
    if pattern.startswith("{}"):
        pattern = "\\{\\}" + pattern[2:]
    for k, v in _ESC.items():
        pattern = pattern.replace(k, v)
    out = []
    for e in _expand(pattern, True):
        for k, v in _UNESC.items():
            e = e.replace(k, v)
        out.append(e)
    return out


def glob_roots(pattern: str, base: str) -> list[str]:
    """The directory each expansion of `pattern` walks from (its components before the first wildcard,
    joined to `base` unless absolute, `..` resolved lexically); GlobError when a walk cannot be bounded."""
    roots = []
    for e in brace_expand(pattern):
        parts = e.split("/")
        lead = next((i for i, c in enumerate(parts) if _MAGIC.search(c)), len(parts))
        if any(".." in c.replace("\\", "") for c in parts[lead:]):
            raise GlobError(f"{e[:120]!r} climbs with '..' after a wildcard")
        literal = "/".join(parts[:lead])
        root = posixpath.normpath(posixpath.join(base, literal) if not e.startswith("/") else literal or "/")
        roots.append(root)
    return list(dict.fromkeys(roots))
