"""The layers' one-way arrows (docs/ARCHITECTURE.md), read from the source: every `import` statement counts,
at module level or inside a function alike, and so does a module named by a string in a module that calls
`importlib.import_module` (the CLI's subcommand table).

- the floors, bottom up: framework/base (the ground floor) <- models <- data_pipeline <- the rest of framework <-
  launch, framework/cli.py and framework/drivers; a module imports only its own floor and the floors below;
- inside framework: parallel imports nothing of train, checkpoint, observe or the drivers; checkpoint,
  observe and infer import nothing of train (the loop calls them);
- no product module imports framework/testing (the test kit);
- no cycle between modules;
- no product file over 450 lines; every product module is reachable from an entry point (`tessera`, the
  `python -m` modules), so none is there only for tests or bench.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("framework", "models", "data_pipeline", "launch")

FLOORS: list[tuple[str, ...]] = [
    # bottom up; a module belongs to the floor of its longest matching prefix
    ("framework.base",),
    ("models",),
    ("data_pipeline",),
    ("framework",),
    ("launch", "framework.cli", "framework.drivers"),
]

FORBIDDEN: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # (importer prefix, forbidden target prefixes, allowed exceptions)
    ("framework.parallel", ("framework.train", "framework.checkpoint", "framework.observe", "framework.drivers"), ()),
    ("framework.checkpoint", ("framework.train",), ()),
    ("framework.observe", ("framework.train",), ()),
    ("framework.infer", ("framework.train",), ()),
    ("framework", ("framework.testing",), ("framework.testing",)),
    ("models", ("framework.testing",), ()),
    ("data_pipeline", ("framework.testing",), ()),
    ("launch", ("framework.testing",), ()),
]

ENTRY_POINTS = ("framework.cli", "framework.plan.cli", "launch.torchrun")
"""`tessera` (pyproject's console script) and the modules run as `python -m`."""
TEST_KIT = ("framework.testing",)
"""Shipped for tests of code built on Tessera; reached from tests, not from an entry point."""
MAX_LINES = 450


def modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (a package is its __init__)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` it imports anywhere in its body, relative imports resolved; a name that
    is not a module of `mods` (a namespace package, a third-party module) counts as its nearest known parent."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(), str(path))
        for target in importlib_targets(tree, mods):
            if target != name:
                edges[name].add(target)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                # `from a.b import c`: the module a.b.c if there is one, else a.b (an ancestor package's
                # __init__ runs too, but counting it would make every import depend on `framework`)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                hit = known(target)
                if hit is not None and hit != name:
                    edges[name].add(hit)
    return edges


def importlib_targets(tree: ast.AST, mods: dict[str, Path]) -> set[str]:
    """Modules a module may load through `importlib.import_module`: when it calls it, every string constant of
    the module that names a module of `mods` (a literal argument or a table such as the CLI's subcommands)."""
    calls = any(isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
        or (isinstance(node.func, ast.Name) and node.func.id == "import_module")) for node in ast.walk(tree))
    if not calls:
        return set()
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in mods}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def floor(name: str) -> int:
    """The floor of a module: the one of its longest matching prefix (-1: not a product module)."""
    best, level = -1, -1
    for i, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if _under(name, prefix) and len(prefix) > best:
                best, level = len(prefix), i
    return level


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    return [f"{src} (floor {floor(src)}) imports {dst} (floor {floor(dst)})"
            for src in sorted(edges) for dst in sorted(edges[src]) if floor(dst) > floor(src)]


def unreachable(edges: dict[str, set[str]], entry_points: Iterable[str] = ENTRY_POINTS) -> list[str]:
    """Product modules no entry point reaches (an imported module's parent packages run too)."""
    seen: set[str] = set()
    todo = [m for m in entry_points if m in edges]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in edges]
        todo += edges[mod]
    return sorted(m for m in edges if m not in seen and not any(_under(m, k) for k in TEST_KIT))


def long_files(mods: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    return [f"{path.relative_to(REPO)}: {n} lines" for path in mods.values()
            if (n := len(path.read_text().splitlines())) > limit]


def violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for importer, forbidden, allowed in FORBIDDEN:
        for src in sorted(m for m in edges if _under(m, importer)):
            for dst in sorted(edges[src]):
                if any(_under(dst, f) for f in forbidden) and not any(_under(dst, a) for a in allowed):
                    bad.append(f"{src} imports {dst}")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@functools.cache
def repo_edges() -> dict[str, set[str]]:
    """This repository's import graph, read once for all the tests below."""
    return import_edges(modules(REPO))


def test_layers_import_one_way() -> None:
    edges = repo_edges()
    assert len(edges) > 100, "the scan found too few modules: wrong repository root?"
    assert not violations(edges), "\n".join(violations(edges))


def test_floors_point_down() -> None:
    edges = repo_edges()
    assert not floor_violations(edges), "\n".join(floor_violations(edges))


def test_no_product_file_over_450_lines() -> None:
    found = long_files(modules(REPO))
    assert not found, "\n".join(found)


def test_every_product_module_is_reached_from_an_entry_point() -> None:
    """A product module only tests or bench import belongs to tests/ or bench/."""
    found = unreachable(repo_edges())
    assert not found, "product modules no entry point imports:\n" + "\n".join(found)


def test_no_import_cycle() -> None:
    found = cycles(repo_edges())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_catch_a_back_edge_and_a_cycle(tmp_path: Path) -> None:
    """The scanner sees function-local and relative imports: planted back-edges and a cycle are reported (data
    importing models is the staircase, not a back-edge)."""
    files = {
        "models/__init__.py": "",
        "models/a.py": "def f():\n    from framework.train import loop\n",
        "framework/__init__.py": "",
        "framework/errors.py": "",
        "framework/train/loop.py": "from framework.parallel import zero\n",
        "framework/parallel/zero.py": "from ..train.loop import x\nimport framework.errors\n",
        "data_pipeline/__init__.py": "",
        "data_pipeline/b.py": "from models.a import f\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = import_edges(modules(tmp_path, ("models", "framework", "data_pipeline")))
    assert violations(edges) == ["framework.parallel.zero imports framework.train.loop"]
    assert floor_violations(edges) == ["models.a (floor 1) imports framework.train.loop (floor 3)"]
    assert cycles(edges) == [["framework.parallel.zero", "framework.train.loop"]]


def test_the_checks_catch_floors_importlib_and_orphans(tmp_path: Path) -> None:
    """A data module importing the framework above it, an importlib table naming a module, a module that no
    entry point reaches."""
    files = {
        "framework/__init__.py": "",
        "framework/cli.py": "import importlib\nMODS = ['data_pipeline.cli']\nimportlib.import_module(MODS[0])\n",
        "framework/base/__init__.py": "",
        "framework/base/errors.py": "",
        "framework/train/__init__.py": "",
        "framework/train/config.py": "from framework.base import errors\n",
        "data_pipeline/__init__.py": "",
        "data_pipeline/cli.py": "from framework.base.errors import E\n",
        "data_pipeline/stage.py": "from framework.train.config import C\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = import_edges(modules(tmp_path, ("framework", "data_pipeline")))
    assert edges["framework.cli"] == {"data_pipeline.cli"}
    assert floor_violations(edges) == ["data_pipeline.stage (floor 2) imports framework.train.config (floor 3)"]
    assert unreachable(edges, ("framework.cli",)) == ["data_pipeline.stage", "framework.train",
                                                      "framework.train.config"]
