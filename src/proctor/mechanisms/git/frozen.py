"""Frozen checks: which files define the tests, and the job's tree with the base's versions of them.

Owns the documented list of test-defining files per ecosystem (docs "Frozen checks") and building the
tree that runs the base's tests against the agent's code. An agent that edits one of these files may be
choosing its own verdict (found in review: a weakened assertion, a `GNUmakefile` beside the Makefile, a
`.pytest.ini` loading a plugin, a `pytest/` package shadowing the runner), so a change to any is a risk,
and validation runs a second time on the frozen tree. It never runs anything itself.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from proctor.mechanisms.git.command import git
from proctor.mechanisms.git.worktree import Failure

# Any file below a directory of one of these names.
TEST_DIRS = frozenset({"test", "tests", "testing", "__tests__", "spec", "specs", "testdata", "benches", "e2e"})
# Any file of one of these names, at any depth.
NAMES = frozenset({
    # Python
    "conftest.py", "pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "tox.ini", "tox.toml", "setup.cfg",
    "pyproject.toml", "noxfile.py",
    "setup.py", "sitecustomize.py", "usercustomize.py", ".coveragerc",
    # a dist-info/egg-info's entry points: pytest loads them as plugins, importlib.metadata finds them on sys.path
    "entry_points.txt",
    # make
    "Makefile", "GNUmakefile", "makefile",
    # Node
    "package.json", ".npmrc", ".yarnrc", ".yarnrc.yml", ".pnpmfile.cjs", ".mocharc", ".nycrc",
    "node.config.json", ".pnp.cjs", ".pnp.loader.mjs", "pnpm-workspace.yaml", "bunfig.toml", "deno.json",
    "deno.jsonc",
    # Rust
    "Cargo.toml", "build.rs", "rust-toolchain", "rust-toolchain.toml",
    # Go
    "go.mod", "go.sum", "go.work", "go.work.sum",
    # .NET
    "Directory.Build.props", "Directory.Build.targets", "Directory.Packages.props", "global.json", "nuget.config",
    "NuGet.Config",
    # proctor's own per-repo config
    ".proctor.toml",
})
# File-name globs, at any depth.
GLOBS = ("test_*.py", "*_test.py", "*_test.go", "*.test.*", "*.spec.*", "*.mk", "*.pth", "*.sln", "*.csproj",
         "*.fsproj", "*.vbproj", ".mocharc.*", "jest.config.*", "vitest.config.*", "vite.config.*",
         "vitest.workspace.*", "karma.conf.*", "ava.config.*", "playwright.config.*", "cypress.config.*",
         "babel.config.*",
         ".babelrc*", ".nycrc.*", "*.runsettings")
# Paths (from the root) that steer a runner: cargo's runner override, vendored node modules, Go's vendor
# manifest (its presence turns on -mod=vendor).
PREFIXES = (".cargo/", "node_modules/", "vendor/modules.txt")
# Top-level modules a Python test run imports before any test: a file or package of the same name at the
# root shadows them (`python -m pytest` puts the root first on sys.path).
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "unittest",
                            "exceptiongroup", "tomli", "colorama", "coverage", "hypothesis", "site", "encodings"})


def is_test_defining(path: str) -> bool:
    p = PurePosixPath(path)
    parts = p.parts
    if not parts:
        return False
    if any(part in TEST_DIRS for part in parts[:-1]) or p.name in NAMES:
        return True
    if any(fnmatch.fnmatchcase(p.name, g) for g in GLOBS) or path.startswith(PREFIXES):
        return True
    top = parts[0]
    module = top[:-3] if len(parts) == 1 and top.endswith(".py") else top if len(parts) > 1 else None
    return module in RUNNER_MODULES


def test_defining(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if is_test_defining(p)]


def frozen_tree(git_dir: Path, index: Path, commit: str, base: str, touched: list[str]) -> str | Failure:
    """The tree of `commit` with every path of `touched` as the base has it: restored where the base has
    it, removed where the agent added it."""
    read = git(["read-tree", commit], git_dir=git_dir, index_file=index)
    if not read.ok:
        return Failure(f"git read-tree failed: {read.err}")
    listing = git(["ls-tree", "-r", "-z", "--full-tree", base, "--", *touched], git_dir=git_dir)
    if not listing.ok:
        return Failure(f"git ls-tree of the base failed: {listing.err}")
    in_base: dict[str, str] = {}
    for entry in listing.out.split(b"\0"):
        if entry:
            meta, name = entry.split(b"\t", 1)
            mode, _kind, sha = meta.decode().split(" ")
            in_base[name.decode("utf-8", "surrogateescape")] = f"{mode},{sha}"
    lines = []
    for path in touched:
        if path in in_base:
            mode, sha = in_base[path].split(",")
            lines.append(f"{mode} {sha}\t{path}")
        else:
            lines.append(f"0 {'0' * len(base)}\t{path}")  # mode 0 removes the entry
    info = git(["update-index", "-z", "--index-info"], git_dir=git_dir, index_file=index,
               input_bytes=b"\0".join(line.encode("utf-8", "surrogateescape") for line in lines) + b"\0")
    if not info.ok:
        return Failure(f"git update-index failed: {info.err}")
    tree = git(["write-tree"], git_dir=git_dir, index_file=index)
    return tree.text if tree.ok else Failure(f"git write-tree failed: {tree.err}")
