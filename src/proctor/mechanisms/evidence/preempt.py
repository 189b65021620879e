"""Files that run before or instead of the code under test: the agent's additions a test run finds by itself.

Owns the classes of path that pre-empt a runner without touching a test (issue 20, each found in review):
a top-level module named like one the run imports (the standard library, an installed distribution, the
runner), Python's own import hooks (`*.pth`, a `*.dist-info`/`*.egg-info` whose `entry_points.txt` pytest
loads as a plugin, `sitecustomize`), compiled files a reviewer cannot read, and every file a test runner
discovers as its configuration, per its documentation. It judges paths only: it never reads a file, never
imports one, and never decides a verdict: each class is one risk naming its paths.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import sys
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

from proctor.mechanisms.git.frozen import RUNNER_MODULES

SHOWN = 5
# Suffixes Python imports a module from (an extension module's tag, `json.cpython-311-x86_64-linux-gnu.so`,
# is part of its name).
IMPORTABLE = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
# Standard-library names no test run imports from the root: a `test/` directory is a project's tests.
NOT_SHADOWING = frozenset({"test", "__main__", "__phello__"})
COMPILED = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll", ".node", ".wasm", ".class", ".jar", ".a", ".o",
            ".obj", ".lib", ".exe", ".bin", ".elf")
# Each runner's configuration discovery, from its documentation (a name matches at any depth).
RUNNER_CONFIG: dict[str, tuple[str, ...]] = {
    # pytest 9 (docs.pytest.org "Configuration file formats", rootdir/configfile discovery): pytest.toml and
    # .pytest.toml first, then (.)pytest.ini, pyproject.toml, tox.ini, setup.cfg; conftest.py in every
    # directory from the rootdir down to the tests; setup.py marks a rootdir.
    "pytest": ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini",
               "setup.cfg", "conftest.py", "setup.py", ".coveragerc"),
    # tox 4 (tox.wiki "Discovery and file types"): tox.ini, setup.cfg, pyproject.toml, tox.toml; nox: noxfile.py.
    "tox/nox": ("tox.toml", "noxfile.py"),
    # jest (jest.config.{js,ts,mjs,cjs,cts,json} or package.json "jest"), vitest (vitest.config.* before
    # vite.config.*, any JS/TS extension), mocha (.mocharc.{js,cjs,mjs,yaml,yml,json,jsonc}, package.json
    # "mocha", searched up the parents), ava (ava.config.*), node (node.config.json), babel transforms.
    "node": ("package.json", "jest.config.*", "vitest.config.*", "vite.config.*", "vitest.workspace.*",
             ".mocharc", ".mocharc.*", "ava.config.*", "node.config.json", "babel.config.*", ".babelrc*",
             "karma.conf.*", "playwright.config.*", "cypress.config.*", ".nycrc", ".nycrc.*"),
    # The package managers that start a script: npm, yarn (incl. its Plug'n'Play loader), pnpm, bun, deno.
    "npm": (".npmrc", ".yarnrc", ".yarnrc.yml", ".pnp.cjs", ".pnp.loader.mjs", ".pnpmfile.cjs",
            "pnpm-workspace.yaml", "bunfig.toml", "deno.json", "deno.jsonc"),
    # go: the module and workspace files (a vendor/modules.txt turns on -mod=vendor).
    "go": ("go.mod", "go.sum", "go.work", "go.work.sum"),
    # cargo: .cargo/config(.toml) in the directory and every parent, the manifest, build scripts, toolchain.
    "cargo": ("Cargo.toml", "build.rs", "rust-toolchain", "rust-toolchain.toml"),
    "make": ("Makefile", "GNUmakefile", "makefile", "*.mk"),
    ".NET": ("Directory.Build.props", "Directory.Build.targets", "Directory.Packages.props", "global.json",
             "nuget.config", "NuGet.Config", "*.runsettings"),
    "proctor": (".proctor.toml",),
}
# Paths (from the root) a runner reads, beside the names above.
RUNNER_PREFIXES = ("vendor/modules.txt", "node_modules/")
RUNNER_DIRS = frozenset({".cargo"})  # at any depth: cargo probes every parent of its working directory


@functools.cache
def installed_names() -> frozenset[str]:
    """Import names of this interpreter's installed distributions (computed once)."""
    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # noqa: BLE001 - a broken installed distribution's metadata: the standard library stands
        return frozenset()


def _module_path(path: str) -> tuple[str, ...]:
    """`path` relative to where an import finds a top-level name: the root, or `src/` of a src layout."""
    parts = PurePosixPath(path).parts
    return parts[1:] if len(parts) > 1 and parts[0] == "src" else parts


def top_level_modules(paths: Iterable[str]) -> frozenset[str]:
    """The import names a tree defines at its root or under `src/` (a module file or a package's
    `__init__`): for the base's paths, the project's own packages, never a shadow of anything."""
    return frozenset(name for p in paths if (name := _shadow_name(p)) is not None)


def _shadow_name(path: str) -> str | None:
    rel = _module_path(path)
    if not rel:
        return None
    if len(rel) == 1 and rel[0].endswith(IMPORTABLE):
        return rel[0].split(".")[0]
    if len(rel) == 2 and rel[1].split(".")[0] == "__init__" and rel[1].endswith(IMPORTABLE):
        return rel[0]
    return None


def _is_hook(path: str) -> bool:
    p = PurePosixPath(path)
    customize = ("sitecustomize", "usercustomize")
    if p.suffix == ".pth" or p.name.split(".")[0] in customize and p.name.endswith(IMPORTABLE):
        return True
    if any(part in customize for part in p.parts[:-1]):
        return True  # a sitecustomize package
    return any(part.endswith((".dist-info", ".egg-info")) for part in p.parts[:-1]) or p.name.endswith(".egg-info")


def _is_compiled(path: str) -> bool:
    p = PurePosixPath(path)
    name = p.name.lower()
    return "__pycache__" in p.parts or name.endswith(COMPILED) or ".so." in name


def _is_runner_config(path: str) -> bool:
    p = PurePosixPath(path)
    if path.startswith(RUNNER_PREFIXES) or any(part in RUNNER_DIRS for part in p.parts[:-1]):
        return True
    if len(p.parts) > 1 and p.parts[-2] == "test" and p.name == "mocha.opts":  # mocha's legacy options
        return True
    return any(fnmatch.fnmatchcase(p.name, g) for names in RUNNER_CONFIG.values() for g in names)


def _names(paths: list[str]) -> str:
    more = f" (+{len(paths) - SHOWN} more)" if len(paths) > SHOWN else ""
    return ", ".join(paths[:SHOWN]) + more


def preempting(changed: Sequence[str], *, python_names: frozenset[str] | None = None,
               base_modules: frozenset[str] = frozenset()) -> list[str]:
    """Risks naming the changed paths (added or modified vs the base) that can run before or instead of the
    code under test, one risk per class. `python_names`: import names of installed distributions to treat
    as shadowable (default: this interpreter's); the standard library and the runners' modules always are.
    `base_modules`: the base's own top-level modules (`top_level_modules` of its paths), never a shadow:
    the project's package has its distribution's name once it is installed."""
    always = (frozenset(sys.stdlib_module_names) | RUNNER_MODULES) - NOT_SHADOWING

    def shadowable(name: str) -> bool:
        # The installed names are read only for a module the base does not have and the standard library and
        # the runners do not name: reading every distribution's file list is 13 MB of the host's peak and most
        # of a job's landing CPU (measured 2026-12-07), for an answer most jobs never need.
        if name in always:
            return True
        return name in (installed_names() if python_names is None else python_names) and name not in NOT_SHADOWING

    classes: dict[str, list[str]] = {"shadow": [], "hook": [], "compiled": [], "config": []}
    for path in dict.fromkeys(changed):
        name = _shadow_name(path)
        if _is_hook(path):
            classes["hook"].append(path)
        elif name is not None and name not in base_modules and shadowable(name):
            classes["shadow"].append(path)
        elif _is_compiled(path):
            classes["compiled"].append(path)
        elif _is_runner_config(path):
            classes["config"].append(path)
    said = {
        "shadow": "a module named like one the test run imports (standard library, installed distribution or "
                  "the runner), found before it",
        "hook": "an import hook Python or the runner loads by itself (.pth, sitecustomize, a dist-info or "
                "egg-info whose entry points pytest loads as plugins)",
        "compiled": "compiled files a reviewer cannot read (bytecode, native libraries, binaries)",
        "config": "configuration a test runner discovers by itself",
    }
    return [f"runs before the code under test: {said[k]}: {_names(v)}" for k, v in classes.items() if v]
