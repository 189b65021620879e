"""Benchmark (not a test): the review page's job view on a 39 MB diff (issue 23: it took 64 s and 44 MB of
HTML before each file's patch was cut at a stated size). Runs tests/test_review_bigdiff.py's job through a
real `proctor serve` and times the first and second view of the job page.
Target: the first view within a second. Run: .venv/bin/python bench/review_page.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import make_repo  # noqa: E402
from review_site import Server, run_job  # noqa: E402
from test_review_bigdiff import BIG_BYTES, big_files  # noqa: E402

from proctor.mechanisms.adapters.testing import Behaviour, FakeAgent  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        from conftest import GIT_ENV

        os.environ.update(GIT_ENV)
        os.environ["PROCTOR_HOME"] = str(root / "home")
        (root / "home").mkdir()
        (root / "home" / "config.toml").write_text('confine = "off"\n')
        os.environ["HOME"] = str(root / "userhome")
        (root / "userhome").mkdir()
        bin_dir = root / "bin"
        bin_dir.mkdir()
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        FakeAgent(bin_dir, "claude", Behaviour(writes=big_files()))
        repo = make_repo(root)
        res = run_job(repo, "T-big")
        server = Server()
        try:
            c = server.client()
            times = []
            for _ in range(2):
                started = time.monotonic()
                r = c.get(server.prefix + f"/jobs/{res['jobId']}")
                times.append(time.monotonic() - started)
        finally:
            server.stop()
        print(f"job page with a {BIG_BYTES / 2**20:.0f} MB diff: first view {times[0]:.2f} s, then "
              f"{times[1]:.2f} s, {len(r.text) / 2**20:.2f} MB of HTML; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
