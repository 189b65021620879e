"""The v1 request rules (DESIGN.md §1), checked where every surface checks them."""

from __future__ import annotations

import pytest

from proctor.contract import RunAgentRequest, parse_request

GOOD = {"agent": "patch", "task": "do it", "repo": "/tmp/x", "ticket": "T-1.a_b"}


def test_good_request_parses_with_defaults():
    req = parse_request(GOOD)
    assert isinstance(req, RunAgentRequest)
    assert (req.mode, req.timeout_sec, req.branch, req.validate_command) == ("build", 1200, None, None)


@pytest.mark.parametrize("given,expected", [(5, 60), (60, 60), (61, 61), (14400, 14400), (99999, 14400), ("300", 300)])
def test_timeout_is_clamped_not_refused(given, expected):
    assert parse_request({**GOOD, "timeoutSec": given}).timeout_sec == expected


@pytest.mark.parametrize("field,value,needle", [
    ("ticket", "T 1", "ticket"),
    ("ticket", "T/1", "ticket"),
    ("ticket", "", "ticket"),
    ("branch", "main..evil", "'..'"),
    ("branch", "-x", "must not start with '-'"),
    ("branch", "feat;rm", "branch"),
    ("task", "   ", "task must be non-empty"),
    ("repo", "relative/path", "absolute"),
    ("timeoutSec", "soon", "not a finite number"),
    ("timeoutSec", "inf", "not a finite number"),
    ("timeoutSec", 1e999, "not a finite number"),
    ("ticket", "x.lock", "valid branch component"),
    ("ticket", ".hidden", "valid branch component"),
    ("ticket", "-opt", "valid branch component"),
    ("timeoutSec", True, "number of seconds"),
    ("validateCommand", " ", "validateCommand"),
    ("agent", "", "agent"),
])
def test_each_violation_is_named(field, value, needle):
    errors = parse_request({**GOOD, field: value})
    assert isinstance(errors, list) and errors
    assert any(needle in e for e in errors), errors


def test_missing_and_unknown_fields_are_refused():
    errors = parse_request({"agent": "patch", "approved": True})
    text = " ".join(errors)
    for name in ("task", "repo", "ticket", "approved"):
        assert name in text


def test_safe_branch_names_pass():
    for ref in ("main", "release/1.2", "feature/x-y_z", "v1.0"):
        assert parse_request({**GOOD, "branch": ref}).branch == ref
