"""The adapter data shape (one TOML table per agent) and turning it into an argv for one job.

Owns validation of adapter declarations, placeholder expansion and the argv size cap. It never runs
anything: the host spawns what `build()` returns.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proctor.mechanisms.adapters.output import READERS
from proctor.mechanisms.confine.endpoints import parse_endpoint

PLACEHOLDERS = ("{prompt}", "{prompt_file}", "{worktree}")
# The CLIs whose hooks proctor can install (proctor.mechanisms.gatekeeper.service.DIALECTS).
GATE_DIALECTS = ("claude", "codex", "gemini", "opencode")
_PLACEHOLDER_RE = re.compile(r"\{[a-z_]+\}")
# A model endpoint's keys (AdapterSpec.base_url, .api_key_env, .model) as placeholders of endpoint_args/_env.
ENDPOINT_KEYS = ("base_url", "api_key_env", "model")
_ENDPOINT_RE = re.compile(r"\{(base_url|api_key_env|model)\}")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
    # The CLI versions proctor's real-CLI suite passed with, as its `--version` names them
    # (proctor.mechanisms.adapters.versions): another version is a risk on the job, refused under
    # `cli_versions = "strict"`. Empty (a user's own adapter): not compared.
    tested: tuple[str, ...] = ()
    state_dirs: tuple[str, ...] = ()  # the CLI's own state: each job gets a copy of it (proctor.services.job.sandbox_home)
    # The variables that carry the CLI's login (keys, tokens): passed from the host's environment to the
    # agent's process only, never to its version probe, setup or validation (the code under test never
    # needs the model's key). `pool_env` and `api_key_env` are passed the same way.
    credentials: tuple[str, ...] = ()
    # More host variables this agent gets (config's top-level `env_pass` adds to every agent's).
    env_pass: tuple[str, ...] = ()
    # "~/..." paths inside `state_dirs`. `state_keep`: the CLI's login files: a job's change to one (a
    # refresh) is said in the result, never written back (sandbox_home.settle says why).
    # `state_watch`: its config, hooks, MCP servers, extensions: a job's change to one is a risk naming it
    # ("file#key" compares one top-level key of a JSON file the CLI rewrites on every run).
    # `state_skip`: not copied into a job (session records, logs, caches: large, and the user's history).
    state_keep: tuple[str, ...] = ()
    state_watch: tuple[str, ...] = ()
    state_skip: tuple[str, ...] = ()
    # `state_seed`: files (a path ending in "/": a folder) put into the job's copy when the user has none,
    # with this text: what keeps a CLI from fetching its own set-up at every start (opencode's plugin
    # package, which the proxy would refuse: a risk on every job). Never written to the user's own.
    state_seed: dict[str, str] = Field(default_factory=dict)
    # retry = false: a nonzero exit is final (proctor.services.job.attempts): a `git apply` that failed fails again.
    retry: bool = True
    # Exit codes that mean the CLI cannot run as configured (gemini: 41 auth, 52 config): AGENT_MISCONFIGURED,
    # never retried, like its measured texts ("Not logged in", "Invalid auth method selected").
    misconfigured_exit_codes: tuple[int, ...] = ()
    # The CLI's hook dialect (proctor.mechanisms.gatekeeper.service): every tool call it makes is asked of proctor's gate
    # first. `gate_args` install the hook for one job ({gate_dir}: the job's gate dir, outside the worktree;
    # {gate_settings}: the CLI's settings file in it). One of GATE_DIALECTS. None:
    # the CLI has no hook proctor can use; its jobs are UNGATED (confinement alone protects them).
    gate: str | None = None
    gate_args: tuple[str, ...] = ()
    # network = true: the agent's network is the host's egress proxy (proctor.mechanisms.confine.egress), which lets a
    # CONNECT through only to an `egress` entry, "host[:port]" (port 443 unless given); a declared name that
    # resolves to a loopback or private address is refused, a declared IP literal ("127.0.0.1:8443", a
    # local model gateway) is the operator's explicit choice. network = true with no egress reaches nothing,
    # and the result's gaps say so. network = false: no network at all (the proxy is not even bound in).
    network: bool = True
    egress: tuple[str, ...] = ()
    # node_proxy = true: a Node CLI whose HTTP client ignores the proxy variables (grok's OpenAI SDK on node's
    # fetch; node 20 has no NODE_USE_ENV_PROXY) is started with a preload that sends its fetch and http(s)
    # through the egress proxy all the same (proctor/mechanisms/confine/node_proxy.cjs); without it such a
    # CLI, confined, never reaches its model.
    node_proxy: bool = False
    # The credential pool a backend's limit applies to, which the breaker is kept per: `pool` when given,
    # else the adapter's name plus a digest of the values of `pool_env` (API keys, base URLs) as the agent
    # will see them. Two jobs on one key share a backoff; jobs on another key or gateway do not.
    pool: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._@:-]{1,64}$")
    pool_env: tuple[str, ...] = ()
    # A model endpoint other than the CLI's own (a proxy, a self-hosted gateway), by configuration alone: the
    # user sets `base_url`, `api_key_env` (the NAME of the variable holding the key, never the key) and
    # `model`; the adapter declares how its CLI takes them, with {base_url} {api_key_env} {model}
    # placeholders: an `endpoint_args` group (inserted before the command's first option, after the program
    # and its subcommand) or an `endpoint_env` entry is used only when every key it names is set, and a key
    # that no used group or entry takes is refused, never silently ignored. `endpoint_env` lands in `env`.
    base_url: str | None = Field(default=None, pattern=r"^https?://[^\s\"'\\{}]+$")
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    model: str | None = Field(default=None, pattern=r"^[^\s\"'\\{}]+$")
    endpoint_args: tuple[tuple[str, ...], ...] = ()
    endpoint_env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _endpoint_env(cls, data: Any) -> Any:
        """Fold the `endpoint_env` entries whose keys are set into `env`; refuse a key that takes no effect."""
        if not isinstance(data, dict):
            return data
        values = {k: data[k] for k in ENDPOINT_KEYS if isinstance(data.get(k), str) and data[k]}
        groups, templates = data.get("endpoint_args") or (), data.get("endpoint_env") or {}
        if not isinstance(groups, (list, tuple)) or not isinstance(templates, dict) or not all(
                isinstance(g, (list, tuple)) and all(isinstance(t, str) for t in g) for g in groups) or not all(
                isinstance(v, str) for v in templates.values()):
            return data  # the field validators say what is wrong
        used: set[str] = set()
        for where, texts in [*((f"endpoint_args group {list(g)}", g) for g in groups),
                             *((f"endpoint_env.{k}", (v,)) for k, v in templates.items())]:
            keys = {m for t in texts for m in _ENDPOINT_RE.findall(t)}
            if not keys:
                raise ValueError(f"{where} names none of {{base_url}} {{api_key_env}} {{model}}")
            if keys <= values.keys():
                used |= keys
        unused = sorted(values.keys() - used)
        if unused:
            raise ValueError(f"{', '.join(unused)} takes no effect on this adapter: none of its endpoint_args or "
                             "endpoint_env uses it" + (" (with the keys set)" if groups or templates else ""))
        env = {k: _fill(v, values) for k, v in templates.items() if set(_ENDPOINT_RE.findall(v)) <= values.keys()}
        if env and isinstance(data.get("env") or {}, dict):
            data = {**data, "env": {**(data.get("env") or {}), **env}}
        return data

    def env_under(self, home: str) -> dict[str, str]:
        """`env` with a value "~" or "~/x" made one under `home`, the agent's HOME (as state_dirs are)."""
        return {k: home + v[1:] if v == "~" or v.startswith("~/") else v for k, v in self.env.items()}

    def endpoint_command(self) -> tuple[str, ...]:
        """`command` with the `endpoint_args` groups whose keys are set, before its first option."""
        values = {k: getattr(self, k) for k in ENDPOINT_KEYS if getattr(self, k)}
        args = [_fill(t, values) for g in self.endpoint_args
                if {m for t in g for m in _ENDPOINT_RE.findall(t)} <= values.keys() for t in g]
        at = next((i for i, t in enumerate(self.command) if i and t.startswith("-")), len(self.command))
        return (*self.command[:at], *args, *self.command[at:])

    @field_validator("credentials", "env_pass")
    @classmethod
    def _names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not _ENV_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return v

    @model_validator(mode="after")
    def _state_paths(self) -> AdapterSpec:
        dirs = [d.rstrip("/") for d in self.state_dirs]
        for field_name in ("state_keep", "state_watch", "state_skip", "state_seed"):
            for entry in getattr(self, field_name):
                path = entry.split("#", 1)[0]
                if not path.startswith("~/") or ".." in path.split("/") or not any(
                        path == d or path.startswith(d + "/") for d in dirs):
                    raise ValueError(f"{field_name} entry {entry!r} is not a \"~/...\" path inside one of the "
                                     "adapter's state_dirs")
        return self

    @field_validator("gate")
    @classmethod
    def _gate(cls, v: str | None) -> str | None:
        if v is not None and v not in GATE_DIALECTS:
            raise ValueError(f"gate {v!r} is not one of {', '.join(GATE_DIALECTS)}")
        return v

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
        known = (*PLACEHOLDERS, *(f"{{{k}}}" for k in ENDPOINT_KEYS))
        for token in (*(t for g in self.endpoint_args for t in g), *self.endpoint_env.values()):
            for ph in _PLACEHOLDER_RE.findall(token):
                if ph not in known:
                    raise ValueError(f"unknown placeholder {ph} in endpoint_args/endpoint_env (known: "
                                     f"{', '.join(known)})")
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


def pool_key(spec: AdapterSpec, env: dict[str, str]) -> str:
    """The breaker's key for a job of `spec` whose agent sees `env` (see `AdapterSpec.pool`)."""
    if spec.pool:
        return spec.pool
    values = [f"{k}={env[k]}" for k in sorted(set(spec.pool_env)) if env.get(k)]
    # An endpoint given as adapter keys (an argv flag for codex) is a pool of its own, as is its key.
    if spec.base_url:
        values.append(f"base_url={spec.base_url}")
    if spec.api_key_env and env.get(spec.api_key_env) and spec.api_key_env not in spec.pool_env:
        values.append(f"{spec.api_key_env}={env[spec.api_key_env]}")
    if not values:
        return spec.name
    return f"{spec.name}@{hashlib.sha256(chr(0).join(values).encode()).hexdigest()[:12]}"


def _fill(template: str, values: dict[str, str]) -> str:
    return _ENDPOINT_RE.sub(lambda m: values[m.group(1)], template)


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
    spec: AdapterSpec, prompt: str, worktree: Path, prompt_file: Path | None, env: dict[str, str],
    gate_dir: Path | None = None,
) -> Invocation | Refused:
    """The argv for one job (with `gate_args` before its first option when `gate_dir` is given). An argv
    prompt past its cap is refused, never truncated."""
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
    command = spec.endpoint_command()
    if gate_dir is not None and spec.gate_args:
        at = next((i for i, t in enumerate(command) if i and t.startswith("-")), len(command))
        settings = str(gate_dir / f"{spec.gate}-settings.json")
        gate = (t.replace("{gate_settings}", settings).replace("{gate_dir}", str(gate_dir)) for t in spec.gate_args)
        command = (*command[:at], *gate, *command[at:])
    argv = tuple(_PLACEHOLDER_RE.sub(lambda m: values.get(m.group(0), m.group(0)), t) for t in command)
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
