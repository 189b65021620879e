"""A huge diff on the review page (issue 23): a 39 MB patch made a job page take 64 s and 44 MB of HTML. Now
each file's patch is cut at a stated size with a notice, and the page answers within a second."""

from __future__ import annotations

import os
import time

from review_site import Server, run_job

from proctor.testing import Behaviour
from proctor.web import patch

BIG_BYTES = 39 * 1024 * 1024


def test_a_39_mb_diff_gives_a_job_page_within_a_second_with_the_cut_said(repo, fake):
    line = "x" * 99 + "\n"
    big = line * (BIG_BYTES // len(line))
    fake("claude", Behaviour(writes={"big.txt": big, "small.py": "print('small')\n"}))
    del big
    res = run_job(repo, "T-big")
    assert res["status"] == "completed" and "big.txt" in res["changed_files"], res
    job = res["jobId"]
    server = Server()
    try:
        c = server.client()
        started = time.monotonic()
        r = c.get(server.prefix + f"/jobs/{job}")
        took = time.monotonic() - started
        small = c.get(server.prefix)  # the control: the list, with the same server
    finally:
        server.stop()
    assert r.status_code == 200 and small.status_code == 200
    html = r.text
    print(f"job page with a {BIG_BYTES / 2**20:.0f} MB diff: {took:.2f} s, {len(html) / 2**20:.2f} MB of HTML")
    assert took < float(os.environ.get("PROCTOR_BIG_PAGE_S", "1.0")), took
    assert len(html) < 4 * 2**20
    assert "more lines of this file are not shown" in html and "proctor diff" in html
    assert "small.py" in html  # the next file is still shown: the cut is per file
