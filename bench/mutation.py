"""Mutation testing of the modules that decide correctness: put one plausible bug in, run the tests that cover the
module, see whether they fail ("killed") or pass ("survived": a blind spot, or an equivalent mutant).

    /work/bin/heavy python bench/mutation.py --modules framework/checkpoint/guard.py --per-module 12
    python bench/mutation.py --list framework/locks.py          # the mutants a module has, without running them

Mutants are made on the AST and written back as a source edit of the one node (the rest of the file keeps its
text, so the survivors list shows real lines). Operators, each a kind of bug the project has met:
  compare   a comparison flipped (< / >=, <= / >, == / !=, in / not in, is / is not)
  offbyone  an integer constant n -> n + 1 (0 -> 1, 1 -> 2, 127 -> 128)
  negate    an `if` / `while` / `assert`-free condition negated; True <-> False
  boolop    `and` <-> `or`
  return    a function returns at once (its first statement becomes `return`, or `return None` where it returns
            values) — "a state not restored", "an early return"
  kwarg     one keyword argument dropped from a call, so the callee's default applies — "a default dropped"
  group     a mesh axis / process-group name swapped for another ("tp" -> "dp_shard", ...) — "a wrong group"
  arith     + <-> -, * <-> // on one binary operation
Each mutant runs in a temporary copy of the tree (never the working tree), with bytecode caching off (a stale
.pyc of the same size and second would hide the mutant), under a time limit; a timeout counts as killed.
A module's mutants are a fixed sample (seeded by the module's path) of all its sites, `--per-module` of them.
The module -> tests map is bench/mutation_map.py.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.mutation_map import EQUIVALENT, MODULE_TESTS  # noqa: E402

AXES = ("tp", "pp", "dp_shard", "dp_replicate", "cp", "ep", "edp", "dp")
_FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}


@dataclass(frozen=True)
class Mutant:
    module: str
    op: str
    line: int
    before: str
    after: str
    """The edited source segment, before and after."""
    span: tuple[int, int, int, int]
    """(line, col, end_line, end_col) of the segment, 1-based lines, 0-based columns (ast's)."""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.line}:{self.op}:{self.after}"


def _segment(src: str, node: ast.AST) -> str:
    return ast.get_source_segment(src, node) or ""


def _docstring_end(body: list[ast.stmt]) -> int:
    first = body[0]
    is_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
              and isinstance(first.value.value, str))
    return 1 if is_doc and len(body) > 1 else 0


def _returns_value(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))


def _sites(src: str, module: str) -> Iterator[Mutant]:
    tree = ast.parse(src)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)  # type: ignore[attr-defined]
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    annotations: set[int] = set()  # type hints are not behaviour
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in ast.walk(n.returns) if n.returns else ():
                annotations.add(id(a))
        if isinstance(n, ast.arg) and n.annotation is not None:
            annotations.update(id(a) for a in ast.walk(n.annotation))
        if isinstance(n, ast.AnnAssign):
            annotations.update(id(a) for a in ast.walk(n.annotation))

    def mutant(op: str, node: ast.AST, new: ast.AST | str) -> Mutant | None:
        before = _segment(src, node)
        after = new if isinstance(new, str) else ast.unparse(new)
        if not before or before == after or getattr(node, "end_lineno", None) is None:
            return None
        span = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return Mutant(module, op, node.lineno, before, after, span)  # type: ignore[attr-defined]

    out: list[Mutant | None] = []
    for node in ast.walk(tree):
        if id(node) in annotations or id(node) in docstrings:
            continue
        if isinstance(node, ast.Compare):
            for i, cmp in enumerate(node.ops):
                if type(cmp) in _FLIP:
                    new = ast.Compare(node.left, [*node.ops[:i], _FLIP[type(cmp)](), *node.ops[i + 1:]],
                                      node.comparators)
                    out.append(mutant("compare", node, new))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append(mutant("offbyone", node, repr(node.value + 1)))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append(mutant("negate", node, repr(not node.value)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in AXES:
            other = AXES[(AXES.index(node.value) + 1) % len(AXES)]
            out.append(mutant("group", node, repr(other)))
        elif isinstance(node, (ast.If, ast.While)):
            out.append(mutant("negate", node.test, ast.UnaryOp(ast.Not(), node.test)))
        elif isinstance(node, ast.BoolOp):
            out.append(mutant("boolop", node, ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(),
                                                         node.values)))
        elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            out.append(mutant("arith", node, ast.BinOp(node.left, _ARITH[type(node.op)](), node.right)))
        elif isinstance(node, ast.Call) and node.keywords:
            for i, kw in enumerate(node.keywords):
                if kw.arg is not None:
                    out.append(mutant("kwarg", node, ast.Call(node.func, node.args,
                                                              [*node.keywords[:i], *node.keywords[i + 1:]])))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[_docstring_end(node.body)]
            if isinstance(first, ast.Return) or (node.name.startswith("__") and node.name != "__init__"):
                continue
            ret = "return None" if _returns_value(node) else "return"
            stmt = _segment(src, first)
            if stmt and first.lineno == first.end_lineno:  # a one-line statement becomes `return; <it>`
                out.append(Mutant(module, "return", first.lineno, stmt, f"{ret}; {stmt}",
                                  (first.lineno, first.col_offset, first.end_lineno,
                                   first.end_col_offset)))  # type: ignore[arg-type]
    return iter([m for m in out if m is not None])


def apply(src: str, m: Mutant) -> str:
    """`src` with the mutant's segment replaced; ValueError when the segment is not there (the module changed
    since the mutant was made, e.g. a rerun of an old log's survivors)."""
    lines = src.splitlines(keepends=True)
    l0, c0, l1, c1 = m.span
    # ast columns are UTF-8 byte offsets
    head = lines[l0 - 1].encode()[:c0].decode()
    tail = lines[l1 - 1].encode()[c1:].decode()
    seg = "".join(lines[l0 - 1:l1]).encode()
    seg = seg[c0:len(seg) - len(lines[l1 - 1].encode()) + c1]
    if seg.decode() != m.before:
        raise ValueError(f"{m.module}:{m.line}: {m.before!r} is not at its place any more; make the mutant again")
    return "".join([*lines[:l0 - 1], head + m.after + tail, *lines[l1:]])


def function_lines(src: str, names: Sequence[str]) -> set[int]:
    """Source lines of the named functions (`name` or `Class.name`; a class name takes all its methods)."""
    lines: set[int] = set()

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{node.name}"
                if node.name in names or qual in names:
                    lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{qual}.")

    walk(ast.parse(src).body, "")
    unknown = [n for n in names if not any(n in (q, q.rsplit(".", 1)[-1]) for q in _qualnames(src))]
    if unknown:
        raise SystemExit(f"no function {unknown} in the module")
    return lines


def _qualnames(src: str) -> list[str]:
    out: list[str] = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append(f"{prefix}{node.name}")
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{prefix}{node.name}.")

    walk(ast.parse(src).body, "")
    return out


def mutants(module: str, per_module: int, functions: Sequence[str] = (), ops: Sequence[str] = (),
            offset: int = 0) -> list[Mutant]:
    """A fixed sample of the module's mutants that still compile (seeded by the module path), optionally only
    those inside `functions` (the code that decides correctness, not messages and plumbing) and of `ops`."""
    src = (REPO / module).read_text()
    inside = function_lines(src, functions) if functions else None
    every = []
    seen = set()
    for m in _sites(src, module):
        if m.key in seen or (inside is not None and m.line not in inside) or (ops and m.op not in ops):
            continue
        seen.add(m.key)
        try:
            compile(apply(src, m), module, "exec")
        except SyntaxError:
            continue
        every.append(m)
    every.sort(key=lambda m: (m.line, m.op, m.after))
    random.Random(module).shuffle(every)
    return every[offset:offset + per_module] if per_module > 0 else every[offset:]


def copy_tree(dest: Path) -> None:
    """The working tree's product and test files (not .git, virtualenvs, caches, build outputs)."""
    dest.mkdir(parents=True)
    skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "runs", "node_modules"}
    for top in REPO.iterdir():
        if top.name in skip:
            continue
        if top.is_dir():
            shutil.copytree(top, dest / top.name, ignore=shutil.ignore_patterns(*skip))
        else:
            shutil.copy2(top, dest / top.name)


def run_tests(tree: Path, tests: list[str], timeout_s: float) -> tuple[str, float]:
    """'passed', 'failed', 'timeout' or 'error' (nothing collected, usage, internal) for `tests` in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]
    t0 = time.perf_counter()
    # its own session, so a timeout ends the forked ranks of a multi-rank test too (they would otherwise wait out
    # their collective timeout, holding a core)
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout", time.perf_counter() - t0
    took = time.perf_counter() - t0
    # 1: a test failed; 2: collection failed (the mutant broke an import); any other code but pytest's own
    # (3 internal error, 4 usage, 5 nothing collected) is the test process dying, e.g. os._exit or a signal:
    # all three kill the mutant
    return {0: "passed", 3: "error", 4: "error", 5: "error"}.get(proc.returncode, "failed"), took


def run_module(tree: Path, module: str, per_module: int, timeout_s: float, log: Path | None,
               only: list[Mutant] | None = None, functions: Sequence[str] = (), ops: Sequence[str] = (),
               tests: list[str] | None = None, offset: int = 0) -> dict[str, object]:
    tests = tests or MODULE_TESTS[module]
    target = tree / module
    original = target.read_text()
    base, base_s = run_tests(tree, tests, timeout_s * 4)
    result: dict[str, object] = {"module": module, "tests": tests, "baseline": base, "baseline_s": round(base_s, 1),
                                 "mutants": []}
    if log is not None:
        with log.open("a") as f:
            f.write(json.dumps({"module": module, "baseline": base, "baseline_s": round(base_s, 1)}) + "\n")
    if base != "passed":
        return result
    limit = max(timeout_s, 3 * base_s)
    for m in only if only is not None else mutants(module, per_module, functions, ops, offset):
        try:
            target.write_text(apply(original, m))
        except ValueError as err:
            print(f"stale    {err}", flush=True)
            continue
        try:
            outcome, took = run_tests(tree, tests, limit)
        finally:
            target.write_text(original)
        # the same command passed on the unmutated tree, so pytest refusing to run (exit 4: a conftest's import
        # broken by the mutant, e.g. a table entry without a required field) is the mutant's doing: killed
        outcome = "failed" if outcome == "error" else outcome
        row = {**asdict(m), "outcome": outcome, "seconds": round(took, 1)}
        result["mutants"].append(row)  # type: ignore[attr-defined]
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"{outcome:8s} {took:6.1f}s {module}:{m.line} {m.op}: {m.before!r} -> {m.after!r}", flush=True)
    return result


def _key(m: dict[str, object]) -> tuple[object, ...]:
    """One mutant across logs; the span tells apart two edits of equal text on one line (two `True`s)."""
    return m["module"], m["line"], m["op"], m["before"], m["after"], tuple(m.get("span") or ())  # type: ignore[arg-type]


def _equivalent(m: dict[str, object]) -> str | None:
    """Why the mutant is equivalent (bench/mutation_map.py), or None."""
    return EQUIVALENT.get((f"{m['module']}:{m['line']}", str(m["op"]), str(m["before"]), str(m["after"])))


def _killed(m: dict[str, object]) -> bool:
    return m["outcome"] in ("failed", "timeout")


def summary(results: list[dict[str, object]]) -> str:
    """Per module: mutants, killed at the first run, equivalent (bench/mutation_map.py says why), killed now
    (after the tests added for the first run's survivors), and the kill rate now over the non-equivalent ones."""
    rows = ["| module | mutants | killed (first run) | equivalent | killed now | kill rate now | tests' time |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    tot = [0, 0, 0, 0]
    for r in results:
        ms = [m for m in r["mutants"] if m["outcome"] != "error"]  # type: ignore[attr-defined]
        if r["baseline"] != "passed":
            rows.append(f"| {r['module']} | - | - | - | - | baseline {r['baseline']} | {r['baseline_s']} s |")
            continue
        n, first = len(ms), sum(bool(m["first_killed"]) for m in ms)
        eq = sum(_equivalent(m) is not None for m in ms)
        now = sum(_killed(m) for m in ms if _equivalent(m) is None)
        tot = [tot[0] + n, tot[1] + first, tot[2] + eq, tot[3] + now]
        rows.append(f"| {r['module']} | {n} | {first} ({100 * first / max(1, n):.0f}%) | {eq} | {now} | "
                    f"{100 * now / max(1, n - eq):.0f}% | {r['baseline_s']} s |")
    n, first, eq, now = tot
    rows.append(f"| all | {n} | {first} ({100 * first / max(1, n):.0f}%) | {eq} | {now} | "
                f"{100 * now / max(1, n - eq):.0f}% | |")
    return "\n".join(rows)


def from_logs(paths: list[Path]) -> list[dict[str, object]]:
    """Per-module results from the JSON lines of one or more runs, in order (the bench runs in pieces): a mutant
    run again later (--survivors-of) keeps its first outcome as `first_killed` and takes the last as `outcome`."""
    by: dict[str, dict[str, object]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            r = by.setdefault(row["module"], {"module": row["module"], "mutants": {}, "baseline": "passed",
                                              "baseline_s": 0.0})
            if "outcome" not in row:
                if not r.get("seen_baseline"):
                    r.update(baseline=row["baseline"], baseline_s=row["baseline_s"], seen_baseline=True)
                continue
            ms = r["mutants"]
            assert isinstance(ms, dict)
            first = ms[_key(row)]["first_killed"] if _key(row) in ms else _killed(row)
            ms[_key(row)] = {**row, "first_killed": first}
    for r in by.values():
        r["mutants"] = list(r["mutants"].values())  # type: ignore[attr-defined]
    return list(by.values())


def survivors_md(results: list[dict[str, object]]) -> str:
    """Every mutant that survived its first run, and every equivalent one: what became of it (killed now, or why
    it is equivalent)."""
    rows = ["| module:line | operator | before | after | now |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        for m in r["mutants"]:  # type: ignore[attr-defined]
            if (m["first_killed"] and _equivalent(m) is None) or m["outcome"] == "error":
                continue  # (an equivalent mutant is listed even when a timeout under load "killed" it)
            cell = [str(m[k]).replace("|", "\\|").replace("\n", " ") for k in ("before", "after")]
            why = _equivalent(m)
            now = f"equivalent: {why}" if why else "killed by a new test" if _killed(m) else "**survives**"
            rows.append(f"| {m['module']}:{m['line']} | {m['op']} | `{cell[0]}` | `{cell[1]}` | {now} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", nargs="*", default=None, help="modules to mutate (default: every one in the map)")
    ap.add_argument("--per-module", type=int, default=12, help="mutants sampled per module (0: all)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant's test run (at least 3x baseline)")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per mutant here")
    ap.add_argument("--functions", nargs="+", default=(), metavar="NAME",
                    help="only mutants inside these functions (name or Class.name) of the one module given")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip the sample's first N (a slow module's mutants run in pieces: 0, then N, ...)")
    ap.add_argument("--ops", nargs="+", default=(), help="only these operators (compare offbyone negate ...)")
    ap.add_argument("--tests", nargs="+", default=None,
                    help="judge by these tests instead of the map's (a quick check of a new test; report the map's)")
    ap.add_argument("-k", dest="keyword", default=None,
                    help="pytest -k expression: run only the mapped tests it selects (the covering subset)")
    ap.add_argument("--list", metavar="MODULE", help="print the module's sampled mutants and exit")
    ap.add_argument("--report", nargs="+", type=Path, help="print the table and survivors of earlier --out files")
    ap.add_argument("--survivors-of", nargs="+", type=Path, metavar="LOG",
                    help="rerun only the mutants that survived in these --out files (after adding tests)")
    args = ap.parse_args(argv)
    if args.report:
        results = from_logs(args.report)
        print(summary(results) + "\n\nSurvivors:\n\n" + survivors_md(results))
        return 0
    if args.list:
        for m in mutants(args.list, args.per_module, args.functions, args.ops, args.offset):
            print(f"{m.module}:{m.line} {m.op}: {m.before!r} -> {m.after!r}")
        return 0
    rerun: dict[str, list[Mutant]] | None = None
    if args.survivors_of:
        rerun = {}
        for r in from_logs(args.survivors_of):
            for m in r["mutants"]:  # type: ignore[attr-defined]
                if m["outcome"] == "passed":
                    fields = {k: m[k] for k in ("module", "op", "line", "before", "after")}
                    rerun.setdefault(m["module"], []).append(Mutant(**fields, span=tuple(m["span"])))
    modules = args.modules or (list(rerun) if rerun is not None else list(MODULE_TESTS))
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        raise SystemExit(f"no tests mapped for {unknown}; add them to bench/mutation_map.py")
    results = []
    with tempfile.TemporaryDirectory(prefix="tessera-mutation-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        for module in modules:
            only = rerun.get(module, []) if rerun is not None else None
            tests = (args.tests or MODULE_TESTS[module]) + (["-k", args.keyword] if args.keyword else [])
            results.append(run_module(tree, module, args.per_module, args.timeout, args.out, only, args.functions,
                                      args.ops, tests, args.offset))
    for r in results:
        for m in r["mutants"]:  # type: ignore[attr-defined]
            m["first_killed"] = _killed(m)
    print(summary(results) + "\n\nSurvivors:\n\n" + survivors_md(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
