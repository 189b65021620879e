"""Frequent rows are one a principal a minute, the rest counted (issue 41: 1,000 MCP `list_jobs` calls wrote
1,000 rows). A real ledger, a clock the test moves; and the real MCP server, whose session's reads end as two
rows, not twenty."""

from __future__ import annotations

import anyio
from mcp import Client
from test_mcp import params

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.ledger.summary import Summary


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def payloads(ledger: Ledger, kind: str) -> list[dict]:
    return [r.payload for r in ledger.rows(kind=kind)]


def test_one_row_a_principal_a_window_and_the_rest_counted(tmp_path):
    clock = Clock()
    reads = Summary(clock=clock)
    with Ledger(tmp_path / "l.sqlite3") as led:
        for _ in range(1000):
            assert reads.note(led, "review.jobs", {"n": 1}, principal="client-a") is None
        reads.note(led, "review.jobs", {"n": 1}, principal="client-b")  # another principal: a row of its own
        assert payloads(led, "review.jobs") == [{"n": 1}, {"n": 1}]
        clock.now += 61  # the next window: the first one's count, then this row
        reads.note(led, "review.jobs", {"n": 2}, principal="client-a")
        assert payloads(led, "review.jobs")[2:] == [{"n": 1, "summarised": 999, "window_s": 60.0}, {"n": 2}]
        reads.note(led, "review.jobs", {"n": 3}, principal="client-a")
        reads.flush(led)
        assert payloads(led, "review.jobs")[4:] == [{"n": 2, "summarised": 1, "window_s": 60.0}]
        assert led.chain_problems() == []


def test_an_mcp_sessions_twenty_list_jobs_are_two_rows(tmp_path):
    async def main() -> None:
        async with Client(params(granted=False)) as client:
            for _ in range(20):
                got = await client.call_tool("list_jobs", {})
                assert not got.is_error

    anyio.run(main)
    with Ledger.default() as led:
        rows = payloads(led, "review.jobs")
    assert len(rows) == 2 and "summarised" not in rows[0] and rows[1]["summarised"] == 19, rows
    assert rows[0]["client"].startswith("mcp ") and rows[0]["via"] == "mcp"
