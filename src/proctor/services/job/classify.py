"""Classifying a finished agent run: rate limited, stalled on an approval, or just failed.

Owns the shared patterns and the rule that applies them: **only a nonzero exit is ever reclassified**. A run
that exits 0 and prints "429" is judged by validation like any other; the text is the model's to control.
It never decides whether a run succeeded; the host does, from the exit code, the diff and validation.

Patterns are the real texts measured from the CLIs here (shared/agent-clis/README.md, research/clis.md)
and reported in their issue threads; adapters add their own in the same data shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from proctor.contract import Status

RATE_LIMIT_PATTERNS: tuple[str, ...] = (
    # A bare "429" is too common (line numbers, sizes); require it beside words of an HTTP status.
    r"(?:status|error|code|http|api)[^\n]{0,24}\b429\b",
    r"\(429\)",
    r"too many requests",
    r"rate[ _-]?limit(?:ed|_error| exceeded| reached|_exceeded)",
    r"exceeded retry limit",
    r"you'?ve hit your (usage )?limit",
    r"usage_limit_reached",
    r"usage limit",
    r"quota exceeded",
    r"exceeded your current quota",
    r"insufficient_quota",
    r"resource_exhausted",
    r"resource has been exhausted",
    r"terminalquotaerror",
    r"you have exhausted your capacity",
    r"overloaded_error",
)

APPROVAL_PATTERNS: tuple[str, ...] = (
    r"approval (is )?required",
    r"requires? (your )?approval",
    r"waiting for (user )?approval",
    r"permission (was )?denied by (the )?user",
    r"needs? (your )?permission",
    r"do you want to (proceed|allow|run)",
    r"allow this (command|action|tool)",
    r"requested permissions? to",
    r"not allowed to run",
)

# The CLI cannot work as configured (no login, a bad key, an auth type it rejects): the same run fails the
# same way again, so it is never retried and the CLI's own line is the summary. Measured texts
# (research/clis.md): claude, gemini (also its exit 41), grok, codex's 401.
MISCONFIGURED_PATTERNS: tuple[str, ...] = (
    r"not logged in[^\n]{0,40}/login",
    r"invalid auth method selected",
    r"please set an auth method",
    r"api key required",
    r"incorrect api key provided",
    r"failed to authenticate",
    r"unexpected status 401",
    r"invalid x-api-key",
)

# Texts that look like a limit but are not: no network means no request was ever rate limited.
NOT_RATE_LIMIT: tuple[str, ...] = (
    r"waiting for network",
    r"unable to connect to api",
    r"failedtoopensocket",
)

RESET_RE = re.compile(r"(?:resets?|try again|retry)(?: (?:at|in|after))?\s+([0-9][^\n\"'·]{0,40})", re.I)


@dataclass(frozen=True)
class Patterns:
    rate_limit: tuple[re.Pattern[str], ...]
    approval: tuple[re.Pattern[str], ...]

    @classmethod
    def build(cls, extra_rate: Iterable[str] = (), extra_approval: Iterable[str] = ()) -> Patterns:
        def comp(ps: Iterable[str]) -> tuple[re.Pattern[str], ...]:
            return tuple(re.compile(p, re.I) for p in ps)

        return cls(comp((*RATE_LIMIT_PATTERNS, *extra_rate)), comp((*APPROVAL_PATTERNS, *extra_approval)))


@dataclass(frozen=True)
class Classification:
    status: Status | None  # rate_limited / approval_required, or None: an ordinary failure
    matched: str | None = None
    retry_after: str | None = None


_NOT_RATE = tuple(re.compile(p, re.I) for p in NOT_RATE_LIMIT)


def classify(exit_code: int | None, text: str, patterns: Patterns) -> Classification:
    """Classify a failed run's output. Exit 0 (or a run that never started) is never reclassified."""
    if exit_code is None or exit_code == 0:
        return Classification(None)
    for p in patterns.rate_limit:
        m = p.search(text)
        if m and not _only_network(text, m):
            reset = RESET_RE.search(text)
            return Classification(Status.rate_limited, m.group(0), reset.group(1).strip() if reset else None)
    for p in patterns.approval:
        m = p.search(text)
        if m:
            return Classification(Status.approval_required, m.group(0))
    return Classification(None)


def _only_network(text: str, m: re.Match[str]) -> bool:
    # "429" inside "Reconnecting... waiting for network" noise would be a false limit; require the match
    # not to sit on a line that is only about connectivity.
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = text[start : end if end >= 0 else len(text)]
    return any(p.search(line) for p in _NOT_RATE)


_MISCONFIGURED = tuple(re.compile(p, re.I) for p in MISCONFIGURED_PATTERNS)


def misconfigured(exit_code: int | None, text: str, exit_codes: Iterable[int] = ()) -> str | None:
    """The CLI's own line saying it cannot run as configured, on a nonzero exit only; an adapter's declared
    exit codes (gemini's 41 auth, 52 config) count too. None: not that."""
    if exit_code is None or exit_code == 0:
        return None
    for p in _MISCONFIGURED:
        m = p.search(text)
        if m:
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            return text[start: end if end >= 0 else len(text)].strip()[:500]
    if exit_code in set(exit_codes):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return (lines[-1][:500] if lines else "") or f"exit {exit_code}, which the adapter declares a misconfiguration"
    return None
