"""The documentation site (issue 43): it builds offline with `--strict` and no warning (a broken link, a
missing anchor, an example file the page includes that is gone all fail it), and the reference generated
from the code lists every CLI command and option, every config key and every stable code: a test fails when
one is missing, so a new flag or code cannot go undocumented."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]


def reference():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strict_with_no_warning(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "WARNING" not in said, said[-4000:]
    index = (tmp_path / "site" / "index.html").read_text()
    assert "the host, not the agent" in index.lower() or "judges the" in index
    for page in ("reference/cli/index.html", "reference/codes/index.html", "howto/go/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # A how-to page carries its example's real files (snippets), not a copy that could drift.
    go = (tmp_path / "site" / "howto" / "go" / "index.html").read_text()
    assert "TestMul" in go and "sed" in go


def test_the_cli_reference_lists_every_command_and_option():
    from proctor.surfaces.cli.main import load_all, main

    text = reference().cli_markdown()
    load_all()
    missing = []
    for name, cmd in reference()._commands(main):  # noqa: SLF001
        if f"`proctor {name}`" not in text:
            missing.append(name)
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help":
                missing += [f"{name} {o}" for o in p.opts if f"`{o}`" not in text]
    assert not missing, missing
    assert "`proctor race`" in text and "`--continue`" in text  # the control: it does list what it should


def test_the_config_reference_lists_every_key():
    from proctor.mechanisms.adapters.spec import AdapterSpec
    from proctor.mechanisms.config import model, settings

    text = reference().config_markdown()
    models = [model.Config, model.BreakerSettings, model.LimitsSettings, model.QueueSettings, model.ServeSettings,
              model.AutoLand, AdapterSpec]
    missing = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items()
               if name not in ("source", "overlays", "name", "breaker", "limits", "queue", "serve")
               and f"`{f.alias or name}`" not in text]
    missing += [k for k in settings.KEYS if f"`{k}`" not in text]
    assert not missing, missing


def test_the_codes_reference_lists_every_code():
    ref = reference()
    text = ref.codes_markdown()
    missing = [f"{where}.{c}" for _, where, codes in ref.code_enums()
               for c in ([m.value for m in codes] if isinstance(codes, type) else codes) if f"`{c}`" not in text]
    assert not missing, missing
    from proctor.contract import Code

    assert all(f"`{c.value}`" in text for c in Code) and "`NOT_AS_SHOWN`" in text
