"""Checks whose answers never enter the sandbox: read from a held-out dir's `sealed.toml`, run confined in the
validation checkout, and compared by the host over values it decodes without running code.

    load(path) -> Sealed | str          the pairs and data checks of one file (a str: why it is unusable)
    driver(sealed, nonce) -> str        the Python source the sandbox runs: each pair's expression, its value
                                        reported once as a Python literal of builtins (no expected value in it)
    judge_pairs(sealed, stdout, nonce) / judge_check(check, exit, stdout, files) -> [Outcome]
                                        the host's comparison: each pair reported exactly once, each value
                                        equal to what the file expects, as a person would call equal

A sealed file (TOML, in a `[holdout]` dir, which the agent's sandbox and validation's never see):

    [[pair]]                                        # a library: an expression and its value
    setup = "from calc import add"                  # Python statements run first (optional)
    expr = "add(1234, 4321)"
    expect = 5555                                   # a TOML value; or expect_raises = "ValueError"
    [[check]]                                       # a command: its stdout, exit code, output files
    argv = ["python", "-m", "calc", "2", "3"]
    stdin = ""                                      # optional; `files = {"in.txt" = "..."}` laid in first
    stdout = "5\\n"
    exit = 0                                        # optional; `outputs = {"out.txt" = "..."}` read after

Why it holds where in-process evidence does not: the code under test owns its process (an `__eq__` that is
always true, a patched assertion, a forged report line), so nothing inside it can judge it. Here nothing
inside judges: the values leave as bytes the host decodes with `ast.literal_eval` (size-capped), each pair
must be reported exactly once (a cheat may send many candidates, or none), and the host compares. A cheat
must know the answers to pass, and they never enter the sandbox. An answer a cheat can guess (`True`,
`None`, `0`, an empty output, "raises") still counts but does not make the step `sealed`. It never runs
anything itself.
"""

from __future__ import annotations

import ast
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path, PurePosixPath
from typing import Any

SEALED_FILE = "sealed.toml"  # the name a held-out dir holds its sealed checks under (never laid in)
MAX_FILE = 4 * 1024 * 1024
MAX_LINE = 256 * 1024  # one reported value
MAX_CHECKS = 5000
GUESSABLE = (None, True, False, 0, 1, -1, "", [], {})


@dataclass(frozen=True)
class Pair:
    id: str
    expr: str
    setup: str = ""
    expect: Any = None
    raises: str | None = None

    @property
    def guessable(self) -> bool:
        return self.raises is not None or any(type(self.expect) is type(g) and self.expect == g for g in GUESSABLE)


@dataclass(frozen=True)
class Check:
    id: str
    argv: tuple[str, ...]
    stdin: str = ""
    files: Mapping[str, str] = field(default_factory=dict)
    stdout: str | None = None
    exit: int | None = None
    outputs: Mapping[str, str] = field(default_factory=dict)

    @property
    def guessable(self) -> bool:
        said = [v for v in (self.stdout, *self.outputs.values()) if v is not None]
        return not said or all(v.strip() in ("", "True", "False", "None", "0", "1", "true", "false") for v in said)


@dataclass(frozen=True)
class Sealed:
    pairs: tuple[Pair, ...] = ()
    checks: tuple[Check, ...] = ()

    def __add__(self, other: Sealed) -> Sealed:
        return Sealed(self.pairs + other.pairs, self.checks + other.checks)

    @property
    def count(self) -> int:
        return len(self.pairs) + len(self.checks)


@dataclass(frozen=True)
class Outcome:
    id: str
    passed: bool
    why: str = ""  # for the host's log only: it may hold the expected value
    guessable: bool = False


def _rel(path: str) -> str | None:
    p = PurePosixPath(path)
    return None if p.is_absolute() or ".." in p.parts or not path.strip() else p.as_posix()


def _comparable(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, list):
        return all(_comparable(x) for x in v)
    if isinstance(v, dict):
        return all(_comparable(x) for x in v.values())
    return False


def load(path: Path, prefix: str = "") -> Sealed | str:
    """One sealed file. Every entry is checked before any runs: a bad one makes the file unusable."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE:
            return f"{path} is not a regular file of at most {MAX_FILE} bytes"
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return f"{path} cannot be read: {exc}"
    unknown = sorted(set(data) - {"pair", "check"})
    if unknown:
        return f"{path}: unknown tables {', '.join(unknown)} (known: pair, check)"
    pairs, checks = [], []
    for n, raw in enumerate(data.get("pair") or [], 1):
        if not isinstance(raw, dict) or not isinstance(raw.get("expr"), str) or not raw["expr"].strip():
            return f"{path}: pair {n} needs an `expr` string"
        extra = sorted(set(raw) - {"id", "expr", "setup", "expect", "expect_raises"})
        if extra or ("expect" in raw) == ("expect_raises" in raw):
            return f"{path}: pair {n} needs exactly one of `expect`, `expect_raises` (and no {', '.join(extra)})"
        if "expect" in raw and not _comparable(raw["expect"]):
            return (f"{path}: pair {n}: `expect` must be a number, bool, string, array or table of them (a TOML "
                    "date or time is never a reported value: give its string or its isoformat())")
        pairs.append(Pair(f"{prefix}{raw.get('id') or f'pair-{n}'}", raw["expr"], str(raw.get("setup") or ""),
                          raw.get("expect"), raw.get("expect_raises")))
    for n, raw in enumerate(data.get("check") or [], 1):
        argv = raw.get("argv") if isinstance(raw, dict) else None
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            return f"{path}: check {n} needs `argv`, a list of strings"
        extra = sorted(set(raw) - {"id", "argv", "stdin", "files", "stdout", "exit", "outputs"})
        if extra:
            return f"{path}: check {n}: unknown keys {', '.join(extra)}"
        files, outputs = raw.get("files") or {}, raw.get("outputs") or {}
        for table in (files, outputs):
            if not isinstance(table, dict) or not all(isinstance(v, str) and _rel(k) for k, v in table.items()):
                return f"{path}: check {n}: files and outputs map relative paths to strings"
        if "stdout" not in raw and "exit" not in raw and not outputs:
            return f"{path}: check {n} expects nothing (give stdout, exit or outputs)"
        checks.append(Check(f"{prefix}{raw.get('id') or f'check-{n}'}", tuple(argv), str(raw.get("stdin") or ""),
                            files, raw.get("stdout"), raw.get("exit"), outputs))
    if len(pairs) + len(checks) > MAX_CHECKS:
        return f"{path}: more than {MAX_CHECKS} checks"
    ids = [x.id for x in (*pairs, *checks)]
    if len(set(ids)) != len(ids):
        return f"{path}: check ids repeat"
    return Sealed(tuple(pairs), tuple(checks))


# -- the driver the sandbox runs ----------------------------------------------------------------------------

# Each value is made a literal of builtins before it leaves: the honest types a person compares as numbers,
# text or containers (numpy scalars and arrays, Decimal, Fraction, Enum) become theirs; anything else is
# reported by its repr, which the host compares only with an `expect` that is a string of that repr. The
# driver decides nothing: a cheat that rewrites it can only send bytes, and must send the right ones.
DRIVER = r'''
import sys
NONCE = {nonce!r}
PAIRS = {pairs!r}


def plain(v, depth=0):
    if depth > 50:
        return ("repr", repr(v)[:2000])
    if v is None or type(v) in (bool, int, float, str, bytes, complex):
        return v
    mod = type(v).__module__
    if mod == "numpy" and hasattr(v, "tolist"):
        return plain(v.tolist(), depth + 1)
    if type(v).__name__ == "Decimal" and mod == "decimal":
        return ("decimal", str(v))
    if type(v).__name__ == "Fraction" and mod == "fractions":
        return ("fraction", str(v))
    enum = sys.modules.get("enum")
    if enum is not None and isinstance(v, enum.Enum):
        return ("enum", type(v).__name__ + "." + v.name, plain(v.value, depth + 1))
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [plain(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {{"dict": [[plain(k, depth + 1), plain(x, depth + 1)] for k, x in v.items()]}}
    if isinstance(v, (set, frozenset)):
        return {{"set": [plain(x, depth + 1) for x in v]}}
    return ("repr", repr(v)[:2000])


for i, (setup, expr) in enumerate(PAIRS):
    ns = {{"__name__": "__proctor_sealed__"}}
    try:
        exec(setup, ns)
        out = ("value", plain(eval(expr, ns)))
    except BaseException as exc:
        out = ("raises", type(exc).__name__)
    line = "PROCTOR-SEALED " + NONCE + " " + str(i) + " " + repr(out)
    sys.__stdout__.write(line[:{cap}] + "\n")
    sys.__stdout__.flush()
'''


def driver(sealed: Sealed, nonce: str) -> str:
    return DRIVER.format(nonce=nonce, pairs=[(p.setup, p.expr) for p in sealed.pairs], cap=MAX_LINE)


# -- the host's comparison ----------------------------------------------------------------------------------

def _reported(stdout: bytes, nonce: str) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    head = f"PROCTOR-SEALED {nonce} "
    for raw in stdout.decode("utf-8", "replace").splitlines():
        if not raw.startswith(head) or len(raw) > MAX_LINE:
            continue
        index, _, literal = raw[len(head):].partition(" ")
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            value = ("unreadable", None)
        if index.isascii() and index.isdigit():  # `"²".isdigit()` holds, and int() of it raises
            out.setdefault(int(index), []).append(value)
    return out


def same(expected: Any, got: Any) -> bool:
    """Equal as a person would call it: numbers by value (floats to 1e-9 relative), bools only to bools,
    text exactly, sequences element by element (a tuple equals a TOML array), dicts and sets as such,
    Decimal and Fraction by value, an Enum by its value or its `Name.MEMBER`."""
    if isinstance(got, tuple) and len(got) >= 2 and got[0] in ("decimal", "fraction", "enum", "repr"):
        kind = got[0]
        if kind == "repr":
            return isinstance(expected, str) and expected == got[1]
        if kind == "enum":
            return (isinstance(expected, str) and expected in (got[1], got[1].split(".")[-1])) or same(expected, got[2])
        try:
            from fractions import Fraction

            conv = Decimal if kind == "decimal" else Fraction
            return conv(str(expected)) == conv(got[1])
        except (InvalidOperation, ValueError, ZeroDivisionError):
            return False
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(expected) is bool and type(got) is bool and expected == got
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, float):
            return math.isclose(expected, float(got), rel_tol=1e-9, abs_tol=1e-12)
        # An int is exact: a float only where it is that very integer (`mean` giving 2.0 for 2), never near
        # it (1e20 for 10**20 + 1, 2027.0000001 for 2027).
        return expected == got if isinstance(got, int) else got.is_integer() and int(got) == expected
    if isinstance(got, dict) and set(got) == {"dict"} and isinstance(expected, dict):
        items = got["dict"]
        if not isinstance(items, list) or len(items) != len(expected) or not all(
                isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in items):
            return False
        return all(any(same(k, gk) and same(v, gv) for gk, gv in items) for k, v in expected.items())
    if isinstance(got, dict) and set(got) == {"set"} and isinstance(expected, list):
        items = got["set"]
        return isinstance(items, list) and len(items) == len(expected) and all(
            any(same(e, g) for g in items) for e in expected)
    if isinstance(expected, list) and isinstance(got, list):
        return len(expected) == len(got) and all(same(e, g) for e, g in zip(expected, got))
    if isinstance(expected, str) and isinstance(got, str):
        return expected == got
    return False


def judge_pairs(sealed: Sealed, stdout: bytes, nonce: str) -> list[Outcome]:
    got = _reported(stdout, nonce)
    out = []
    for i, pair in enumerate(sealed.pairs):
        values = got.get(i, [])
        if len(values) != 1:
            out.append(Outcome(pair.id, False, f"reported {len(values)} times, not once", pair.guessable))
            continue
        value = values[0]
        if not (isinstance(value, tuple) and len(value) == 2):
            out.append(Outcome(pair.id, False, "an unreadable report", pair.guessable))
            continue
        kind, v = value
        if pair.raises is not None:
            ok = kind == "raises" and v == pair.raises
            why = "" if ok else f"expected {pair.raises} raised, got {kind} {v!r}"[:500]
        else:
            try:
                ok = kind == "value" and same(pair.expect, v)
            except Exception:  # noqa: BLE001 - the report is the judged code's bytes: any shape that breaks
                ok = False     # the comparison fails the check, and the job goes on
            why = "" if ok else f"expected {pair.expect!r}, got {kind} {v!r}"[:500]
        out.append(Outcome(pair.id, ok, why, pair.guessable))
    return out


def judge_check(check: Check, exit_code: int | None, stdout: bytes, outputs: Mapping[str, bytes | None]) -> Outcome:
    why = []
    if check.exit is not None and exit_code != check.exit:
        why.append(f"exit {exit_code}, expected {check.exit}")
    if check.stdout is not None and stdout.decode("utf-8", "replace") != check.stdout:
        why.append("its stdout differs from the expected")
    for rel, want in check.outputs.items():
        got = outputs.get(rel)
        if got is None or got.decode("utf-8", "replace") != want:
            why.append(f"{rel} is missing or differs")
    return Outcome(check.id, not why, "; ".join(why), check.guessable)


def summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """What may leave the host: counts and opaque ordinals, never ids, expressions or values."""
    failed = [i + 1 for i, o in enumerate(outcomes) if not o.passed]
    return {"checks": len(outcomes), "passed": len(outcomes) - len(failed), "failed": len(failed),
            "failed_ordinals": failed[:20], "sealing": sum(1 for o in outcomes if o.passed and not o.guessable)}

