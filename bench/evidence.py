"""Benchmark (not a test): what collecting per-test evidence costs a validation run.

The same pytest run of a generated project (N test modules of M tests each, the shape of a real suite),
with and without proctor's evidence plugin laid out the way validation lays it out (PYTEST_ADDOPTS,
PYTHONPATH, no bytecode written); and the readers' time on the report. Median of R runs each.
With --real, the same on the real Python projects of tests/test_ecosystems.py (cachetools, src layout;
six, flat), their own test suites, the import root on PYTHONPATH as the job environment puts it.
Target (issue 20): evidence collection costs <= 5% of validation time.
Run: .venv/bin/python bench/evidence.py [--modules 40] [--tests 25] [--runs 7] [--real]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proctor.mechanisms.evidence import instrument, readers


def make_project(root: Path, modules: int, tests: int) -> Path:
    proj = root / "proj"
    (proj / "tests").mkdir(parents=True)
    (proj / "lib.py").write_text("def f(x):\n    return x * 2\n")
    for m in range(modules):
        body = "".join(f"def test_{t}():\n    assert lib.f({t}) == {2 * t}\n\n" for t in range(tests))
        (proj / "tests" / f"test_m{m}.py").write_text("import lib\n\n" + body)
    return proj


def run(proj: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=proj, env=env, check=True,
                   capture_output=True)
    return time.perf_counter() - start


def real(root: Path, runs: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import ecosystems_fetch as fx

    for key, sub in (("python-src", "src"), ("python-flat", "")):
        repo = fx.require(fx.make_repo, key, root / key)
        base = {**os.environ, "PYTHONPATH": str(repo / sub), "PYTHONDONTWRITEBYTECODE": "1"}
        plain, instrumented = [], []
        for i in range(runs):
            plain.append(run(repo, base))
            inst = instrument.instrument(root / f"{key}-plugin{i}", root / f"{key}-tmp{i}", base)
            instrumented.append(run(repo, {**base, **inst.env}))
            ev = readers.read_pytest(inst.report.read_bytes())
            assert ev is not None and ev.ended == 1 and ev.passed > 0, ev
        p, w = statistics.median(plain), statistics.median(instrumented)
        print(f"{key}: {ev.passed} tests; plain pytest {p * 1000:.0f} ms, with evidence {w * 1000:.0f} ms: "
              f"{w / p:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", type=int, default=40)
    ap.add_argument("--tests", type=int, default=25)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--real", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.real:
            real(root, args.runs)
            print(f"load {os.getloadavg()[0]:.2f}")
            return
        proj = make_project(root, args.modules, args.tests)
        base = {**os.environ, "PYTHONPATH": str(proj), "PYTHONDONTWRITEBYTECODE": "1"}
        plain, instrumented, reading = [], [], []
        for i in range(args.runs):
            plain.append(run(proj, base))
            inst = instrument.instrument(root / f"plugin{i}", root / f"tmp{i}", base)
            instrumented.append(run(proj, {**base, **inst.env}))
            data = inst.report.read_bytes()
            t = time.perf_counter()
            ev = readers.read_pytest(data)
            reading.append(time.perf_counter() - t)
            assert ev is not None and ev.passed == args.modules * args.tests, ev
        p, w, r = statistics.median(plain), statistics.median(instrumented), statistics.median(reading)
        print(f"tests: {args.modules * args.tests}; plain pytest {p * 1000:.0f} ms, with evidence {w * 1000:.0f} ms "
              f"(+ reading {r * 1000:.1f} ms): {(w + r) / p:.3f}x; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
