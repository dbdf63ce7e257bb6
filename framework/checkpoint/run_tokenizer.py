"""The tokenizer a checkpoint's run trained with, found without preparing its data.

`tessera ckpt export-hf` and `tessera generate` need only the tokenizer file. Preparing the run's data to learn it
would build the whole training mixture (minutes), and on a non-builder process under a relative cache directory
(another working directory) it waits for a build that never comes. So the trainer records, in every checkpoint's
meta, the tokenizer's absolute path (`tokenizer`) and the build's (`data_build_dir`); this module reads those, and
for checkpoints written before they were recorded, the manifest of the build the saved data config names. Nothing
here builds, waits or locks. `export_tokenizer` writes that file as a transformers tokenizer (for export-hf).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from framework.base.errors import CheckpointError, DataError


def _from_build(data: dict[str, Any]) -> Path:
    """The tokenizer a build's manifest names (`tokenizer_path`: nothing built, opened or waited for); DataError
    when the build is not there."""
    from data_pipeline.config import DataConfig
    from data_pipeline.read.prepare import tokenizer_path
    from framework.base.yaml_config import from_dict

    found = tokenizer_path(from_dict(DataConfig, data, "data"))
    assert found is not None  # not synthetic: the caller checked
    if not found.is_file():
        raise DataError(f"{found} (named by its build's manifest) is gone")
    return found


def checkpoint_tokenizer(meta: dict[str, Any], where: Path | str = "the checkpoint") -> Path | None:
    """The tokenizer file of the run that wrote checkpoint meta `meta`; None when it trained on synthetic data.

    Looked for, in order: the absolute path the trainer recorded; the tokenizer in the recorded build directory;
    the build the saved data config names. Raises CheckpointError naming every place looked at when the run had
    a tokenizer and none of them holds it any more.
    """
    data = (meta.get("config") or {}).get("data") or {}
    if data.get("kind", "synthetic") == "synthetic" and not meta.get("tokenizer"):
        return None
    tried: list[str] = []
    recorded = meta.get("tokenizer")
    if recorded:
        if Path(recorded).is_file():
            return Path(recorded)
        tried.append(str(recorded))
    builds = [{"kind": "build", "build_dir": meta["data_build_dir"]}] if meta.get("data_build_dir") else []
    for build in [*builds, *([data] if data.get("kind", "synthetic") != "synthetic" else [])]:
        try:
            return _from_build(build)
        except DataError as err:
            tried.append(str(err).split(";")[0])
    raise CheckpointError(f"the tokenizer of {where} is not found (looked at: {'; '.join(tried) or 'nothing'}): its "
                          f"data build was moved or deleted, or its relative data path means another working "
                          f"directory; pass --tokenizer PATH (the build's tokenizer.model or tokenizer.json)")


def export_tokenizer(model_file: Path, out: Path) -> None:
    """Write a transformers tokenizer equivalent to the build's tokenizer into `out`.

    A `tokenizer.json` (given, trained with HF tokenizers, or converted from a tiktoken file) is written as it is,
    with the special tokens its `tokenizer_config.json` names. A sentencepiece model is converted:

    transformers' Llama converter reads the BPE vocabulary and merges; the normalizer is then set to what
    sentencepiece does with Tessera's settings (dummy prefix "▁" before the text, every space -> "▁", no
    pre-tokenizer), and the user-defined pieces (newline, tab) stay ordinary vocabulary entries, never merged,
    so token ids match sentencepiece's exactly (tests check it on real text). `AutoTokenizer.from_pretrained(out)`
    loads it; the original `tokenizer.model` is copied alongside.
    """
    import tempfile

    from tokenizers import Tokenizer
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    if model_file.name.endswith(".json"):  # a build's HF tokenizer (given, trained or converted from tiktoken)
        side = model_file.with_name("tokenizer_config.json")
        conf = json.loads(side.read_text()) if side.is_file() else {}
        # a special token is a string or an AddedToken dict ({"content": ...}, older files); both name the token
        names = {k: v.get("content") if isinstance(v, dict) else v
                 for k in ("eos_token", "bos_token", "pad_token", "unk_token") if (v := conf.get(k))}
        PreTrainedTokenizerFast(tokenizer_file=str(model_file), **names).save_pretrained(str(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        converted = LlamaTokenizer.from_pretrained(tmp)
        spec = json.loads(converted.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["special"]]
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["pre_tokenizer"] = None
    spec["post_processor"] = None  # Tessera adds no BOS; documents end with EOS
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))
    shutil.copy(model_file, out / "tokenizer.model")
