"""The command allowlist: a trusted TOML file of what each agent may run, and picking the entry a request fits.

Owns the file shape (closed models: an unknown key is an error, so nothing can be written in), loading it
(the `match` / `not_match` examples of every entry are checked, as Codex's execpolicy does), the ceilings a
file cannot raise, and check 3 (argv matches an entry of that agent; cwd equals the entry's pinned cwd).
It never runs anything and never reads the request from disk. Default file: `$PROCTOR_HOME/commands.toml`.

    version = 1
    protected = ["docs/brief.md"]           # briefs: control plane, never writable, watched for tampering

    [agents.codex]
    write_scopes = ["src/**"]               # the agent's ordinary scoped writes (any entry)

    [[agents.codex.commands]]
    name = "pytest-file"
    argv = ["python3", "-m", "pytest", "-q", {type = "path", globs = ["tests/**"], exists = true}]
    cwd = "."
    writes = [".pytest_cache/**"]
    timeout_s = 120
    env = {PYTHONDONTWRITEBYTECODE = "1"}   # fixed values; env_pass = ["NAME"] passes one from the host
    confinement = {profile = "confined", exec_paths = ["/usr"]}
    read_home = false                       # default: $HOME hidden; $PROCTOR_HOME is, always
    stdin_gates = [{type = "max_bytes", limit = 65536}]
    match = [["python3", "-m", "pytest", "-q", "tests/test_a.py"]]
    not_match = [["python3", "-m", "pytest", "-q", "--rootdir=/"]]
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from proctor.services.commands import globs
from proctor.services.commands.controlplane import ControlPlane, Fingerprint, fingerprint, real
from proctor.services.commands.errors import ProposalError, RequestCode
from proctor.services.commands.gates import Gate
from proctor.services.commands.pattern import Miss, PathContext, TailArg, Token, match
from proctor.home import proctor_home

ALLOWLIST_FILE = "commands.toml"
# Ceilings no allowlist can raise (agentteams capped entry timeouts at 7200 s; so do we).
MAX_COMMAND_TIMEOUT_S = 7200.0
MAX_OUTPUT_BYTES = 1_000_000
NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_CLOSED = ConfigDict(extra="forbid", frozen=True)


class Confinement(BaseModel):
    """How the entry may be confined. `confined`: writes only to its declared write roots, no network."""

    model_config = _CLOSED

    profile: Literal["none", "confined"] = "none"
    exec_paths: list[str] = Field(default_factory=list)
    """Absolute folders the program must live in when it runs confined."""
    required: bool = False
    """Refuse to run this entry unconfined."""

    @model_validator(mode="after")
    def _consistent(self) -> Confinement:
        if self.profile == "confined" and not self.exec_paths:
            raise ValueError("a confined profile needs exec_paths")
        if self.profile == "none" and (self.exec_paths or self.required):
            raise ValueError("exec_paths and required belong to a confined profile")
        for p in self.exec_paths:
            if not os.path.isabs(p) or os.path.normpath(p) == "/":
                raise ValueError(f"exec path {p!r} must be an absolute folder other than /")
        return self


class Entry(BaseModel):
    model_config = _CLOSED

    name: str
    argv: list[Token] = Field(min_length=1)
    cwd: str = "."
    writes: list[str] = Field(default_factory=list)
    timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    max_output_bytes: int = Field(default=MAX_OUTPUT_BYTES, ge=1, le=MAX_OUTPUT_BYTES)
    env: dict[str, str] = Field(default_factory=dict)
    env_pass: list[str] = Field(default_factory=list)
    confinement: Confinement = Field(default_factory=Confinement)
    read_home: bool = False
    """Let the command read the user's home (`$HOME`, the uid's login home, `$XDG_RUNTIME_DIR`), read-only
    where bwrap runs. Off: hidden, but for what the command itself needs there (the project, the program)."""
    stdin_gates: list[Gate] = Field(default_factory=list)
    match: list[list[str]] = Field(default_factory=list)
    not_match: list[list[str]] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"entry name {v!r} must match [A-Za-z0-9._-]+")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str) -> str:
        norm = os.path.normpath(v)
        if os.path.isabs(norm) or norm == ".." or norm.startswith("../") or ".git" in norm.split("/"):
            raise ValueError(f"cwd {v!r} must be a folder inside the project, outside .git")
        return norm

    @field_validator("writes")
    @classmethod
    def _writes(cls, v: list[str]) -> list[str]:
        return [globs.check_glob(g) for g in v]

    @field_validator("env", "env_pass")
    @classmethod
    def _env_names(cls, v: dict[str, str] | list[str]) -> dict[str, str] | list[str]:
        for name in v:
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"environment variable name {name!r} is not valid")
        return v

    @model_validator(mode="after")
    def _pattern(self) -> Entry:
        if not isinstance(self.argv[0], str):
            raise ValueError("argv[0] must be a literal program name, never a placeholder")
        for i, tok in enumerate(self.argv):
            if isinstance(tok, TailArg) and i != len(self.argv) - 1:
                raise ValueError("a tail token may only come last")
        for example in self.match:
            miss = match(self.argv, example, None, self.cwd)
            if miss is not None:
                raise ValueError(f"match example {example} does not match: {miss.reason}")
        for example in self.not_match:
            if match(self.argv, example, None, self.cwd) is None:
                raise ValueError(f"not_match example {example} matches")
        return self

    @property
    def program(self) -> str:
        return str(self.argv[0])


class AgentAllowlist(BaseModel):
    model_config = _CLOSED

    write_scopes: list[str] = Field(default_factory=list)
    """Globs this agent may always declare writes in (the ordinary scoped-write check)."""
    commands: list[Entry] = Field(default_factory=list)

    @field_validator("write_scopes")
    @classmethod
    def _scopes(cls, v: list[str]) -> list[str]:
        return [globs.check_glob(g) for g in v]

    @model_validator(mode="after")
    def _unique(self) -> AgentAllowlist:
        names = [e.name for e in self.commands]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"entry name(s) {dupes} appear more than once")
        return self


class AllowlistFile(BaseModel):
    model_config = _CLOSED

    version: Literal[1] = 1
    protected: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    agents: dict[str, AgentAllowlist] = Field(default_factory=dict)


@dataclass(frozen=True)
class Allowlist:
    """A loaded allowlist, with where it came from so a change during a run can be caught."""

    file: AllowlistFile
    source: Path | None = None
    source_fingerprint: Fingerprint = None

    @staticmethod
    def default_path() -> Path:
        return proctor_home() / ALLOWLIST_FILE

    @classmethod
    def parse(cls, text: str, *, source: Path | None = None) -> Allowlist:
        where = str(source) if source is not None else "allowlist"
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ProposalError(RequestCode.POLICY_INVALID, f"{where}: not valid TOML: {exc}") from None
        try:
            parsed = AllowlistFile.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "file"
            msg = err["msg"].removeprefix("Value error, ")
            raise ProposalError(RequestCode.POLICY_INVALID, f"{where}: {loc}: {msg}") from None
        fp = fingerprint(real(source)) if source is not None else None
        return cls(parsed, real(source) if source is not None else None, fp)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Allowlist:
        """The allowlist at `path` (default `$PROCTOR_HOME/commands.toml`). A missing file is refused: no
        allowlist means nothing may run, and saying so beats an empty default that refuses everything."""
        src = Path(path) if path is not None else cls.default_path()
        try:
            text = src.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise ProposalError(RequestCode.POLICY_INVALID, f"allowlist {src} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ProposalError(RequestCode.POLICY_INVALID, f"allowlist {src}: cannot read: {exc}") from None
        return cls.parse(text, source=src)

    def agent(self, name: str) -> AgentAllowlist:
        found = self.file.agents.get(name)
        if found is None or not found.commands:
            raise ProposalError(RequestCode.NO_ALLOWLIST, f"the allowlist has no commands for agent {name!r}")
        return found

    def select(self, agent: str, argv: list[str], cwd: str, plane: ControlPlane) -> Entry:
        """Check 3: the first entry whose pattern matches `argv` and whose pinned cwd is the requested one."""
        entries = self.agent(agent).commands
        fits: list[Entry] = []
        best: tuple[Miss, Entry] | None = None
        for entry in entries:
            ctx = PathContext(plane, real(plane.project / entry.cwd))
            miss = match(entry.argv, argv, ctx, entry.cwd)
            if miss is None:
                fits.append(entry)
            elif best is None or miss.position > best[0].position:
                best = (miss, entry)
        if not fits:
            assert best is not None
            miss, entry = best
            raise ProposalError(
                miss.code,
                f"argv matches no allowlist entry of agent {agent!r}; closest is {entry.name!r}, {miss.reason}",
            )
        asked = _normalize_cwd(cwd, plane)
        for entry in fits:
            if entry.cwd == asked:
                return entry
        pinned = sorted({e.cwd for e in fits})
        raise ProposalError(
            RequestCode.CWD_MISMATCH,
            f"entry {fits[0].name!r} runs in {pinned[0]!r}" + (f" (others: {pinned[1:]})" if pinned[1:] else "")
            + f"; the request asked for cwd {cwd!r}",
        )


def _normalize_cwd(cwd: str, plane: ControlPlane) -> str | None:
    if os.path.isabs(cwd):
        return plane.relative(real(cwd))
    norm = os.path.normpath(cwd or ".")
    return None if norm == ".." or norm.startswith("../") else norm
