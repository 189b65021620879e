"""proctor's evidence reporter for pytest, loaded by the host from a directory outside the tree.

The host copies this file, under a name of its own making (unguessable, so nothing in the tree can shadow
it), into a read-only directory, sets `REPORT` in the copy, and adds `-p <name>` to PYTEST_ADDOPTS. Every
session start, collection, per-test outcome and the session's normal end go to `REPORT` as JSON lines,
one `os.write` each on an O_APPEND descriptor, so a process that dies mid-run leaves whole lines and no
`finish`. It decides nothing: the host reads the lines (proctor.mechanisms.evidence.readers) and judges.

Kept to hooks pytest has had since 7 and to modules the interpreter has loaded before the tree is on
the import path (`os`, `sys`): a root-level `json.py` shadows the standard library's for everything imported
after it (found in review), so this file encodes its own JSON rather than trust `json.dumps`.
"""

import os
import sys

REPORT = None  # set by the host in its copy of this file

_fd = None


def _emit(record):
    global _fd
    if REPORT is None:
        return
    if _fd is None:
        _fd = os.open(REPORT, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    record["pid"] = os.getpid()
    os.write(_fd, (_json(record) + "\n").encode("utf-8", "replace"))


def _json(value):
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, dict):
        return "{" + ",".join(_json(str(k)) + ":" + _json(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_json(v) for v in value) + "]"
    out = []
    for ch in str(value):
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif code < 0x20 or 0xD800 <= code <= 0xDFFF:
            out.append("\\u%04x" % code)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _controller(config):
    # Under pytest-xdist the workers' reports reach the controller's hooks too: count them once.
    return not hasattr(config, "workerinput")


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_sessionstart(session):
    if _controller(session.config):
        version = getattr(sys.modules.get("pytest"), "__version__", "?")
        _emit({"e": "start", "version": version, "rootdir": str(session.config.rootpath)})


def pytest_collectreport(report):
    if _config is None or not _controller(_config) or report.passed:
        return
    origin = report.longrepr[0] if report.skipped and isinstance(report.longrepr, tuple) else None
    _emit({"e": "collect", "id": report.nodeid, "outcome": report.outcome, "origin": origin})


def pytest_deselected(items):
    if _config is not None and _controller(_config):
        _emit({"e": "deselected", "n": len(items)})


def pytest_collection_finish(session):
    if _controller(session.config):
        _emit({"e": "collected", "n": len(session.items)})
        if getattr(session.config.option, "collectonly", False):
            # The base's test set, for the host to hold the job's run to (a collect-only run of the base).
            for item in session.items:
                _emit({"e": "item", "id": item.nodeid})


def pytest_runtest_logreport(report):
    if _config is None or not _controller(_config):
        return
    origin = None
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        origin = [str(report.longrepr[0]), report.longrepr[1]]
    _emit({"e": "test", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
           "xfail": hasattr(report, "wasxfail"), "origin": origin})


def pytest_sessionfinish(session, exitstatus):
    if _controller(session.config):
        _emit({"e": "finish", "exit": int(exitstatus), "failed": session.testsfailed,
               "collected": session.testscollected})
