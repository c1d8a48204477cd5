"""The package's import graph and the places that spell the fused op's argument list, read from
the source with ``ast`` (nothing is imported). tests/test_layout.py asserts the rules; run it
as a script for the figures (``python tests/layout.py``).

Rules (issue "the house"):

* the library never imports its apps: everything under ``fusedres/apps/`` (``APPS``);
* nothing under ``fusedres/`` imports the developer tools (``tools/``, not installed), except
  the pairs in ``TOOL_IMPORTS``, each inside a function and each with its reason;
* no import cycles between the package's modules, counting imports inside functions too (a
  function-level import hides a cycle, it does not remove it);
* apps use only public names of the library: no ``_name`` imported from, or read as an
  attribute of, a library module;
* library modules import no private function, class or variable (``_name`` defined in another
  module); the library's private modules (``fusedres.ops._backend``...) may be imported inside it;
* apps do not import each other, except the dispatcher ``fusedres.apps.cli`` (which starts them and
  holds the command-line conventions they share), and the experiments on trained runs
  (``fusedres.apps.experiments``) the trainer (``fusedres.apps.train``): a run is what the trainer
  wrote (its config, checkpoint format, data and model builder), read through its own code, not a
  copy.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Package directories and the dotted name they install as (setup.py's package_dir).
PACKAGE_DIRS = {"fusedres": ROOT / "fusedres", "fusedres.kernels": ROOT / "kernels"}
# Applications built on the library, all in one package: they use its public API, as a user's
# code would. fusedres.__main__ is `python -m fusedres`: the dispatcher's entry point, an app
# like it. Each entry of fusedres/apps/ (a module or a package) is one app.
APPS_PACKAGE = "fusedres.apps"
APPS = (APPS_PACKAGE, "fusedres.__main__")
# The developer tools: a top-level package of the repository, run from a checkout, not installed.
TOOLS = "tools"
TOOLS_DIR = ROOT / "tools"


def is_app(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in APPS)


def is_tool(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    # (target module, imported name or None, line, at module level)
    imports: list[tuple[str, str | None, int, bool]] = field(default_factory=list)
    private_attrs: list[tuple[str, str, int]] = field(default_factory=list)


def discover() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for dotted, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([dotted, *parts])
            if name == "fusedres.kernels" and dotted == "fusedres":
                continue
            modules[name] = Module(name, path, is_package, ast.parse(path.read_text(), str(path)))
    return modules


def _resolve(module: Module, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    if hasattr(n, "lineno"):
                        lines.add(n.lineno)
    return lines


def analyse(modules: dict[str, Module] | None = None) -> dict[str, Module]:
    modules = modules if modules is not None else discover()
    for mod in modules.values():
        skip = _type_checking_lines(mod.tree)
        # Nodes that run at import: everything outside function and class bodies (one walk per
        # top-level statement; testing each node against every statement's walk was quadratic).
        top_level: set[int] = set()
        for t in mod.tree.body:
            if isinstance(t, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top_level.add(id(t))
            else:
                top_level.update(id(x) for x in ast.walk(t))
        for node in ast.walk(mod.tree):
            top = id(node) in top_level
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fusedres") or is_tool(alias.name):
                        mod.imports.append((alias.name, None, node.lineno, top))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node.level, node.module)
                if not (base.startswith("fusedres") or is_tool(base)):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        mod.imports.append((sub, None, node.lineno, top))
                    else:
                        mod.imports.append((base, alias.name, node.lineno, top))
        # Private attributes read off an imported library module: FR._conv2d_checked.
        aliases: dict[str, str] = {}
        for target, name, _, _ in mod.imports:
            if name is None:
                aliases[target.rsplit(".", 1)[-1]] = target
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node.level, node.module)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fusedres"):
                        aliases[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0])
        for node in ast.walk(mod.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                mod.private_attrs.append((aliases[node.value.id], node.attr, node.lineno))
    return modules


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for mod in modules.values():
        for target, _, _, _ in mod.imports:
            if target in modules and target != mod.name:
                graph[mod.name].add(target)
    return graph


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = edges(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _private(name: str | None) -> bool:
    return name is not None and name.startswith("_") and not name.startswith("__")


def private_imports(modules: dict[str, Module]) -> list[str]:
    """Violations of the two private-name rules, as 'module:line: what'."""
    out = []
    for mod in modules.values():
        app = is_app(mod.name)
        for target, name, line, _ in mod.imports:
            if is_app(target) and app:
                continue  # an app's own modules
            if app:
                private_module = any(_private(p) for p in target.split("."))
                if private_module or _private(name):
                    out.append(f"{mod.name}:{line}: {target}{'.' + name if name else ''}")
            elif _private(name) and target != mod.name:
                out.append(f"{mod.name}:{line}: {target}.{name}")
        for target, attr, line in mod.private_attrs:
            if target == mod.name or (is_app(target) and app):
                continue
            if app or not any(_private(p) for p in target.split(".")):
                out.append(f"{mod.name}:{line}: {target}.{attr} (attribute)")
    return sorted(set(out))


def _literal_all(module: Module) -> set[str] | None:
    for node in module.tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "__all__"):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def non_public_app_imports(modules: dict[str, Module]) -> list[str]:
    """What apps import from the library that its ``__all__`` does not export: a name missing
    from its module's ``__all__``, or a module missing from its package's ``__all__``."""
    out = []
    for mod in modules.values():
        if not is_app(mod.name):
            continue
        for target, name, line, _ in mod.imports:
            if is_app(target) or target not in modules:
                continue
            if name is None:
                package, _, sub = target.rpartition(".")
                exported = _literal_all(modules[package]) if package in modules else None
                if exported is not None and sub not in exported:
                    out.append(f"{mod.name}:{line}: module {target} (not in {package}.__all__)")
            else:
                exported = _literal_all(modules[target])
                if exported is not None and name not in exported:
                    out.append(f"{mod.name}:{line}: {target}.{name} (not in its __all__)")
    return sorted(set(out))


def library_imports_apps(modules: dict[str, Module]) -> list[str]:
    return sorted(f"{m.name}:{line}: {t}" for m in modules.values() if not is_app(m.name)
                  for t, _, line, _ in m.imports if is_app(t))


# (importer, imported tool module): the installed package's only imports of tools/, each inside a
# function whose callers handle its absence (an installed package has no tools/).
TOOL_IMPORTS = {
    # `fusedres bench` on a GPU puts the performance model's MODELED time beside each measured
    # one when run from a checkout; elsewhere the column is left out with a warning.
    ("fusedres.apps.bench.units", "tools.perfmodel.units"),
}


def tool_imports(modules: dict[str, Module]) -> list[str]:
    """Imports of tools/ from the installed package other than ``TOOL_IMPORTS``, and those
    pairs' imports at module level (which would break the import of an installed package)."""
    def module(target: str, name: str | None) -> str:
        # `from tools.perfmodel import model`: the module tools.perfmodel.model
        sub = f"{target}.{name}" if name else target
        path = ROOT.joinpath(*sub.split("."))
        return sub if path.with_suffix(".py").is_file() or path.is_dir() else target
    return sorted(f"{m.name}:{line}: {module(t, n)}" for m in modules.values()
                  for t, n, line, top in m.imports if is_tool(t)
                  and (top or (m.name, module(t, n)) not in TOOL_IMPORTS))


def function_level_imports(modules: dict[str, Module]) -> int:
    return sum(1 for m in modules.values() for *_, top in m.imports if not top)


# The dispatcher: it starts the apps (by name, importlib) and holds the command-line conventions
# they share (UsageError, parse_bytes); an app may import it, and it the apps.
DISPATCHER = "fusedres.apps.cli"
# (importer, imported) app pairs allowed beside the dispatcher: the experiments read the
# trainer's runs with the trainer's own config, checkpoint, data and build_model; the step
# benchmark times the trainer's own graphed step (fusedres.apps.train.step), not a copy of it.
ALLOWED_APP_IMPORTS = {("fusedres.apps.experiments", "fusedres.apps.train"),
                       ("fusedres.apps.bench", "fusedres.apps.train")}


def app_cross_imports(modules: dict[str, Module]) -> list[str]:
    """Imports from one app into another (e.g. bench reading the trainer's config), other than
    to or from the dispatcher."""
    def app_of(name: str) -> str | None:
        if name.startswith(APPS_PACKAGE + "."):
            return ".".join(name.split(".")[:3])  # fusedres.apps.<app>
        return name if name in APPS else None
    return sorted(f"{m.name}:{line}: {t}" for m in modules.values() if app_of(m.name)
                  for t, _, line, _ in m.imports
                  if app_of(t) and app_of(t) != app_of(m.name)
                  and DISPATCHER not in (app_of(m.name), app_of(t))
                  and (app_of(m.name), app_of(t)) not in ALLOWED_APP_IMPORTS)


# --------------------------------------------------------------------------- the folders

# Build outputs that land in fusedres/ (`setup.py build_ext --inplace`), not sources.
_BUILD_OUTPUT = re.compile(r"^(_C.*\.(so|pyd|dll)|__pycache__)$")
MAX_TOP_LEVEL = 15


def top_level_entries() -> list[str]:
    """The source entries of fusedres/ (files and folders), build outputs left out."""
    return sorted(p.name for p in (ROOT / "fusedres").iterdir() if not _BUILD_OUTPUT.match(p.name))


def setup_packages() -> list[str]:
    """The packages setup.py installs, from its ``find_packages(include=[...])`` call and the
    ``fusedres.kernels`` mapping, computed here the same way (setup.py is not run)."""
    from setuptools import find_packages

    tree = ast.parse((ROOT / "setup.py").read_text())
    include = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "find_packages"
                and any(k.arg == "include" for k in node.keywords)):
            include = ast.literal_eval(next(k.value for k in node.keywords if k.arg == "include"))
    if include is None:
        raise AssertionError("setup.py: no find_packages(include=[...]) call found")
    return sorted(find_packages(str(ROOT), include=include))


# --------------------------------------------------------------------------- the op's arguments

_SPELLED = re.compile(r"bn_weight,\s*bn_bias,\s*(?:state\.)?mean,\s*(?:state\.)?invstd")


def spelled_argument_lists(paths=None) -> list[str]:
    """Places (file:line) in the product code that spell the op's BatchNorm/conv argument list
    out (``..., bn_weight, bn_bias, mean, invstd, ...``)."""
    roots = paths or [ROOT / "fusedres", ROOT / "kernels"]
    out = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            text = path.read_text()
            for m in _SPELLED.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                out.append(f"{path.relative_to(ROOT)}:{line}")
    return out


def main() -> None:
    modules = analyse()
    print(f"modules: {len(modules)}")
    cyc = cycles(modules)
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("   ", " <-> ".join(c))
    priv = private_imports(modules)
    print(f"private cross-module imports: {len(priv)}")
    for p in priv:
        print("   ", p)
    lib = library_imports_apps(modules)
    print(f"library imports of apps: {len(lib)}")
    for p in lib:
        print("   ", p)
    cross = app_cross_imports(modules)
    print(f"imports between apps: {len(cross)}")
    for p in cross:
        print("   ", p)
    tools = tool_imports(modules)
    print(f"imports of tools/ beyond TOOL_IMPORTS: {len(tools)}")
    for p in tools:
        print("   ", p)
    print(f"top-level entries of fusedres/: {len(top_level_entries())}")
    print(f"function-level imports of fusedres modules: {function_level_imports(modules)}")
    spelled = spelled_argument_lists()
    print(f"places spelling the op's argument list: {len(spelled)}")


if __name__ == "__main__":
    main()
