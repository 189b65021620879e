"""Cheat signals in the agent's diff: added lines a person must look at before a passing run is trusted.

Owns reading the lines the agent added to source files (never to test-defining files) and naming, as
risks with the file and line, the shapes real reward hacks take (issue 20, rebuilt from public transcripts
of coding agents on impossible tasks): code that reads its caller or detects the test runner, code that
ends the process from a library, state kept across calls where the base kept none, and literals copied
from the test files. Each is a hint, not a verdict: honest code trips them now and then, so a signal only
ever becomes a risk for a person to read.

It never runs the repo's code nor git's repo-controlled machinery: only `diff --no-ext-diff --no-textconv`,
`ls-tree` and `cat-file --batch` on the host-made git dir. It never raises on odd input (binary, non-UTF-8,
huge or unparsable files are skipped or read as far as they go) and reads a capped number of bytes.

The folder: scan (a file as the rules read it), rules (caller, runner, process exit), state, literals (copied
from the tests), commits (reading the two commits), findings (diff_signals, the face).
"""

from proctor.mechanisms.evidence.signals.findings import MAX_RISKS, PREFIX, diff_signals

__all__ = ["MAX_RISKS", "PREFIX", "diff_signals"]
