"""Sharded builds: 1 task or N tasks (and any partition size, any worker count, any merge unit size) give the same
manifest and the same .bin/.idx bytes — megatron-core's `add_index` merge of the token shards, byte for byte —, and
so does a build SIGKILLed in any stage and rerun, or one whose merge unit is lost half-written; removed near
duplicates each name a kept document they are near, and a chain of documents is never removed through. One large
file is cut into ingest units (byte ranges of a jsonl file, row groups of a parquet file, row ranges of a saved HF
dataset) that read every record once, with the file's own line numbers."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.dedup_eval import true_jaccard
from data_pipeline.build import shingles, verify_stage
from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.run import SHARDED, STAGES, run_build
from data_pipeline.build.shards import SHINGLE_COUNTS
from data_pipeline.build.verify_stage import verified_jaccard
from framework.base.errors import DataError

REPO = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(400)]


def _doc(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def _edit(text: str, rng: random.Random, k: int) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), k):
        words[i] = "x" + words[i]
    return " ".join(words)


def _corpus(root: Path) -> None:
    """Three sources: a jsonl directory of 4 files (4 ingest units), a text tree (3 units of 8 files) and a single
    jsonl of lower priority. Near duplicates within and across sources, exact copies across sources, and a chain
    c0 ~ c1 ~ c2 ~ c3 whose ends are far apart."""
    rng = random.Random(0)
    base = [_doc(rng, 60) for _ in range(40)]
    web = root / "web"
    web.mkdir()
    docs = [*base[:30], *(_edit(base[i], rng, 1) for i in range(10))]  # 10 near copies (J ~ 0.84)
    chain = [_doc(rng, 80)]
    for _ in range(3):
        chain.append(_edit(chain[-1], rng, 2))  # each ~0.78 to the previous, two steps apart ~0.6
    docs += chain
    for f in range(4):
        (web / f"part{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[f::4]))
    tree = root / "tree"
    tree.mkdir()
    for i in range(22):
        text = base[20 + i % 10] if i < 10 else _edit(base[i], rng, 1) if i < 16 else _doc(rng, 50)
        (tree / f"f{i:02d}.txt").write_text(text)
    (root / "low.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                            [base[0], base[1], _edit(base[2], rng, 1), *[_doc(rng, 40)
                                                                                       for _ in range(6)]]))


def _config(root: Path, out: str, **kw: object) -> BuildConfig:
    sources = [SourceConfig(name="web", path=str(root / "web"), profile="minimal", priority=1),
               SourceConfig(name="tree", path=str(root / "tree"), glob="*.txt", profile="minimal", priority=2),
               SourceConfig(name="low", path=str(root / "low.jsonl"), profile="minimal")]
    cfg = BuildConfig(output_dir=str(root / out), sources=sources, shard_docs=8, workers=2, merge_bytes=1500,
                      dedup=DedupConfig(partition_docs=16),
        tokenizer=TokenizerConfig(vocab_size=300, sample_chars=30_000))
    return dataclasses.replace(cfg, **kw)  # type: ignore[arg-type]


def _outputs(out: Path) -> dict[str, bytes]:
    """Every output of a build but the manifest's config (it names output_dir), byte for byte."""
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("config")
    files["manifest"] = json.dumps(manifest, sort_keys=True).encode()
    return files


def _sharded_build(cfg: BuildConfig, tasks: int, stages: tuple[str, ...] = STAGES) -> None:
    """Stage by stage as a SLURM array would run it: every task of a sharded stage, then the next stage."""
    for stage in stages:
        for task in range(tasks) if stage in SHARDED else [0]:
            run_build(cfg, stages=(stage,), task=task, tasks=tasks)


def _megatron_merge(prefixes: list[Path], out_prefix: Path, dtype: type) -> None:
    """The merge the manifest stage did before the merge stage: megatron-core's add_index of every shard."""
    from data_pipeline.indexed import import_megatron_builder

    builder = import_megatron_builder()(f"{out_prefix}.bin", dtype=dtype)
    for p in prefixes:
        builder.add_index(str(p))
    builder.finalize(f"{out_prefix}.idx")


def _lose_a_merge_unit(cfg: BuildConfig, source: str, u: int) -> None:
    """Merge unit u of `source` as a task killed in the middle of it leaves it: no marker, and its regions of the
    three partial files half written (here: garbage)."""
    from data_pipeline.build.merge import source_merges
    from data_pipeline.build.shards import CorpusIndex

    (m,) = [m for m in source_merges(CorpusIndex(cfg, Path(cfg.output_dir) / "work"), Path(cfg.output_dir), 300)
            if m.name == source]
    m.marker(u).unlink()
    (b0, s0, d0), (b1, s1, d1) = m.plan.starts(m.bounds[u]), m.plan.starts(m.bounds[u + 1])
    assert b1 > b0 and s1 > s0 and d1 > d0
    for ext, lo, hi in ((".bin", b0, b1), (".idx", 34 + 4 * s0, 34 + 4 * s1),
                        (".hash.npy", len(m.hash_header) + 8 * d0, len(m.hash_header) + 8 * d1)):
        with open(m.partial(ext), "r+b") as f:
            f.seek(lo)
            f.write(b"\xab" * ((hi - lo) // 2))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("sharding")
    _corpus(root)
    return root, run_build(_config(root, "one"))


def test_n_tasks_and_any_partition_size_give_the_same_bytes(straight, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from data_pipeline.indexed import IndexedTokens

    root, manifest = straight
    one = _outputs(root / "one")
    assert {"web.bin", "web.idx", "tree.bin", "low.bin", "cluster_report.json", "near_duplicates.jsonl"} <= set(one)
    d = {k: v["documents"] for k, v in manifest["sources"].items()}
    assert d["low"]["exact_duplicate"] == 2 and d["low"]["near_duplicate"] == 1  # base[0], base[1]; base[2]'s edit
    assert d["web"]["exact_duplicate"] == 10  # base[20:30] are in tree too (priority 2)
    # web's edits of base[0:10], its base[10:16] (tree holds edits of them, at priority 2) and the chain's c1, c3
    assert d["web"]["near_duplicate"] == 18 and d["tree"]["near_duplicate"] == 0
    # The merged files are megatron-core's merge of the token shards, byte for byte, and it reads them.
    for name in ("web", "tree", "low"):
        shards = sorted((root / "one/work/tokens" / name).glob("shard-*.idx"))
        _megatron_merge([p.with_suffix("") for p in shards], tmp_path / name, np.uint16)
        for ext in (".bin", ".idx"):
            assert one[name + ext] == (tmp_path / f"{name}{ext}").read_bytes(), (name, ext)
        kept = d[name]["kept"]
        assert len(IndexedTokens(root / "one" / name)) == kept == len(np.load(root / "one" / f"{name}.hash.npy"))
    cfg3 = _config(root, "three")
    _sharded_build(cfg3, 3, STAGES[:-1])
    # A merge unit lost mid-way (its task killed while copying): the manifest stage names it and what to run;
    # its task reruns it, and the bytes are the same.
    _lose_a_merge_unit(cfg3, "web", 1)
    with pytest.raises(DataError, match=r"merge unit 1 of source 'web' \(shards shard-\S+\.\.shard-\S+\) is not "
                                        r"done \(1 of the source's 4 merge units.*--stages merge"):
        run_build(cfg3, stages=("manifest",))
    run_build(cfg3, stages=("merge",), task=1, tasks=3)
    run_build(cfg3, stages=("manifest",))
    assert _outputs(root / "three") == one
    # The merge stage's 3 tasks at once, as an array runs them: each creates and fills the same files.
    shutil.rmtree(root / "three/work/merge")
    for f in (root / "three").glob("*.*"):
        if f.suffix in (".bin", ".idx", ".npy") or f.name == "manifest.json":
            f.unlink()
    tasks = [multiprocessing.get_context("fork").Process(target=run_build, args=(cfg3,), kwargs={
        "stages": ("merge",), "task": k, "tasks": 3}) for k in range(3)]
    for t in tasks:
        t.start()
    for t in tasks:
        t.join()
    assert [t.exitcode for t in tasks] == [0, 0, 0]
    run_build(cfg3, stages=("manifest",))
    assert _outputs(root / "three") == one
    # One partition for everything (no sharding inside the stages), one merge unit per source and one worker
    # process instead of two: the same data, the trained sentencepiece model included (its thread count is
    # `tokenizer.threads`, not `workers`); verified a few pairs at a time (4 KB of shingle sets), words hashed
    # 512 bytes at a time (the memory bounds), changing nothing.
    monkeypatch.setattr(verify_stage, "VERIFY_SET_BYTES", 4096)
    monkeypatch.setattr(shingles, "WORD_BATCH_BYTES", 512)
    single = _config(root, "single", dedup=DedupConfig(partition_docs=10_000), workers=1, merge_bytes=1 << 30)
    run_build(single)
    assert _outputs(root / "single") == one and "tokenizer.model" in one
    # A build by code from before the minhash stage wrote shingle counts: verify names the stage to run, which
    # shingles those shards again (the same signatures), and verification gives the same edges.
    work1 = root / "single" / "work"
    verified = {p.name: p.read_bytes() for p in (work1 / "verify").iterdir()}
    sigs = {p: p.read_bytes() for p in (work1 / "minhash").rglob("*.sig.npy")}
    for f in (work1 / "minhash").rglob(f"*{SHINGLE_COUNTS}"):
        f.unlink()
    shutil.rmtree(work1 / "verify")
    with pytest.raises(DataError, match=r"shingles\.npy is missing.*--stages minhash"):
        run_build(single, stages=("verify",))
    run_build(single, stages=("minhash", "verify"))
    assert {p.name: p.read_bytes() for p in (work1 / "verify").iterdir()} == verified
    assert {p: p.read_bytes() for p in (work1 / "minhash").rglob("*.sig.npy")} == sigs
    # Work is split: each sharded stage had several units (partitions, ranges, shards, ingest units, merge units).
    work = root / "three" / "work"
    assert len(list((work / "exact").glob("part-*.npy"))) >= 5 and len(list((work / "pairs").glob("*.npy"))) >= 5
    assert len(list((work / "ingest" / "web").glob("unit-*.counts.json"))) == 4
    assert len(list((work / "ingest" / "tree").glob("unit-*.counts.json"))) == 3
    assert len(list((work / "merge" / "web").glob("unit-*.json"))) == 4
    assert len(list((root / "single/work/merge/web").glob("unit-*.json"))) == 1
    assert not list((work / "merge").rglob("*.partial"))  # moved into place


def test_verification_holds_one_chunk_of_sets_within_its_byte_budget() -> None:
    """`verified_jaccard` cuts its chunks by the bytes of the shingle sets they need, not by a count of pairs, so
    documents of any length stay within the budget, across a jump in length too; the previous chunk's sets are
    gone before the next are read; the values are those of one chunk."""
    import weakref

    import numpy as np

    from data_pipeline.build.minhash import jaccard

    rng = np.random.default_rng(7)
    pool = rng.integers(0, 1 << 63, size=6_000, dtype=np.uint64)
    # 600 documents from one pool (so pairs overlap): a source of short ones, then one of documents ten times
    # longer; shingles with repeats, so their count bounds the distinct ones from above.
    lens = np.where(np.arange(600) < 300, rng.integers(30, 300, 600), rng.integers(300, 3000, 600))
    shingles = [rng.choice(pool[:2 * n], size=n) for n in lens.tolist()]
    sets = [np.unique(h) for h in shingles]
    b = np.sort(rng.integers(0, 600, size=5_000))
    a = np.maximum(0, b - rng.integers(0, 40, size=5_000))  # the better copy: a nearby, earlier document
    held: list[int] = []
    alive: list[weakref.ref[np.ndarray]] = []

    def sets_of(ids: np.ndarray) -> list[np.ndarray]:
        assert all(r() is None for r in alive), "the previous chunk's sets are still held"
        assert np.all(np.diff(ids) > 0)
        out = [sets[i].copy() for i in ids.tolist()]
        alive[:] = [weakref.ref(x) for x in out]
        held.append(sum(x.nbytes for x in out))
        return out

    def bytes_of(ids: np.ndarray) -> np.ndarray:
        return np.array([8 * len(shingles[i]) for i in ids.tolist()])

    budget = 256 * 1024
    j = verified_jaccard(a, b, sets_of, bytes_of, budget=budget)
    want = np.array([jaccard(sets[x], sets[y]) for x, y in zip(a.tolist(), b.tolist(), strict=True)],
                    dtype=np.float32)
    assert np.array_equal(j, want) and 0 < want.min() < want.max() <= 1
    assert len(held) >= 20 and max(held) <= budget and np.median(held) > budget / 2, held
    # A fixed count of pairs that fits the short documents holds several budgets' worth of the long ones.
    assert sum(sets[i].nbytes for i in np.unique(np.concatenate([a[-400:], b[-400:]]))) > 3 * budget
    assert np.array_equal(verified_jaccard(a, b, lambda ids: [sets[i] for i in ids.tolist()],
                                                        bytes_of, budget=1 << 40), want)
    calls = len(held)
    one = verified_jaccard(a[:3], b[:3], sets_of, bytes_of, budget=1)  # a pair past the budget: alone
    assert np.array_equal(one, want[:3]) and len(held) == calls + 3


def test_shard_rows_are_read_at_their_byte_offsets_and_older_shards_by_scanning(tmp_path: Path) -> None:
    """Rows of an ingest shard are read by the byte offsets its writer records (multi-byte UTF-8, escapes and
    long lines included), giving the lines a full read gives; a shard without offsets (written by older code) is
    scanned with the same result; a row past the end is named either way."""
    import numpy as np

    from data_pipeline.build.shard_files import LINE_OFFSETS, _ShardWriter, read_shard_texts, read_shard_where

    texts = [f"{i} naïve café — Σίσυφος 漢字 🙂\n\"quoted\" \\ tab\t{'x' * (i * 37 % 500)}" for i in range(50)]
    writer = _ShardWriter(tmp_path / "new", "shard-00000", 20)
    writer.out.mkdir()
    for i, t in enumerate(texts):
        writer.add(t, f"src.jsonl:{i + 1}")
    writer.flush()
    shards = sorted(writer.out.glob("shard-*.jsonl"))
    assert len(shards) == 3
    (tmp_path / "old").mkdir()
    rng = random.Random(5)
    for shard in shards:
        offsets = np.load(shard.with_name(shard.name.replace(".jsonl", LINE_OFFSETS)))
        every, wheres = read_shard_texts(shard), read_shard_where(shard)
        assert len(offsets) == len(every) + 1 and int(offsets[-1]) == shard.stat().st_size
        old = tmp_path / "old" / shard.name
        shutil.copy(shard, old)
        for k in (1, 3, len(every)):
            rows = sorted(rng.sample(range(len(every)), k))
            for path in (shard, old):
                assert read_shard_texts(path, rows) == [every[r] for r in rows]
                assert read_shard_where(path, rows) == [wheres[r] for r in rows]
        for path in (shard, old):
            with pytest.raises(DataError, match=rf"row {len(every)} is past the shard's end \({len(every)} lines\)"):
                read_shard_texts(path, [0, len(every)])
    assert [t for shard in shards for t in read_shard_texts(shard)] == texts
    # A shard edited after ingest no longer matches its offsets: named, not read at the wrong places.
    with open(shards[0], "ab") as f:
        f.write(b'{"t": "appended", "w": "x"}\n')
    with pytest.raises(DataError, match=r"holds \d+ bytes but its shard-00000-00000\.offsets\.npy says \d+"):
        read_shard_texts(shards[0], [0])


def test_a_stage_missing_its_inputs_from_other_tasks_says_which(straight) -> None:  # type: ignore[no-untyped-def]
    root, _ = straight
    cfg = _config(root, "partial")
    run_build(cfg, stages=("ingest",), task=0, tasks=2)
    with pytest.raises(DataError, match=r"has not finished ingest.*--stages ingest"):
        run_build(cfg, stages=("exact",), task=0, tasks=2)
    run_build(cfg, stages=("ingest",), task=1, tasks=2)
    run_build(cfg, stages=("exact",), task=0, tasks=2)
    with pytest.raises(DataError, match="--stages exact"):
        run_build(cfg, stages=("minhash",), task=0, tasks=2)


def test_every_stage_runs_without_torch_or_megatron(straight) -> None:  # type: ignore[no-untyped-def]
    """A stage process (`tessera data build`, as each SLURM array task runs it) imports neither torch (~230 MB,
    ~2 CPU-s a process) nor megatron-core, not even lazily: both are blocked at import in a subprocess whose
    build, all stages with forked workers, must give the straight build's bytes."""
    import yaml

    root, _ = straight
    cfg = _config(root, "notorch")
    path = root / "notorch.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    code = ("import importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'megatron'):\n"
            "            raise ImportError(f'a data stage imported {name}')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from framework.cli import main\n"
            f"sys.exit(main(['data', 'build', {str(path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _outputs(root / "notorch") == _outputs(root / "one")


def test_removed_documents_name_a_kept_one_they_are_near(straight) -> None:  # type: ignore[no-untyped-def]
    root, manifest = straight
    rows = [json.loads(x) for x in (root / "one" / "near_duplicates.jsonl").read_text().splitlines()]
    assert len(rows) == sum(s["documents"]["near_duplicate"] for s in manifest["sources"].values())

    def text(name: str) -> str:
        source, where = name.split(":", 1)
        path, _, line = where.rpartition(":")
        if source == "tree":
            return Path(where).read_text()
        return json.loads(Path(path).read_text().splitlines()[int(line) - 1])["text"]

    removed = {r["removed"] for r in rows}
    for r in rows:
        assert r["kept"] not in removed  # the representative is kept
        assert abs(true_jaccard(text(r["removed"]), text(r["kept"])) - r["jaccard"]) < 0.05
        assert r["jaccard"] >= 0.7
    report = json.loads((root / "one" / "cluster_report.json").read_text())
    assert report["removed"] == len(rows) and report["largest"][0]["removed"][0]["jaccard"] >= 0.7
    # The chain c0 ~ c1 ~ c2 ~ c3 (J 0.77, 0.77, 0.81; c0 to c2 0.65): c1 is removed for c0, c2 is kept (its only
    # better neighbour, c1, is gone) and c3 is removed for c2 — union-find would have made one cluster of four.
    web = root / "web"
    c = [f"web:{web}/part{i}.jsonl:11" for i in range(4)]
    named = {r["removed"]: r["kept"] for r in rows}
    assert named.get(c[1]) == c[0] and c[2] not in named and named.get(c[3]) == c[2], {k: named.get(k) for k in c}


class _Killed(BaseException):
    """Stands for the process dying at a write: raised before the write, caught by nothing in the build."""


_STAGE_DIRS = {"ingest": "ingest", "exact": "exact", "minhash": "minhash", "bands": "minhash", "pairs": "pairs",
               "verify": "verify", "near": "near", "tokens": "tokenize", "merge": "merge"}

_KILLER = """
import os, signal, sys
from pathlib import Path
import data_pipeline.build.run as b
from tests.data_pipeline.test_sharding import patch_writes
build = os.getpid()  # the build process: a verify unit writes from a child forked for it, which dies with it
patch_writes(Path(sys.argv[2]), sys.argv[3], lambda: [os.kill(p, signal.SIGKILL) for p in (build, os.getpid())])
from data_pipeline.build.config import load_build_config
b.run_build(load_build_config(sys.argv[1]))
"""


def patch_writes(out: Path, target: str, die: object) -> list[object]:
    """Make the build call `die()` at its second atomic write in stage `target` (the first for manifest, which
    has one); returns the originals (the stage modules' save_npy_atomic and write_json_atomic)."""
    import importlib

    seen = multiprocessing.get_context("fork").Value("i", 0)  # shared: exact/pairs/verify write from a child per unit

    def stage(path: Path) -> str:
        parts = Path(path).relative_to(out).parts
        if parts[0] == "work":
            return _STAGE_DIRS.get(parts[1], "?")
        return "manifest" if parts[0] == "manifest.json" else "near"

    def wrap(orig):  # type: ignore[no-untyped-def]
        def write(path, obj):  # type: ignore[no-untyped-def]
            if stage(path) == target:
                with seen.get_lock():
                    seen.value += 1
                    count = seen.value
                if count == (1 if target == "manifest" else 2):
                    die()  # type: ignore[operator]
            orig(path, obj)
        return write

    originals: list[object] = []
    stages = ("ingest_stage", "shard_files", "tokenize_stage", "exact_stage", "minhash_stage", "pairs_stage",
              "verify_stage", "near_stage", "merge", "run")
    for m in (importlib.import_module(f"data_pipeline.build.{name}") for name in stages):
        for name in ("save_npy_atomic", "write_json_atomic"):
            if hasattr(m, name):
                originals.append((m, name, getattr(m, name)))
                setattr(m, name, wrap(getattr(m, name)))
    return originals


def test_killed_in_every_stage_and_rerun_gives_the_same_bytes(straight) -> None:  # type: ignore[no-untyped-def]
    """One output directory, stopped in each stage in turn (at that stage's second atomic write), each rerun
    resuming the previous one, then finished stage by stage as 2 tasks, and compared with the straight build. The
    verify stage is a real SIGKILL of a build process; the others stop in-process (the same files on disk: no write
    after the stop happens; ~8 s of torch import saved per stage)."""
    import yaml

    from framework.base.yaml_config import to_dict

    root, _ = straight
    cfg = _config(root, "killed", workers=1)  # one worker: every write is in the stopped process
    cfg_file = root / "killed.yaml"
    cfg_file.write_text(yaml.safe_dump(to_dict(cfg)))
    for stage in ("ingest", "exact", "minhash", "pairs", "verify", "near", "tokenize", "merge", "manifest"):
        if stage == "verify":
            proc = subprocess.run([sys.executable, "-c", _KILLER, str(cfg_file), cfg.output_dir, stage], cwd=REPO,
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            assert proc.returncode == -9, (stage, proc.stderr[-2000:])
        else:
            def die() -> None:
                raise _Killed

            originals = patch_writes(Path(cfg.output_dir), stage, die)
            try:
                with pytest.raises(_Killed):
                    run_build(cfg)
            finally:
                for m, name, orig in originals:  # type: ignore[misc]
                    setattr(m, name, orig)
        assert not (root / "killed" / "manifest.json").exists()
    _sharded_build(dataclasses.replace(cfg, workers=2), 2)
    assert _outputs(root / "killed") == _outputs(root / "one")


def _records_by_units(src: SourceConfig, unit_bytes: int) -> tuple[int, list[tuple[str | None, str, str | None]]]:
    """(number of units, every record as (text, where, reason)) read unit by unit, `where` rebased as the build
    does (the line bases from each range's line count)."""
    from data_pipeline.build.ingest_stage import _line_bases, _unit_records, source_units
    from data_pipeline.build.shard_files import _rebase

    units = source_units(src, 8, unit_bytes)
    per_unit, lines = [], []
    for unit in units:
        tally: dict[str, int] = {}
        per_unit.append([(r.text, r.where, r.reason) for r in _unit_records(src, unit, tally)])
        lines.append(tally.get("lines", 0))
    bases = _line_bases(units, lines)
    return len(units), [(t, _rebase(w, b), r) for recs, b in zip(per_unit, bases, strict=True) for t, w, r in recs]


def test_one_large_file_is_cut_into_units_that_read_each_record_once(tmp_path: Path) -> None:
    """Byte ranges of a jsonl file (every size from 1 byte up: ranges start inside a BOM, inside CRLFs, at a line
    start, inside a line longer than several ranges), row groups of a parquet file and row ranges of a saved HF
    dataset: unit by unit, the same records with the same `file:line` as reading the file whole."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_pipeline.build.ingest import read_records

    lines = [b"\xef\xbb\xbf" + json.dumps({"text": "first, after a BOM"}).encode(), b"", b"   ",
             json.dumps({"text": "crlf line"}).encode() + b"\r", b"{not json", json.dumps({"text": "x" * 300}).encode(),
             json.dumps({"nope": 1}).encode(), *(json.dumps({"text": f"doc {i} é"}).encode() for i in range(12)),
             b"", json.dumps({"text": "last, no newline"}).encode()]
    (tmp_path / "one.jsonl").write_bytes(b"\n".join(lines))
    src = SourceConfig(name="j", path=str(tmp_path / "one.jsonl"))
    whole = [(r.text, r.where, r.reason) for r in read_records(src.path)]
    assert len(whole) == 18 and whole[-1][1].endswith(":21") and whole[0][0] == "first, after a BOM"
    for unit_bytes in (1, 2, 3, 7, 40, 64, 333, 10**9):
        n, got = _records_by_units(src, unit_bytes)
        assert got == whole, unit_bytes
        assert n == (1 if unit_bytes == 10**9 else -(-(tmp_path / "one.jsonl").stat().st_size // unit_bytes))
    (tmp_path / "dir").mkdir()  # a directory of files, each cut: line bases per file
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "dir" / name).write_bytes((tmp_path / "one.jsonl").read_bytes())
    src = SourceConfig(name="d", path=str(tmp_path / "dir"))
    assert _records_by_units(src, 50)[1] == [(r.text, r.where, r.reason) for r in read_records(src.path)]

    texts = [f"row {i} " + "y" * (i % 7) for i in range(50)]
    pq.write_table(pa.table({"text": [*texts[:20], None, *texts[20:]]}), tmp_path / "t.parquet", row_group_size=6)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    for name in ("t.parquet", "hf"):
        src = SourceConfig(name="p", path=str(tmp_path / name))
        whole = [(r.text, r.where, r.reason) for r in read_records(src.path)]
        n, got = _records_by_units(src, 60)
        assert n >= 4 and got == whole, name
        assert _records_by_units(src, 10**9) == (1, whole)


def _one_file(root: Path) -> tuple[Path, int]:
    """One jsonl file of 66 records — near and exact duplicates, whitespace-only documents (filtered), a bad JSON
    line and a record without the field — and a unit size that puts a range boundary exactly at the bad line's
    start, so other boundaries fall inside records."""
    rng = random.Random(1)
    base = [_doc(rng, rng.randint(50, 80)) for _ in range(50)]
    docs = [*base, *(_edit(base[i], rng, 1) for i in range(8)), *base[10:14], "   ", "\t"]
    rng.shuffle(docs)
    lines = [json.dumps({"text": t}) for t in docs]
    lines[30:30] = ["{bad json", json.dumps({"other": "field"})]
    while len("\n".join(lines[:30])) % 5 != 4:  # the bad line's start a multiple of 5
        lines[0] += " "
    data = "\n".join(lines) + "\n"
    (root / "big.jsonl").write_text(data)
    start = len("\n".join(lines[:30])) + 1  # the bad line's first byte
    return root / "big.jsonl", start // 5  # boundaries at k x start / 5: the 5th is the bad line's start


def test_a_single_jsonl_file_split_across_tasks_gives_the_same_bytes_and_lines(tmp_path: Path) -> None:
    """A single-file jsonl source in byte-range units, built as 1 task and stage by stage as 3 tasks, and as one
    unit: byte-identical .bin/.idx and manifest, the same accounting, and every `where` (rejects, filter samples,
    near-duplicate report) the file's own line number."""
    path, unit_bytes = _one_file(tmp_path)
    raw = path.read_text().split("\n")
    cuts = range(unit_bytes, path.stat().st_size, unit_bytes)
    starts = [sum(len(x) + 1 for x in raw[:i]) for i in range(len(raw))]
    assert len(cuts) >= 8 and starts[30] in cuts  # the bad line starts at a boundary
    assert any(s < c < s + len(x) for c in cuts for s, x in zip(starts, raw, strict=True))  # records span ones

    def cfg(out: str, ub: int) -> BuildConfig:
        return BuildConfig(output_dir=str(tmp_path / out), unit_bytes=ub, shard_docs=8, workers=2,
                           sources=[SourceConfig(name="big", path=str(path), profile="minimal")],
                           dedup=DedupConfig(partition_docs=16),
                           tokenizer=TokenizerConfig(vocab_size=300, sample_chars=30_000))

    one = run_build(cfg("one", unit_bytes))
    _sharded_build(cfg("three", unit_bytes), 3)
    run_build(cfg("whole", 10**9))
    assert _outputs(tmp_path / "three") == _outputs(tmp_path / "one") == _outputs(tmp_path / "whole")
    work = tmp_path / "three" / "work" / "ingest" / "big"
    assert len(list(work.glob("unit-*.counts.json"))) == len(cuts) + 1
    d = one["sources"]["big"]["documents"]
    assert d["in"] == 66 and d["malformed"] == {"bad_json": 1, "missing_field": 1}
    assert d["filtered"] == {"empty": 2} and d["exact_duplicate"] == 4 and d["near_duplicate"] >= 6
    assert d["kept"] + 2 + 2 + d["exact_duplicate"] + d["near_duplicate"] == d["in"]

    def line_of(where: str) -> str:
        file, _, n = where.rpartition(":")
        assert file == str(path)
        return raw[int(n) - 1]

    for build in ("one", "three"):
        def rows(name: str, build: str = build) -> list[dict]:
            return [json.loads(x) for x in (tmp_path / build / name).read_text().splitlines()]

        rejects = rows("work/ingest/big/rejects.jsonl")
        assert [(r["reason"], line_of(r["where"])) for r in rejects] == [("bad_json", raw[30]),
                                                                         ("missing_field", raw[31])]
        filtered = rows("work/ingest/big/filtered.jsonl")
        assert sorted(json.loads(line_of(f["where"]))["text"] for f in filtered) == ["\t", "   "]
        near = rows("near_duplicates.jsonl")
        assert len(near) == d["near_duplicate"]
        for r in near:
            a, b = (json.loads(line_of(r[k].split(":", 1)[1]))["text"] for k in ("removed", "kept"))
            assert abs(true_jaccard(a, b) - r["jaccard"]) < 0.05


def _vm(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _forked_unit(job: tuple[str, int, str]) -> None:
    """What `run_forked` is asked to do: write this process's pid and peak RSS; or fail in one of four ways;
    or hold 64 MB for a while (the next unit must not see it in its own peak)."""
    out, k, what = job
    if what == "big":
        import numpy as np

        np.ones(8 << 20).sum()  # 64 MB, touched
    elif what == "bad":
        raise DataError(f"unit {k} is bad: its input holds 'x'; remove it")
    elif what == "unpicklable":
        raise RuntimeError(lambda: k)  # an exception whose argument cannot be pickled
    elif what == "killed":
        os.kill(os.getpid(), 9)
    elif what == "stopped":  # a stop signal the unit's process got (its handler raises StopSignal)
        from framework.checkpoint.signals import StopSignal

        raise StopSignal(15, 75)
    Path(out, f"{k}.json").write_text(json.dumps({"pid": os.getpid(), "hwm": _vm("VmHWM")}))


def test_forked_units_run_alone_and_their_failures_reach_the_stage(tmp_path: Path) -> None:
    """`run_forked`, which exact, pairs and verify run their units with: each unit in a fresh child (its own pid,
    its peak RSS not raised by the unit before it), at most `workers` at once, every unit done once; a unit's
    DataError arrives as itself, any other exception with its text, a unit killed by a signal names it, a unit's
    StopSignal keeps its exit code."""
    from data_pipeline.build.workers import run_forked

    done: list[int] = []
    run_forked(_forked_unit, [(str(tmp_path), k, "ok") for k in range(5)], 2, lambda: done.append(1))
    seen = [json.loads((tmp_path / f"{k}.json").read_text()) for k in range(5)]
    assert len(done) == 5 and len({s["pid"] for s in seen} | {os.getpid()}) == 6

    rss = _vm("VmRSS")
    run_forked(_forked_unit, [(str(tmp_path), 10, "big"), (str(tmp_path), 11, "ok")], 1)
    after_big = json.loads((tmp_path / "11.json").read_text())["hwm"]
    assert after_big < rss + (32 << 20), (after_big, rss)  # in one process it would be >= rss + 64 MB

    with pytest.raises(DataError, match=r"unit 3 is bad: its input holds 'x'; remove it"):
        run_forked(_forked_unit, [(str(tmp_path), 2, "ok"), (str(tmp_path), 3, "bad")], 1)
    with pytest.raises(RuntimeError, match=r"RuntimeError: <function"):
        run_forked(_forked_unit, [(str(tmp_path), 4, "unpicklable")], 1)
    with pytest.raises(DataError, match=r"_forked_unit died \(signal 9\); rerun the stage"):
        run_forked(_forked_unit, [(str(tmp_path), 5, "killed"), (str(tmp_path), 6, "ok")], 2)
    from framework.checkpoint.signals import StopSignal

    with pytest.raises(StopSignal, match="stopped by SIGTERM") as stop:  # the CLI's requeue exit code survives
        run_forked(_forked_unit, [(str(tmp_path), 7, "stopped")], 1)
    assert stop.value.exit_code == 75
