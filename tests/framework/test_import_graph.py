"""The layers' one-way arrows (docs/ARCHITECTURE.md), read from the source: every `import` statement counts,
at module level or inside a function alike.

- models imports nothing of framework but framework.errors and framework.config;
- framework/parallel imports nothing of framework/train, framework/checkpoint, framework/observe or the
  experiment drivers (framework/drivers);
- data_pipeline imports nothing of models or framework/train;
- no cycle between modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("framework", "models", "data_pipeline", "launch")

FORBIDDEN: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # (importer prefix, forbidden target prefixes, allowed exceptions)
    ("models", ("framework",), ("framework.errors", "framework.config")),
    ("framework.parallel", ("framework.train", "framework.checkpoint", "framework.observe", "framework.drivers"), ()),
    ("data_pipeline", ("models", "framework.train"), ()),
]


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
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


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


def test_layers_import_one_way() -> None:
    edges = import_edges(modules(REPO))
    assert len(edges) > 100, "the scan found too few modules: wrong repository root?"
    assert not violations(edges), "\n".join(violations(edges))


def test_no_import_cycle() -> None:
    found = cycles(import_edges(modules(REPO)))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_catch_a_back_edge_and_a_cycle(tmp_path: Path) -> None:
    """The scanner sees function-local and relative imports: a planted back-edge and a cycle are reported."""
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
    assert violations(edges) == ["models.a imports framework.train.loop",
                                 "framework.parallel.zero imports framework.train.loop",
                                 "data_pipeline.b imports models.a"]
    assert cycles(edges) == [["framework.parallel.zero", "framework.train.loop"]]
