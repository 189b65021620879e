"""Path globs of an allowlist (`writes`, `write_scopes`, path placeholders, gates) over project-relative paths.

Owns one glob dialect: `/` separates segments, `*` and `?` stay inside one segment, `[...]` is a class, `**`
as a whole segment matches zero or more segments. It never touches the filesystem. Python 3.11's fnmatch
lets `*` cross `/`, which would let `build/*` admit `build/../../x`-shaped keys; hence this small dialect.
"""

from __future__ import annotations

import re
from functools import lru_cache

_MAGIC = re.compile(r"[*?\[]")


def check_glob(pattern: str) -> str:
    """A pattern the allowlist may hold: relative, no `..`, no empty segment, not inside `.git`."""
    if not pattern or pattern.startswith("/"):
        raise ValueError(f"glob {pattern!r} must be a non-empty project-relative path")
    parts = pattern.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"glob {pattern!r} has an empty, '.' or '..' segment")
    if ".git" in parts:
        raise ValueError(f"glob {pattern!r} reaches into .git, which is never writable")
    return pattern


def _segment(seg: str) -> str:
    out = []
    i = 0
    while i < len(seg):
        c = seg[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = seg.find("]", i + 2 if seg[i + 1 : i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = seg[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@lru_cache(maxsize=1024)
def compile_glob(pattern: str) -> re.Pattern[str]:
    parts = pattern.split("/")
    rx = ""
    for i, seg in enumerate(parts):
        last = i == len(parts) - 1
        if seg == "**":
            rx += ".*" if last else "(?:[^/]+/)*"
        else:
            rx += _segment(seg) + ("" if last else "/")
    return re.compile(rx)


def matches(pattern: str, path: str) -> bool:
    """Whether the normalized project-relative `path` matches `pattern` (the project root itself is `.`)."""
    return compile_glob(pattern).fullmatch(path) is not None


def literal_root(pattern: str) -> str:
    """The longest leading run of plain segments: the folder (or file) every match lies in; `.` for none."""
    parts = pattern.split("/")
    plain: list[str] = []
    for seg in parts:
        if _MAGIC.search(seg):
            break
        plain.append(seg)
    return "/".join(plain) or "."


def covers_folder(pattern: str, folder: str) -> bool:
    """Whether `pattern` admits every path under `folder` (`folder/**`-shaped, root at or above `folder`)."""
    if not pattern.endswith("/**") and pattern != "**":
        return False
    head = pattern[: -len("/**")] if pattern != "**" else ""
    if _MAGIC.search(head):
        return False
    return head == "" or folder == head or folder.startswith(head + "/")
