"""The verdict against the base's own run, on the project shapes a new user brings (issue 38), with real
runners: a Django app's sqlite TestCases (Django from PyPI, its own `manage.py test`), a TypeScript library on
vitest whose config makes vite write its cache into node_modules (vitest from npm), a C library whose Makefile
`test` target runs a TAP-printing test binary (the machine's cc and make), a unittest project run through its
Makefile, a package whose ignored `_version.py` is generated at install (hatch-vcs's shape), and a pnpm
workspace whose member runs vitest (pnpm from npm). No config, but where the project's own docs need some.

Each honest fix comes back `completed`, `needs_human_review: false`, no risk; each break `VALIDATION_FAILED`
naming the broken test; a base that cannot run is refused before any agent runs with the line that fixes it.
Confined (bwrap+landlock) like every job; under CI=true a missing tool or registry fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import ecosystems_fetch as fx
from conftest import sh_job
from proctor import Status
from proctor.contract import Code
from proctor.mechanisms.confine import detect

CAPS = detect()
BOTH = CAPS.bwrap is not None and CAPS.landlock
if not BOTH and os.environ.get("CI") == "true":
    pytest.fail("CI must have bwrap and Landlock for the baseline project tests", pytrace=False)
pytestmark = pytest.mark.skipif(not BOTH, reason="needs bubblewrap and Landlock (bwrap+landlock)")
CI = os.environ.get("CI") == "true"


def need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        if CI:
            pytest.fail(f"CI must have {tool}", pytrace=False)
        pytest.skip(f"needs {tool}")
    return found


def job(repo: Path, tmp_path: Path, script: str, branch: str = "master", extra: str = ""):
    """One autodetected job of a `sh` agent running `script`, confine = required."""
    res, _ = sh_job(repo, tmp_path, script, branch, extra)
    assert res.confinement == "bwrap+landlock" or res.code is Code.BASELINE_FAILED, res
    return res


def assert_fixed(res, fixed: str) -> None:
    assert res.status is Status.completed and res.code is Code.OK, (res.known_risks, res.tests_attempted, res.summary)
    assert res.needs_human_review is False and res.known_risks == [], res.known_risks
    compared = res.validation[-1]["compared"]
    assert compared and any(fixed in t for t in compared["fixed"]), compared


def assert_broken(res, broken: str) -> None:
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED, (res.known_risks, res.summary)
    assert res.needs_human_review is True
    assert any(r.startswith("validation failed: ") and broken in r for r in res.known_risks), res.known_risks


def git_repo(root: Path, files: dict[str, str], bug: tuple[str, str, str] | None = None,
             ignore: str = "") -> Path:
    """A repo: master as written, and `broken` one commit on with `bug` (path, good text, bad text)."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / ".gitignore").write_text("__pycache__/\nnode_modules/\n" + ignore)
    run = [["init", "-q", "-b", "master"], ["add", "-A"], ["commit", "-qm", "base"]]
    for argv in run:
        subprocess.run([*fx.GIT, *argv], cwd=root, check=True, capture_output=True)
    if bug:
        path, good, bad = bug
        subprocess.run([*fx.GIT, "checkout", "-q", "-b", "broken"], cwd=root, check=True)
        text = (root / path).read_text()
        assert good in text, (path, good)
        (root / path).write_text(text.replace(good, bad, 1))
        for argv in (["commit", "-qam", "a bug"], ["checkout", "-q", "master"]):
            subprocess.run([*fx.GIT, *argv], cwd=root, check=True, capture_output=True)
    return root


def edit(path: str, frm: str, to: str) -> str:
    return fx.Edit(path, frm, to).script(frm, to)


# -- Django: sqlite TestCases through its own runner -------------------------------------------------------

DJANGO = {
    "manage.py": ("#!/usr/bin/env python\nimport os\nimport sys\n\n\ndef main():\n"
                  "    os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'mysite.settings')\n"
                  "    from django.core.management import execute_from_command_line\n"
                  "    execute_from_command_line(sys.argv)\n\n\nif __name__ == '__main__':\n    main()\n"),
    "mysite/__init__.py": "",
    "mysite/settings.py": ("from pathlib import Path\n\nBASE_DIR = Path(__file__).resolve().parent.parent\n"
                           "SECRET_KEY = 'test-only'\nDEBUG = True\nINSTALLED_APPS = ['shop']\n"
                           "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', "
                           "'NAME': BASE_DIR / 'db.sqlite3'}}\nUSE_TZ = True\n"
                           "DEFAULT_AUTO_FIELD = 'django.db.models.BigAutoField'\n"),
    "shop/__init__.py": "",
    "shop/models.py": ("from django.db import models\n\n\nclass Item(models.Model):\n"
                       "    name = models.CharField(max_length=50)\n    price = models.IntegerField()\n\n"
                       "    def total(self, qty):\n        return self.price * qty\n"),
    "shop/migrations/__init__.py": "",
    "shop/migrations/0001_initial.py": (
        "from django.db import migrations, models\n\n\nclass Migration(migrations.Migration):\n"
        "    initial = True\n    dependencies = []\n    operations = [migrations.CreateModel(name='Item', fields=[\n"
        "        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),\n"
        "        ('name', models.CharField(max_length=50)), ('price', models.IntegerField())])]\n"),
    "shop/tests.py": ("from django.test import TestCase\n\nfrom .models import Item\n\n\nclass ItemTests(TestCase):\n"
                      "    def test_total(self):\n        self.assertEqual(Item.objects.create(name='a', price=3).total(2), 6)\n\n"
                      "    def test_saved(self):\n        Item.objects.create(name='b', price=1)\n"
                      "        self.assertEqual(Item.objects.count(), 1)\n"),
}
DJANGO_BUG = ("shop/models.py", "return self.price * qty", "return self.price + qty")


@pytest.fixture(scope="module")
def django_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("django")
    py = fx.require(fx.django_venv, root / "venv")
    repo = git_repo(root / "site", DJANGO, DJANGO_BUG, ignore="db.sqlite3\n")
    return repo, py


def test_django_app_with_zero_config(django_project, tmp_path, monkeypatch):
    repo, py = django_project
    monkeypatch.setenv("VIRTUAL_ENV", str(py.parent.parent))
    monkeypatch.setenv("PATH", f"{py.parent}{os.pathsep}{os.environ['PATH']}")
    res = job(repo, tmp_path / "fix", edit(*DJANGO_BUG[:1], DJANGO_BUG[2], DJANGO_BUG[1]), "broken")
    assert_fixed(res, "shop.tests.ItemTests.test_total")
    assert res.tests_attempted == ["python manage.py test => exit 0"], res.tests_attempted
    assert res.baseline["steps"][0]["runners"] == ["django"] and res.baseline["steps"][0]["evidence"] == ["unittest"]

    res = job(repo, tmp_path / "break", edit(*DJANGO_BUG))
    assert_broken(res, "shop.tests.ItemTests.test_total")
    assert res.validation[-1]["compared"]["broken"] == ["shop.tests.ItemTests.test_total"]


def test_django_app_without_its_runner_is_refused_with_the_line_that_fixes_it(django_project, tmp_path,
                                                                              monkeypatch, lean_python_bin):
    """The job's repo says pytest (a `validate` a new user wrote): pytest is not where Django is. Refused
    before the agent; the fix line is Django's own runner. Control: the same job with that line completes."""
    repo, py = django_project
    monkeypatch.setenv("VIRTUAL_ENV", str(py.parent.parent))
    monkeypatch.setenv("PATH", f"{py.parent}{os.pathsep}{os.environ['PATH']}")
    marker = "echo ran > agent-ran.txt; "
    fix = marker + edit(*DJANGO_BUG[:1], DJANGO_BUG[2], DJANGO_BUG[1])
    res = job(repo, tmp_path / "pytest", fix, "broken", extra=f'[repos."{repo}"]\nvalidate = "python -m pytest"\n')
    assert res.status is Status.failed and res.code is Code.BASELINE_FAILED, (res.code, res.known_risks)
    assert 'validate = "python manage.py test"' in res.summary, res.summary
    assert not (Path(res.worktree_path) / "agent-ran.txt").exists(), "an agent ran on a base that cannot run"
    ok = job(repo, tmp_path / "manage", fix, "broken", extra=f'[repos."{repo}"]\nvalidate = "python manage.py test"\n')
    assert ok.status is Status.completed and not ok.needs_human_review, ok.known_risks


# -- vitest: a TypeScript library whose config vite bundles into node_modules ------------------------------

VITEST_PKG = {"name": "tsmath", "version": "1.0.0", "type": "module", "private": True,
              "scripts": {"test": "vitest run"}, "devDependencies": {"vitest": "3.2.7"}}
VITEST = {
    "package.json": json.dumps(VITEST_PKG, indent=2) + "\n",
    # A TS config: vite bundles it into node_modules/.vite-temp before it runs (EROFS on a read-only share).
    "vitest.config.ts": "import { defineConfig } from 'vitest/config'\n\nexport default defineConfig({ test: {} })\n",
    "src/math.ts": ("export function clamp(x: number, lo: number, hi: number): number {\n"
                    "  return Math.min(hi, Math.max(lo, x))\n}\n\nexport function double(x: number): number {\n"
                    "  return x * 2\n}\n"),
    "test/math.test.ts": ("import { describe, expect, test } from 'vitest'\nimport { clamp, double } from '../src/math'\n\n"
                          "describe('clamp', () => {\n  test('low', () => expect(clamp(-5, 0, 10)).toBe(0))\n"
                          "  test('high', () => expect(clamp(50, 0, 10)).toBe(10))\n})\n"
                          "test('double', () => expect(double(4)).toBe(8))\n"),
}
VITEST_BUG = ("src/math.ts", "Math.min(hi, Math.max(lo, x))", "Math.max(hi, Math.min(lo, x))")


@pytest.fixture(scope="module")
def vitest_project(tmp_path_factory):
    need("npm")
    cache = fx.require(fx.npm_devdeps, "vitest-3.2.7", {"name": "x", "version": "1.0.0",
                                                        "devDependencies": {"vitest": "3.2.7"}})
    root = tmp_path_factory.mktemp("vitest") / "tsmath"
    for rel, text in VITEST.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    fx.require(fx.npm_install_offline, root, cache)  # node_modules, and the lockfile the project commits
    return git_repo(root, {}, VITEST_BUG)


def test_vitest_library_writing_its_cache_with_zero_config(vitest_project, tmp_path):
    repo = vitest_project
    before = sorted(p.name for p in (repo / "node_modules").iterdir())
    res = job(repo, tmp_path / "fix", edit(VITEST_BUG[0], VITEST_BUG[2], VITEST_BUG[1]), "broken")
    assert_fixed(res, "test/math.test.ts > clamp low")
    assert res.baseline["steps"][0]["evidence"] == ["vitest"], res.baseline
    res = job(repo, tmp_path / "break", edit(*VITEST_BUG))
    assert_broken(res, "clamp low")
    # What vite wrote went to the job's layer, never into the person's node_modules.
    assert sorted(p.name for p in (repo / "node_modules").iterdir()) == before


# -- C: a Makefile `test` target that builds and runs a TAP-printing test binary ---------------------------

C_LIB = {
    "Makefile": ("CC ?= cc\n\ntest: test_runner\n\t./test_runner\n\n"
                 "test_runner: src/strx.c tests/test_strx.c\n\t$(CC) -Isrc -o $@ src/strx.c tests/test_strx.c\n\n"
                 ".PHONY: test\n"),
    "src/strx.h": "int strx_len(const char *s);\nvoid strx_rev(char *s);\n",
    "src/strx.c": ("#include \"strx.h\"\n\nint strx_len(const char *s) {\n    int n = 0;\n    while (s[n]) n++;\n"
                   "    return n;\n}\n\nvoid strx_rev(char *s) {\n    int n = strx_len(s);\n"
                   "    for (int i = 0; i < n / 2; i++) {\n        char t = s[i];\n        s[i] = s[n - 1 - i];\n"
                   "        s[n - 1 - i] = t;\n    }\n}\n"),
    "tests/test_strx.c": ("#include <stdio.h>\n#include <string.h>\n#include \"strx.h\"\n\nstatic int n, bad;\n"
                          "static void check(const char *name, int ok) {\n"
                          "    printf(\"%sok %d - %s\\n\", ok ? \"\" : \"not \", ++n, name);\n    bad += !ok;\n}\n\n"
                          "int main(void) {\n    char a[] = \"abc\", b[] = \"abcd\";\n    printf(\"1..3\\n\");\n"
                          "    check(\"len\", strx_len(\"hello\") == 5);\n    strx_rev(a);\n"
                          "    check(\"rev odd\", strcmp(a, \"cba\") == 0);\n    strx_rev(b);\n"
                          "    check(\"rev even\", strcmp(b, \"dcba\") == 0);\n    return bad != 0;\n}\n"),
}
C_BUG = ("src/strx.c", "i < n / 2", "i < n / 2 - 1")


def test_c_library_make_test_running_a_tap_binary_with_zero_config(tmp_path):
    need("cc")
    need("make")
    repo = git_repo(tmp_path / "strx", C_LIB, C_BUG, ignore="test_runner\n")
    res = job(repo, tmp_path / "fix", edit(C_BUG[0], C_BUG[2], C_BUG[1]), "broken")
    assert_fixed(res, "rev even")
    assert res.baseline["steps"][0]["evidence"] == ["tap"], res.baseline
    res = job(repo, tmp_path / "break", edit(*C_BUG))
    assert_broken(res, "rev even")


# -- unittest through the project's Makefile ------------------------------------------------------------------

UNITTEST = {
    "pyproject.toml": "[project]\nname = 'textutil'\nversion = '1.0'\n",
    "Makefile": "test:\n\tpython -m unittest discover -s tests -t . -v\n",
    "textutil/__init__.py": "def words(s):\n    return s.split()\n\n\ndef shout(s):\n    return s.upper() + '!'\n",
    "tests/__init__.py": "",
    "tests/test_textutil.py": ("import unittest\n\nfrom textutil import shout, words\n\n\nclass T(unittest.TestCase):\n"
                               "    def test_words(self):\n        self.assertEqual(words('a b'), ['a', 'b'])\n\n"
                               "    def test_shout(self):\n        self.assertEqual(shout('hi'), 'HI!')\n"),
}
UNITTEST_BUG = ("textutil/__init__.py", "return s.upper() + '!'", "return s.upper()")


def test_unittest_run_through_make_with_zero_config(tmp_path, monkeypatch, lean_python_bin):
    monkeypatch.setenv("PATH", f"{lean_python_bin}{os.pathsep}{os.environ['PATH']}")
    repo = git_repo(tmp_path / "textutil", UNITTEST, UNITTEST_BUG)
    res = job(repo, tmp_path / "fix", edit(UNITTEST_BUG[0], UNITTEST_BUG[2], UNITTEST_BUG[1]), "broken")
    assert_fixed(res, "tests.test_textutil.T.test_shout")
    assert res.tests_attempted == ["make test => exit 0"] and res.baseline["steps"][0]["evidence"] == ["unittest"]
    res = job(repo, tmp_path / "break", edit(*UNITTEST_BUG))
    assert_broken(res, "tests.test_textutil.T.test_shout")


# -- a generated, ignored version file (hatch-vcs's shape) -------------------------------------------------

VERSIONED = {
    "pyproject.toml": "[project]\nname = 'verlib'\ndynamic = ['version']\n",
    "verlib/__init__.py": "from ._version import __version__\n\n\ndef inc(x):\n    return x + 1\n",
    "tests/test_verlib.py": "from verlib import __version__, inc\n\n\ndef test_inc():\n    assert inc(1) == 2\n\n\n"
                            "def test_version():\n    assert __version__\n",
}
VERSIONED_BUG = ("verlib/__init__.py", "return x + 1", "return x + 2")


def test_a_generated_version_file_is_named_by_the_refusal_and_copy_fixes_it(tmp_path, monkeypatch, lean_python_bin):
    monkeypatch.setenv("PATH", f"{lean_python_bin}{os.pathsep}{os.environ['PATH']}")
    repo = git_repo(tmp_path / "verlib", VERSIONED, VERSIONED_BUG, ignore="verlib/_version.py\n")
    (repo / "verlib" / "_version.py").write_text("__version__ = '1.2.3'\n")  # what the build generated
    fix = "echo ran > agent-ran.txt; " + edit(VERSIONED_BUG[0], VERSIONED_BUG[2], VERSIONED_BUG[1])
    res = job(repo, tmp_path / "plain", fix, "broken")
    assert res.status is Status.failed and res.code is Code.BASELINE_FAILED, (res.code, res.known_risks)
    assert 'copy = ["verlib/_version.py"]' in res.summary, res.summary
    assert not (Path(res.worktree_path) / "agent-ran.txt").exists()
    line = f'[repos."{repo}"]\ncopy = ["verlib/_version.py"]\n'
    res = job(repo, tmp_path / "fix", edit(VERSIONED_BUG[0], VERSIONED_BUG[2], VERSIONED_BUG[1]), "broken", line)
    assert_fixed(res, "tests/test_verlib.py::test_inc")
    res = job(repo, tmp_path / "break", edit(*VERSIONED_BUG), "master", line)
    assert_broken(res, "tests/test_verlib.py::test_inc")


# -- a pnpm workspace whose member runs vitest --------------------------------------------------------------

PNPM = {
    "package.json": json.dumps({"name": "ws", "private": True, "scripts": {"test": "pnpm -r test"}}) + "\n",
    "pnpm-workspace.yaml": "packages:\n  - 'packages/*'\n",
    "packages/core/package.json": json.dumps({"name": "@ws/core", "version": "1.0.0", "type": "module",
                                              "scripts": {"test": "vitest run"},
                                              "devDependencies": {"vitest": "3.2.7"}}) + "\n",
    "packages/core/src/index.js": "export function sum(xs) {\n  return xs.reduce((a, b) => a + b, 0)\n}\n",
    "packages/core/test/index.test.js": ("import { expect, test } from 'vitest'\nimport { sum } from '../src/index.js'\n\n"
                                         "test('sums', () => expect(sum([1, 2, 3])).toBe(6))\n"
                                         "test('empty', () => expect(sum([])).toBe(0))\n"),
}
PNPM_BUG = ("packages/core/src/index.js", "(a, b) => a + b, 0", "(a, b) => a + b, 1")


@pytest.fixture(scope="module")
def pnpm_workspace(tmp_path_factory):
    need("npm")
    pnpm = fx.require(fx.pnpm_binary)
    root = tmp_path_factory.mktemp("pnpm") / "ws"
    for rel, text in PNPM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    fx.require(fx.pnpm_install, root)  # node_modules at the root and the member's, pnpm-lock.yaml
    repo = git_repo(root, {}, PNPM_BUG)
    return repo, Path(pnpm).parent


def test_pnpm_workspace_member_on_vitest_with_zero_config(pnpm_workspace, tmp_path, monkeypatch):
    repo, pnpm_bin = pnpm_workspace
    monkeypatch.setenv("PATH", f"{pnpm_bin}{os.pathsep}{os.environ['PATH']}")
    res = job(repo, tmp_path / "fix", edit(PNPM_BUG[0], PNPM_BUG[2], PNPM_BUG[1]), "broken")
    assert_fixed(res, "sums")
    assert res.tests_attempted == ["pnpm test => exit 0"], res.tests_attempted
    res = job(repo, tmp_path / "break", edit(*PNPM_BUG))
    assert_broken(res, "sums")

