"""Stdin gates: checks an allowlist entry registers, which content must pass before it reaches a command.

Owns the closed set of gate kinds and judging one `StdinContent` against them. Gates are data, not code
from the agent: they parse or scan the content in this process and never run it, and they never touch disk.

    {type = "max_bytes", limit = 65536}             UTF-8 size at most `limit`
    {type = "path_glob", globs = ["data/*.json"]}   the content's project path matches a glob
    {type = "deny_regex", patterns = ["(?i)secret"]} no pattern is found anywhere in the content
    {type = "json"} / {type = "toml"}               the content parses
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proctor.services.commands import globs
from proctor.services.commands.request import StdinContent

_CLOSED = ConfigDict(extra="forbid", frozen=True)


class MaxBytes(BaseModel):
    model_config = _CLOSED
    type: Literal["max_bytes"]
    limit: int = Field(ge=0)

    def judge(self, stdin: StdinContent, rel_path: str) -> str | None:
        size = len(stdin.content.encode("utf-8"))
        return None if size <= self.limit else f"content is {size} bytes, over the gate's {self.limit}"


class PathGlob(BaseModel):
    model_config = _CLOSED
    type: Literal["path_glob"]
    globs: list[str] = Field(min_length=1)

    @field_validator("globs")
    @classmethod
    def _globs(cls, v: list[str]) -> list[str]:
        return [globs.check_glob(g) for g in v]

    def judge(self, stdin: StdinContent, rel_path: str) -> str | None:
        if any(globs.matches(g, rel_path) for g in self.globs):
            return None
        return f"content path {rel_path!r} matches none of {self.globs}"


class DenyRegex(BaseModel):
    model_config = _CLOSED
    type: Literal["deny_regex"]
    patterns: list[str] = Field(min_length=1)

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for p in v:
            re.compile(p)
        return v

    def judge(self, stdin: StdinContent, rel_path: str) -> str | None:
        for p in self.patterns:
            if re.search(p, stdin.content):
                return f"content matches the denied pattern {p!r}"
        return None


class Json(BaseModel):
    model_config = _CLOSED
    type: Literal["json"]

    def judge(self, stdin: StdinContent, rel_path: str) -> str | None:
        try:
            json.loads(stdin.content)
        except ValueError as exc:
            return f"content is not JSON: {exc}"
        return None


class Toml(BaseModel):
    model_config = _CLOSED
    type: Literal["toml"]

    def judge(self, stdin: StdinContent, rel_path: str) -> str | None:
        try:
            tomllib.loads(stdin.content)
        except tomllib.TOMLDecodeError as exc:
            return f"content is not TOML: {exc}"
        return None


Gate = Annotated[MaxBytes | PathGlob | DenyRegex | Json | Toml, Field(discriminator="type")]


def first_failure(gates: Sequence[Gate], stdin: StdinContent, rel_path: str) -> str | None:
    """The first gate the content fails, in the entry's order, as a message; None when all pass."""
    for i, gate in enumerate(gates):
        why = gate.judge(stdin, rel_path)
        if why is not None:
            return f"stdin gate {i} ({gate.type}): {why}"
    return None
