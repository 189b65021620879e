"""The adapter data shape (one TOML table per agent) and turning it into an argv for one job.

Owns validation of adapter declarations, placeholder expansion and the argv size cap. It never runs
anything: the host spawns what `build()` returns.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proctor.adapters.output import READERS
from proctor.confine.egress import parse_endpoint

PLACEHOLDERS = ("{prompt}", "{prompt_file}", "{worktree}")
_PLACEHOLDER_RE = re.compile(r"\{[a-z_]+\}")


def max_arg_strlen() -> int:
    """The kernel's cap on ONE argv string, NUL included (Linux: MAX_ARG_STRLEN = 32 pages).

    Exceeding it fails execve with E2BIG however small the total is, so it binds before ARG_MAX does.
    """
    if sys.platform.startswith("linux"):
        return 32 * os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_ARG_MAX")


def arg_max() -> int:
    return os.sysconf("SC_ARG_MAX")


class AdapterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    command: tuple[str, ...] = Field(min_length=1)
    prompt: Literal["stdin", "argv", "file"] = "argv"
    max_prompt_bytes: int | None = Field(default=None, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    rate_limit_patterns: tuple[str, ...] = ()
    approval_patterns: tuple[str, ...] = ()
    output: str = "text"
    version_args: tuple[str, ...] | None = None
    state_dirs: tuple[str, ...] = ()  # the CLI's own state, writable under confinement
    # network = true: the agent's network is the host's egress proxy (proctor.confine.egress), which lets a
    # CONNECT through only to an `egress` entry, "host[:port]" (port 443 unless given); a declared name that
    # resolves to a loopback or private address is refused, a declared IP literal ("127.0.0.1:11434", a
    # local model gateway) is the operator's explicit choice. network = true with no egress reaches nothing,
    # and the result's gaps say so. network = false: no network at all (the proxy is not even bound in).
    network: bool = True
    egress: tuple[str, ...] = ()

    @field_validator("egress")
    @classmethod
    def _egress(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(parse_endpoint(e)) for e in v)

    @field_validator("output")
    @classmethod
    def _reader(cls, v: str) -> str:
        if v not in READERS:
            raise ValueError(f"output {v!r} is not one of {', '.join(sorted(READERS))}")
        return v

    @field_validator("rate_limit_patterns", "approval_patterns")
    @classmethod
    def _regexes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} is not a valid regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _placeholders(self) -> AdapterSpec:
        for token in self.command:
            for ph in _PLACEHOLDER_RE.findall(token):
                if ph not in PLACEHOLDERS:
                    raise ValueError(f"unknown placeholder {ph} in command (known: {', '.join(PLACEHOLDERS)})")
        joined = " ".join(self.command)
        if self.prompt == "argv" and "{prompt}" not in joined:
            raise ValueError('prompt = "argv" needs a {prompt} placeholder in command')
        if self.prompt == "file" and "{prompt_file}" not in joined:
            raise ValueError('prompt = "file" needs a {prompt_file} placeholder in command')
        if self.prompt != "argv" and self.max_prompt_bytes is not None:
            raise ValueError("max_prompt_bytes applies to prompt = \"argv\" only")
        if self.egress and not self.network:
            raise ValueError("egress hosts need network = true")
        return self


@dataclass(frozen=True)
class Invocation:
    argv: tuple[str, ...]
    stdin: bytes | None


@dataclass(frozen=True)
class Refused:
    """The job cannot be expressed as an argv on this platform; nothing is launched."""

    reason: str
    code: str  # a contract Code value: PROMPT_TOO_LARGE or INVALID_REQUEST


def build(
    spec: AdapterSpec, prompt: str, worktree: Path, prompt_file: Path | None, env: dict[str, str]
) -> Invocation | Refused:
    """The argv for one job. An argv prompt past its cap is refused, never truncated."""
    data = prompt.encode("utf-8")
    if spec.prompt == "argv" and "\0" in prompt:
        return Refused("the task contains a NUL byte, which no argv can carry; use a stdin or file adapter",
                       "INVALID_REQUEST")
    bad_env = [k for k, v in env.items() if "\0" in k or "\0" in v or "=" in k]
    if bad_env:
        return Refused(f"environment variable {bad_env[0][:60]!r} cannot be passed to a process", "INVALID_REQUEST")
    if spec.prompt == "argv":
        cap = min(spec.max_prompt_bytes or max_arg_strlen() - 1, max_arg_strlen() - 1)
        if len(data) > cap:
            return Refused(
                f"prompt is {len(data)} bytes; agent {spec.name!r} takes it in argv, capped at {cap} bytes "
                "(refused, not truncated: use a stdin or file adapter for larger tasks)", "PROMPT_TOO_LARGE"
            )
    values = {"{prompt}": prompt, "{worktree}": str(worktree), "{prompt_file}": str(prompt_file or "")}
    argv = tuple(_PLACEHOLDER_RE.sub(lambda m: values.get(m.group(0), m.group(0)), t) for t in spec.command)
    for token in argv:
        if len(token.encode("utf-8")) + 1 > max_arg_strlen():
            return Refused(f"an argument of {len(token.encode())} bytes exceeds the platform's "
                           f"single-argument limit of {max_arg_strlen() - 1} bytes", "PROMPT_TOO_LARGE")
    total = sum(len(t.encode("utf-8")) + 1 for t in argv)
    total += sum(len(k) + len(v) + 2 for k, v in env.items())
    if total > arg_max() - 4096:
        return Refused(f"argv and environment total {total} bytes, over the platform's ARG_MAX {arg_max()}",
                       "PROMPT_TOO_LARGE")
    return Invocation(argv, data if spec.prompt == "stdin" else None)
