"""The cheat signals of one diff as risks for a person to read: every rule run over the added lines of each
changed source, one finding per line and kind, at most MAX_RISKS and a tail. A failure to read the diff is
itself said as a signal, never the job's end.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.evidence.signals.commits import (Unread, changed_sources, data_files, declared_entry_points,
                                                         known_literals)
from proctor.mechanisms.evidence.signals.literals import LiteralSet, copied_literals
from proctor.mechanisms.evidence.signals.rules import Frames, ends_process, frames, is_entry_file, reads_caller
from proctor.mechanisms.evidence.signals.scan import Source, scan
from proctor.mechanisms.evidence.signals.state import braced_state, python_state
from proctor.mechanisms.evidence.signals.tamper import tampers

PREFIX = "cheat signal: "
MAX_RISKS = 20
CODE_CHARS = 80


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str
    code: str

    def risk(self) -> str:
        return f"{PREFIX}{self.path}:{self.line}: {self.what} ({self.code})"


def _excerpt(raw: str) -> str:
    text = raw.strip().encode("unicode_escape").decode("ascii")
    return text if len(text) <= CODE_CHARS else text[:CODE_CHARS - 1] + "…"


def _parse(text: str) -> ast.AST | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _rust_test_start(code: list[str]) -> int | None:
    """The first line of a Rust file's `#[cfg(test)]` module: the lines from there on are tests."""
    for n, line in enumerate(code, 1):
        if re.match(r"^\s*#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", line):
            return n
    return None


def _signals(src: Source, tests: LiteralSet, sources: LiteralSet, entry_points: Sequence[str] = (),
             tree: ast.AST | None = None, flow: Frames | None = None) -> list[tuple[int, str]]:
    new, old = scan(src.new, src.lang), scan(src.old, src.lang)
    added = src.added
    if src.lang == "rust":
        start = _rust_test_start(new.code)
        if start is not None:
            added = frozenset(n for n in added if n < start)
    old_tree = _parse(src.old) if src.lang == "python" and src.old else None
    lines = sorted(added)
    found = [*reads_caller(src, new, lines, tree, flow), *ends_process(src, new, old, tree, lines, entry_points),
             *tampers(src, new, tree, lines, entry=is_entry_file(src, old))]
    if src.lang == "python":
        found += python_state(src, new, old, tree, old_tree, added)
    else:
        found += braced_state(src, new, old, added)
    found += copied_literals(new, old, tests, sources, added)
    return found


def _rust_inline_tests(sources: Sequence[Source], tests: LiteralSet) -> None:
    """A Rust file's own `#[cfg(test)]` module holds tests too: its literals count as the tests'."""
    for src in sources:
        if src.lang == "rust":
            code = src.new.split("\n")
            start = _rust_test_start(code)
            if start is not None:
                tests.read("\n".join(code[start - 1:]))


def diff_signals(git_dir: Path, base: str, commit: str, changed: Sequence[str],
                 is_test: Callable[[str], bool]) -> list[str]:
    """Cheat signals in what `commit` adds over `base` to the non-test source files among `changed`, as
    risks naming file and line: "cheat signal: PATH:LINE: WHAT (CODE)", at most MAX_RISKS and a tail."""
    try:
        sources, unread = changed_sources(git_dir, base, commit, changed, is_test)
        said = _unread(unread) + _loaded(data_files(changed, sources, is_test))
        if not sources:
            return said
        tests, known = known_literals(git_dir, base, commit, is_test, changed)
        entry_points = declared_entry_points(git_dir, commit)
        _rust_inline_tests(sources, tests)
        trees = {src.path: _parse(src.new) if src.lang == "python" else None for src in sources}
        # A function of one changed file that hands back its caller's frame is a read wherever it is called.
        getters: frozenset[str] = frozenset()
        for _ in range(4):  # a getter's caller that hands its answer on is one too (`_name()` returns `_caller()`)
            flows = {p: frames(t, getters) for p, t in trees.items() if t is not None}
            more = getters.union(*(f.getters for f in flows.values()))
            if more == getters:
                break
            getters = more
        else:
            flows = {p: frames(t, getters) for p, t in trees.items() if t is not None}
        findings: list[Finding] = []
        for src in sources:
            seen: set[tuple[int, str]] = set()
            lines = src.new_lines
            for n, what in sorted(_signals(src, tests, known, entry_points, trees[src.path], flows.get(src.path)),
                                  key=lambda f: f[0]):
                kind = what.split(":")[0].split(" through")[0]
                if (n, kind) in seen:
                    continue  # one finding per line and kind
                seen.add((n, kind))
                findings.append(Finding(src.path, n, what, _excerpt(lines[n - 1] if 0 < n <= len(lines) else "")))
    except Exception as exc:  # noqa: BLE001 - a signal is a hint: its failure is said, never the job's end
        return [f"{PREFIX}the diff could not be read for cheat signals: {exc}"]
    risks = said + [f.risk() for f in findings[:MAX_RISKS]]
    if len(findings) > MAX_RISKS:
        risks.append(f"{PREFIX}(+{len(findings) - MAX_RISKS} more)")
    return risks


def _unread(unread: Sequence[Unread]) -> list[str]:
    """Fail closed: a changed file the signals could not read is one a person must (the hard-code padded
    past the size cap, hundreds of dummy files before the real one, the module turned a symlink)."""
    if not unread:
        return []
    shown = ", ".join(f"{u.path} ({u.why})" for u in unread[:5])
    more = f" (+{len(unread) - 5} more)" if len(unread) > 5 else ""
    return [f"{PREFIX}changed files the signals did not read, for a person to: {shown}{more}"]


def _loaded(paths: Sequence[str]) -> list[str]:
    if not paths:
        return []
    more = f" (+{len(paths) - 5} more)" if len(paths) > 5 else ""
    return [f"{PREFIX}data the changed code names and may load or run, which no rule reads: "
            f"{', '.join(paths[:5])}{more}"]
