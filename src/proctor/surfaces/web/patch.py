"""A job's patch as the review page shows it: one section a file, each line numbered and highlighted.

Owns splitting `git diff-tree -p` output (proctor.services.review.diff made it, from objects alone) into files and
hunks, and turning each line into escaped HTML: Pygments, with the lexer chosen by the file's name only
(never by its content: no guessing), over the hunk's text with the +/- column taken off, so a string or
comment spanning lines is coloured as the file has it. Every byte of it is the agent's: nothing is marked
safe that Pygments did not escape, and the page is cut at stated limits, each cut said on the page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from markupsafe import Markup, escape
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import get_lexer_for_filename
from pygments.lexers.special import TextLexer
from pygments.util import ClassNotFound

from proctor.mechanisms.terminal import escape_char, is_dangerous

MAX_FILE_LINES = 3000  # of one file's patch shown; the rest is counted, not shown
MAX_TOTAL_LINES = 20000  # of the whole patch on one page
MAX_LINE_CHARS = 1000  # of one line (a minified file is one line)
# Bytes, beside lines: 20,000 lines of 2,000 characters made a 39 MB diff a 44 MB page that took 64 s (issue 23).
MAX_FILE_BYTES = 256 * 1024  # of one file's patch text shown
MAX_PAGE_BYTES = 2 * 1024 * 1024  # of the whole patch's text shown on one page
CUT_NAMES = 20  # files past the page's limits are named, this many
HIGHLIGHT_MAX_LINES = 5000  # a hunk longer than this is shown escaped, uncoloured (Pygments is slow on it)
# Pygments colours about 0.4 MB/s of minified JS here (measured: 2 MB of it took 5.6 s): past this many
# characters a page's lines are shown escaped, uncoloured, so a job page stays within a second.
HIGHLIGHT_MAX_CHARS = 96 * 1024
CSS_CLASS = "hl"
_CANDIDATE = re.compile(r"[^\x20-\x7e]")  # a character that may be invisible or reorder what is shown


@dataclass(frozen=True)
class Line:
    kind: str  # add | del | ctx | hunk | meta
    old: int | None
    new: int | None
    html: Markup
    cut: str = ""  # what of this line is not shown, said on the line itself ("" when all of it is)


@dataclass
class FileDiff:
    header: str  # the `diff --git` line, as text
    path: str  # the new path (the old one for a deletion), as git wrote it
    status: str  # added | deleted | modified | renamed | binary
    added: int = 0
    removed: int = 0
    lines: list[Line] = field(default_factory=list)
    cut: int = 0  # lines of this file not shown (a limit)
    cut_bytes: int = 0  # and their size
    shown_bytes: int = 0


@dataclass(frozen=True)
class Page:
    files: list[FileDiff]
    cut_files: int  # files not shown at all (the page limit)
    cut_names: list[str] = field(default_factory=list)  # the first CUT_NAMES of them

    @property
    def whole(self) -> bool:
        """Every byte of the patch is on the page: no file, line or part of a line cut. Only then may the page
        land it (what a person saw is what lands: `proctor land` after `proctor diff` otherwise)."""
        return not self.cut_files and not any(f.cut or f.cut_bytes or any(ln.cut for ln in f.lines)
                                              for f in self.files)


def line_cut(text: str, size: int) -> str:
    """What of a line of `size` bytes, decoded as `text`, the page does not show past MAX_LINE_CHARS: said in
    characters when all of it was decoded, else in bytes (a line past the decode window is never decoded
    whole). "" when nothing is cut. A cut line ending in blanks and `; curl ... | sh` looked whole (issue 41)."""
    if size > 4 * MAX_LINE_CHARS:
        return f"this line is {size:,} bytes; its first {MAX_LINE_CHARS:,} characters are shown"
    if len(text) > MAX_LINE_CHARS:
        return f"{len(text) - MAX_LINE_CHARS:,} more characters of this line are not shown"
    return ""


def _path_from_header(header: str) -> str:
    """`diff --git a/P b/P` -> P (the halves are equal but for a rename, when +++ or `rename to` says)."""
    rest = header[len("diff --git "):]
    half = (len(rest) - 1) // 2
    if len(rest) % 2 == 1 and rest[half] == " " and rest[:half].startswith("a/") and rest[half + 1:].startswith("b/") \
            and rest[2:half] == rest[half + 3:]:
        return rest[2:half]
    return rest


def _lexer(path: str) -> Lexer:
    return _lexer_for(path.rsplit("/", 1)[-1].strip('"'))


@lru_cache(maxsize=256)
def _lexer_for(name: str) -> Lexer:
    try:
        lexer = get_lexer_for_filename(name, stripnl=False, stripall=False, ensurenl=False)
    except ClassNotFound:
        lexer = TextLexer(stripnl=False, ensurenl=False)
    return lexer


_FORMATTER = HtmlFormatter(nowrap=True, classprefix=f"{CSS_CLASS}-")


def warm() -> None:
    """Load Pygments' lexer table and a common lexer now, at server start, not in a reviewer's first job page
    (measured: the first page of a big diff took 0.15 s more than the next)."""
    for name in ("x.py", "x.js", "x.txt"):
        highlight("x = 1\n", _lexer_for(name), _FORMATTER)


def stylesheet() -> str:
    """The colours of the highlighted tokens (served from the package, like every asset of the page)."""
    return HtmlFormatter(style="default", classprefix=f"{CSS_CLASS}-").get_style_defs(".code")


def _reveal_one(m: re.Match[str]) -> str:
    ch = m.group()
    if ch == "\t" or not is_dangerous(ch):
        return ch
    return f'<span class="ctl" title="U+{ord(ch):04X}">{escape_char(ch)}</span>'


def reveal(html: str) -> Markup:
    """Escaped HTML with every control, bidi and invisible character (Trojan Source) shown as a marked
    escape: a reviewer sees the bytes that reorder or hide code, not their effect. Such characters occur
    only in text nodes of escaped HTML, so marking them up there is safe."""
    return Markup(_CANDIDATE.sub(_reveal_one, html))


def _colour(texts: list[str], lexer: Lexer, allowance: list[int] | None = None) -> list[Markup]:
    """Each text line highlighted; the result has exactly one entry a line (or all escaped when it cannot).
    `allowance`: characters the page may still colour (one-item list, spent here)."""
    size = sum(len(t) + 1 for t in texts)
    if allowance is not None:
        if size > allowance[0]:
            return [reveal(escape(t)) for t in texts]
        allowance[0] -= size
    if len(texts) > HIGHLIGHT_MAX_LINES or isinstance(lexer, TextLexer):
        return [reveal(escape(t)) for t in texts]
    out = highlight("\n".join(texts) + "\n", lexer, _FORMATTER).split("\n")
    if out and out[-1] == "":
        out.pop()
    if len(out) != len(texts):  # a lexer that folded or split lines: fall back, never misalign
        return [reveal(escape(t)) for t in texts]
    return [reveal(o) for o in out]


def _status(meta: list[str]) -> str:
    for m in meta:
        if m.startswith("new file mode"):
            return "added"
        if m.startswith("deleted file mode"):
            return "deleted"
        if m.startswith("rename to ") or m.startswith("rename from "):
            return "renamed"
        if m.startswith("Binary files ") or m == "GIT binary patch":
            return "binary"
    return "modified"


def _hunk_start(line: str) -> tuple[int, int]:
    """`@@ -a,b +c,d @@ ...` -> (a, c)."""
    try:
        spec = line.split("@@")[1].split()
        return int(spec[0][1:].split(",")[0]), int(spec[1][1:].split(",")[0])
    except (IndexError, ValueError):
        return 0, 0


def _rows(data: bytes, most_lines: int, most_bytes: int) -> tuple[list[tuple[str, int]], int]:
    """The first rows of `data` shown (at most `most_lines`, as many as fit `most_bytes` with each line cut at
    MAX_LINE_CHARS), decoded one by one with each row's whole size in bytes, and how many bytes of `data`
    they took. Lazy on purpose: a 39 MB file is never decoded or split whole, only the part the page shows."""
    rows: list[tuple[str, int]] = []
    pos = size = 0
    while pos < len(data) and len(rows) < most_lines:
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        text = data[pos:min(end, pos + 4 * MAX_LINE_CHARS)].decode("utf-8", "replace")
        size += min(len(text), MAX_LINE_CHARS) + 1
        if size > most_bytes:
            break
        rows.append((text, end - pos))
        pos = end + 1
    return rows, min(pos, len(data))


def _hunks_at(body: bytes) -> int:
    """Where the first hunk (`@@`) of a file's body starts; the end when it has none (a mode change, binary)."""
    if body.startswith(b"@@"):
        return 0
    at = body.find(b"\n@@")
    return len(body) if at < 0 else at + 1


def _file(section: bytes, budget: int, byte_budget: int = MAX_PAGE_BYTES, colour: list[int] | None = None) -> FileDiff:
    nl = section.find(b"\n")
    header = section[: nl if nl >= 0 else len(section)].decode("utf-8", "replace")
    body = section[nl + 1:] if nl >= 0 else b""
    start = _hunks_at(body)
    meta = body[:start].decode("utf-8", "replace").split("\n")
    if meta and meta[-1] == "":
        meta.pop()
    data = body[start:]
    if data.endswith(b"\n"):
        data = data[:-1]
    path = _path_from_header(header)
    for m in meta:
        if m.startswith("rename to "):
            path = m[len("rename to "):]
        elif m.startswith("+++ b/"):
            path = m[len("+++ b/"):]
    fd = FileDiff(header, path, _status(meta))
    fd.lines.extend(Line("meta", None, None, reveal(escape(m[:MAX_LINE_CHARS])), line_cut(m, len(m.encode())))
                    for m in meta if not m.startswith(("--- ", "+++ ", "index ")))
    lexer = _lexer(path)
    # Counted in C over the bytes: a row is a line of the hunks; the first is an `@@` line, never + or -.
    fd.added, fd.removed = data.count(b"\n+"), data.count(b"\n-")
    total = data.count(b"\n") + 1 if data else 0
    rows, used = _rows(data, min(MAX_FILE_LINES, budget), min(MAX_FILE_BYTES, byte_budget))
    shown = [r for r, _ in rows]
    cuts = [line_cut(r, n) for r, n in rows]
    fd.cut, fd.cut_bytes = total - len(shown), len(data) - used
    fd.shown_bytes = sum(min(len(r), MAX_LINE_CHARS) + 1 for r in shown)
    # Hunk by hunk: the header line, then its lines coloured together.
    j = 0
    while j < len(shown):
        if not shown[j].startswith("@@"):
            j += 1
            continue
        old, new = _hunk_start(shown[j])
        fd.lines.append(Line("hunk", None, None, reveal(escape(shown[j][:MAX_LINE_CHARS])), cuts[j]))
        k = j + 1
        while k < len(shown) and not shown[k].startswith("@@"):
            k += 1
        hunk = shown[j + 1:k]
        texts = [h[1:MAX_LINE_CHARS] for h in hunk]
        for h, cut, html in zip(hunk, cuts[j + 1:k], _colour(texts, lexer, colour), strict=True):
            mark = h[:1]
            if mark == "+":
                fd.lines.append(Line("add", None, new, html, cut))
                new += 1
            elif mark == "-":
                fd.lines.append(Line("del", old, None, html, cut))
                old += 1
            elif mark == "\\":  # "\ No newline at end of file"
                fd.lines.append(Line("meta", None, None, reveal(escape(h[:MAX_LINE_CHARS])), cut))
            else:
                fd.lines.append(Line("ctx", old, new, html, cut))
                old, new = old + 1, new + 1
        j = k
    return fd


_FILE_START = re.compile(rb"^diff --git ", re.MULTILINE)


def split(patch: bytes, colour_chars: int = HIGHLIGHT_MAX_CHARS) -> Page:
    """The patch's files, within the page's limits (a file past them is counted in `cut_files`, and named)."""
    starts = [m.start() for m in _FILE_START.finditer(patch)]
    bounds = list(zip(starts, [*starts[1:], len(patch)], strict=True))
    files: list[FileDiff] = []
    budget, byte_budget, colour = MAX_TOTAL_LINES, MAX_PAGE_BYTES, [colour_chars]
    for a, b in bounds:
        if budget <= 0 or byte_budget <= 0:
            break
        fd = _file(patch[a:b], budget, byte_budget, colour)
        budget -= len(fd.lines)
        byte_budget -= fd.shown_bytes
        files.append(fd)
    cut = bounds[len(files):]
    return Page(files, len(cut), [_path_from_header(_first_line(patch, a, b)) for a, b in cut[:CUT_NAMES]])


def _first_line(data: bytes, a: int, b: int) -> str:
    end = data.find(b"\n", a, b)
    return data[a:end if end >= 0 else b].decode("utf-8", "replace")
