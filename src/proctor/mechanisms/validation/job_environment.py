"""What a job's validation environment is, as a value: made by environment.prepare(), made real by apply(),
checked by probe.check(), described to the ledger. Data only: it never reads nor changes the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.validation.shares import Share
from proctor.mechanisms.validation.venvs import PythonEnv


@dataclass(frozen=True)
class JobEnvironment:
    checkout: Path
    main_checkout: Path
    env: dict[str, str] = field(default_factory=dict)
    shares: tuple[Share, ...] = ()
    bind: bool = True  # shares as read-only bind mounts (bwrap); else symlinks (kept read-only by Landlock)
    copies: tuple[tuple[Path, Path], ...] = ()  # (source in the main checkout, target in the checkout)
    dirs: tuple[Path, ...] = ()  # private dirs to create (HOME, caches)
    readonly: tuple[Path, ...] = ()  # toolchain homes that must stay visible and unwritable
    risks: tuple[str, ...] = ()
    python_packages: tuple[str, ...] = ()
    node_package: str | None = None
    setup: tuple[str, ...] = ()
    python: str | None = None  # the autodetected plan's interpreter (`python`/`python3`): the probe runs it too
    python_env: PythonEnv | None = None  # the repo's venv, when one is used

    @property
    def shown(self) -> tuple[Path, ...]:
        """What of the person's checkout the repo's commands use (node_modules, the repo's venv): shown to
        them read-only where the rest of that checkout is hidden."""
        return (*(sh.source for sh in self.shares), *((self.python_env.venv,) if self.python_env else ()))

    @property
    def ro_binds(self) -> tuple[tuple[Path, Path], ...]:
        return tuple((s.source, s.target) for s in self.shares if not s.layer) if self.bind else ()
