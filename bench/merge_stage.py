"""The merge stage (data_pipeline/build/merge.py) against the merge it replaced (megatron-core's add_index in the
one-task manifest stage): per-task CPU and peak RSS, and memory as the document count grows.

1. Build (`--docs`, default 10^5): bench/build_scaling.py's corpus, built to tokenize as one task; then, on the
   same token shards, its merge stage as 1 and as each of `--tasks` tasks, each followed by the manifest stage,
   and the manifest stage of `--reference` (a commit before the merge stage, from `git archive`: megatron-core's
   add_index). Every stage is its own process (CPU from `os.wait4`, peak RSS its own VmHWM); the .bin/.idx/.hash.npy of
   every variant are asserted byte-identical, and so are the manifests but their config.
2. Synthetic (`--shards`, `--shard-docs`): S and 10 S shards of short documents concatenated in one process by
   indexed.write_parts and by megatron-core's add_index: peak RSS of each, as the documents grow 10x.

    PYTHONPATH=. nice -n 19 python bench/merge_stage.py --docs 100000 --tasks 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.build_scaling import config, write_corpus
from data_pipeline.indexed import INDEX_HEADER

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from framework.cli import main; sys.exit(main(sys.argv[1:]))"


HWM = ("import atexit, os\natexit.register(lambda: open(os.environ['MERGE_BENCH_HWM'], 'w').write(next("
       "l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))))\n")
"""Prepended to every measured program: it writes its own peak RSS (VmHWM, kB) at exit. `os.wait4`'s ru_maxrss is
not enough: the kernel carries the parent's high-water mark over the child's exec, so a child reads at least as
large as its parent was when it was started (this bench's parent holds the synthetic shards it wrote)."""


def run(args: list[str], tree: Path = REPO) -> dict[str, float]:
    """`python -c CODE ARGS...` run from `tree`, which must succeed: its CPU seconds (wait4), its own peak RSS
    (VmHWM) and wall."""
    with tempfile.NamedTemporaryFile() as hwm:
        env = {**os.environ, "PYTHONPATH": str(tree), "MERGE_BENCH_HWM": hwm.name}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", HWM + args[1], *args[2:]], cwd=tree, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, ru = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise RuntimeError(f"{' '.join(args[-6:])} failed:\n{err.decode()[-3000:]}")
        return {"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": int(Path(hwm.name).read_text()) / 1024,
                "wall_s": time.perf_counter() - t0}


def stage(cfg: Path, name: str, task: int = 0, tasks: int = 1, tree: Path = REPO) -> dict[str, float]:
    return run(["-c", CLI, "data", "build", str(cfg), "--stages", name, "--task", str(task), "--tasks", str(tasks)],
               tree)


def outputs(out: Path) -> dict[str, str]:
    """sha256 of every merged file, and of the manifest without its config."""
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(out.iterdir())
           if p.suffix in (".bin", ".idx") or p.name.endswith(".hash.npy")}
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("config")
    got["manifest"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    return got


def clear_merge(out: Path) -> None:
    shutil.rmtree(out / "work" / "merge", ignore_errors=True)
    for p in out.iterdir():
        if p.suffix in (".bin", ".idx") or p.name.endswith(".hash.npy") or p.name == "manifest.json":
            p.unlink()


def build_part(root: Path, docs: int, tasks: list[int], reference: str) -> dict[str, Any]:
    corpus = root / f"corpus-{docs}"
    if not (corpus / "done").is_file():
        shutil.rmtree(corpus, ignore_errors=True)
        (corpus / "done").parent.mkdir(parents=True)
        (corpus / "done").write_text(str(write_corpus(corpus, docs, 8, 4, 0)))
    out = root / f"build-{docs}"
    cfg = root / f"build-{docs}.yaml"
    cfg.write_text(yaml.safe_dump(config(out, corpus, 8)))
    for s in ("ingest", "exact", "minhash", "pairs", "verify", "near", "tokenizer", "tokenize"):
        stage(cfg, s)  # each resumes, and is a no-op once done
    table: dict[str, Any] = {"process_start": run(["-c", "import framework.cli, data_pipeline.build.run"]),
                             "docs": docs,
                             "token_bytes": sum(p.stat().st_size for p in (out / "work" / "tokens")
                                                              .rglob("*.bin")), "variants": {}}
    digests = {}
    for n in sorted({1, *tasks}):
        clear_merge(out)
        runs = [stage(cfg, "merge", k, n) for k in range(n)]
        table["variants"][f"merge {n} tasks"] = {"tasks": runs, "manifest": stage(cfg, "manifest")}
        digests[f"merge {n} tasks"] = outputs(out)
    ref = root / f"ref-{reference}"
    if not ref.is_dir():
        ref.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", reference], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(ref)], input=archive.stdout, check=True)
    clear_merge(out)
    stamps = out / "work" / "stamps.json"  # the reference knows no merge stage: its units would look like sources
    kept = {k: v for k, v in json.loads(stamps.read_text()).items() if not k.startswith("merge/")}
    stamps.write_text(json.dumps(kept))
    table["variants"][f"manifest of {reference} (megatron-core add_index)"] = {"manifest": stage(cfg, "manifest",
                                                                                              tree=ref)}
    digests[f"reference {reference}"] = outputs(out)
    clear_merge(out)  # leave the build in this tree's layout
    if len({json.dumps(d, sort_keys=True) for d in digests.values()}) != 1:
        raise AssertionError(f"the variants' outputs differ: {json.dumps(digests, indent=1)}")
    table["outputs"] = next(iter(digests.values()))
    return table


def write_shard(prefix: Path, lengths: np.ndarray, rng: np.random.Generator) -> None:
    """A Megatron .bin/.idx of one sequence per document (uint16 tokens), written directly in the format."""
    rng.integers(0, 4096, size=int(lengths.sum()), dtype=np.uint16).tofile(f"{prefix}.bin")
    n = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(INDEX_HEADER + np.array([1], "<u8").tobytes() + bytes([8]) + np.array([n, n + 1], "<u8").tobytes())
        f.write(lengths.astype("<i4").tobytes() + pointers.astype("<i8").tobytes() +
                np.arange(n + 1, dtype="<i8").tobytes())


OURS = """
import os, sys
from pathlib import Path
from data_pipeline.indexed import open_sized, plan_concat, write_parts
prefixes = sys.argv[2:]
plan = plan_concat(prefixes, 4096)
fds = [open_sized(Path(sys.argv[1] + ext), size) for ext, size in ((".bin", plan.bin_bytes), (".idx", plan.idx_bytes))]
write_parts(plan, 0, len(prefixes), *fds)
"""
THEIRS = """
import sys
import numpy as np
from data_pipeline.indexed import import_megatron_builder
builder = import_megatron_builder()(sys.argv[1] + ".bin", dtype=np.uint16)
for p in sys.argv[2:]:
    builder.add_index(p)
builder.finalize(sys.argv[1] + ".idx")
"""
BASE = "import data_pipeline.indexed as i; i.import_megatron_builder()"


def synthetic_part(root: Path, shards: int, shard_docs: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    table: dict[str, Any] = {"shard_docs": shard_docs, "rows": [], "imports": {
        "ours": run(["-c", "import data_pipeline.indexed"]), "megatron": run(["-c", BASE])}}
    print(f"imports alone: peak RSS ours {table['imports']['ours']['peak_rss_mb']:.0f} MB, megatron-core "
          f"{table['imports']['megatron']['peak_rss_mb']:.0f} MB", flush=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        parts: list[str] = []
        for count in (shards, 10 * shards):
            while len(parts) < count:
                parts.append(str(Path(tmp) / f"shard-{len(parts):05d}"))
                write_shard(Path(parts[-1]), rng.integers(1, 16, size=shard_docs).astype(np.int32), rng)
            row: dict[str, Any] = {"shards": count, "documents": count * shard_docs}
            for name, code in (("ours", OURS), ("megatron", THEIRS)):
                row[name] = run(["-c", code, str(Path(tmp) / name), *parts])
            same = all(Path(tmp, f"ours{e}").read_bytes() == Path(tmp, f"megatron{e}").read_bytes()
                       for e in (".bin", ".idx"))
            assert same, f"{count} shards: our concatenation differs from megatron-core's"
            for name in ("ours", "megatron"):
                for e in (".bin", ".idx"):
                    Path(tmp, f"{name}{e}").unlink()
            table["rows"].append(row)
            print(f"synthetic {row['documents']:>10,} documents in {count} shards: peak RSS ours "
                  f"{row['ours']['peak_rss_mb']:.0f} MB ({row['ours']['cpu_s']:.1f} CPU-s), megatron-core "
                  f"{row['megatron']['peak_rss_mb']:.0f} MB ({row['megatron']['cpu_s']:.1f} CPU-s)", flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--tasks", type=int, nargs="+", default=[4])
    parser.add_argument("--reference", default="cf3b965", help="a commit whose manifest stage merges with megatron")
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--shard-docs", type=int, default=100_000)
    parser.add_argument("--parts", nargs="+", choices=("synthetic", "build"), default=["synthetic", "build"])
    parser.add_argument("--root", default=".cache/tessera/merge_stage")
    parser.add_argument("--json", help="write the tables here")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    table: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    if "synthetic" in args.parts:
        table["synthetic"] = synthetic_part(root, args.shards, args.shard_docs)
    if "build" in args.parts:
        table["build"] = build_part(root, args.docs, args.tasks, args.reference)
        for name, v in table["build"]["variants"].items():
            tasks = v.get("tasks", [])
            cpu = " + ".join(f"{t['cpu_s']:.1f}" for t in tasks)
            merge = (f"merge as {len(tasks)} task(s): CPU-s {cpu}, peak RSS per task "
                     f"{max(t['peak_rss_mb'] for t in tasks):.0f} MB; " if tasks else "")
            print(f"{args.docs:,} documents, {name}: {merge}manifest {v['manifest']['cpu_s']:.1f} CPU-s, "
                  f"{v['manifest']['peak_rss_mb']:.0f} MB", flush=True)
        start = table["build"]["process_start"]
        print(f"one stage process before any work (imports): {start['cpu_s']:.1f} CPU-s, "
              f"{start['peak_rss_mb']:.0f} MB; token shards {table['build']['token_bytes'] / 1e6:.1f} MB")
        print(f"outputs identical across variants: {table['build']['outputs']}")
    table["load_after"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
