"""proctor's evidence reporter for pytest and unittest, loaded by the host from a directory outside the tree.

The host copies this file, under a name of its own making (unguessable, so nothing in the tree can shadow
it), into a read-only directory, sets `REPORT` (and `SELECT`) in the copy, and adds `-p <name>` to
PYTEST_ADDOPTS; a `sitecustomize` beside it calls `unittest_hook()` at interpreter start, which reaches
unittest, Django's runner and anything else built on unittest's `TestResult` whatever command starts them
(a Makefile, tox, a script), as PYTEST_ADDOPTS reaches pytest. Every session start, collection, per-test
outcome and the session's normal end go to `REPORT` as JSON lines, one `os.write` each on an O_APPEND
descriptor, so a process that dies mid-run leaves whole lines and no `finish`. `SELECT`, when the host
sets it, names the only pytest ids to run (a failure run again to tell a flaky test from a broken one).
It decides nothing: the host reads the lines (proctor.mechanisms.evidence.readers) and judges.

Kept to hooks pytest has had since 7 and to modules the interpreter has loaded before the tree is on
the import path (`os`, `sys`): a root-level `json.py` shadows the standard library's for everything imported
after it (found in review), so this file encodes its own JSON rather than trust `json.dumps`.
"""

import os
import sys

REPORT = None  # set by the host in its copy of this file
SELECT = None  # set by the host when it runs only some ids: a tuple of node ids, or of files
ROOT = None  # the checkout, set with SELECT: the host names ids from it, not from pytest's rootdir

_fd = None
_none_selected = False


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


def _runner(tag, record):
    record["r"] = tag
    _emit(record)


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
        _runner("pytest", {"e": "start", "version": version, "rootdir": str(session.config.rootpath)})


def pytest_collectreport(report):
    if _config is None or not _controller(_config) or report.passed:
        return  # a module that failed to import, or was skipped whole: its tests are never reported
    _runner("pytest", {"e": "collect", "id": report.nodeid, "outcome": report.outcome})


def pytest_deselected(items):
    if _config is not None and _controller(_config):
        _runner("pytest", {"e": "deselected", "n": len(items)})


def pytest_collection_finish(session):
    if _controller(session.config):
        _runner("pytest", {"e": "collected", "n": len(session.items)})


def pytest_collection_modifyitems(session, config, items):
    if SELECT is None:
        return
    # An entry is an id, a parametrized test's id before its `[...]`, or a file (every test it holds), named
    # as the host's reader names them: from the checkout, a rootdir below it a prefix of the id (a project
    # run as `cd pkg && pytest` reports `tests/t.py::x` for the checkout's `pkg/tests/t.py::x`).
    keep = set(SELECT)
    prefix = ""
    if ROOT:
        here, root = str(config.rootpath), ROOT.rstrip("/") + "/"
        prefix = here[len(root):].strip("/") + "/" if here.startswith(root) else ""

    def kept(item):
        tid = prefix + item.nodeid
        return tid in keep or tid.split("[", 1)[0] in keep or tid.split("::", 1)[0] in keep
    global _none_selected
    chosen = [i for i in items if kept(i)]
    gone = [i for i in items if not kept(i)]
    if gone:
        config.hook.pytest_deselected(items=gone)
    items[:] = chosen
    _none_selected = not chosen


def pytest_runtest_logreport(report):
    if _config is None or not _controller(_config):
        return
    _runner("pytest", {"e": "test", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
                       "xfail": hasattr(report, "wasxfail"), "file": str(report.fspath)})


def pytest_sessionfinish(session, exitstatus):
    if _controller(session.config):
        _runner("pytest", {"e": "finish", "exit": int(exitstatus), "failed": session.testsfailed,
                           "collected": session.testscollected})
    # A session the host's selection left empty ran nothing of what it was asked: not pytest's "no tests
    # collected" (5), which ends `pytest a && pytest b` before the session that holds them.
    if _none_selected and int(exitstatus) == 5:
        session.exitstatus = 0


# -- unittest -----------------------------------------------------------------------------------------------
# unittest's TestResult is patched as its module is first imported (a finder at the front of sys.meta_path,
# gone once used): importing unittest at every interpreter start would cost every Python process of the run.
# Outcomes count only on a result inside its own startTestRun/stopTestRun (TextTestRunner's bracket), in the
# process that opened it: Django's parallel workers report through their parent's result, and pytest's own
# unittest support never opens one, so nothing is counted twice.

_UNITTEST = (("addSuccess", "passed"), ("addFailure", "failed"), ("addError", "error"), ("addSkip", "skipped"),
             ("addExpectedFailure", "xfailed"), ("addUnexpectedSuccess", "xpassed"))


def _test_id(test):
    try:
        return str(test.id())
    except Exception:  # noqa: BLE001 - a test whose id() raises is still a test that ran
        return repr(test)[:300]


def _patch_result(module):
    result = module.TestResult

    def counted(self):
        return getattr(self, "_proctor_run", None) == os.getpid()

    def wrap(name, outcome):
        original = getattr(result, name)

        def method(self, test, *args):
            if counted(self):
                _runner("unittest", {"e": "test", "id": _test_id(test), "outcome": outcome})
            return original(self, test, *args)
        setattr(result, name, method)

    for name, outcome in _UNITTEST:
        wrap(name, outcome)
    sub = result.addSubTest

    def add_sub_test(self, test, subtest, err):
        if err is not None and counted(self):
            failed = issubclass(err[0], getattr(self, "failureException", AssertionError))
            _runner("unittest", {"e": "test", "id": _test_id(test), "outcome": "failed" if failed else "error"})
        return sub(self, test, subtest, err)
    result.addSubTest = add_sub_test
    start, stop = result.startTestRun, result.stopTestRun

    def start_test_run(self):
        # A unittest run a pytest test starts (testing test tooling) is that test's business, not a session.
        if "PYTEST_CURRENT_TEST" not in os.environ:
            self._proctor_run = os.getpid()
            _runner("unittest", {"e": "start"})
        return start(self)

    def stop_test_run(self):
        out = stop(self)
        if counted(self):
            _runner("unittest", {"e": "finish"})
        return out
    result.startTestRun, result.stopTestRun = start_test_run, stop_test_run


class _UnittestFinder:
    def find_spec(self, name, path=None, target=None):
        if name != "unittest.result":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        machinery = sys.modules["_frozen_importlib_external"]
        spec = machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _patch_result(module)
        spec.loader.exec_module = exec_module
        return spec


def unittest_hook():
    if REPORT is None:
        return
    if "unittest.result" in sys.modules:
        _patch_result(sys.modules["unittest.result"])
    else:
        sys.meta_path.insert(0, _UnittestFinder())
