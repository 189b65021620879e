"""The `Progress` seam: what a job tells whoever watches it (a phase starts, a chunk of output, the end),
and its quiet implementation. It never shows anything itself but `say`, the host's own one-line messages
(a refusal, a cancel) on stderr; the terminal's live line is the CLI's (proctor.surfaces.cli.progress).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Protocol

from proctor.mechanisms.process.spawn import Watch
from proctor.mechanisms.terminal import visible

if TYPE_CHECKING:
    from proctor.contract import RunAgentResult


class Progress(Protocol):
    def phase(self, name: str) -> None: ...
    def watch(self, inner: Watch | None) -> Watch | None: ...
    def done(self, result: RunAgentResult) -> None: ...


class NullProgress:
    def phase(self, name: str) -> None:
        pass

    def watch(self, inner: Watch | None) -> Watch | None:
        return inner

    def done(self, result: RunAgentResult) -> None:
        pass

    def say(self, line: str) -> None:
        print(visible(line), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass
