"""Argv patterns of the allowlist, and matching one argv against one pattern.

Owns the token vocabulary, designed as Codex's execpolicy prefix rules are: tokens match left to right, a
literal is an exact string, a list of strings is a set of alternatives at that position, and the rule carries
`match` / `not_match` examples checked when the allowlist loads. Where Codex matches any argv the pattern is
a prefix of, a pattern here matches the whole argv; a trailing `tail` token is the explicit, typed and
bounded way to accept more, so a rule never admits an option it did not name. Typed placeholders:

    {type = "path", globs = ["tests/**"], exists = false}   a path inside the project (symlinks followed)
    {type = "int", min = 0, max = 64}                          a decimal integer in range
    {type = "choice", values = ["-q", "-v"]}                   one of these (same as ["-q", "-v"])
    {type = "tail", item = <token>, max = 32}                  0..max more tokens, each matching `item`

It never runs anything and never reads the allowlist file (allowlist does).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proctor.services.commands import globs
from proctor.services.commands.controlplane import ControlPlane, real
from proctor.services.commands.errors import RequestCode

_CLOSED = ConfigDict(extra="forbid", frozen=True)
_INT = re.compile(r"-?[0-9]+")


class PathArg(BaseModel):
    model_config = _CLOSED

    type: Literal["path"]
    globs: list[str] = Field(default_factory=lambda: ["**"], min_length=1)
    """Project-relative globs the resolved path must match."""
    exists: bool = False
    """The path must exist when the request is judged (an input, not an output)."""

    @field_validator("globs")
    @classmethod
    def _globs(cls, v: list[str]) -> list[str]:
        return [globs.check_glob(g) for g in v]


class IntArg(BaseModel):
    model_config = _CLOSED

    type: Literal["int"]
    min: int = 0
    """Negative values read as options to most programs, so they are admitted only when `min` is below 0."""
    max: int | None = None


class ChoiceArg(BaseModel):
    model_config = _CLOSED

    type: Literal["choice"]
    values: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)


Single = Annotated[PathArg | IntArg | ChoiceArg, Field(discriminator="type")]
# Codex's union shorthand: a list of literals at one position. Empty would match nothing, so it is an error.
Alternatives = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


class TailArg(BaseModel):
    model_config = _CLOSED

    type: Literal["tail"]
    item: str | Alternatives | Single
    max: int = Field(default=32, ge=1, le=4096)


Token = str | Alternatives | Annotated[PathArg | IntArg | ChoiceArg | TailArg, Field(discriminator="type")]


@dataclass(frozen=True)
class PathContext:
    """What a path placeholder is judged against; absent when the allowlist loads (syntax only)."""

    plane: ControlPlane
    cwd: Path
    """The real folder the command runs in: relative arguments are resolved from here."""


@dataclass(frozen=True)
class Miss:
    """Why an argv does not match a pattern: where, with which code, in words."""

    position: int
    code: RequestCode
    reason: str


def _path(spec: PathArg, arg: str, ctx: PathContext | None, entry_cwd: str) -> Miss | str | None:
    if arg.startswith("-"):
        return f"{arg!r} looks like an option, not a path"
    if ctx is None:
        lexical = os.path.normpath(os.path.join(entry_cwd, arg))
        if os.path.isabs(lexical) or lexical == ".." or lexical.startswith("../"):
            return f"path {arg!r} leaves the project"
        rel = lexical
    else:
        resolved = real(ctx.cwd / arg)
        found = ctx.plane.relative(resolved)
        if found is None:
            why = f"path {arg!r} resolves to {resolved}, outside the project"
            return Miss(0, RequestCode.ARG_PATH_OUTSIDE_PROJECT, why)
        if ctx.plane.is_protected(resolved):
            return Miss(0, RequestCode.ARG_PATH_PROTECTED, f"path {arg!r} is in the control plane")
        if spec.exists and not os.path.lexists(resolved):
            return f"path {arg!r} does not exist"
        rel = found
    if not any(globs.matches(g, rel) for g in spec.globs):
        return f"path {rel!r} matches none of {spec.globs}"
    return None


def _single(
    spec: str | list[str] | PathArg | IntArg | ChoiceArg, arg: str, ctx: PathContext | None, entry_cwd: str
) -> Miss | str | None:
    """None on a match; else a reason (a plain mismatch) or a Miss carrying a more specific code."""
    if isinstance(spec, str):
        return None if arg == spec else f"expected {spec!r}, got {arg!r}"
    if isinstance(spec, list):
        return None if arg in spec else f"{arg!r} is not one of {spec}"
    if isinstance(spec, ChoiceArg):
        return None if arg in spec.values else f"{arg!r} is not one of {spec.values}"
    if isinstance(spec, IntArg):
        if not _INT.fullmatch(arg):
            return f"{arg!r} is not a decimal integer"
        n = int(arg)
        if n < spec.min or (spec.max is not None and n > spec.max):
            return f"{n} is outside {spec.min}..{'' if spec.max is None else spec.max}"
        return None
    return _path(spec, arg, ctx, entry_cwd)


def match(pattern: Sequence[Token], argv: Sequence[str], ctx: PathContext | None, entry_cwd: str = ".") -> Miss | None:
    """None when `argv` matches `pattern` entirely; else the first position that failed and why."""
    for i, spec in enumerate(pattern):
        if isinstance(spec, TailArg):
            rest = argv[i:]
            if len(rest) > spec.max:
                return Miss(i + spec.max, RequestCode.NOT_ALLOWLISTED, f"more than {spec.max} trailing arguments")
            for j, arg in enumerate(rest):
                why = _single(spec.item, arg, ctx, entry_cwd)
                if why is not None:
                    return _miss(i + j, why)
            return None
        if i >= len(argv):
            return Miss(i, RequestCode.NOT_ALLOWLISTED, f"argv ends after {len(argv)} argument(s); more expected")
        why = _single(spec, argv[i], ctx, entry_cwd)
        if why is not None:
            return _miss(i, why)
    if len(argv) > len(pattern):
        return Miss(len(pattern), RequestCode.NOT_ALLOWLISTED, f"unexpected extra argument {argv[len(pattern)]!r}")
    return None


def _miss(position: int, why: Miss | str) -> Miss:
    if isinstance(why, Miss):
        return Miss(position, why.code, f"argument {position}: {why.reason}")
    return Miss(position, RequestCode.NOT_ALLOWLISTED, f"argument {position}: {why}")
