"""User configuration (TOML): declared agents and host settings, merged over the built-in adapters.

Owns finding the config file (`--config FILE`, else `$PROCTOR_CONFIG`, else `$PROCTOR_HOME/config.toml`),
parsing it and the built-ins through the same loader, and reporting a bad file: every problem at once, one a
line, as `file:line key: what is wrong, what is allowed` in proctor's words (never pydantic's: "Extra
inputs are not permitted" for a typo sent a user to the source, issue 24). It never holds trusted policy
(ceilings, forbidden effects): that is `policy.toml`, which a caller cannot pass. The types it fills are
proctor.mechanisms.config.model's.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from proctor.home import proctor_home
from proctor.mechanisms.adapters.spec import AdapterSpec
from proctor.mechanisms.config.model import Config
# Read from here by mechanisms/queue/connection.py, mechanisms/queue/testing.py and surfaces/cli/queue.py,
# until they import it from proctor.mechanisms.config.model.


class ConfigError(Exception):
    """An unusable config file: `problems` holds every one found, each naming the file, line and key; the
    message is them one a line."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


# -- problems, in the user's words ------------------------------------------------------------------------

# Set by the loader, never by a user: a file naming one is told it is not a key.
INTERNAL_KEYS = {Config: ("overlays", "source"), AdapterSpec: ("name",)}
_BARE = r"[A-Za-z0-9_-]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"|\'[^\']*\''
_KEY_PART = re.compile(rf"\s*({_BARE}|{_QUOTED})\s*(\.|$)")
_HEADER = re.compile(r"^\s*\[\[?([^\[\]]+)\]\]?\s*(#.*)?$")
_ASSIGN = re.compile(rf"^\s*((?:{_BARE}|{_QUOTED})(?:\s*\.\s*(?:{_BARE}|{_QUOTED}))*)\s*=")


def _key_path(text: str) -> tuple[str, ...]:
    parts, at = [], 0
    while at < len(text):
        m = _KEY_PART.match(text, at)
        if m is None:
            return ()
        raw = m.group(1)
        parts.append(raw[1:-1] if raw[:1] in "\"'" else raw)
        at = m.end()
    return tuple(parts)


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The line each table header and key of a TOML text is on, by its full dotted path. tomllib keeps no
    positions, so the text is scanned: headers, `key =` lines, multi-line strings skipped; a key inside an
    inline table is found by its table's line."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    open_quote: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if open_quote is not None:
            if line.count(open_quote) % 2:
                open_quote = None
            continue
        header = _HEADER.match(line)
        if header:
            table = _key_path(header.group(1).strip())
            lines.setdefault(table, n)
            continue
        assign = _ASSIGN.match(line)
        if assign:
            lines.setdefault(table + _key_path(assign.group(1)), n)
            rest = line[assign.end():]
            for quote in ('"""', "\'\'\'"):
                if rest.count(quote) % 2:
                    open_quote = quote
    return lines


@dataclass(frozen=True)
class _Source:
    """One TOML file as problems name it: its name and where its keys are."""

    name: str
    lines: dict[tuple[str, ...], int]

    def problem(self, loc: tuple[str | int, ...], what: str) -> str:
        path = tuple(str(p) for p in loc)
        line = next((self.lines[path[:i]] for i in range(len(path), 0, -1) if path[:i] in self.lines), None)
        key = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) if _plain(p) else
                      (f'."{p}"' if i else f'"{p}"') for i, p in enumerate(loc))
        return f"{self.name}{f':{line}' if line else ''} {key}: {what}" if key else \
            f"{self.name}{f':{line}' if line else ''}: {what}"


def _plain(part: object) -> bool:
    return isinstance(part, int) or bool(re.fullmatch(_BARE, str(part)))


def _model_at(model: type[BaseModel], path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model whose keys sit at `path` under `model`, through nested models and dicts of them."""
    i = 0
    while i < len(path):
        field = None if isinstance(path[i], int) else model.model_fields.get(str(path[i]))
        if field is None:
            return None
        ann = field.annotation
        if typing.get_origin(ann) is dict:
            ann, i = typing.get_args(ann)[1], i + 1  # past the dict's own key (a name, a path)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model, i = ann, i + 1
    return model


def allowed_keys(model: type[BaseModel]) -> list[str]:
    return [k for k in model.model_fields if k not in INTERNAL_KEYS.get(model, ())]


def unknown_key(key: str, known: list[str]) -> str:
    """`what is wrong, what is allowed` for a key no table has, with the closest known key when one is."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return f"unknown key (known: {', '.join(known)})"


def _got(value: object) -> str:
    if isinstance(value, (dict, list, tuple)):
        return {dict: "a table", list: "a list", tuple: "a list"}[type(value)]
    shown = repr(value)
    kind = {str: "text", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), type(value).__name__)
    return f"{kind} {shown}" if len(shown) <= 40 else kind


_TYPE_WORDS = {"tuple_type": "a list", "list_type": "a list", "set_type": "a list", "string_type": "a string",
               "int_type": "a whole number", "int_parsing": "a whole number", "int_from_float": "a whole number",
               "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
               "bool_parsing": "true or false", "dict_type": "a table", "model_type": "a table",
               "model_attributes_type": "a table", "finite_number": "a finite number"}


def plain_error(err: ErrorDetails) -> str:
    """One pydantic error in proctor's words: what is wrong, then what is allowed."""
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "missing":
        return "missing: this key is required"
    if kind in _TYPE_WORDS:
        return f"got {_got(given)}, must be {_TYPE_WORDS[kind]}"
    if kind == "literal_error":
        return f"{given!r} is not allowed; use {ctx.get('expected')}"
    bounds = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
              "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}
    if kind in bounds:
        words, name = bounds[kind]
        return f"{given!r} is out of range: must be {words} {ctx.get(name)}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "too_short":
        return f"must have at least {ctx.get('min_length')} item(s)"
    if kind == "string_pattern_mismatch":
        return f"{given!r} has a form not allowed (it must match {ctx.get('pattern')})"
    if kind == "value_error" and ctx.get("error") is not None:
        return str(ctx["error"])
    return err["msg"].removeprefix("Value error, ")


def _problems_of(exc: ValidationError, model: type[BaseModel], src: _Source, prefix: tuple[str, ...]) -> list[str]:
    out = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            what = unknown_key(str(loc[-1]), allowed_keys(parent)) if parent else "unknown key"
        else:
            what = plain_error(err)
        out.append(src.problem(prefix + loc, what))
    return out


# -- loading ------------------------------------------------------------------------------------------------

def _parse_agents(raw: Any, src: _Source, problems: list[str]) -> dict[str, AdapterSpec]:
    """Every adapter table that is valid; each problem of the others appended to `problems`."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(src.problem(("agents",), f"got {_got(raw)}, must be a table of adapters ([agents.NAME])"))
        return {}
    out = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            problems.append(src.problem(("agents", name), f"got {_got(table)}, must be a table"))
            continue
        if "name" in table:
            problems.append(src.problem(("agents", name, "name"), "not a key: an adapter's name is its table's"))
            continue
        try:
            out[name] = AdapterSpec.model_validate({**table, "name": name})
        except ValidationError as exc:
            problems.extend(_problems_of(exc, AdapterSpec, src, ("agents", name)))
    return out


def _read_toml(text: str, origin: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib says "(at line N, column M)": the line goes where every other problem puts it.
        m = re.search(r"\s*\(at line (\d+), column \d+\)$", str(exc))
        where = f"{origin}:{m.group(1)}" if m else origin
        raise ConfigError(f"{where}: not valid TOML: {str(exc)[:m.start()] if m else exc}") from None


def _builtin_tables() -> dict[str, Any]:
    text = resources.files("proctor.mechanisms.adapters").joinpath("builtin.toml").read_text(encoding="utf-8")
    return _read_toml(text, "builtin.toml").get("agents") or {}


def builtin_agents() -> dict[str, AdapterSpec]:
    problems: list[str] = []
    agents = _parse_agents(_builtin_tables(), _Source("builtin.toml", {}), problems)
    if problems:
        raise ConfigError(problems)
    return agents


def _overlay(builtins: dict[str, Any], user: Any) -> tuple[Any, dict[str, tuple[str, ...]]]:
    """A user table named like a built-in overlays it key by key (its `env` too, variable by variable): a
    user adds a base URL or a model without copying the command. Other names are new adapters, whole."""
    if not isinstance(user, dict):
        return user, {}  # _parse_agents says what is wrong with it
    tables: dict[str, Any] = {}
    overlays: dict[str, tuple[str, ...]] = {}
    for name, table in user.items():
        base = builtins.get(name)
        if not isinstance(table, dict) or not isinstance(base, dict):
            tables[name] = table
            continue
        env = table.get("env")
        merged = {**base, **table}
        if isinstance(env, dict) and isinstance(base.get("env"), dict):
            merged["env"] = {**base["env"], **env}
        tables[name] = merged
        overlays[name] = tuple(sorted(
            [k for k in table if k != "env"] + [f"env.{k}" for k in (env if isinstance(env, dict) else {})]))
    return tables, overlays


def _repo_problems(raw: Any, src: _Source) -> list[str]:
    """`[repos."/abs/path"]` tables checked one key at a time, so a typo is named beside the other problems
    (proctor.mechanisms.config.settings.parse_settings stops at its first)."""
    from proctor.mechanisms.config.settings import KEYS, parse_settings

    if not isinstance(raw, dict):
        return [src.problem(("repos",), f"got {_got(raw)}, must be a table of repos ([repos.\"/abs/path\"])")]
    out = []
    for path, table in raw.items():
        if not Path(path).is_absolute():
            out.append(src.problem(("repos", path), "must name an absolute path (the repo's top folder)"))
        if not isinstance(table, dict):
            out.append(src.problem(("repos", path), f"got {_got(table)}, must be a table"))
            continue
        out += [src.problem(("repos", path, k), unknown_key(k, list(KEYS))) for k in table if k not in KEYS]
        origin = f"repos.{path}"
        try:
            parse_settings({k: v for k, v in table.items() if k in KEYS}, origin)
        except ValueError as exc:
            what = str(exc).removeprefix(f"{origin}: ")
            key = what.split(" ", 1)[0]
            loc = ("repos", path, key) if key in KEYS else ("repos", path)
            out.append(src.problem(loc, what.removeprefix(f"{key} ") if key in KEYS else what))
    return out


def config_path(explicit: str | Path | None = None) -> Path | None:
    if explicit:
        return Path(explicit)
    env = os.environ.get("PROCTOR_CONFIG")
    if env:
        return Path(env)
    default = proctor_home() / "config.toml"
    return default if default.is_file() else None


def load_config(explicit: str | Path | None = None) -> Config:
    """The config: the built-in adapters, the user's file over them. Every problem of the file is one
    line of the ConfigError raised, none hidden behind the first."""
    path = config_path(explicit)
    builtins = _builtin_tables()
    agents = builtin_agents()
    data: dict[str, Any] = {}
    overlays: dict[str, tuple[str, ...]] = {}
    problems: list[str] = []
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"config {path}: cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {path}: cannot be read: not UTF-8 text ({exc.reason})") from None
        data = _read_toml(text, str(path))
        src = _Source(str(path), key_lines(text))
        known = allowed_keys(Config)
        for key in [k for k in data if k in INTERNAL_KEYS[Config]]:
            problems.append(src.problem((key,), unknown_key(key, known)))
            del data[key]
        if "agents" in data:
            tables, overlays = _overlay(builtins, data.pop("agents"))
            agents.update(_parse_agents(tables, src, problems))
        if "repos" in data:
            found = _repo_problems(data["repos"], src)
            if found:
                problems += found
                del data["repos"]  # said once, here, not again by Config's own check
    else:
        src = _Source("config", {})
    try:
        config = Config.model_validate({**data, "agents": agents, "overlays": overlays,
                                        "source": str(path) if path else None})
    except ValidationError as exc:
        problems += _problems_of(exc, Config, src, ())
    if problems:
        raise ConfigError(sorted(problems, key=lambda line: _line_number(line, src.name)))
    return config


def _line_number(problem: str, name: str) -> int:
    """A problem's line in its file (0 for none), to list them in the file's order."""
    m = re.match(rf"{re.escape(name)}:(\d+) ", problem)
    return int(m.group(1)) if m else 0
