"""The reference pages, made from the code each time the site is built (an mkdocs hook), so they cannot
drift from it: every command and option of the CLI (from click), every key of config.toml, .proctor.toml
and policy.toml (from the pydantic models and the settings' key list, each with the comment the code gives
it), the request's and result's JSON schema (from the contract's models), and every stable code (from the
enums, with their comments). tests/test_docs.py checks that nothing is missing.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import click
from pydantic import BaseModel

FIELD_RE = re.compile(r"^\s+(\w+)\s*:[^#\n]*?(?:#\s*(.*))?$")
MEMBER_RE = re.compile(r"^\s+(\w+)\s*=\s*[^#\n]*?(?:#\s*(.*))?$")


def _comments(cls: type, pattern: re.Pattern[str]) -> dict[str, str]:
    """Each field's (or member's) comment in the class's source: its own line's, else the lines above it."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").rstrip())
            continue
        m = pattern.match(line)
        if m and m.group(1) not in out and not line.startswith("        "):
            out[m.group(1)] = (m.group(2) or " ".join(above)).strip()
        above = []
    return out


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the CLI ------------------------------------------------------------------------------------------

def _commands(group: click.Group, prefix: str = "") -> Iterable[tuple[str, click.Command]]:
    ctx = click.Context(group)
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        if cmd is None:
            continue
        yield f"{prefix}{name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")


def cli_markdown() -> str:
    from proctor.surfaces.cli.main import load_all, main

    load_all()
    out = ["# The CLI", "", "Every `proctor` command and option, as `proctor COMMAND --help` prints them (generated "
           "from the code when this site is built).", ""]
    for name, cmd in _commands(main):
        out += [f"## `proctor {name}`", "", (cmd.help or "").strip(), ""]
        params = [p for p in cmd.params if not (isinstance(p, click.Option) and p.name == "help")]
        if not params:
            continue
        out += ["| argument or option | type | default | what it does |", "|---|---|---|---|"]
        for p in params:
            if isinstance(p, click.Argument):
                label = f"`{p.name.upper()}`"
                what = ""
            else:
                label = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
                what = p.help or ""
            kind = "flag" if getattr(p, "is_flag", False) else p.type.name
            default = p.default if p.default not in (None, (), False) and not callable(p.default) else ""
            out.append(f"| {label} | {_md(str(kind))} | {_md(str(default))} | {_md(what)} |")
        out.append("")
    return "\n".join(out) + "\n"


# -- configuration ------------------------------------------------------------------------------------------

def _model_rows(model: type[BaseModel], skip: Iterable[str] = ()) -> list[str]:
    notes = _comments(model, FIELD_RE)
    rows = ["| key | type | default | what it is |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        key = field.alias or name
        kind = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
        default = "" if field.is_required() else (
            "(set)" if field.default_factory is not None else json.dumps(field.default, default=str))
        what = field.description or notes.get(name, "")
        rows.append(f"| `{key}` | {_md(kind)} | {_md(default)} | {_md(what)} |")
    return rows + [""]


def config_markdown() -> str:
    from proctor.mechanisms.adapters.spec import AdapterSpec
    from proctor.mechanisms.config import model, settings
    from proctor.mechanisms.policy import budget, trusted

    tables = [(f"[{name}]", field.annotation) for name, field in model.Config.model_fields.items()
              if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)]
    top_skip = {name for name, f in model.Config.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)} | {"source", "overlays"}
    out = ["# Configuration keys", "",
           "Every key proctor reads from `$PROCTOR_HOME/config.toml`, a repo's `.proctor.toml` and "
           "`$PROCTOR_HOME/policy.toml` (generated from the code when this site is built). How to use them: "
           "[Configuration](configuration.md).", "", "## config.toml: top level", "",
           *_model_rows(model.Config, top_skip)]
    for title, table in tables:
        out += [f"## config.toml: `{title}`", "", *_model_rows(table)]
    out += ["## config.toml: `[agents.<name>]` (an agent: a built-in's keys overlaid, or one you declare)", "",
            *_model_rows(AdapterSpec, ("name",)),
            "## config.toml: `[auto_land.\"<repo>\"]`", "", *_model_rows(model.AutoLand),
            "## `[repos.\"<repo>\"]` in config.toml, or a repo's own `.proctor.toml`", "",
            "| key | what it is |", "|---|---|"]
    notes = _comments(settings.RepoSettings, FIELD_RE)
    out += [f"| `{k}` | {_md(notes.get(k, ''))} |" for k in settings.KEYS] + [""]
    out += ["## policy.toml (the trusted policy: never a request's, never a repo's)", ""]
    for name, field in trusted._PolicyFile.model_fields.items():  # noqa: SLF001 - the file's own shape
        ann = field.annotation
        inner = next((a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)),
                     ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None)
        if inner is not None:
            out += [f"### `[{field.alias or name}]`" + (" (each `[budgets.<name>]`)" if name == "budgets" else ""),
                    "", *_model_rows(inner)]
        else:
            out += [f"### `{field.alias or name}`", ""]
    if not any("budgets" in line for line in out):
        out += ["### `[budgets.<name>]`", "", *_model_rows(budget.BudgetTable)]
    return "\n".join(out) + "\n"


# -- the contract: schemas and codes ---------------------------------------------------------------------------

def schema_markdown() -> str:
    from proctor.contract import RaceResult, RunAgentRequest, RunAgentResult

    out = ["# The request and the result", "",
           "The run_agent contract's JSON schemas (v1: the first nine result fields are frozen, the rest "
           "additive), generated from the models in `proctor.contract` when this site is built. `proctor schema` "
           "prints the same.", ""]
    for model in (RunAgentRequest, RunAgentResult, RaceResult):
        out += [f"## `{model.__name__}`", "", (model.__doc__ or "").strip(), "",
                *_model_rows(model), "```json", json.dumps(model.model_json_schema(by_alias=True), indent=2),
                "```", ""]
    return "\n".join(out) + "\n"


def code_enums() -> list[tuple[str, str, type[enum.Enum] | dict[str, str]]]:
    from proctor import contract
    from proctor.services.commands.codes import RequestCode
    from proctor.services.listen.checks import Refusal
    from proctor.services.review import outcome
    from proctor.surfaces.mcp import results

    mcp = {k: v for k, v in vars(results).items() if k.isupper() and isinstance(v, str) and v == k}
    return [("A job's result (`code`)", "proctor.contract.Code", contract.Code),
            ("Review verbs (land, discard, show, ...)", "proctor.services.review.outcome.Code", outcome.Code),
            ("Command requests (`proctor run-request`)", "proctor.services.commands.codes.RequestCode", RequestCode),
            ("The queue's refusals (a signed result's `refusal`)", "proctor.services.listen.checks.Refusal", Refusal),
            ("MCP tool errors", "proctor.surfaces.mcp.results", mcp)]


def codes_markdown() -> str:
    out = ["# Stable codes", "", "Every code proctor answers with, by where it appears; additive only, never "
           "renamed (generated from the enums when this site is built).", ""]
    for title, where, codes in code_enums():
        notes = _comments(codes, MEMBER_RE) if isinstance(codes, type) else _module_notes(where)
        names = [c.value for c in codes] if isinstance(codes, type) else sorted(codes)
        out += [f"## {title}", "", f"`{where}`", "", "| code | what it means |", "|---|---|"]
        out += [f"| `{n}` | {_md(notes.get(n, ''))} |" for n in names] + [""]
    return "\n".join(out) + "\n"


def _module_notes(module: str) -> dict[str, str]:
    import importlib

    src = inspect.getsource(importlib.import_module(module)).splitlines()
    return {m.group(1): (m.group(2) or "").strip() for line in src if (m := re.match(r"^(\w+)\s*=\s*\"\w+\"\s*(?:#\s*(.*))?$", line))}


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_markdown,
    "reference/config-keys.md": config_markdown,
    "reference/schema.md": schema_markdown,
    "reference/codes.md": codes_markdown,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        files.append(File.generated(config, path, content=make()))
    return files
