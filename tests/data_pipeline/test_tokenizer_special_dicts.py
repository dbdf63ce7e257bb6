"""tokenizer_config.json may name its special tokens as strings or as AddedToken dicts ({"content": ..., "lstrip":
...}; older transformers and many Hub repos write the dict form). Both spellings give the same ids, at build
time (data_pipeline.tokenizer.Tokenizer) and in the HF export transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.tokenizer import Tokenizer

SPECIALS = {"eos_token": "<|stop|>", "bos_token": "<|go|>", "pad_token": "<|fill|>", "unk_token": "<|what|>"}


def _tokenizer_json(folder: Path) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token=SPECIALS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # the specials are not the first ids and not in EOS_NAMES: a fallback can't find them by accident
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad0>", "<|endoftext|>", *SPECIALS.values()])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "tokens and more tokens " * 20],
                            trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _dict_form(name: str) -> dict[str, object]:
    return {"__type": "AddedToken", "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


@pytest.mark.parametrize("form", ["str", "dict"])
def test_special_tokens_in_either_spelling(tmp_path: Path, form: str) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoTokenizer

    from framework.checkpoint.hf import export_tokenizer

    path = _tokenizer_json(tmp_path / "tok")
    conf = {k: (_dict_form(v) if form == "dict" else v) for k, v in SPECIALS.items()}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(conf))
    want = {k: HFTokenizer.from_file(str(path)).token_to_id(v) for k, v in SPECIALS.items()}
    assert len(set(want.values())) == 4 and min(want.values()) >= 2  # distinct, none at the default-looking ids

    tok = Tokenizer(path)
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.unk_id) == (
        want["eos_token"], want["bos_token"], want["pad_token"], want["unk_token"])
    assert tok.encode_docs(["the fox"])[0][-1] == want["eos_token"]  # documents end with the named EOS

    export_tokenizer(path, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        want["eos_token"], want["bos_token"], want["pad_token"], want["unk_token"])


def test_a_post_processor_adding_bos_is_not_applied(tmp_path: Path) -> None:
    """Llama 3's tokenizer.json prepends BOS in a post-processor; documents are encoded without it (the build
    separates documents with EOS only), by `encode` and `encode_docs` alike."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    path = _tokenizer_json(tmp_path / "tok")
    hf = HFTokenizer.from_file(str(path))
    bos = hf.token_to_id(SPECIALS["bos_token"])
    hf.post_processor = TemplateProcessing(single=f"{SPECIALS['bos_token']} $A", special_tokens=[
        (SPECIALS["bos_token"], bos)])
    hf.save(str(path))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(SPECIALS))
    assert hf.encode("the fox").ids[0] == bos  # the file does add it when asked
    tok = Tokenizer(path)
    plain = hf.encode("the fox", add_special_tokens=False).ids
    assert tok.encode("the fox") == plain
    assert tok.encode_docs(["the fox"])[0].tolist() == [*plain, tok.eos_id]
