"""Reading the two commits a diff's signals come from, on the host-made git dir: the changed sources (both
versions and the lines added), and the literals of the test-defining files and of the base's other sources.
Only `diff --no-ext-diff --no-textconv`, `ls-tree` and `cat-file --batch`, never git's repo-controlled
machinery; every read is capped (a file, the changed sources, the trees).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from proctor.mechanisms.evidence.signals.literals import LiteralSet
from proctor.mechanisms.evidence.signals.scan import DATA, LANGUAGES, Source, language
from proctor.mechanisms.git.command import git

MAX_FILE_BYTES = 1 << 20  # a source or test file larger than this is skipped (generated, vendored, data)
MAX_SOURCE_BYTES = 8 << 20  # the agent's changed sources read in all (both versions)
MAX_TREE_BYTES = 20 << 20  # test files, and the base's other sources, read for their literals
MAX_FILES = 300
LITERAL_PATHS = {"GIT_LITERAL_PATHSPECS": "1"}  # a path from the tree is a path, never a glob


@dataclass(frozen=True)
class Entry:
    mode: str
    sha: str
    size: int


def _listing(git_dir: Path, tree: str, paths: Sequence[str] = ()) -> dict[str, Entry]:
    args = ["ls-tree", "-r", "-z", "-l", "--full-tree", tree]
    res = git([*args, "--", *paths] if paths else args, git_dir=git_dir, env=LITERAL_PATHS)
    out: dict[str, Entry] = {}
    if not res.ok:
        return out
    for raw in res.out.split(b"\0"):
        meta, sep, name = raw.partition(b"\t")
        fields = meta.decode("ascii", "replace").split()
        if sep and len(fields) == 4 and fields[1] == "blob" and fields[0] in ("100644", "100755") \
                and fields[3].isdigit():
            out[name.decode("utf-8", "surrogateescape")] = Entry(fields[0], fields[2], int(fields[3]))
    return out


def _blobs(git_dir: Path, shas: Iterable[str]) -> dict[str, bytes]:
    wanted = list(dict.fromkeys(shas))
    if not wanted:
        return {}
    res = git(["cat-file", "--batch"], git_dir=git_dir, input_bytes=("\n".join(wanted) + "\n").encode())
    out: dict[str, bytes] = {}
    data, pos = res.out, 0
    while pos < len(data):
        eol = data.find(b"\n", pos)
        if eol < 0:
            break
        header = data[pos:eol].split()
        pos = eol + 1
        if len(header) != 3 or not header[2].isdigit():
            continue  # "<sha> missing"
        size = int(header[2])
        out[header[0].decode()] = data[pos:pos + size]
        pos += size + 1
    return out


def _text(data: bytes) -> str | None:
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", "replace")


def _unquote(raw: bytes) -> str:
    """A path as git's diff header spells it: C-quoted when it holds a quote, backslash or control byte."""
    if raw.startswith(b'"') and raw.endswith(b'"'):
        body, out, i = raw[1:-1], bytearray(), 0
        simple = {ord("a"): 7, ord("b"): 8, ord("t"): 9, ord("n"): 10, ord("v"): 11, ord("f"): 12, ord("r"): 13}
        while i < len(body):
            c = body[i]
            if c == 0x5C and i + 1 < len(body):
                nxt = body[i + 1]
                if 0x30 <= nxt <= 0x37:
                    out.append(int(body[i + 1:i + 4], 8) & 0xFF)
                    i += 4
                    continue
                out.append(simple.get(nxt, nxt))
                i += 2
                continue
            out.append(c)
            i += 1
        raw = bytes(out)
    return raw.decode("utf-8", "surrogateescape")


HUNK = re.compile(rb"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def _added_lines(git_dir: Path, base: str, commit: str, paths: Sequence[str]) -> dict[str, set[int]]:
    """Line numbers (in `commit`) of the lines added to each path; -U0 hunks name exactly those."""
    res = git(["diff", "--no-ext-diff", "--no-textconv", "--no-color", "--no-renames", "-U0",
               "--src-prefix=a/", "--dst-prefix=b/", base, commit, "--", *paths], git_dir=git_dir, env=LITERAL_PATHS)
    added: dict[str, set[int]] = {}
    current: str | None = None
    in_header = False
    for raw in res.out.split(b"\n") if res.ok else []:
        if raw.startswith(b"diff --git "):
            current, in_header = None, True
        elif in_header and raw.startswith(b"+++ "):
            name = _unquote(raw[4:].rstrip(b"\t"))
            current = name[2:] if name.startswith("b/") else None
        elif raw.startswith(b"@@"):
            in_header = False
            m = HUNK.match(raw)
            if m and current is not None:
                start, count = int(m.group(1)), int(m.group(2) or b"1")
                added.setdefault(current, set()).update(range(start, start + count))
    return added


def changed_sources(git_dir: Path, base: str, commit: str, changed: Sequence[str],
             is_test: Callable[[str], bool]) -> list[Source]:
    wanted = [p for p in dict.fromkeys(changed) if language(p) and not is_test(p) and "\n" not in p][:MAX_FILES]
    if not wanted:
        return []
    new_entries = _listing(git_dir, commit, wanted)
    old_entries = _listing(git_dir, base, wanted)
    budget, kept = MAX_SOURCE_BYTES, []
    for p in wanted:
        e, o = new_entries.get(p), old_entries.get(p)
        size = (e.size if e else 0) + (o.size if o else 0)
        if e is None or e.size > MAX_FILE_BYTES or (o is not None and o.size > MAX_FILE_BYTES) or size > budget:
            continue
        budget -= size
        kept.append(p)
    blobs = _blobs(git_dir, [new_entries[p].sha for p in kept] + [old_entries[p].sha for p in kept if p in old_entries])
    added = _added_lines(git_dir, base, commit, kept)
    out = []
    for p in kept:
        new = _text(blobs.get(new_entries[p].sha, b""))
        old = _text(blobs.get(old_entries[p].sha, b"")) if p in old_entries else ""
        if new is None or old is None or not added.get(p):
            continue
        out.append(Source(p, language(p) or "", new, old, frozenset(added[p])))
    return out


def _read_literals(git_dir: Path, sizes: dict[str, int], budget: int) -> LiteralSet:
    shas = []
    for sha, size in sizes.items():
        if size <= budget:
            budget -= size
            shas.append(sha)
    literals = LiteralSet()
    for data in _blobs(git_dir, shas).values():
        text = _text(data)
        if text is not None:
            literals.read(text)
    return literals


def known_literals(git_dir: Path, base: str, commit: str,
                    is_test: Callable[[str], bool]) -> tuple[LiteralSet, LiteralSet]:
    """The literals of the test-defining files of both trees (the base's run frozen, the agent's as it left
    them), and of the base's other sources (what the project's code already used), each capped: a file
    over MAX_FILE_BYTES is skipped, MAX_TREE_BYTES read at most."""
    tests: dict[str, int] = {}
    sources: dict[str, int] = {}
    for tree in (base, commit):
        for path, e in _listing(git_dir, tree).items():
            suffix = PurePosixPath(path).suffix.lower()
            if e.size > MAX_FILE_BYTES or (suffix not in LANGUAGES and suffix not in DATA):
                continue
            if is_test(path):
                tests.setdefault(e.sha, e.size)
            elif tree == base and suffix in LANGUAGES:
                sources.setdefault(e.sha, e.size)
    return _read_literals(git_dir, tests, MAX_TREE_BYTES), _read_literals(git_dir, sources, MAX_TREE_BYTES)
