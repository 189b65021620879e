"""`make demo`, the README's first command, run as a user runs it: a fix of a failing test completes and a
break of a passing one fails validation. It is the front door: when the verdict changes what it says of
either job, this names it (it did: the break used to leave the already-failing test failing, which the
verdict against the base rightly calls pre-existing, not this job's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "scripts" / "demo.py"


def test_make_demo_says_ok(tmp_path):
    done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
                               "TMPDIR": str(tmp_path)})
    assert done.returncode == 0 and "demo OK" in done.stderr, done.stderr[-3000:]
    # What a newcomer reads: each job's closing lines say what happened and what to do next, not a JSON.
    err = done.stderr
    assert "completed (OK)" in err and "checked; nothing asks for a person" in err, err[-3000:]
    assert "failed (VALIDATION_FAILED)" in err and "needs review:" in err, err[-3000:]
    assert "tests: 2 passed" in err and "next: proctor show" in err and "proctor land" in err, err[-3000:]
    assert "the whole result JSON:" in err and done.stdout == "", done.stdout[:500]
    assert len(err.splitlines()) < 30, err  # a page, not ~470 lines
