"""Near-dedup throughput and quality: Tessera's numpy MinHash LSH vs datatrove's MinHash pipeline vs datasketch.

All three use word 5-grams and 14 bands x 8 rows on the same corpus (standard-library .py chunks of 150-400
words plus mutated copies with known Jaccard), measured in the same run on one core. Throughput counts every
step end to end: shingling, signatures, banding, clustering (and, for Tessera, exact-Jaccard verification).
docs/s is documents per CPU-second of the process and its children (fair on a shared machine) with wall
seconds beside it.

datatrove and datasketch are not Tessera dependencies; run this with a separate environment:
    python3 -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install numpy xxhash datasketch datatrove spacy
    PYTHONPATH=. taskset -c 0 /tmp/benchvenv/bin/python bench/dedup_vs_peers.py --base 10000 --copies 2000
"""

from __future__ import annotations

import argparse
import pickle
import re
import resource
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_pipeline.dedup import NearDedupResult, near_dedup
from data_pipeline.dedup_eval import DedupBenchmark, make_benchmark, recall_precision
from data_pipeline.minhash import MinHashConfig, union_find

_WORDS = re.compile(r"\w+")


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def shingles(text: str) -> set[bytes]:
    w = _WORDS.findall(text.lower())
    return {" ".join(w[i:i + 5]).encode() for i in range(max(1, len(w) - 4))}


def run_datasketch(texts: list[str]) -> NearDedupResult:
    """The usual streaming use: query each document; a hit is a duplicate of a kept one, else insert it."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    keep = np.ones(len(texts), dtype=bool)
    edges = []
    for i, text in enumerate(texts):
        m = MinHash(num_perm=112, seed=1)
        m.update_batch(list(shingles(text)))
        hits = lsh.query(m)
        if hits:
            keep[i] = False
            edges.append((min(hits), i))
        else:
            lsh.insert(i, m)
    return NearDedupResult(keep=keep, cluster=union_find(len(texts), edges), candidates=len(edges),
                           verified=len(edges))


def run_datatrove(texts: list[str]) -> NearDedupResult:
    """datatrove's four MinHash stages (signature, buckets, cluster, filter) with the local executor."""
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
        kept: list[int] = []

        def collect(data, rank: int = 0, world_size: int = 1):  # type: ignore[no-untyped-def]
            for doc in data:
                kept.append(int(doc.id))
                yield doc

        stages: list[tuple[list, int]] = [
            ([docs, MinhashDedupSignature(output_folder=str(root / "sigs"), config=cfg)], 1),
            ([MinhashDedupBuckets(input_folder=str(root / "sigs"), output_folder=str(root / "buckets"),
                                  config=cfg)], 14),
            ([MinhashDedupCluster(input_folder=str(root / "buckets"), output_folder=str(root / "remove"),
                                  config=cfg, save_cluster_id=True)], 1),
            ([docs, MinhashDedupFilter(input_folder=str(root / "remove")), collect], 1),
        ]
        for k, (pipeline, tasks) in enumerate(stages):
            LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1,
                                  logging_dir=str(root / f"logs{k}")).run()
        cluster = np.arange(len(texts))
        clusters_file = root / "remove" / "000000.clusters"
        if clusters_file.is_file():
            raw = clusters_file.read_bytes()
            for idx, cid in struct.iter_unpack("<2I", raw):
                cluster[idx] = len(texts) + cid
    keep = np.zeros(len(texts), dtype=bool)
    keep[kept] = True
    return NearDedupResult(keep=keep, cluster=cluster, candidates=0, verified=0)


def measure(name: str, fn: Callable[[list[str]], NearDedupResult], bench: DedupBenchmark) -> dict[str, float]:
    c0, t0 = cpu_seconds(), time.perf_counter()
    result = fn(bench.texts)
    cpu, wall = cpu_seconds() - c0, time.perf_counter() - t0
    recall, precision = recall_precision(bench, result)
    row = {"docs_per_cpu_s": len(bench.texts) / cpu, "wall_s": wall, "recall@0.8": recall,
           "precision@0.7": precision, "removed": float((~result.keep).sum())}
    print(f"{name:34s} {row['docs_per_cpu_s']:9.0f} docs/s  (cpu {cpu:6.1f} s, wall {wall:6.1f} s)  "
          f"recall@0.8 {recall:.3f}  precision@0.7 {precision:.3f}  removed {int(row['removed'])}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=int, default=10_000)
    parser.add_argument("--copies", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=".cache/tessera/dedup_bench")
    parser.add_argument("--skip", nargs="*", default=[], help="peers to skip: datatrove datasketch")
    args = parser.parse_args()
    cache = Path(args.cache) / f"bench-{args.base}-{args.copies}-{args.seed}.pkl"
    if cache.is_file():
        bench = pickle.loads(cache.read_bytes())
    else:
        bench = make_benchmark(args.base, args.copies, args.seed)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(pickle.dumps(bench))
    js = np.array([j for _, _, j in bench.pairs])
    print(f"corpus: {len(bench.texts)} documents, {len(bench.pairs)} known pairs (Jaccard {js.min():.2f}-"
          f"{js.max():.2f}, {(js >= 0.8).sum()} with J >= 0.8); python {sys.version.split()[0]}")
    rows = {
        "tessera (14x8, probe + verify)": measure("tessera (14x8, probe + verify)",
                                                  lambda t: near_dedup(t, MinHashConfig()), bench),
        "tessera (14x8 plain, no verify)": measure(
            "tessera (14x8 plain, no verify)",
            lambda t: near_dedup(t, MinHashConfig(probe=False, verify_threshold=None)), bench),
    }
    if "datasketch" not in args.skip:
        rows["datasketch"] = measure("datasketch MinHashLSH", run_datasketch, bench)
    if "datatrove" not in args.skip:
        rows["datatrove"] = measure("datatrove MinHash pipeline", run_datatrove, bench)
    ours = rows["tessera (14x8, probe + verify)"]["docs_per_cpu_s"]
    for peer in ("datasketch", "datatrove"):
        if peer in rows:
            print(f"tessera / {peer}: {ours / rows[peer]['docs_per_cpu_s']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
