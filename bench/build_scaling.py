"""End-to-end build scaling: generated corpora, ingest to manifest, as 1, 2, 4, 8 array tasks.

Every stage runs as its own processes, `tessera data build CFG --stages STAGE --task K --tasks N` for each
task K of a sharded stage (`data_pipeline.build.run.SHARDED`; task 0 alone for the others), each process's CPU
seconds and peak RSS taken from the kernel (`os.wait4`), tasks one after another (their sum is what N nodes
would spend; the wall of N parallel nodes is about the slowest task's). Per (documents, tasks): documents per
CPU-second of the whole build, per stage the tasks' CPU seconds and largest peak RSS, the bytes each stage
left on disk, and a digest of manifest.json + every .bin/.idx — asserted equal across task counts (the same
build whatever N).

Corpus: `--sources` jsonl sources of `--files` files each; documents of 60-400 words assembled from lines of
the standard library (so each is distinct), plus exact copies (2%) and near copies (3%, truth J 0.6-0.95),
profile `minimal`, sentencepiece vocab 4096.

    PYTHONPATH=. nice -n 19 python bench/build_scaling.py --docs 100000 --tasks 1 2 4 8
    ... --docs 1000000 (about 1 GB of text; hours of CPU on a 2-core machine)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py`: bench.* from the root

from bench.dedup_eval import mutate
from data_pipeline.build.run import SHARDED, STAGES
from data_pipeline.build.stdlib_corpus import list_stdlib_files


def write_corpus(root: Path, docs: int, sources: int, files: int, seed: int) -> int:
    """jsonl files under root/<source>/; returns the bytes of text written."""
    rng = random.Random(seed)
    pool = [line for _, p in list_stdlib_files()[:400] for line in p.read_text(errors="replace").splitlines()
            if len(line.split()) >= 3]
    handles = []
    for s in range(sources):
        (root / f"s{s}").mkdir(parents=True, exist_ok=True)
        handles.append([open(root / f"s{s}" / f"part-{f:03d}.jsonl", "w") for f in range(files)])
    recent: list[str] = []
    size = 0
    for i in range(docs):
        r = rng.random()
        if r < 0.02 and recent:
            text = rng.choice(recent)
        elif r < 0.05 and recent:
            text = mutate(rng.choice(recent), rng.uniform(0.6, 0.95), rng)
        else:
            lines, words, target = [], 0, rng.randint(60, 400)
            while words < target:
                line = pool[rng.randrange(len(pool))]
                lines.append(line)
                words += len(line.split())
            text = "\n".join(lines)
            if len(recent) < 1000:
                recent.append(text)
            else:
                recent[i % 1000] = text  # a ring of the last originals, the sources of copies
        handles[i % sources][(i // sources) % files].write(json.dumps({"text": text}) + "\n")
        size += len(text)
    for hs in handles:
        for h in hs:
            h.close()
    return size


def config(out: Path, corpus: Path, sources: int, partition_docs: int | None = None) -> dict[str, Any]:
    return {"output_dir": str(out), "workers": 1, "shard_docs": 5000, "rejects": False,
            **({"dedup": {"partition_docs": partition_docs}} if partition_docs else {}),
            "sources": [{"name": f"s{s}", "path": str(corpus / f"s{s}"), "profile": "minimal"} for s in range(sources)],
            "tokenizer": {"vocab_size": 4096, "type": "bpe", "sample_chars": 5_000_000}}


LAUNCHER = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = proc.stderr.read()
_, status, ru = os.wait4(proc.pid, 0)
sys.stderr.buffer.write(err)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "cpu_s": ru.ru_utime + ru.ru_stime,
                  "peak_rss_mb": ru.ru_maxrss / 1024}))
"""
"""Starts a stage process and reports its rusage. A child's ru_maxrss starts from the high-water mark of the
process that spawned it (the kernel carries it across vfork + exec), so stage processes are started by this
small launcher (about 10 MB), not by the bench, whose RSS grows with the corpus and the digests (52-67 MB)."""


def launch(cmd: list[str], what: str) -> dict[str, float]:
    """`cmd` run through `LAUNCHER`: its CPU seconds, own peak RSS and wall seconds; an error names `what`."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, check=True)
    ru = json.loads(done.stdout)
    if ru["code"]:
        raise RuntimeError(f"{what} failed ({ru['code']}):\n{done.stderr.decode()[-3000:]}")
    return {"cpu_s": ru["cpu_s"], "peak_rss_mb": ru["peak_rss_mb"], "wall_s": time.perf_counter() - t0}


def run_task(cfg_path: Path, stage: str, task: int, tasks: int) -> dict[str, float]:
    cmd = [sys.executable, "-c", "import sys; from framework.cli import main; sys.exit(main(sys.argv[1:]))",
           "data", "build", str(cfg_path), "--stages", stage, "--task", str(task), "--tasks", str(tasks)]
    return launch(cmd, " ".join(cmd[4:]))


def files_under(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def run_killed(cfg_path: Path, out: Path, stage: str, task: int, tasks: int, rng: random.Random) -> dict[str, Any]:
    """The task, SIGKILLed (with its worker processes) a seeded 0-2 s after it wrote its first new file under the
    build — mid-stage, with some of its units done and one in flight; the rerun (by the caller) must finish it.
    Returns whether it was killed (a stage that ends first is not) and the CPU it spent."""
    cmd = [sys.executable, "-c", "import sys; from framework.cli import main; sys.exit(main(sys.argv[1:]))",
           "data", "build", str(cfg_path), "--stages", stage, "--task", str(task), "--tasks", str(tasks)]
    before, delay = files_under(out), rng.uniform(0.0, 2.0)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wrote_at = None
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:  # ended before the kill
            break
        if wrote_at is None and files_under(out) > before:
            wrote_at = time.perf_counter()
        if wrote_at is not None and time.perf_counter() - wrote_at >= delay:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, ru = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return {"killed": killed, "cpu_s": ru.ru_utime + ru.ru_stime}


def process_start() -> dict[str, float]:
    """What one stage process costs before any work: the CLI's imports (the reference for small builds)."""
    return launch([sys.executable, "-c", "import framework.cli, data_pipeline.build.run"], "the CLI's imports")


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def digest(out: Path) -> str:
    """sha256 over manifest.json (minus timings/paths) and every .bin/.idx of the build."""
    h = hashlib.sha256()
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("created", "elapsed_s", "output_dir", "config_path"):
        manifest.pop(key, None)
    h.update(json.dumps(manifest, sort_keys=True, default=str).replace(str(out), "OUT").encode())
    for f in sorted([*out.glob("*.bin"), *out.glob("*.idx")]):
        h.update(f.name.encode())
        with open(f, "rb") as fh:  # in chunks: a whole .bin read at once stays in this process's RSS high-water
            while chunk := fh.read(1 << 24):  # mark, which the next build's children inherit in ru_maxrss
                h.update(chunk)
    return h.hexdigest()[:16]


def build(corpus: Path, out: Path, sources: int, tasks: int, kill: random.Random | None = None,
          partition_docs: int | None = None) -> dict[str, Any]:
    """One build, stage by stage; with `kill`, one task of every stage (chosen by it) is first killed mid-way
    (`run_killed`) and then rerun, as after a node failure."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg_path = out.parent / f"{out.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config(out, corpus, sources, partition_docs)))
    sharded = tuple(SHARDED)
    stages: dict[str, Any] = {}
    disk_before = 0
    for stage in STAGES:
        n = tasks if stage in sharded else 1  # the others run in task 0 only
        victim = kill.randrange(n) if kill else -1
        killed = run_killed(cfg_path, out, stage, victim, tasks, kill) if kill else None
        runs = [run_task(cfg_path, stage, k, tasks) for k in range(n)]
        disk = du(out)
        stages[stage] = {"tasks": n, "cpu_s": sum(r["cpu_s"] for r in runs),
                         "max_task_cpu_s": max(r["cpu_s"] for r in runs),
                         "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
                         "disk_bytes_added": disk - disk_before}
        if killed is not None:
            stages[stage].update(killed_task=victim, killed=killed["killed"], killed_cpu_s=killed["cpu_s"])
        disk_before = disk
    return {"stages": stages, "cpu_s": sum(s["cpu_s"] for s in stages.values()),
            "peak_rss_mb": max(s["peak_rss_mb"] for s in stages.values()), "disk_bytes": du(out),
            "digest": digest(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[100_000])
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--root", default=".cache/tessera/build_scaling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--dry", action="store_true", help="600 documents, 1 and 2 tasks")
    parser.add_argument("--drop", action="store_true", help="delete each build once measured (6.6 GB at 10^6)")
    parser.add_argument("--kill", action="store_true",
                        help="kill one task of every stage mid-way and rerun it, in every build (seeded by --seed)")
    parser.add_argument("--expect", help="the digest every build must have (e.g. an uninterrupted build's)")
    parser.add_argument("--partition-docs", type=int,
                        help="dedup.partition_docs (default the build's 2^19: a 10^5 corpus then fills a fifth of one"
                             " partition, so its exact/verify/near tasks hold less than a 10^6 corpus's)")
    args = parser.parse_args(argv)
    if args.dry:
        args.docs, args.tasks, args.sources, args.files = [600], [1, 2], 2, 2
    root = Path(args.root)
    table: dict[str, Any] = {"sharded_stages": list(SHARDED), "load_before": os.getloadavg()[0],
                             "process_start": process_start(), "runs": []}
    print(f"one stage process before any work: {table['process_start']['cpu_s']:.1f} CPU-s, "
          f"{table['process_start']['peak_rss_mb']:.0f} MB peak RSS; sharded stages {table['sharded_stages']}")
    for n_docs in args.docs:
        corpus = root / f"corpus-{n_docs}-{args.sources}x{args.files}-{args.seed}"
        if not (corpus / "done").is_file():
            shutil.rmtree(corpus, ignore_errors=True)
            size = write_corpus(corpus, n_docs, args.sources, args.files, args.seed)
            (corpus / "done").write_text(str(size))
        digests = set()
        for tasks in args.tasks:
            kill = random.Random(f"{args.seed}-{n_docs}-{tasks}") if args.kill else None
            row = build(corpus, root / f"build-{n_docs}-t{tasks}", args.sources, tasks, kill, args.partition_docs)
            row.update(docs=n_docs, tasks=tasks, killed=args.kill, partition_docs=args.partition_docs,
                       text_bytes=int((corpus / "done").read_text()),
                       docs_per_cpu_s=n_docs / row["cpu_s"])
            table["runs"].append(row)
            digests.add(row["digest"])
            per_stage = "  ".join(f"{k} {v['cpu_s']:.1f}s/{v['peak_rss_mb']:.0f}MB/{v['disk_bytes_added'] / 1e6:.1f}MB"
                                  for k, v in row["stages"].items())
            print(f"{n_docs:>9} docs  {tasks} tasks: {row['docs_per_cpu_s']:7.0f} docs/CPU-s  peak RSS/task "
                  f"{row['peak_rss_mb']:6.0f} MB  disk {row['disk_bytes'] / 1e6:7.1f} MB  digest {row['digest']}\n"
                  f"    stage CPU s / peak RSS / disk added: {per_stage}", flush=True)
            if args.kill:
                print("    killed mid-stage, then rerun: " + "  ".join(
                    f"{k} task {v['killed_task']} {'killed' if v['killed'] else 'ended first'} after "
                    f"{v['killed_cpu_s']:.1f} CPU-s" for k, v in row["stages"].items()), flush=True)
            if args.dry or args.drop:
                shutil.rmtree(root / f"build-{n_docs}-t{tasks}")
        if len(digests) != 1 or (args.expect and digests != {args.expect}):
            raise AssertionError(f"{n_docs} documents: builds differ across task counts {args.tasks}: {digests}"
                                 + (f", expected {args.expect}" if args.expect else ""))
    table["load_after"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
