"""The per-repo settings (config.toml `[repos."<path>"]`, `.proctor.toml` at the base): their type and parser.

Below both the config loader and validation, so neither reaches into the other; it imports nothing of proctor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RepoSettings:
    """The per-repo keys (config.toml `[repos."<path>"]`, `.proctor.toml` at the base)."""

    setup: tuple[str, ...] = ()  # shell commands run before the agent and before validation, confined
    copy: tuple[str, ...] = ()  # untracked files of the main checkout copied in (`.env`)
    share: tuple[str, ...] | None = None  # ignored dependency dirs exposed read-only; None: autodetect
    validate: str | None = None  # the repo's test command, over autodetect (not over --validate-cmd)
    registries: tuple[str, ...] = ()  # the only network `setup` reaches (host[:port], through a proxy)
    must_pass: tuple[str, ...] = ()  # test ids every job's run must pass, whatever the base did
    flaky: tuple[str, ...] = ()  # test ids known to fail or flake: never a job's failure, never a risk
    # The rung a verdict must reach for `needs_human_review: false` (exit-code < base-tests < held-out < sealed)
    require_basis: str | None = None
    source: str = ""  # where the keys came from, for risks


def _strs(raw: object, key: str, origin: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ValueError(f"{origin}: {key} must be a string or a list of strings")
    return tuple(raw)


KEYS = ("setup", "copy", "share", "validate", "registries", "must_pass", "flaky", "require_basis")
RUNGS = ("exit-code", "base-tests", "held-out", "sealed")  # what a verdict rests on, weakest first (docs)


def parse_settings(table: Mapping, origin: str) -> RepoSettings:
    """One table of the per-repo keys; an unknown key or a wrong type raises ValueError naming it."""
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ValueError(f"{origin}: unknown keys {', '.join(unknown)} (known: {', '.join(KEYS)})")
    need = table.get("require_basis")
    if need is not None and need not in RUNGS:
        raise ValueError(f"{origin}: require_basis must be one of {', '.join(RUNGS)}")
    val = table.get("validate")
    if val is not None and (not isinstance(val, str) or not val.strip()):
        raise ValueError(f"{origin}: validate must be a non-empty string")
    for p in (*_strs(table.get("copy"), "copy", origin), *_strs(table.get("share"), "share", origin)):
        if p.startswith("/") or ".." in Path(p).parts or not p.strip():
            raise ValueError(f"{origin}: {p!r} must be a relative path inside the repo")
    return RepoSettings(setup=_strs(table.get("setup"), "setup", origin),
                        copy=_strs(table.get("copy"), "copy", origin),
                        share=_strs(table.get("share"), "share", origin) if "share" in table else None,
                        validate=val, registries=_strs(table.get("registries"), "registries", origin),
                        must_pass=_strs(table.get("must_pass"), "must_pass", origin),
                        flaky=_strs(table.get("flaky"), "flaky", origin), require_basis=need, source=origin)
