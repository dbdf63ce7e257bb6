"""A vocabulary past 65,535 tokens: the tokenize stage's own .bin/.idx shards (before the merge, which rebuilds the
index) hold int32 tokens, and their .idx pointers on disk are the byte offsets of each document — read with
struct/numpy from the bytes, as Megatron-LM would, not through our reader or the merged index."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.run import run_build
from data_pipeline.tokenizer import CL100K_PATTERN


def _parse_idx(path: Path) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    assert version == 1
    at = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(raw, "<i4", n_seq, at)
    pointers = np.frombuffer(raw, "<i8", n_seq, at + 4 * n_seq)
    docs = np.frombuffer(raw, "<i8", n_doc, at + 12 * n_seq)
    assert len(raw) == at + 12 * n_seq + 8 * n_doc  # nothing after the document indices
    return code, lengths, pointers, docs


def test_int32_shards_have_byte_pointers_on_disk(tmp_path: Path) -> None:
    import base64

    import tiktoken

    docs = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}x{j % 13}" for j in range(30 + i)) for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    singles = [bytes([b]) for b in range(256)]
    pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
    triples = sorted({d.encode()[i:i + 3] for d in docs for i in range(len(d) - 2)})[:3000]
    ranks = {t: i for i, t in enumerate(dict.fromkeys([*singles, *pairs, *triples]))}
    assert len(ranks) > 65_536
    model = tmp_path / "big.tiktoken"
    model.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    out = tmp_path / "build"
    cfg = BuildConfig(output_dir=str(out), workers=1, shard_docs=8, dedup=DedupConfig(exact=False, near=False),
                      sources=[SourceConfig(name="docs", path=str(tmp_path / "docs.jsonl"), profile="minimal")],
                      tokenizer=TokenizerConfig(model=str(model)))
    run_build(dataclasses.replace(cfg))
    enc = tiktoken.Encoding("big", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})

    shards = sorted((out / "work/tokens/docs").glob("shard-*.idx"))
    assert len(shards) >= 3  # 40 documents at 8 per shard
    got: list[list[int]] = []
    for idx in shards:
        code, lengths, pointers, doc_idx = _parse_idx(idx)
        assert code == 4  # Megatron's int32
        assert pointers.tolist() == (np.concatenate([[0], np.cumsum(lengths[:-1])]) * 4).tolist()
        assert doc_idx.tolist() == list(range(len(lengths) + 1))
        data = idx.with_suffix(".bin").read_bytes()
        assert len(data) == 4 * int(lengths.sum())
        got += [np.frombuffer(data, "<i4", int(n), int(p)).tolist() for n, p in zip(lengths, pointers, strict=True)]
    assert got == [[*enc.encode(d), len(ranks)] for d in docs]
    assert max(max(g) for g in got) > 65_535


@pytest.mark.parametrize("vocab", [300, 65_499])
def test_small_vocabularies_stay_uint16_on_disk(tmp_path: Path, vocab: int) -> None:
    from data_pipeline.indexed import IndexedWriter

    w = IndexedWriter(tmp_path / "x", vocab)
    for doc in ([1, 2, 3], [4], [5, 6]):
        w.add(doc)
    w.finalize()
    code, lengths, pointers, _ = _parse_idx(tmp_path / "x.idx")
    assert code == 8 and lengths.tolist() == [3, 1, 2] and pointers.tolist() == [0, 6, 8]  # uint16: 2 bytes
