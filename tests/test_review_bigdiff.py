"""A huge diff on the review page (issue 23): a 39 MB patch made a job page take 64 s and 44 MB of HTML. Now
each file's patch is cut at a stated size with a notice, so the page's size is bounded whatever the diff. How
long it takes is measured in bench/review_page.py (0.5 s here), never asserted: a test's clock is the
machine's load."""

from __future__ import annotations

from review_site import Server, run_job

from proctor.mechanisms.adapters.testing import Behaviour

BIG_BYTES = 39 * 1024 * 1024


def big_files() -> dict[str, str]:
    """39 MB in the shapes that cost: minified JavaScript (long lines Pygments colours slowly), then a text file
    of short lines, then a small file after both."""
    minified = ("var a=1;" * 500 + "\n") * 1250  # 5 MB of 4,000-character lines
    files = {f"dist/m{i}.min.js": minified for i in range(4)}
    line = "x" * 99 + "\n"
    files["big.txt"] = line * ((BIG_BYTES - 4 * len(minified)) // len(line))
    files["small.py"] = "print('small')\n"
    return files


def test_a_39_mb_diff_gives_a_bounded_job_page_with_the_cut_said(repo, fake):
    fake("claude", Behaviour(writes=big_files()))
    res = run_job(repo, "T-big")
    assert res["status"] == "completed" and "big.txt" in res["changed_files"], res
    job = res["jobId"]
    server = Server()
    try:
        c = server.client()
        r = c.get(server.prefix + f"/jobs/{job}")
        small = c.get(server.prefix)  # the control: the list, with the same server
    finally:
        server.stop()
    assert r.status_code == 200 and small.status_code == 200
    html = r.text
    assert len(html) < 4 * 2**20
    assert "more lines of this file are not shown" in html and "proctor diff" in html
    assert "small.py" in html  # the next file is still shown: the cut is per file
