"""Reading an agent CLI's own output: its final message (-> summary), its claim (-> claimed_status) and the
usage it reports (-> usage, what the spend governor settles a booking with).

Owns one reader per output format and the structured events that may end a run early. A claim decides
nothing: the host judges by exit code, diff and validation. Measured traps (shared/agent-clis/README.md):
claude prints `"subtype":"success"` beside `"is_error":true`, so `subtype` is never read; grok exits 0 on
HTTP errors and says so only in prose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

SUMMARY_CHARS = 4000


@dataclass(frozen=True)
class Backend:
    """What the CLI's own protocol said of its model API: an HTTP status in a field of an error event, never
    read from prose. The only input that may move the breaker beyond an exit code."""

    status: int
    source: str  # the event and field it came from, e.g. "result.api_error_status"


@dataclass(frozen=True)
class Usage:
    """What a run used, as a field of the CLI's own protocol states it (claude's `result.usage` and
    `total_cost_usd`, codex's `turn.completed.usage`, gemini's `result.stats`); never read from prose.
    `tokens_in` counts cached input too (`tokens_cached` says how much of it was); `usd` is None when the
    CLI states no cost (codex and gemini do not); `tokens_stated` is False when it stated a cost but no
    tokens (the counts are then zeros, not a report, and a settlement keeps the token estimate)."""

    tokens_in: int
    tokens_out: int
    usd: float | None
    source: str
    tokens_cached: int = 0
    tokens_stated: bool = True

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    def plus(self, other: Usage | None) -> Usage:
        """Two attempts of one job, added up (a retried run spent on both)."""
        if other is None:
            return self
        usd = None if self.usd is None and other.usd is None else (self.usd or 0.0) + (other.usd or 0.0)
        source = self.source if other.source == self.source else f"{self.source}+{other.source}"
        return Usage(self.tokens_in + other.tokens_in, self.tokens_out + other.tokens_out, usd, source,
                     self.tokens_cached + other.tokens_cached, self.tokens_stated and other.tokens_stated)

    def as_dict(self) -> dict[str, Any]:
        if not self.tokens_stated:
            return {"tokens_in": None, "tokens_out": None, "tokens_cached": None, "usd": self.usd,
                    "source": self.source}
        return {"tokens_in": self.tokens_in, "tokens_out": self.tokens_out, "tokens_cached": self.tokens_cached,
                "usd": self.usd, "source": self.source}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _cost(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value < float("inf") else None


def _tokens(fields: dict[str, Any], inputs: tuple[str, ...], outputs: tuple[str, ...],
            cached: tuple[str, ...]) -> tuple[int, int, int] | None:
    """Sums of the named counters; None when the object holds none of them (the CLI said nothing)."""
    def total(keys: tuple[str, ...]) -> tuple[int, bool]:
        found = [n for k in keys if (n := _count(fields.get(k))) is not None]
        return sum(found), bool(found)

    (tin, a), (tout, b), (tcached, _) = total(inputs), total(outputs), total(cached)
    return (tin, tout, tcached) if a or b else None


@dataclass(frozen=True)
class Reading:
    summary: str = ""
    claimed_status: str | None = None  # "completed" | "failed" as the agent itself reported
    retry_after: str | None = None
    # The CLI's own error reports (error events, an is_error result), never the model's ordinary prose:
    # what classification may read besides stderr. For plain-text CLIs it is all of stdout.
    error_text: str = ""
    backend: Backend | None = None
    usage: Usage | None = None


def http_status(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and 400 <= value <= 599 else None


# Codex formats its own failure as "... last status: 429 ..." / "unexpected status 401 ...": a status the
# CLI measured, in an event of the CLI's protocol (the server's body follows it, so only the first match).
CODEX_STATUS_RE = re.compile(r"\b(?:last status:|unexpected status)\s*([45][0-9]{2})\b")


def _json_lines(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # model-shaped input may nest without bound
                continue
            if isinstance(obj, dict):
                yield obj


def _last_json(text: str) -> dict[str, Any] | None:
    """The last JSON object in `text`, which may follow a banner and span several lines.

    Measured: real gemini prints a line of prose, then its error object pretty-printed over many lines, on
    stderr; a per-line parse misses it.
    """
    decoder = json.JSONDecoder()
    found = None
    offset = 0
    skip_to = 0  # the end of the last object found: objects nested inside it are not candidates
    for line in text.splitlines(keepends=True):
        if offset >= skip_to and line.lstrip().startswith("{"):
            start = offset + (len(line) - len(line.lstrip()))
            try:
                obj, end = decoder.raw_decode(text, start)
            except (ValueError, RecursionError):
                obj, end = None, 0
            if isinstance(obj, dict):
                found, skip_to = obj, end
        offset += len(line)
    return found


def _clip(s: str) -> str:
    s = s.strip()
    return s if len(s) <= SUMMARY_CHARS else s[: SUMMARY_CHARS - 1] + "…"


def _last_lines(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def read_text(stdout: str, stderr: str) -> Reading:
    body = stdout.strip() or stderr.strip()
    claimed = None
    low = body.lower()
    if "sorry, i encountered an error" in low or low.startswith("❌ error") or "❌ error:" in low:
        claimed = "failed"
    return Reading(_clip(_last_lines(body)), claimed, error_text=stdout)


def _codex_usage(raw: Any, so_far: Usage | None) -> Usage | None:
    # One `turn.completed` per turn, each with that turn's usage: a resumed thread's turns add up. Its
    # `input_tokens` already holds `cached_input_tokens` (the Responses API's accounting).
    found = _tokens(raw, ("input_tokens",), ("output_tokens",), ("cached_input_tokens",)) \
        if isinstance(raw, dict) else None
    if found is None:
        return so_far
    turn = Usage(found[0], found[1], None, "turn.completed.usage", found[2])
    return turn.plus(so_far)


def read_codex(stdout: str, stderr: str) -> Reading:
    message, claimed = "", None
    backend: Backend | None = None
    usage: Usage | None = None
    errors: list[str] = []
    for ev in _json_lines(stdout):
        kind = ev.get("type")
        item = ev.get("item") if isinstance(ev.get("item"), dict) else {}
        if kind == "item.completed" and item.get("type") in ("agent_message", "assistant_message"):
            message = str(item.get("text", "")) or message
        elif kind == "turn.completed":
            claimed = claimed or "completed"
            usage = _codex_usage(ev.get("usage"), usage)
        elif kind == "turn.failed":
            claimed = "failed"
            err = ev.get("error")
            errors.append(str(err.get("message") if isinstance(err, dict) else err))
            found = CODEX_STATUS_RE.search(errors[-1])
            backend = Backend(int(found.group(1)), "turn.failed.error.message") if found else backend
        elif kind == "error":
            errors.append(str(ev.get("message", "")))
    if not message and errors:
        message = errors[-1]
        claimed = claimed or "failed"
    return Reading(_clip(message or _last_lines(stderr)), claimed, error_text="\n".join(errors), backend=backend,
                   usage=usage)


def _claude_usage(obj: dict[str, Any]) -> Usage | None:
    # Anthropic's `input_tokens` leaves out the cache's: the cache writes and reads are input too.
    raw = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    found = _tokens(raw, ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"),
                    ("output_tokens",), ("cache_read_input_tokens",))
    usd = _cost(obj.get("total_cost_usd"))
    if found is None and usd is None:
        return None
    tin, tout, cached = found or (0, 0, 0)
    source = ", ".join(s for s, there in (("result.usage", found), ("result.total_cost_usd", usd is not None))
                       if there)
    return Usage(tin, tout, usd, source, cached, tokens_stated=found is not None)


def _claude_result(obj: dict[str, Any]) -> Reading:
    is_error = obj.get("is_error")
    claimed = "failed" if is_error is True else ("completed" if is_error is False else None)
    text = str(obj.get("result", ""))
    status = http_status(obj.get("api_error_status")) if is_error is True else None
    backend = Backend(status, "result.api_error_status") if status else None
    return Reading(_clip(text), claimed, error_text=text if is_error is True else "", backend=backend,
                   usage=_claude_usage(obj))


def read_claude_json(stdout: str, stderr: str) -> Reading:
    obj = _last_json(stdout)
    if obj is None or obj.get("type") != "result":
        return Reading(_clip(_last_lines(stdout or stderr)))
    return _claude_result(obj)


def read_claude_stream(stdout: str, stderr: str) -> Reading:
    result: Reading | None = None
    retry_after = None
    last_text = ""
    retried: Backend | None = None  # the last `system/api_retry` status: what a run cut short was failing on
    for ev in _json_lines(stdout):
        kind = ev.get("type")
        if kind == "result":
            result = _claude_result(ev)
        elif kind == "system" and ev.get("subtype") == "api_retry":
            status = http_status(ev.get("error_status"))
            retried = Backend(status, "system.api_retry.error_status") if status else retried
        elif kind == "rate_limit_event":
            info = ev.get("rate_limit_info") if isinstance(ev.get("rate_limit_info"), dict) else {}
            reset = info.get("resetsAt") or info.get("resets_at")
            if reset is not None:
                retry_after = str(reset)
        elif kind == "assistant":
            msg = ev.get("message") if isinstance(ev.get("message"), dict) else {}
            for part in msg.get("content") or []:
                if isinstance(part, dict) and part.get("type") == "text":
                    last_text = str(part.get("text", ""))
    if result is None:
        return Reading(_clip(last_text or _last_lines(stderr)), None, retry_after, backend=retried)
    return Reading(result.summary, result.claimed_status, retry_after, result.error_text,
                   result.backend or (retried if result.claimed_status == "failed" else None), result.usage)


def read_gemini(stdout: str, stderr: str) -> Reading:
    # Its error JSON goes to stderr (measured: exit 41 with {"error": {...}} there).
    obj = _last_json(stdout) or _last_json(stderr)
    if obj is None:
        return Reading(_clip(_last_lines(stdout or stderr)))
    err = obj.get("error")
    if isinstance(err, dict):
        msg = str(err.get("message", ""))
        # `code` is the exit code for the CLI's own failures (41 auth) and the API's status for API errors.
        status = http_status(err.get("code")) or http_status(err.get("status"))
        backend = Backend(status, "error.code") if status else None
        return Reading(_clip(msg), "failed", error_text=f"{err.get('type', '')}: {msg}", backend=backend)
    return Reading(_clip(str(obj.get("response", ""))), "completed" if "response" in obj else None,
                   usage=_gemini_json_usage(obj.get("stats")))


def _gemini_json_usage(stats: Any) -> Usage | None:
    """`--output-format json`'s `stats.models.<model>.tokens` (measured on 0.61: prompt, candidates, cached,
    thoughts, total per model; thoughts are output the model was billed for)."""
    models = stats.get("models") if isinstance(stats, dict) else None
    if not isinstance(models, dict):
        return None
    total: Usage | None = None
    for model in models.values():
        tokens = model.get("tokens") if isinstance(model, dict) else None
        found = _tokens(tokens, ("prompt",), ("candidates", "thoughts"), ("cached",)) \
            if isinstance(tokens, dict) else None
        if found is not None:
            total = Usage(found[0], found[1], None, "stats.models.tokens", found[2]).plus(total)
    return total


def _gemini_stream_usage(result: dict[str, Any]) -> Usage | None:
    stats = result.get("stats")
    found = _tokens(stats, ("input_tokens",), ("output_tokens",), ("cached",)) if isinstance(stats, dict) else None
    return Usage(found[0], found[1], None, "result.stats", found[2]) if found else None


def read_gemini_stream(stdout: str, stderr: str) -> Reading:
    """`--output-format stream-json`: the assistant's last message (its text after the last tool result) and
    the `result` event's status. Measured on 0.61: an API error is `result` with `status: "error"` and the
    CLI's `[API Error: <the API's error JSON>]` as its message; a startup failure (exit 41) is prose on stderr.
    `--output-format json`'s one object reads as `read_gemini` reads it."""
    events = list(_json_lines(stdout))
    if not any("type" in ev for ev in events):
        if _last_json(stdout) is not None:  # `--output-format json`'s one object (a user's own adapter)
            return read_gemini(stdout, stderr)
        # No stream at all: it failed before starting one (0.61 prints a startup failure, exit 41 included,
        # as prose on stderr in this format), which is its claim.
        early = read_gemini("", stderr)
        return early if early.claimed_status else Reading(early.summary, "failed", error_text=early.error_text)
    text, last, result = "", "", None
    for ev in events:
        kind = ev.get("type")
        if kind == "message" and ev.get("role") == "assistant" and isinstance(ev.get("content"), str):
            text = text + ev["content"] if ev.get("delta") else ev["content"]
        elif kind in ("tool_use", "tool_result"):
            last, text = text or last, ""
        elif kind == "result":
            result = ev
    if result is None:  # cut short: what it said last, else its stderr
        return Reading(_clip(text or last)) if text or last else read_gemini("", stderr)
    err = result.get("error") if isinstance(result.get("error"), dict) else None
    usage = _gemini_stream_usage(result)  # a failed run spent too
    if result.get("status") == "error" or err:
        msg = str((err or {}).get("message", "")) or "gemini reported an error"
        backend = None
        if msg.startswith("[API Error: ") and msg.endswith("]"):
            api = _last_json(msg[len("[API Error: "):-1])
            api_err = api.get("error") if isinstance(api, dict) and isinstance(api.get("error"), dict) else {}
            status = http_status(api_err.get("code"))
            backend = Backend(status, "result.error.message.error.code") if status else None
        return Reading(_clip(msg), "failed", error_text=f"{(err or {}).get('type', '')}: {msg}", backend=backend,
                       usage=usage)
    return Reading(_clip(text or last), "completed" if result.get("status") == "success" else None, usage=usage)


def read_jsonl(stdout: str, stderr: str) -> Reading:
    """Generic JSON events (opencode and user CLIs): the last text-bearing field wins."""
    text, claimed = "", None
    errors: list[str] = []
    backend: Backend | None = None
    for ev in _json_lines(stdout):
        for key in ("text", "result", "response", "message", "content"):
            val = ev.get(key)
            if isinstance(val, str) and val.strip():
                text = val
        part = ev.get("part")
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text = part["text"]
        if ev.get("type") == "error" or ev.get("error"):
            claimed = "failed"
            errors.append(json.dumps(ev.get("error") or ev.get("message") or ev)[:2000])
            err = ev.get("error") if isinstance(ev.get("error"), dict) else {}
            data = err.get("data") if isinstance(err.get("data"), dict) else {}
            status = http_status(data.get("statusCode"))  # opencode's APIError
            backend = Backend(status, "error.data.statusCode") if status else backend
    return Reading(_clip(text or _last_lines(stdout or stderr)), claimed, error_text="\n".join(errors),
                   backend=backend)


READERS: dict[str, Callable[[str, str], Reading]] = {
    "text": read_text,
    "codex-jsonl": read_codex,
    "claude-json": read_claude_json,
    "claude-stream-json": read_claude_stream,
    "gemini-json": read_gemini,
    "gemini-stream-json": read_gemini_stream,
    "jsonl": read_jsonl,
}


class ClaudeStreamWatch:
    """Ends a stream-json run on a *rejected* `rate_limit_event`.

    Measured in the wild (research/orchestrators.md, SCU-1129): after such an event the CLI can pause and
    never send a `result`, so waiting for the exit means waiting for the deadline. Only a top-level event of
    the CLI's protocol counts; text inside a message is the model's and is never read here. The host then
    kills the run, so the exit is nonzero and the only-on-nonzero classification rule still holds.
    """

    def __init__(self) -> None:
        self._partial = b""

    def __call__(self, stream: str, chunk: bytes) -> str | None:
        if stream != "stdout":
            return None
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()[-1_000_000:]
        for raw in lines:
            if b"rate_limit_event" not in raw:
                continue
            try:
                ev = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(ev, dict) and ev.get("type") == "rate_limit_event":
                info = ev.get("rate_limit_info") if isinstance(ev.get("rate_limit_info"), dict) else ev
                if str(info.get("status", "")).lower() == "rejected":
                    return "rate_limit_event: rejected"
        return None


WATCHERS: dict[str, Callable[[], Callable[[str, bytes], str | None]]] = {
    "claude-stream-json": ClaudeStreamWatch,
}
