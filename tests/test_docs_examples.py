"""The how-to pages' examples (docs/howto/*.md include them from docs/examples/): each project is committed into a
fresh repo and run as a real confined job with its page's change, so a page cannot show an example that
does not work. A fix comes back completed with nothing for a person to look at; a break fails validation.
Issue 43: "each page's example run by the test suite so it cannot rot"."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import ecosystems_fetch as fx  # at import, while HOME is still the real one (its REAL_HOME)
from conftest import make_repo, sh_job
from proctor.contract import Code, Status
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
PROJECTS = sorted(p.name for p in EXAMPLES.iterdir() if (p / "project").is_dir())
TOOLS = {"go": "go", "rust": "cargo", "c-make": "make", "node": "npm", "workspaces": "npm"}
CONFINED = detect().bwrap is not None
if not CONFINED and os.environ.get("CI") == "true":
    pytest.fail("CI must have bubblewrap for the docs examples", pytrace=False)



def project(name: str, tmp_path: Path, monkeypatch) -> Path:
    if name == "rust":  # rustup's proxy finds its toolchain under the real home, which the suite moves
        for var, value in fx.require(fx.rust_env).items():
            monkeypatch.setenv(var, value)
    tool = TOOLS.get(name)
    if tool and shutil.which(tool) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must have {tool} for the {name} example", pytrace=False)
        pytest.skip(f"needs {tool}")
    root = EXAMPLES / name / "project"
    files = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}
    return make_repo(tmp_path, files)


@pytest.mark.skipif(not CONFINED, reason="needs bubblewrap")
@pytest.mark.parametrize("name", PROJECTS)
def test_a_how_to_pages_example_fix_completes_and_its_break_fails(name, tmp_path, monkeypatch):
    repo = project(name, tmp_path, monkeypatch)
    fix = (EXAMPLES / name / "fix.sh").read_text()
    res, _ = sh_job(repo, tmp_path / "fix", fix)
    assert res.status is Status.completed and res.needs_human_review is False, (res.known_risks, res.summary)
    assert res.known_risks == [] and res.validation, res.validation
    brk = EXAMPLES / name / "break.sh"
    if brk.is_file():
        bad, _ = sh_job(repo, tmp_path / "break", brk.read_text())
        assert bad.status is Status.failed and bad.code is Code.VALIDATION_FAILED, (bad.known_risks, bad.summary)


def test_the_own_model_pages_config_loads_as_shown(tmp_path, monkeypatch):
    config = load_config(EXAMPLES / "own-model" / "config.toml")
    claude, local = config.adapter("claude"), config.adapter("local")
    assert claude is not None and claude.env.get("ANTHROPIC_BASE_URL") == "https://gateway.internal:4000"
    assert claude.egress == ("gateway.internal:4000",)
    assert local is not None and local.command[0] == "my-agent-cli" and local.prompt == "stdin"


def test_the_uv_pages_settings_read_as_a_repos_own():
    from proctor.mechanisms.config.settings import parse_settings

    import tomllib

    got = parse_settings(tomllib.loads((EXAMPLES / "uv-poetry" / "proctor.toml").read_text()), ".proctor.toml")
    assert got.setup == ("uv sync --frozen --offline",) and "pypi.org" in got.registries
