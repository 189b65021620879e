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
from proctor.mechanisms.evidence.signals.scan import DATA, LANGUAGES, Literal, Source, language, scan
from proctor.mechanisms.git.command import LITERAL_PATHS, git

MAX_FILE_BYTES = 4 << 20  # a source or test file larger than this is not read (said as a risk when changed)
MAX_SOURCE_BYTES = 32 << 20  # the agent's changed sources read in all (both versions)
MAX_TREE_BYTES = 20 << 20  # test files, and the base's other sources, read for their literals
MAX_FILES = 2000


@dataclass(frozen=True)
class Entry:
    mode: str
    sha: str
    size: int


@dataclass(frozen=True)
class Unread:
    """A changed file the signals did not read, and why: a signal that could not look fails closed."""
    path: str
    why: str


def _listing(git_dir: Path, tree: str, paths: Sequence[str] | None = None, *, sizes: bool = True) -> dict[str, Entry]:
    """path -> entry of each regular file or symlink of `tree` under `paths` (literal; None: the whole tree,
    and no path is nothing: a no-op job's empty list listed both whole trees, 80 ms of its 229). Without
    `sizes` each entry's size is -1: git reads every blob's header for `-l`, a cost per file of the tree
    (23 ms at 2,000 loose objects, measured 2026-12-07) that a caller sizing a few of them spends on all."""
    if paths is not None and not paths:
        return {}
    args = ["ls-tree", "-r", "-z", *(["-l"] if sizes else []), "--full-tree", tree]
    res = git([*args, "--", *paths] if paths else args, git_dir=git_dir, env=LITERAL_PATHS)
    out: dict[str, Entry] = {}
    if not res.ok:
        return out
    for raw in res.out.split(b"\0"):
        meta, sep, name = raw.partition(b"\t")
        fields = meta.decode("ascii", "replace").split()
        if not sizes and len(fields) == 3:
            fields.append("-1")
        if sep and len(fields) == 4 and fields[1] == "blob" and fields[0] in ("100644", "100755", "120000") \
                and fields[3].lstrip("-").isdigit():
            out[name.decode("utf-8", "surrogateescape")] = Entry(fields[0], fields[2], int(fields[3]))
    return out


def _cat_file(git_dir: Path, option: str, shas: Iterable[str]) -> bytes:
    """`git cat-file OPTION`'s answer for each sha once, in order (nothing asked: nothing run)."""
    wanted = list(dict.fromkeys(shas))
    if not wanted:
        return b""
    return git(["cat-file", option], git_dir=git_dir, input_bytes=("\n".join(wanted) + "\n").encode()).out


def _sizes(git_dir: Path, shas: Iterable[str]) -> dict[str, int]:
    """sha -> size of each blob, from its header alone."""
    out: dict[str, int] = {}
    for line in _cat_file(git_dir, "--batch-check", shas).splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[2].isdigit():  # "<sha> missing" is left out: nothing to read
            out[fields[0].decode()] = int(fields[2])
    return out


def _blobs(git_dir: Path, shas: Iterable[str]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    data, pos = _cat_file(git_dir, "--batch", shas), 0
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
                    is_test: Callable[[str], bool]) -> tuple[list[Source], list[Unread]]:
    """The changed sources (both versions, the lines added), and every changed file the signals did not
    read that can run, with why: over a cap, a symlink, binary, compiled code (a `calc.cpython-312-*.so`
    beside `calc.py` is imported before it). A file of no language the rules read is data: checked by
    `data_files` for code that runs it."""
    candidates = [p for p in dict.fromkeys(changed) if not is_test(p) and "\n" not in p]
    unread: list[Unread] = []
    new_entries = _listing(git_dir, commit, candidates[:MAX_FILES * 4])
    old_entries = _listing(git_dir, base, [p for p in candidates[:MAX_FILES * 4] if language(p)])
    budget, kept = MAX_SOURCE_BYTES, []
    for p in candidates:
        e, o = new_entries.get(p), old_entries.get(p)
        if e is None:
            continue  # deleted: nothing of it runs
        if e.mode == "120000":
            unread.append(Unread(p, "a symlink (the signals read no file through it)"))
            continue
        if not language(p):
            if COMPILED.search(p):
                unread.append(Unread(p, "compiled code (the signals read no source of it)"))
            continue
        if len(kept) >= MAX_FILES:
            unread.append(Unread(p, f"past the {MAX_FILES} files the signals read"))
            continue
        size = e.size + (o.size if o else 0)
        if e.size > MAX_FILE_BYTES or (o is not None and o.size > MAX_FILE_BYTES):
            unread.append(Unread(p, f"over {MAX_FILE_BYTES >> 20} MiB"))
            continue
        if size > budget:
            unread.append(Unread(p, f"past the {MAX_SOURCE_BYTES >> 20} MiB the signals read"))
            continue
        budget -= size
        kept.append(p)
    blobs = _blobs(git_dir, [new_entries[p].sha for p in kept] + [old_entries[p].sha for p in kept if p in old_entries])
    added = _added_lines(git_dir, base, commit, kept)
    out = []
    for p in kept:
        new = _text(blobs.get(new_entries[p].sha, b""))
        old = _text(blobs.get(old_entries[p].sha, b"")) if p in old_entries else ""
        if new is None or old is None:
            unread.append(Unread(p, "binary"))
            continue
        if not added.get(p):
            continue
        out.append(Source(p, language(p) or "", new, old, frozenset(added[p])))
    return out, unread


COMPILED = re.compile(r"\.(?:so|pyd|dll|dylib|pyc|pyo|node|wasm|jar|class|a|o)$|\.so\.\d[\d.]*$", re.I)


def data_files(changed: Sequence[str], sources: Sequence[Source], is_test: Callable[[str], bool]) -> list[str]:
    """Changed files the rules cannot read (no language) that a changed source names in a string it added:
    data the code under test loads or executes (`exec(open("calc.impl").read())`)."""
    data = [p for p in changed if not language(p) and not is_test(p)]
    if not data:
        return []  # nothing to name: the sources are not scanned a second time (the rules scan them too)
    named = [(PurePosixPath(src.path).parent, lit.value) for src in sources for lit in _added_strings(src)]
    out = []
    for p in data:
        path = PurePosixPath(p)
        for where, s in named:
            # The file's name or path, or (beside the code that names it) its extension: `__file__[:-3] + '.impl'`
            if s == p or s == path.name or s.endswith("/" + path.name) or (
                    s.startswith(".") and path.name.endswith(s) and path.parent == where):
                out.append(p)
                break
    return out


RUNS = re.compile(r"\b(?:exec|eval|compile|runpy|run_path|import_module|spec_from_file_location|SourceFileLoader"
                  r"|exec_module|load_source|marshal|pickle|dill|cloudpickle|vm\.run\w*|new\s+Function|require)\b")


def _added_strings(src: Source) -> list[Literal]:
    """The string literals on the lines the agent added that execute or unpickle what they name: data the
    code runs (`exec(open(... + '.impl').read())`), not data it reads (a zoneinfo tarball, a stylesheet)."""
    scanned = scan(src.new, src.lang)
    runs = [scanned.line(n) for n in src.added if RUNS.search(scanned.line(n))]
    if not runs:
        return []
    # Code that executes text (`exec`, `eval`, a loader) anywhere in what the agent added: every path it added
    # counts, however the text reaches the call (`with open(IMPL) as f: exec(f.read())`, a helper taking the
    # source, two steps through names: found in review).
    executes = any(EXECS.search(r) for r in runs)

    def executed(line: int) -> bool:
        code = scanned.line(line)
        if executes or RUNS.search(code):
            return True
        # A name bound to it (`IMPL = "calc.impl"`, `const IMPL = ...`) that a running line uses.
        bound = BINDS.match(code)
        return bound is not None and any(re.search(rf"(?<![\w.$]){re.escape(bound.group(1))}\b", r) for r in runs)
    return [lit for lit in scanned.strings if lit.line in src.added and len(lit.value) >= 3 and executed(lit.line)]


BINDS = re.compile(r"^\s*(?:(?:export\s+)?(?:const|let|var)\s+)?([A-Za-z_$][\w$]*)\s*(?::[^=]*)?=(?!=)")
EXECS = re.compile(r"(?<![\w.$])(?:exec|eval|compile)\s*\(|\brunpy\b|\brun_path\b|\bexec_module\b|\bload_source\b"
                   r"|\bSourceFileLoader\b|\bmarshal\s*\.\s*loads?\b|\b(?:c?[Pp]ickle|dill|cloudpickle)\s*\.\s*loads?\b"
                   r"|\bvm\s*\.\s*run\w*|\bnew\s+Function\b")


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


def known_literals(git_dir: Path, base: str, commit: str, is_test: Callable[[str], bool],
                   changed: Sequence[str] | None = None) -> tuple[LiteralSet, LiteralSet]:
    """The literals of the test-defining files of both trees (the base's run frozen, the agent's as it left
    them), and of the base's other sources (what the project's code already used), each capped: a file
    over MAX_FILE_BYTES is skipped, MAX_TREE_BYTES read at most. `changed`: every path whose entry differs
    between the two (the host's own diff), so only those of `commit` are listed: the rest are the base's."""
    tests: dict[str, None] = {}
    sources: dict[str, None] = {}
    for tree in (base, commit):
        if tree == commit and changed is not None and len(changed) <= MAX_FILES:
            listed = _listing(git_dir, commit, changed, sizes=False)
        else:
            listed = _listing(git_dir, tree, sizes=False)
        for path, e in listed.items():
            suffix = PurePosixPath(path).suffix.lower()
            if suffix not in LANGUAGES and suffix not in DATA:
                continue
            if is_test(path):
                tests.setdefault(e.sha)
            elif tree == base and suffix in LANGUAGES:
                sources.setdefault(e.sha)
    size = _sizes(git_dir, [*tests, *sources])

    def capped(shas: dict[str, None]) -> dict[str, int]:
        return {sha: size[sha] for sha in shas if sha in size and size[sha] <= MAX_FILE_BYTES}

    return (_read_literals(git_dir, capped(tests), MAX_TREE_BYTES),
            _read_literals(git_dir, capped(sources), MAX_TREE_BYTES))


def declared_entry_points(git_dir: Path, commit: str) -> list[str]:
    """`module:function` of every program the package at `commit` declares: pyproject's [project.scripts]
    and [project.gui-scripts], its console_scripts entry points, setup.cfg's console_scripts."""
    import configparser
    import tomllib

    listing = _listing(git_dir, commit, ["pyproject.toml", "setup.cfg"])
    blobs = _blobs(git_dir, [e.sha for e in listing.values() if e.size <= MAX_FILE_BYTES])
    out: list[str] = []
    py = listing.get("pyproject.toml")
    if py is not None and py.sha in blobs:
        try:
            data = tomllib.loads(blobs[py.sha].decode("utf-8", "replace"))
        except tomllib.TOMLDecodeError:
            data = {}
        project = data.get("project") if isinstance(data.get("project"), dict) else {}
        tables = [project.get("scripts"), project.get("gui-scripts"),
                  (project.get("entry-points") or {}).get("console_scripts") if isinstance(
                      project.get("entry-points"), dict) else None]
        poetry = ((data.get("tool") or {}).get("poetry") or {}) if isinstance(data.get("tool"), dict) else {}
        tables.append(poetry.get("scripts") if isinstance(poetry, dict) else None)
        out += [v for t in tables if isinstance(t, dict) for v in t.values() if isinstance(v, str)]
    cfg = listing.get("setup.cfg")
    if cfg is not None and cfg.sha in blobs:
        parser = configparser.ConfigParser()
        try:
            parser.read_string(blobs[cfg.sha].decode("utf-8", "replace"))
            raw = parser.get("options.entry_points", "console_scripts", fallback="")
        except configparser.Error:
            raw = ""
        out += [line.split("=", 1)[1].strip() for line in raw.splitlines() if "=" in line]
    return out
