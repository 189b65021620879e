"""The last lines a job prints on stderr: what happened and what to do next, for a person at a terminal.

Owns reading a result as a person does: the status and code, whether a person must look and the first reason
why (the first risk), the tests the host ran (counts as the runner reported them, and against the base), and
the next command. The JSON on stdout stays the record; these lines only point into it.
"""

from __future__ import annotations

from proctor.contract import RunAgentResult, Status
from proctor.services.job.judge import main_steps

RISK_CHARS = 160
COUNTS = ("passed", "failed", "errors", "skipped")


def tests_line(result: RunAgentResult) -> str | None:
    if not result.validation:
        return None
    totals: dict[str, int] = {}
    fixed = broken = 0
    runners: list[str] = []
    for step in main_steps(result.validation):
        tests = step.get("tests") if isinstance(step.get("tests"), dict) else {}
        for key in COUNTS:
            if isinstance(tests.get(key), int):
                totals[key] = totals.get(key, 0) + tests[key]
        if tests.get("source") and tests["source"] not in runners:
            runners.append(str(tests["source"]))
        counts = ((step.get("compared") or {}).get("counts")) or {}
        fixed += int(counts.get("fixed") or 0)
        broken += int(counts.get("broken") or 0)
    shown = ", ".join(f"{n} {k}" for k, n in totals.items() if n or k in ("passed", "failed")) or "no per-test report"
    against = f"; against the base: {fixed} fixed, {broken} broken" if fixed or broken else ""
    return f"tests: {shown}{against}" + (f" ({', '.join(runners)})" if runners else "")


def closing(result: RunAgentResult) -> list[str]:
    """The job's last lines; none for a job refused before it launched (its refusal line says it all)."""
    if not result.job_id or (result.status is not Status.completed and not result.attempts):
        return []
    head = f"{result.status.value} ({result.code.value}) in {result.duration_seconds:.1f}s"
    if not result.needs_human_review:
        head += ": checked; nothing asks for a person"
    else:
        first = result.known_risks[0] if result.known_risks else "the verdict could not say"
        more = f" (+{len(result.known_risks) - 1} more)" if len(result.known_risks) > 1 else ""
        head += f": needs review: {first[:RISK_CHARS]}{'…' if len(first) > RISK_CHARS else ''}{more}"
    lines = [head, *(f"warning: {w}" for w in result.warnings)]
    tests = tests_line(result)
    if tests:
        lines.append(tests)
    if result.landed:
        said = result.landed
        lines.append(f"auto_land: {'landed' if said.get('landed') else 'not landed'} ({said.get('code')}: "
                     f"{str(said.get('reason', ''))[:RISK_CHARS]})")
    jid = result.job_id
    if result.landed and result.landed.get("landed"):
        lines.append(f"next: proctor show {jid}")
    elif result.status is Status.completed and result.commit:
        lines.append(f"next: proctor show {jid}  (the verdict and why) · proctor diff {jid} · proctor land {jid}")
    else:
        lines.append(f"next: proctor show {jid}  (what failed and why) · proctor discard {jid}")
    return lines
