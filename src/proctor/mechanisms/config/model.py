"""The config's types: what config.toml holds once read (`Config` and its tables), with each value's own checks.

Reading the file, overlaying the built-in adapters and saying what is wrong in the user's words is the
loader's (proctor.mechanisms.config.load); this module never reads a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from proctor.mechanisms.adapters.spec import AdapterSpec
from proctor.mechanisms.confine.limits import Limits, total_ram


class BreakerSettings(BaseModel):
    """Per-adapter circuit breaker: `threshold` consecutive failures open it for `cooldown_s`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: int = Field(default=3, ge=1)
    cooldown_s: float = Field(default=300.0, gt=0)
    backoff_s: float = Field(default=60.0, ge=0)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(v: Any) -> int:
    """Bytes from an int or a string like "8GiB", "512 MiB", "64M" (binary units)."""
    if isinstance(v, bool):
        raise ValueError("a size is a number of bytes or a string like \"8GiB\"")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str):
        text = v.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        if unit not in _UNITS or not digits:
            raise ValueError(f"size {v!r}: use bytes or a unit KiB, MiB, GiB, TiB")
        n = int(float(digits) * _UNITS[unit])
    else:
        raise ValueError("a size is a number of bytes or a string like \"8GiB\"")
    if n < 0:
        raise ValueError("a size must not be negative")
    return n


class LimitsSettings(BaseModel):
    """Per-job resource limits (`[limits]`); a job killed at one ends `RESOURCE_LIMIT`. Unset memory sizes
    are fractions of this machine's RAM: a job a third, all jobs together three quarters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory: int | None = None  # default: RAM / 3
    memory_total: int | None = None  # default: RAM * 3 / 4
    swap: int = 0
    pids: int = Field(default=1024, ge=16)
    cpu_weight: int = Field(default=100, ge=1, le=10_000)
    disk: int = 10 << 30

    @field_validator("memory", "memory_total", "swap", "disk", mode="before")
    @classmethod
    def _size(cls, v: Any, info: ValidationInfo) -> int | None:
        if v is None:
            return None
        n = parse_size(v)
        if n < (1 << 20) and info.field_name != "swap":
            raise ValueError("must be at least 1 MiB")
        return n

    def resolve(self) -> Limits:
        ram = total_ram()
        return Limits(memory=self.memory or ram // 3, swap=self.swap, pids=self.pids, cpu_weight=self.cpu_weight,
                      disk=self.disk, memory_total=self.memory_total or ram * 3 // 4)


class QueueSettings(BaseModel):
    """`[queue]`: where the fleet's NATS servers are and how this machine reaches them. `servers` lists any
    of a cluster's nodes (a client fails over to the others); `tls_ca` verifies the servers' certificates
    (required by a `tls://` URL), `tls_cert`/`tls_key` are this machine's client certificate when the server
    asks for one, `nkey_seed` this machine's NKEY seed file (its user's permissions are the server's),
    `name` its identity there (replies come to `_INBOX_<name>`, the only inbox its user may read), `manage`
    whether it creates the stream and buckets (default: only without a seed; a fleet's admin sets it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: list[str] = Field(default_factory=list)
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    manage: bool | None = None
    replicas: int | None = Field(default=None, ge=1, le=5)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    nkey_seed: str | None = None

    @field_validator("servers")
    @classmethod
    def _check_servers(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("nats://", "tls://")) or "," in url:
                raise ValueError(f"{url!r} is not a nats:// or tls:// URL (one a list entry)")
        return v

    @field_validator("tls_ca", "tls_cert", "tls_key", "nkey_seed")
    @classmethod
    def _check_file(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_file():
            raise ValueError(f"{v!r} is not a file")
        return v


class ServeSettings(BaseModel):
    """`[serve]`: who may connect to `proctor serve` (the review page and the HTTP API) over loopback besides
    the install's own user: `allow_uids`, by the uid the kernel says owns the client's socket."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_uids: tuple[int, ...] = ()


class AutoLand(BaseModel):
    """One repo's policy for landing without a person (`[auto_land."<abs repo>"]`), config only: never from a
    request or a repo's own file (proctor.services.review.auto). A job lands when its verdict needs no
    person, rests on at least `basis` and records no risk; a change across the trust line never does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    basis: Literal["exit-code", "base-tests", "held-out", "sealed"] = "base-tests"
    into: str | None = None  # the branch it lands into (default: the job's base branch)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    agents: dict[str, AdapterSpec] = Field(default_factory=dict)
    confine: Literal["auto", "required", "off"] = "auto"
    # An agent CLI whose version is not in its adapter's `tested` list: a risk on the job ("risk"), or the
    # job refused before anything launches ("strict", AGENT_UNTESTED).
    cli_versions: Literal["risk", "strict"] = "risk"
    validate_timeout: int = Field(default=900, ge=1, le=14_400)
    term_grace: float = Field(default=2.0, ge=0, le=60)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    # Per-repo environment keys (`[repos."/abs/path"]`: setup, copy, share, validate, registries), the
    # operator's over the base's committed `.proctor.toml` (proctor.mechanisms.validation.environment).
    repos: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Held-out tests per repo (`[holdout]`, "/abs/repo" = ["/abs/dir", ...]): laid into validation only,
    # never readable by the agent (proctor.mechanisms.evidence.holdout). Config only: never a repo's own file.
    holdout: dict[str, list[str]] = Field(default_factory=dict)
    # Landing without a person, per repo (`[auto_land."/abs/repo"]`); off for every repo it does not name.
    auto_land: dict[str, AutoLand] = Field(default_factory=dict)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    source: str | None = None
    # Host variables every agent gets beside the basics and its adapter's credentials (an adapter's own
    # `env_pass` adds to these); nothing else of the host's environment reaches a job (sandbox_home).
    env_pass: tuple[str, ...] = ()
    # Paths in the user's home ("~/x") the agent may read; the rest of the home is hidden from it, but its
    # toolchains (~/.cargo, ~/.rustup, ...) and the agent's own install.
    read_home: tuple[str, ...] = ()
    # Per built-in adapter the user's config overlays: the keys it set (`env` keys as "env.NAME").
    overlays: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @field_validator("env_pass")
    @classmethod
    def _check_env_pass(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [n for n in v if not n.replace("_", "a").isalnum() or n[0].isdigit()]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an environment variable name")
        return v

    @field_validator("read_home")
    @classmethod
    def _check_read_home(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for entry in v:
            if entry in ("", "~", "~/", ".") or ".." in entry.split("/") or entry.startswith("/"):
                raise ValueError(f"read_home entry {entry!r} must name a path inside the home (\"~/x\")")
        return v

    @field_validator("repos")
    @classmethod
    def _check_repos(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from proctor.mechanisms.config.settings import parse_settings

        for path, table in v.items():
            if not Path(path).is_absolute():
                raise ValueError(f"[repos.{path!r}] must name an absolute path")
            parse_settings(table, f'[repos."{path}"]')
        return v

    @field_validator("holdout")
    @classmethod
    def _check_holdout(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for repo, dirs in v.items():
            if not Path(repo).is_absolute():
                raise ValueError(f"[holdout] {repo!r} must name an absolute repo path")
            for d in dirs:
                if not Path(d).is_absolute():
                    raise ValueError(f"[holdout] {repo!r}: {d!r} must be an absolute directory")
        return v

    @field_validator("auto_land")
    @classmethod
    def _check_auto_land(cls, v: dict[str, AutoLand]) -> dict[str, AutoLand]:
        for repo in v:
            if not Path(repo).is_absolute():
                raise ValueError(f"[auto_land] {repo!r} must name an absolute repo path")
        return v

    def moved(self, repo: Path) -> list[str]:
        """The per-repo tables (`[repos]`, `[holdout]`, `[auto_land]`) naming a path that no longer exists,
        when none names `repo`: a repo that moved from there has lost its settings, held-out tests and policy
        (issue 43), which the person is told rather than left to guess."""
        tables = {"repos": self.repos, "holdout": self.holdout, "auto_land": self.auto_land}
        if any(Path(k).resolve() == repo.resolve() for t in tables.values() for k in t):
            return []
        return [f'[{name}."{k}"]' for name, t in tables.items() for k in t if not Path(k).exists()]

    def auto_land_for(self, repo: Path) -> AutoLand | None:
        return next((p for key, p in self.auto_land.items() if Path(key).resolve() == repo.resolve()), None)

    def holdout_for(self, repo: Path) -> list[str]:
        return [d for key, dirs in self.holdout.items() if Path(key).resolve() == repo.resolve() for d in dirs]

    def adapter(self, name: str) -> AdapterSpec | None:
        return self.agents.get(name)
