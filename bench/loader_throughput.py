"""Loader throughput: Tessera's PackedSource + BatchLoader vs megatron-core's GPTDataset, the same torch batches.

Both read one `.bin/.idx` (written through megatron-core's builder by `IndexedWriter`: generated documents of
lognormal length, or `--prefix` an existing build's source). megatron-core's GPTDataset builds its document,
sample and shuffle indices (one epoch; timed as setup); Tessera's PackedSource is handed the same document
order (`doc_ids`, no shuffle) and reads samples in GPTDataset's shuffle order, so batch b of both is the same
tensor pair: tokens (B, seq_len) and labels (B, seq_len), int64. An untimed pass asserts torch.equal on every
batch; then each side produces all batches `--repeats` times, alternating, and its least CPU time is kept.
A third row: Tessera with its own seeded orders (what training uses; batches differ, the work is the same).
Rates are batches per CPU-second of this process (getrusage), fair on a shared machine.

    PYTHONPATH=. nice -n 19 python bench/loader_throughput.py --samples 20000 --seq-len 1024 --batch 8
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_corpus(prefix: Path, docs: int, vocab: int, seed: int) -> None:
    from data_pipeline.indexed import IndexedWriter

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 1.0, docs).astype(np.int64), 8, 32_768)
    writer = IndexedWriter(prefix, vocab)
    for n in lengths:
        doc = rng.integers(1, vocab, int(n), dtype=np.int64)
        doc[-1] = 0  # EOS
        writer.add(doc)
    writer.finalize()


class _Tok:
    """The attributes GPTDataset needs from a tokenizer."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, eod, -1
        self.unique_identifiers = {"class": "bench", "vocab_size": vocab_size, "eod": eod}


def megatron_dataset(prefix: str, seq_len: int, n: int, seed: int, vocab: int, cache: str) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.utils import Split
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=([prefix], None), split="100,0,0", path_to_cache=cache,
        tokenizer=_Tok(vocab, 0), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    indexed = IndexedDataset(prefix, multimodal=False, mmap=True)
    docs = np.arange(len(indexed.document_indices) - 1, dtype=np.int32)
    return GPTDataset(indexed, prefix, docs, n, Split.train, config)


class _Ordered:
    """Tessera's packed samples read in another order (GPTDataset's shuffle index)."""

    def __init__(self, source: object, order: np.ndarray) -> None:
        self.source, self.order = source, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.source.sample(int(self.order[i]))  # type: ignore[attr-defined]


def tessera_batches(samples: object, batch: int, n_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from data_pipeline.read.loader import BatchLoader

    loader = BatchLoader(samples, global_batch_size=batch, micro_batch_size=batch, dp_rank=0,  # type: ignore[arg-type]
                         dp_size=1)
    for _ in range(n_batches):
        b = loader.next_batch()[0]
        yield b[:, :-1], b[:, 1:]


def megatron_batches(ds: object, batch: int, n_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for k in range(n_batches):
        items = [ds[i] for i in range(k * batch, (k + 1) * batch)]  # type: ignore[index]
        yield torch.stack([s["tokens"] for s in items]), torch.stack([s["labels"] for s in items])


def timed(make: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[float, float]:
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in make():
        pass
    return cpu_seconds() - c0, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--docs", type=int, default=50_000, help="generated documents (mean ~660 tokens)")
    parser.add_argument("--vocab", type=int, default=50_257)
    parser.add_argument("--prefix", help="an existing .bin/.idx prefix instead of a generated corpus")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dry", action="store_true", help="a tiny run (checks equality, prints the table)")
    args = parser.parse_args(argv)
    if args.dry:
        args.samples, args.seq_len, args.docs, args.repeats = 64, 64, 300, 1
    quiet = logging.getLogger("megatron")  # megatron-core logs every index it builds; only for this run
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _run(args)
    finally:
        quiet.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    from data_pipeline.indexed import IndexedTokens
    from data_pipeline.read.packing import PackedSource

    with tempfile.TemporaryDirectory() as tmp:
        prefix = args.prefix
        if prefix is None:
            prefix = str(Path(tmp) / "corpus")
            write_corpus(Path(prefix), args.docs, args.vocab, args.seed)
        c0 = cpu_seconds()
        ds = megatron_dataset(prefix, args.seq_len, args.samples, args.seed, args.vocab, tmp)
        setup_megatron = cpu_seconds() - c0
        doc_index, shuffle = ds.document_index, ds.shuffle_index  # type: ignore[attr-defined]
        if len(doc_index) != len(np.unique(doc_index)):
            raise SystemExit(f"--samples {args.samples} spans more than one epoch of the corpus; lower it or "
                             f"raise --docs (this bench compares one epoch)")
        c0 = cpu_seconds()
        tokens = IndexedTokens(prefix)
        same = PackedSource(tokens, np.asarray(doc_index, dtype=np.int64), seq_len=args.seq_len, seed=args.seed,
                            name="bench", shuffle=False)
        setup_tessera = cpu_seconds() - c0
        own = PackedSource(tokens, np.arange(len(tokens)), seq_len=args.seq_len, seed=args.seed, name="bench")
        n_batches = args.samples // args.batch
        ordered = _Ordered(same, np.asarray(shuffle))
        for k, (a, b) in enumerate(zip(tessera_batches(ordered, args.batch, n_batches),
                                       megatron_batches(ds, args.batch, n_batches), strict=True)):
            if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
                raise AssertionError(f"batch {k} differs between Tessera and megatron-core")
        best: dict[str, tuple[float, float]] = {}
        sides: dict[str, Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]] = {
            "tessera (GPTDataset's orders)": lambda: tessera_batches(ordered, args.batch, n_batches),
            "megatron-core GPTDataset": lambda: megatron_batches(ds, args.batch, n_batches),
            "tessera (own seeded orders)": lambda: tessera_batches(own, args.batch, n_batches),
        }
        for _ in range(args.repeats):  # alternate, so a busy machine hurts every side alike
            for name, make in sides.items():
                cpu, wall = timed(make)
                if name not in best or cpu < best[name][0]:
                    best[name] = (cpu, wall)
    print(f"{n_batches} batches of {args.batch} x {args.seq_len} tokens + labels, all asserted equal between the "
          f"first two rows; setup CPU s: megatron-core indices {setup_megatron:.2f}, tessera {setup_tessera:.2f}; "
          f"load {os.getloadavg()[0]:.1f}")
    ref = n_batches / best["megatron-core GPTDataset"][0]
    for name, (cpu, wall) in best.items():
        rate = n_batches / cpu
        print(f"  {name:32s} {rate:9.0f} batches/CPU-s  (cpu {cpu:6.2f} s, wall {wall:6.2f} s)  {rate / ref:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
