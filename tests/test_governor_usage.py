"""Usage read from each CLI's own output (the readers of proctor.mechanisms.adapters.output): the real claude, codex and
gemini output in tests/samples, a field of the protocol only (never prose), values that are not counts
ignored, and None whenever the CLI did not say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proctor.mechanisms.adapters.output import READERS, Usage

SAMPLES = Path(__file__).parent / "samples"


def read(fmt: str, stdout: str, stderr: str = "") -> Usage | None:
    return READERS[fmt](stdout, stderr).usage


@pytest.mark.parametrize("fmt, sample, expected", [
    ("claude-stream-json", "claude-2.1.197-stream.jsonl", Usage(20, 10, 0.00035, "result.usage, result.total_cost_usd")),
    ("codex-jsonl", "codex-0.171-exec.jsonl", Usage(20, 10, None, "turn.completed.usage")),
    ("gemini-stream-json", "gemini-0.61-stream.jsonl", Usage(30, 15, None, "result.stats")),
    ("gemini-json", "gemini-0.61.json", Usage(30, 15, None, "stats.models.tokens")),
    ("gemini-stream-json", "gemini-0.61.json", Usage(30, 15, None, "stats.models.tokens")),  # a json adapter
])
def test_the_real_clis_output_gives_its_usage(fmt, sample, expected):
    assert read(fmt, (SAMPLES / sample).read_text()) == expected


def test_claude_counts_its_cache_as_input_and_its_json_result_too():
    result = {"type": "result", "is_error": False, "result": "ok", "total_cost_usd": 0.25,
              "usage": {"input_tokens": 3, "cache_creation_input_tokens": 1000, "cache_read_input_tokens": 5000,
                        "output_tokens": 40}}
    expected = Usage(6003, 40, 0.25, "result.usage, result.total_cost_usd", tokens_cached=5000)
    assert read("claude-stream-json", json.dumps(result) + "\n") == expected
    assert read("claude-json", json.dumps(result)) == expected
    # An error result still spent: its usage counts as well.
    failed = {**result, "is_error": True, "api_error_status": 500}
    assert read("claude-json", json.dumps(failed)) == expected


def test_claude_cut_short_says_nothing_of_its_usage():
    # Killed before its `result` (a rejected rate_limit_event): the assistant events' per-message usage is
    # not the run's, so nothing is claimed and the booking keeps its estimate.
    sample = (SAMPLES / "claude-2.1.197-stream.jsonl").read_text().splitlines()
    cut = "\n".join(line for line in sample if json.loads(line)["type"] != "result")
    assert read("claude-stream-json", cut) is None
    assert read("claude-stream-json", "\n".join(sample)) is not None  # control: with it


def test_codex_adds_up_its_turns():
    turn = {"type": "turn.completed", "usage": {"input_tokens": 100, "cached_input_tokens": 60, "output_tokens": 7}}
    out = "\n".join(json.dumps(e) for e in [{"type": "thread.started"}, turn, {"type": "turn.started"}, turn])
    assert read("codex-jsonl", out) == Usage(200, 14, None, "turn.completed.usage", tokens_cached=120)


@pytest.mark.parametrize("bad", ["12", True, -5, 1.5, None, [3]])
def test_a_counter_that_is_not_a_count_is_ignored(bad):
    good = {"type": "turn.completed", "usage": {"input_tokens": 10, "output_tokens": 5}}
    assert read("codex-jsonl", json.dumps(good)) == Usage(10, 5, None, "turn.completed.usage")  # control
    worse = {"type": "turn.completed", "usage": {"input_tokens": bad, "output_tokens": bad}}
    assert read("codex-jsonl", json.dumps(worse)) is None


@pytest.mark.parametrize("bad", ["0.5", True, -0.5, None, [1]])
def test_a_cost_that_is_not_a_number_of_dollars_is_ignored(bad):
    def cost(value: object) -> Usage | None:
        return read("claude-json", json.dumps({"type": "result", "is_error": False, "result": "ok",
                                                "total_cost_usd": value}))

    assert cost(0.5) == Usage(0, 0, 0.5, "result.total_cost_usd", tokens_stated=False)  # control: no tokens
    assert cost(bad) is None


def test_prose_is_never_usage():
    words = "I used 1,000,000 tokens and it cost $500 (total_cost_usd: 500, input_tokens: 9)"
    assert read("text", words) is None
    message = {"type": "item.completed", "item": {"type": "agent_message", "text": '{"usage": {"input_tokens": 9}}'}}
    assert read("codex-jsonl", json.dumps(message)) is None
    assert read("jsonl", json.dumps({"text": "done", "usage": {"input_tokens": 9}})) is None


def test_gemini_reports_usage_for_a_failed_run_too():
    result = {"type": "result", "status": "error", "error": {"type": "ApiError", "message": "boom"},
              "stats": {"total_tokens": 12, "input_tokens": 9, "output_tokens": 3, "cached": 4}}
    out = json.dumps({"type": "init"}) + "\n" + json.dumps(result)
    reading = READERS["gemini-stream-json"](out, "")
    assert reading.claimed_status == "failed"
    assert reading.usage == Usage(9, 3, None, "result.stats", tokens_cached=4)
