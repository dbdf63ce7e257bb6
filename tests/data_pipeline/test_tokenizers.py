"""The user's tokenizer: a tiktoken-format BPE file, a Hugging Face tokenizer.json, a byte-level BPE trained with
HF tokenizers. The tokens a build writes equal an independent encoder's (tiktoken itself; transformers'
AutoTokenizer on the HF export of a model trained on the build) for the same raw documents; vocabularies past
65,535 write int32 tokens."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.run import run_build
from data_pipeline.indexed import IndexedTokens
from data_pipeline.tokenizer import CL100K_PATTERN, Tokenizer, _bytes_to_unicode, train_hf_bpe
from framework.base.errors import DataError
from framework.testing.tiny import TINY

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"


def _documents() -> list[str]:
    """Raw documents that normalization leaves unchanged (so raw text == built text)."""
    docs = []
    for rel in ("README", "docs/guide.rst", "docs/changelog", "code/http_session.py", "code/random_walk.py"):
        docs += [p.strip() for p in (FIXTURE / rel).read_text().split("\n\n") if len(p) > 40]
    docs += ["ünïcödé 日本語 and emoji 🙂 — dashes", "tabs\tand  double  spaces: {x: 1}"]
    from data_pipeline.build.normalize import NormalizeConfig, normalize

    assert all(normalize(d, NormalizeConfig()) == d for d in docs)
    return docs


def _ranks_from(tokenizer_json: Path) -> dict[bytes, int]:
    u2b = {v: k for k, v in _bytes_to_unicode().items()}
    spec = json.loads(tokenizer_json.read_text())
    special = {t["content"] for t in spec["added_tokens"]}
    order = sorted(((bytes(u2b[c] for c in t), i) for t, i in spec["model"]["vocab"].items() if t not in special),
                   key=lambda kv: kv[1])
    return {tok: rank for rank, (tok, _) in enumerate(order)}


def _write_tiktoken(path: Path, ranks: dict[bytes, int]) -> Path:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], BuildConfig]:
    root = tmp_path_factory.mktemp("tok")
    docs = _documents()
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = BuildConfig(output_dir=str(root / "unused"), workers=1, shard_docs=8,
                      dedup=DedupConfig(exact=False, near=False),
                      sources=[SourceConfig(name="docs", path=str(root / "docs.jsonl"), profile="minimal")])
    return root, docs, cfg


def _built_docs(out: Path) -> list[list[int]]:
    ds = IndexedTokens(out / "docs")
    return [ds[i].tolist() for i in range(len(ds))]


def _train_and_export(root: Path, build: Path, name: str) -> Path:
    import torch

    from framework.cli import main
    from framework.config import load_config
    from framework.train.trainer import Trainer

    run, hf = root / f"run-{name}", root / f"hf-{name}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=2", "checkpoint.interval=0", "data.kind=build",
                                   f"data.build_dir={build}", "data.weights={docs: 1.0}", "data.val_fraction=0.0",
                                   "model.vocab_size=1024", "data.seq_len=32"])).train()
    finally:
        torch.set_num_threads(threads)
    assert main(["ckpt", "export-hf", str(run), str(hf), "--step", "2"]) == 0
    return hf


def test_a_tiktoken_file_and_a_tokenizer_json_build_train_and_export(raw) -> None:  # type: ignore[no-untyped-def]
    import tiktoken
    from transformers import AutoTokenizer

    root, docs, cfg = raw
    trained = train_hf_bpe((FIXTURE / "docs/guide.rst").read_text().split("\n") * 3, root / "bpe/tokenizer.json",
                           vocab_size=600)
    ranks = _ranks_from(trained)
    tik = _write_tiktoken(root / "frob.tiktoken", ranks)
    enc = tiktoken.Encoding("frob", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    for name, model in (("tiktoken", tik), ("json", trained)):
        out = root / f"build-{name}"
        manifest = run_build(dataclasses.replace(cfg, output_dir=str(out), tokenizer=TokenizerConfig(model=str(model))))
        eos = manifest["tokenizer"]["eos_id"]
        assert manifest["tokenizer"]["path"] == "tokenizer.json"
        assert eos == (len(ranks) if name == "tiktoken" else 0)  # tiktoken: after the ranks; trained: the first
        built = _built_docs(out)
        if name == "tiktoken":  # encoded by tiktoken itself, from the ranks kept beside the tokenizer.json
            assert Tokenizer(out / "tokenizer.json")._tiktoken is not None
            assert built == [[*enc.encode(d), eos] for d in docs]
        else:  # the given file, loaded by HF tokenizers itself
            from tokenizers import Tokenizer as HF

            given = HF.from_file(str(model))
            assert built == [[*given.encode(d, add_special_tokens=False).ids, eos] for d in docs]
        hf = AutoTokenizer.from_pretrained(str(_train_and_export(root, out, name)))
        assert [[*hf(d, add_special_tokens=False).input_ids, hf.eos_token_id] for d in docs] == built
        assert hf.decode(built[0][:-1]) == docs[0]


def test_a_bpe_trained_with_hf_tokenizers(raw) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer as HF

    root, docs, cfg = raw
    out = root / "build-hf-bpe"
    manifest = run_build(dataclasses.replace(cfg, output_dir=str(out), tokenizer=TokenizerConfig(
        type="hf_bpe", vocab_size=500, special_tokens=["<|endoftext|>", "<|pad|>"])))
    hf = HF.from_file(str(out / "tokenizer.json"))
    eos = hf.token_to_id("<|endoftext|>")
    assert manifest["tokenizer"]["eos_id"] == eos and manifest["tokenizer"]["vocab_size"] == hf.get_vocab_size()
    built = _built_docs(out)
    assert built == [[*hf.encode(d, add_special_tokens=False).ids, eos] for d in docs]
    assert [hf.decode(b[:-1]) for b in built] == docs


def test_a_vocabulary_past_65535_writes_int32(raw) -> None:  # type: ignore[no-untyped-def]
    import tiktoken

    root, docs, cfg = raw
    singles = [bytes([b]) for b in range(256)]
    pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
    triples = sorted({d.encode()[i:i + 3] for d in docs for i in range(len(d.encode()) - 2)})[:6000]
    ranks = {t: i for i, t in enumerate(dict.fromkeys([*singles, *pairs, *triples]))}
    assert len(ranks) > 65_536 + 256
    out = root / "build-big"
    run_build(dataclasses.replace(cfg, output_dir=str(out), tokenizer=TokenizerConfig(
        model=str(_write_tiktoken(root / "big.tiktoken", ranks)))))
    ds = IndexedTokens(out / "docs")
    assert ds.dtype == np.int32
    enc = tiktoken.Encoding("big", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    built = _built_docs(out)
    assert built == [[*enc.encode(d), len(ranks)] for d in docs]
    assert max(max(b) for b in built) > 65_535


def _real_shaped_texts() -> list[str]:
    """Code, unicode, whitespace runs, long lines and special-token text: where two regex engines and two BPE
    implementations could part."""
    from data_pipeline.build.stdlib_corpus import list_stdlib_files

    code = [p.read_text(encoding="utf-8", errors="replace") for _, p in list_stdlib_files()[:40]]
    unicode = ["ünïcödé naïve café — “quotes” «guillemets» 日本語のテキスト 中文 한국어 العربية עברית हिन्दी",
               "emoji 🙂👍🏽 👨‍👩‍👧 flags 🇫🇷 combining e\u0301 a\u0308 zero\u200bwidth \ufeffbom ﬁ ligature ½ ² Ⅻ",
               "math ∀x∈ℝ: x²≥0, ∑ᵢ aᵢ → ∞; greek αβγ ΑΒΓ; cyrillic Привет, мир! 123 4567 89012 ٣٤٥"]
    spaces = ["a  b   c    d\t\te\t \tf\n\n\n g \r\n h\r\r\n\n  \n", " " * 70 + "x" + "\t" * 30 + "\n" * 12,
              "trailing spaces   \n   leading\n\u00a0\u2003\u3000 unicode spaces \u2028 \u2029 end   ",
              "I'm you're they'LL it'S we'd O'Neil's 's 'd"]
    long = ["x = [" + ", ".join(str(i) for i in range(3000)) + "]", "aGVsbG8gd29ybGQ" * 800,
            "word " * 4000, "-" * 5000 + "=" * 3000, "".join(chr(0x4E00 + i % 500) for i in range(6000))]
    special = ["before <|endoftext|> after", "<|endoftext|><|endoftext|>x<|endoftext"]
    return code + unicode + spaces + long + special


def test_native_tiktoken_encodes_as_the_converted_tokenizer_json(tmp_path: Path) -> None:
    """The build's tiktoken path (tiktoken itself, on the ranks kept beside the tokenizer.json) gives the ids the
    converted tokenizer.json gives through HF tokenizers, on real-shaped text; a ranks file that is not the one the
    tokenizer.json was converted from is refused."""
    from tokenizers import Tokenizer as HF

    from data_pipeline.build.run import _given_tokenizer
    from data_pipeline.tokenizer import TIKTOKEN_RANKS

    texts = _real_shaped_texts()
    trained = train_hf_bpe([ln for t in texts[:40] for ln in t.split("\n")], tmp_path / "bpe/tokenizer.json",
                           vocab_size=3000)
    ranks = _ranks_from(trained)
    cfg = BuildConfig(output_dir=str(tmp_path / "unused"), sources=[SourceConfig(name="x", path=str(tmp_path))],
                      tokenizer=TokenizerConfig(model=str(_write_tiktoken(tmp_path / "r.tiktoken", ranks))))
    made = _given_tokenizer(cfg, tmp_path / "build")
    native, converted = Tokenizer(made), HF.from_file(str(made))
    assert native._tiktoken is not None and (made.parent / TIKTOKEN_RANKS).is_file()
    eos = native.eos_id
    expected = [[*converted.encode(t, add_special_tokens=False).ids, eos] for t in texts]
    got = [a.tolist() for a in native.encode_docs(texts)]
    assert got == expected
    assert sum(map(len, got)) > 100_000 and expected[-2].count(eos) == 2  # the text's special token is EOS too
    assert [native.decode(ids[:-1]) for ids in got] == texts

    swapped = dict(ranks)
    a, b = list(ranks)[300:302]
    swapped[a], swapped[b] = ranks[b], ranks[a]
    _write_tiktoken(made.parent / TIKTOKEN_RANKS, swapped)
    with pytest.raises(DataError, match="does not match"):
        Tokenizer(made)
