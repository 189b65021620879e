"""Where the code under test resolves, asked in the job's own confined environment: a probe per ecosystem
(Python's import finder, Node's require), run by the caller, and the risks its answer names (the package
under test found outside the validated tree, node_modules linking back into the main checkout). It never
runs a probe itself nor imports anything of the tree into the host.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from proctor.mechanisms.validation.job_environment import JobEnvironment

# The probe runs with the tree first on the import path: a root-level `json.py` answered it and removed the
# editable-install risk (found in review). So it imports nothing a file can shadow: `sys` is built in, the
# finder is the frozen importlib already loaded, and its answer is a Python literal (repr, a builtin) that
# the host reads with ast.literal_eval. Node's probe: `fs` and `path` are core modules, never from the tree.
PY_PROBE = """
import sys
find = sys.modules["_frozen_importlib"]._find_spec
out = {}
for name in sys.argv[1:]:
    try:
        spec = find(name, None)
    except Exception as exc:
        out[name] = {"error": repr(exc)[:300]}
        continue
    if spec is None:
        out[name] = {"missing": True}
        continue
    locs = list(spec.submodule_search_locations or [])
    out[name] = {"origin": spec.origin, "locations": locs}
print("PROCTOR-PROBE " + repr(out))
"""

NODE_PROBE = """
const fs = require('fs'), path = require('path');
const out = {self: null, entry: null, links: []};
const name = process.argv[1];
const skip = process.argv.slice(2);  // shared dirs: a link into one is the share's (a layer's entries)
if (name) { try { out.self = fs.realpathSync(require.resolve(name, {paths: [process.cwd()]})); } catch (e) {} }
try { out.entry = fs.realpathSync(require.resolve(process.cwd())); } catch (e) {}
const nm = path.join(process.cwd(), 'node_modules');
function scan(dir, depth) {
  let ents = []; try { ents = fs.readdirSync(dir, {withFileTypes: true}); } catch (e) { return; }
  for (const e of ents) {
    const p = path.join(dir, e.name);
    if (e.name.startsWith('@') && e.isDirectory() && depth === 0) { scan(p, 1); continue; }
    if (e.isSymbolicLink()) {
      try {
        const real = fs.realpathSync(p);
        if (!skip.some(s => real === s || real.startsWith(s + path.sep))) out.links.push([p, real]);
      } catch (err) {}
    }
  }
}
scan(nm, 0);
console.log('PROCTOR-PROBE ' + JSON.stringify(out));
"""

Probe = Callable[[list[str]], "tuple[int | None, bytes]"]


def probes(jenv: JobEnvironment, env: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """(kind, argv) of each probe to run confined, in the checkout, with the job environment."""
    out = []
    path = {**env, **jenv.env}.get("PATH", "")
    if jenv.python_packages:
        py = (shutil.which(jenv.python, path=path) if jenv.python else None) \
            or shutil.which("python", path=path) or shutil.which("python3", path=path)
        if py:
            out.append(("python", [py, "-c", PY_PROBE, *jenv.python_packages]))
    if jenv.node_package is not None or jenv.shares:
        node = shutil.which("node", path=path)
        if node and (jenv.checkout / "package.json").exists():
            shared = [str(sh.source.resolve()) for sh in jenv.shares]
            out.append(("node", [node, "-e", NODE_PROBE, jenv.node_package or "", *shared]))
    return out


def _parse(raw: bytes) -> dict | None:
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("PROCTOR-PROBE "):
            text = line[len("PROCTOR-PROBE "):]
            try:
                val = json.loads(text) if text.startswith("{\"") or text == "{}" else ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
            return val if isinstance(val, dict) else None
    return None


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def judge(jenv: JobEnvironment, kind: str, raw: bytes) -> tuple[list[str], dict]:
    """Risks from one probe's output: the code under test resolving outside the validated tree."""
    data = _parse(raw)
    if data is None:
        return [f"the {kind} import probe gave no answer: where the code under test resolves is unknown"], {}
    checkout = jenv.checkout.resolve()
    shared = [s.source.resolve() for s in jenv.shares]
    # A share is mounted (or linked) into the tree, but it is the main checkout's dependencies, not the
    # job's code: a package under test found there (a copy installed into node_modules or .venv) is outside.
    mounted = [base / s.target.relative_to(jenv.checkout) for s in jenv.shares
               if s.target.is_relative_to(jenv.checkout) for base in (jenv.checkout, checkout)]

    def job_code(p: Path) -> bool:
        lexical = Path(os.path.normpath(p))
        return _inside(p.resolve(), checkout) and not any(_inside(lexical, m) for m in mounted)

    risks: list[str] = []
    if kind == "python":
        for name, info in data.items():
            if not isinstance(info, dict) or "origin" not in info:
                continue
            where = [p for p in [info.get("origin"), *(info.get("locations") or [])] if isinstance(p, str)
                     and p not in ("built-in", "frozen", "namespace")]
            outside = [p for p in where if not job_code(Path(p))]
            if outside:
                risks.append(f"the package under test {name!r} resolves outside the validated tree "
                             f"({outside[0]}): validation did not test the job's code")
        return risks, data
    for key in ("self", "entry"):  # `require(name)` (a stale copy?), and the package's own entry point
        found = data.get(key)
        if isinstance(found, str) and not job_code(Path(found)):
            risks.append(f"the package under test {jenv.node_package!r} resolves outside the validated tree "
                         f"({found}): validation did not test the job's code")
    main = jenv.main_checkout
    for link in data.get("links") or []:
        if not (isinstance(link, list) and len(link) == 2 and isinstance(link[1], str)):
            continue
        real = Path(link[1])
        if _inside(real, main) and not any(_inside(real, s) for s in shared):
            risks.append(f"node_modules links back into the main checkout: {link[0]} -> {real}")
    return risks[:5], data


def check(jenv: JobEnvironment, env: Mapping[str, str], probe: Probe) -> tuple[list[str], dict]:
    """Run each probe (`probe(argv) -> (exit, stdout)`, confined by the caller, cwd the checkout, env the
    job's) and judge it. Returns the risks and what each probe found (for the result's details)."""
    risks: list[str] = []
    found: dict = {}
    for kind, argv in probes(jenv, env):
        code, out = probe(argv)
        r, data = judge(jenv, kind, out if code == 0 else b"")
        risks += r
        found[kind] = data
    return risks, found
