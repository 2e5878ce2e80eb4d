"""The library's layout rules, read from its source with ``ast`` (nothing is imported):

* no ``from x import *`` in the library (``hspmd_elastic/``, ``launcher/``): every name a
  module uses is named where it comes from;
* no import circle between library files, counting every import, also one inside a function
  (a function-level import only hides a circle until the function runs);
* ``hspmd_elastic`` never imports ``launcher`` (the data plane runs without the control plane);
* no library file over 600 lines (split by responsibility);
* a function-level import only where it buys something, saying what on its line: ``# torch`` or
  ``# transformers`` (kept out of the torch-free control plane), ``# optional`` (a dependency
  that may be missing: pynvml, a wheel the GPU check's preflight names first), ``# startup``
  (measured start-up time, e.g. numpy and scipy kept out of ``hspmd-launch --help``) or
  ``# cycle``; and at most ``MAX_FUNCTION_IMPORTS`` of them.

``contract/schema.py``, which names its parts' names instead of star-importing them, is checked
to name every one of them.

Each check returns the violations as lines naming the file, so a failure says where to look;
the last test proves the checks find what they look for, on a small library written here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hspmd_elastic", "launcher")
MAX_LINES = 600
# The most function-level imports the library may hold: its count today. The aim is under 30 (29);
# lower this whenever one goes, never raise it (move an import to module level instead).
MAX_FUNCTION_IMPORTS = 36
IMPORT_REASONS = ("torch", "transformers", "optional", "startup", "cycle")
_REASON = re.compile(r"#\s*(?:%s)(?![\w-])" % "|".join(IMPORT_REASONS))

# Where the library still has import circles, each closed only through a function-level import,
# in modules being reworked: a circle wholly inside one of these (a package, or modules sharing
# the prefix) is pending; any other circle fails, and so does an entry with no circle left
# (delete it when its circle goes).
PENDING_CIRCLES: dict[str, str] = {}


def library_files(root: Path = ROOT) -> dict[str, Path]:
    """Every library module by dotted name (a package by its own name, for ``__init__.py``)."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(base module, names imported from it) of one import statement; relative ones resolved."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([base] if base else []))
    return [(base, [alias.name for alias in node.names])]


def _targets(base: str, names: list[str], modules: set[str]) -> set[str]:
    """The library modules an import loads: ``from pkg import sub`` is module ``pkg.sub`` when
    that is a file, else ``pkg`` itself; ``import a.b`` is ``a.b``."""
    out = set()
    for name in names:
        if f"{base}.{name}" in modules:
            out.add(f"{base}.{name}")
        elif base in modules:
            out.add(base)
    if not names and base in modules:
        out.add(base)
    return out


def import_edges(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the library modules it imports anywhere in its body (not itself)."""
    modules = set(files)
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for base, names in _imported(node, module, is_package):
                    deps |= _targets(base, names, modules)
        deps.discard(module)
        edges[module] = deps
    return edges


def star_imports(files: dict[str, Path], root: Path = ROOT) -> list[str]:
    """``path:line: from x import *`` for every star import in the library."""
    found = []
    for path in files.values():
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                found.append(f"{path.relative_to(root)}:{node.lineno}: "
                             f"from {'.' * node.level}{node.module or ''} import *")
    return sorted(found)


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def describe_circle(group: list[str], edges: dict[str, set[str]]) -> str:
    """One line: the group and, per module, whom of the group it imports."""
    inside = set(group)
    return "; ".join(f"{m} -> {', '.join(sorted(edges[m] & inside))}" for m in group)


def launcher_imports(files: dict[str, Path], root: Path = ROOT) -> list[str]:
    """``path:line: <module>`` for every import of ``launcher`` from ``hspmd_elastic``
    (statements, and ``importlib.import_module``/``__import__`` of a literal name)."""
    found = []
    for module, path in files.items():
        if not module.startswith("hspmd_elastic"):
            continue
        is_package = path.name == "__init__.py"
        for node in ast.walk(_parse(path)):
            names: list[str] = []
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [base for base, _ in _imported(node, module, is_package)]
            elif (isinstance(node, ast.Call) and node.args
                  and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and _call_name(node.func) in ("import_module", "__import__")):
                names = [node.args[0].value]
            found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                      if n == "launcher" or n.startswith("launcher.")]
    return sorted(found)


def _call_name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def function_imports(files: dict[str, Path], root: Path = ROOT) -> list[tuple[str, bool]]:
    """``(path:line: statement, has a reason)`` for every import statement inside a function
    or method body; the reason is a ``# torch`` / ``# transformers`` / ``# optional`` /
    ``# startup`` / ``# cycle`` comment on one of the statement's lines."""
    found = {}
    for path in files.values():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    span = lines[node.lineno - 1:node.end_lineno]
                    where = f"{path.relative_to(root)}:{node.lineno}: {span[0].strip()}"
                    found[where] = any(_REASON.search(line) for line in span)
    return sorted(found.items())


def long_files(files: dict[str, Path], root: Path = ROOT, limit: int = MAX_LINES
               ) -> list[str]:
    """``path: N lines`` for every library file over ``limit`` lines."""
    found = []
    for path in files.values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            found.append(f"{path.relative_to(root)}: {n} lines")
    return sorted(found)


# ------------------------------------------------------------------------------------ tests
def test_library_is_found():
    files = library_files()
    assert "hspmd_elastic.contract.schema" in files and "launcher.cli" in files
    assert len(files) > 100, sorted(files)


def test_no_star_imports():
    assert star_imports(library_files()) == []


def test_no_import_circles():
    edges = import_edges(library_files())
    assert sum(map(len, edges.values())) > 200  # the walk sees the imports
    circles = import_circles(edges)
    new = [describe_circle(g, edges) for g in circles if pending(g) is None]
    assert new == [], "import circles"
    gone = set(PENDING_CIRCLES) - {pending(g) for g in circles}
    assert gone == set(), "no circle left there: delete it from PENDING_CIRCLES"


def pending(group: list[str]):
    """The ``PENDING_CIRCLES`` entry whose prefix every module of ``group`` has, or None."""
    return next((p for p in PENDING_CIRCLES if all(m.startswith(p) for m in group)), None)


def test_schema_names_every_public_name_of_its_parts():
    """``contract/schema.py`` re-exports its parts by name (no star import): a name added to
    ``events.py``, ``keys.py`` or ``records.py`` must be added there too, so that
    ``schema.<name>`` keeps working for every caller."""
    from hspmd_elastic.contract import schema

    files = library_files()
    missing = [f"{part}.{name}" for part in ("events", "keys", "records")
               for name in public_names(files[f"hspmd_elastic.contract.{part}"])
               if not hasattr(schema, name)]
    assert missing == []


def public_names(path: Path) -> set[str]:
    """The public names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in _parse(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def test_data_plane_never_imports_launcher():
    assert launcher_imports(library_files()) == []


def test_no_library_file_over_600_lines():
    assert long_files(library_files()) == []


def test_function_level_imports_say_why_and_are_few():
    found = function_imports(library_files())
    assert [where for where, why in found if not why] == [], \
        f"a function-level import without a reason ({', '.join(IMPORT_REASONS)}): move it to " \
        "module level, or say why on its line"
    assert 0 < len(found) <= MAX_FUNCTION_IMPORTS, "\n".join(where for where, _ in found)


def test_checks_find_each_violation(tmp_path):
    """A small library with one of each violation: every check reports it, and only it."""
    (tmp_path / "hspmd_elastic" / "sub").mkdir(parents=True)
    (tmp_path / "launcher").mkdir()
    files = {
        "hspmd_elastic/__init__.py": "",
        "hspmd_elastic/sub/__init__.py": "",
        "hspmd_elastic/sub/a.py": "from . import b\n",
        "hspmd_elastic/sub/b.py": "def f():\n    from hspmd_elastic.sub.a import g\n",
        "hspmd_elastic/lazy.py": ("def f():\n    import torch  # torch\n"
                                  "    import json  # torch-free\n"
                                  "    from os import (  # startup\n        path)\n"),
        "hspmd_elastic/star.py": "from hspmd_elastic.sub.b import *\n",
        "hspmd_elastic/up.py": "import importlib\nimportlib.import_module('launcher.cli')\n",
        "launcher/__init__.py": "",
        "launcher/cli.py": "from hspmd_elastic.sub import a\n" + "x = 1\n" * MAX_LINES,
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    found = library_files(tmp_path)
    assert set(found) == {"hspmd_elastic", "hspmd_elastic.sub", "hspmd_elastic.sub.a",
                          "hspmd_elastic.sub.b", "hspmd_elastic.star", "hspmd_elastic.up",
                          "hspmd_elastic.lazy",
                          "launcher", "launcher.cli"}
    assert star_imports(found, tmp_path) == [
        "hspmd_elastic/star.py:1: from hspmd_elastic.sub.b import *"]
    assert launcher_imports(found, tmp_path) == ["hspmd_elastic/up.py:2: launcher.cli"]
    assert long_files(found, tmp_path) == [f"launcher/cli.py: {MAX_LINES + 1} lines"]
    assert function_imports(found, tmp_path) == [
        ("hspmd_elastic/lazy.py:2: import torch  # torch", True),
        ("hspmd_elastic/lazy.py:3: import json  # torch-free", False),
        ("hspmd_elastic/lazy.py:4: from os import (  # startup", True),
        ("hspmd_elastic/sub/b.py:2: from hspmd_elastic.sub.a import g", False)]
    edges = import_edges(found)
    assert edges["launcher.cli"] == {"hspmd_elastic.sub.a"}
    assert import_circles(edges) == [["hspmd_elastic.sub.a", "hspmd_elastic.sub.b"]]
