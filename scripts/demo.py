"""`make demo`: an offline end-to-end run on the embedded default (the `patch` adapter).

Builds a throw-away repo with a failing test (`add`) and a passing one (`mul`), then runs two real jobs
through the same code path as `proctor run-agent`: one patch that fixes `add` (completed: the host's own run
of the tests sees the failing test pass and nothing else change) and one that breaks `mul` (failed: a test
that passed on the base fails now, whatever the patch claims). Prints each job's closing lines; the whole result
JSON of each is kept in a file the demo names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Each hunk keeps its blank context lines (a single space each): git apply wants context on both sides.
FIX = """--- a/calc.py
+++ b/calc.py
@@ -1,4 +1,4 @@
 def add(a, b):
-    return a - b
+    return a + b
 
 
"""
BREAK = """--- a/calc.py
+++ b/calc.py
@@ -3,4 +3,4 @@
 
 
 def mul(a, b):
-    return a * b
+    return a + b
"""


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=demo", "-c", "user.email=demo@example.invalid", *args],
                   cwd=cwd, check=True, capture_output=True)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="proctor-demo-"))
    print(f"demo: a throw-away repo in {root} and two offline jobs of the `patch` agent (its task is a unified "
          "diff): one fixes the failing test, one breaks a passing one; each takes a few seconds", file=sys.stderr,
          flush=True)
    repo = root / "calc"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    (repo / "test_calc.py").write_text("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
                                       "\n\ndef test_mul():\n    assert mul(2, 3) == 6\n")
    (repo / "pytest.ini").write_text("[pytest]\n")
    git("init", "-q", "-b", "master", cwd=repo)
    git("add", ".", cwd=repo)
    git("commit", "-qm", "calc with a failing test", cwd=repo)
    # Validation autodetects pytest.ini and runs `python -m pytest`: put this venv's python first.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PROCTOR_HOME": str(root / "proctor-home")}
    proctor = str(Path(sys.executable).with_name("proctor"))
    codes, changed = [], []
    for ticket, diff in (("DEMO-fix", FIX), ("DEMO-break", BREAK)):
        task = root / f"{ticket}.diff"
        task.write_text(diff)
        print(f"\n=== {ticket}: proctor run-agent --agent patch --task-file {task.name} --repo {repo} "
              f"--ticket {ticket}", file=sys.stderr, flush=True)
        p = subprocess.run([proctor, "run-agent", "--agent", "patch", "--task-file", str(task), "--repo",
                            str(repo), "--ticket", ticket, "--timeout", "120"], env=env, text=True, capture_output=True)
        kept = root / f"{ticket}.json"
        kept.write_text(p.stdout)
        # The job's own closing lines (status, whether a person must look and why, the tests, the next
        # command), then where its whole result JSON is: the JSON is the record, the lines are what to read.
        sys.stderr.write(p.stderr)
        print(f"=== exit code {p.returncode}; the whole result JSON: {kept}", file=sys.stderr, flush=True)
        codes.append(p.returncode)
        try:
            changed.append(json.loads(p.stdout).get("changed_files"))
        except ValueError:
            changed.append(None)
    # Both patches edit calc.py in place, same size, within the checkout's second: the host must list it.
    ok = codes == [0, 1] and changed == [["calc.py"], ["calc.py"]]
    print(f"\ndemo {'OK' if ok else 'UNEXPECTED'}: the fix completed (exit {codes[0]}), the break of a passing "
          f"test failed validation (exit {codes[1]}); changed_files {changed}. Throw-away files are in {root}; "
          f"to look yourself: PROCTOR_HOME={root / 'proctor-home'} {proctor} jobs", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
