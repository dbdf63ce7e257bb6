"""Tokenizers: sentencepiece `.model` files, Hugging Face `tokenizer.json` files (byte-level BPE as GPT-2 and
Llama 3 use) and tiktoken-format BPE files (converted to an equivalent `tokenizer.json`); training either a
sentencepiece model or a byte-level BPE with HF `tokenizers`; encoding with EOS between documents.

Sentencepiece is trained with the identity normalization and no whitespace folding, so code keeps its
indentation, and with byte fallback, so no text is ever unknown. Newline and tab are user-defined pieces
(sentencepiece trains on lines, so it would otherwise never learn them and spend a byte-fallback token on every
line break). A byte-level BPE needs neither: every byte is in its base alphabet.

BOS/EOS/pad of a `tokenizer.json` come from the tokenizer's own config: `tokenizer_config.json` beside it
(`eos_token`, `bos_token`, `pad_token`), else the first special token with a known end-of-text name.

A build given a tiktoken file keeps the ranks beside the converted `tokenizer.json` (`tokenizer.tiktoken`):
`Tokenizer` then encodes with tiktoken itself, 6-8x faster than HF tokenizers on the same regex, and the ids are
the same (the converted file is the reference: the same vocabulary is checked at load, and tests compare both
encoders on code, unicode, whitespace runs and long lines).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.progress import log
from data_pipeline.script_stats import choose_character_coverage
from framework.base.errors import ConfigError, DataError

USER_SYMBOLS = ("\n", "\t")
TIKTOKEN_RANKS = "tokenizer.tiktoken"
"""The ranks file a build keeps beside a `tokenizer.json` converted from it: its presence makes `Tokenizer` encode
natively with tiktoken."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What a build records about its tokenizer (in the manifest)."""

    path: str
    vocab_size: int
    eos_id: int
    bos_id: int
    unk_id: int
    pad_id: int
    user_symbols: tuple[str, ...]
    sha256: str


def sample_lines(texts: Iterable[str], max_chars: int, seed: int = 0, keep: float = 1.0) -> list[str]:
    """Non-empty lines of `texts`, each kept with probability `keep`, until `max_chars` are collected."""
    rng = random.Random(seed)
    out: list[str] = []
    total = 0
    for text in texts:
        for line in text.split("\n"):
            if not line.strip() or (keep < 1.0 and rng.random() >= keep):
                continue
            out.append(line[:4000])
            total += len(line)
            if total >= max_chars:
                return out
    return out


def train_sentencepiece(lines: Sequence[str], out_path: str | Path, *, vocab_size: int,
                        model_type: str = "bpe", threads: int = 2, character_coverage: float | None = None) -> Path:
    """Train a sentencepiece model on `lines` and write it to `out_path` (a `.model` file), atomically.

    Args:
        lines: Training text, one sentence per item (newlines are learnt as the user-defined piece "\\n").
        out_path: Where the `.model` goes.
        vocab_size: Vocabulary size including the 256 byte-fallback pieces and specials.
        model_type: "bpe" or "unigram".
        threads: Trainer threads.
        character_coverage: Share of the sample's characters that get pieces of their own (the rest fall back to
            bytes); None: chosen by the sample's scripts (`script_stats.choose_character_coverage`).
    """
    import io

    import sentencepiece as spm

    if vocab_size < 300:
        raise ConfigError(f"vocab_size={vocab_size} must be >= 300 (256 byte pieces plus specials); e.g. 4096")
    if not lines:
        raise DataError("no text to train the tokenizer on; every source is empty after filtering")
    if character_coverage is None:
        character_coverage, why = choose_character_coverage(lines, vocab_size)
        log(f"tokenizer: character_coverage {character_coverage} ({why}); set tokenizer.character_coverage to "
            f"choose")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=list(USER_SYMBOLS),
            num_threads=threads, minloglevel=2, character_coverage=character_coverage, max_sentence_length=16384,
            hard_vocab_limit=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    except RuntimeError as err:
        raise _training_error(err, vocab_size, character_coverage) from err
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(model.getvalue())
    tmp.replace(out)
    return out


def _training_error(err: RuntimeError, vocab_size: int, coverage: float) -> DataError:
    """Sentencepiece's failure as what to change: its "required_chars" check names the pieces the sample's
    characters need (those covering `coverage` of it, plus the byte and special pieces)."""
    need = re.search(r"required_chars\. (\d+) vs (\d+)", str(err))
    if need:
        required = int(need.group(2))
        return DataError(f"tokenizer.vocab_size {vocab_size} is smaller than the {required} pieces sentencepiece "
                         f"needs for the characters that make up {coverage:.2%} of the sample (character_coverage "
                         f"{coverage}) plus its byte and special pieces: raise tokenizer.vocab_size to at "
                         f"least {required}, or lower tokenizer.character_coverage (0.9995 is sentencepiece's advice "
                         f"for Chinese and Japanese; lower leaves more rare characters to byte fallback)")
    if "Vocabulary size too high" in str(err):
        return DataError(f"sentencepiece training failed ({err}): the sample is too small for vocab_size "
                         f"{vocab_size}; lower tokenizer.vocab_size or raise tokenizer.sample_chars")
    return DataError(f"sentencepiece training failed ({err}) at vocab_size {vocab_size}, character_coverage "
                     f"{coverage}")


EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
# The pre-tokenizer regex of cl100k_base (GPT-4) and Llama 3, the default for tiktoken-format files.
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_kind(path: str | Path) -> str:
    """sentencepiece, hf (a tokenizer.json) or tiktoken (lines of `base64-token rank`), from the file's content."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.lstrip().startswith(b"{"):
        return "hf"
    first = head.split(b"\n", 1)[0].split()
    if len(first) == 2 and first[1].isdigit():
        return "tiktoken"
    return "sentencepiece"


def _special_id(tok: object, spec: object) -> int:
    name = spec.get("content") if isinstance(spec, dict) else spec
    if not isinstance(name, str):
        return -1
    tid = tok.token_to_id(name)  # type: ignore[attr-defined]
    return -1 if tid is None else int(tid)


class Tokenizer:
    """A loaded tokenizer: a sentencepiece `.model` or a Hugging Face `tokenizer.json`.

    Args:
        path: The file.
    """

    _tiktoken: Any = None
    """A tiktoken Encoding equal to the tokenizer.json (a build's converted tiktoken file), used to encode."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if not Path(self.path).is_file():
            raise DataError(f"tokenizer model {self.path!r} does not exist; train one with `tessera tokenizer "
                            f"train` or point tokenizer.model at a sentencepiece .model or a tokenizer.json")
        self.kind = tokenizer_kind(self.path)
        if self.kind == "tiktoken":
            raise DataError(f"{self.path} is a tiktoken-format BPE file; a build converts it to tokenizer.json "
                            f"(tokenizer.model in the build config), load that")
        self.bos_id = self.pad_id = self.unk_id = -1
        if self.kind == "hf":
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_file(self.path)
            self.vocab_size = int(self._hf.get_vocab_size(with_added_tokens=True))
            side = Path(self.path).with_name("tokenizer_config.json")
            conf = json.loads(side.read_text()) if side.is_file() else {}
            self.eos_id = _special_id(self._hf, conf.get("eos_token"))
            if self.eos_id < 0:
                self.eos_id = next((i for i in (_special_id(self._hf, n) for n in EOS_NAMES) if i >= 0), -1)
            self.bos_id, self.pad_id = _special_id(self._hf, conf.get("bos_token")), \
                _special_id(self._hf, conf.get("pad_token"))
            self.unk_id = _special_id(self._hf, conf.get("unk_token"))
            ranks = Path(self.path).with_name(TIKTOKEN_RANKS)
            if ranks.is_file():
                self._tiktoken = _native_tiktoken(self._hf, Path(self.path), ranks)
        else:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_file=self.path)
            self.vocab_size = int(self._sp.get_piece_size())
            self.eos_id = int(self._sp.eos_id())
            self.bos_id, self.pad_id, self.unk_id = int(self._sp.bos_id()), int(self._sp.pad_id()), \
                int(self._sp.unk_id())
        if self.eos_id < 0:
            raise DataError(f"tokenizer {self.path!r} has no EOS token (none named in tokenizer_config.json's "
                            f"eos_token, none of {list(EOS_NAMES)}); add one — documents are separated by it")

    def info(self) -> TokenizerInfo:
        user: tuple[str, ...] = ()
        if self.kind == "sentencepiece":
            user = tuple(s for s in USER_SYMBOLS if self._sp.piece_to_id(s) != self._sp.unk_id())
        digest = hashlib.sha256(Path(self.path).read_bytes()).hexdigest()
        return TokenizerInfo(self.path, self.vocab_size, self.eos_id, self.bos_id, self.unk_id, self.pad_id, user,
                             digest)

    def encode_docs(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        """Token ids of each text followed by EOS (the document separator), as int64 arrays."""
        if self._tiktoken is not None:
            ids = [self._tiktoken.encode(t, allowed_special="all") for t in texts]
        elif self.kind == "hf":
            ids = [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]
        else:
            ids = self._sp.encode(list(texts), num_threads=threads)
        return [np.asarray([*doc, self.eos_id], dtype=np.int64) for doc in ids]

    def encode(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return list(self._tiktoken.encode(text, allowed_special="all"))
        if self.kind == "hf":
            return list(self._hf.encode(text, add_special_tokens=False).ids)
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        if self.kind == "hf":
            return str(self._hf.decode([int(i) for i in ids], skip_special_tokens=False))
        return str(self._sp.decode([int(i) for i in ids]))


def _native_tiktoken(hf: Any, path: Path, ranks_file: Path) -> Any:
    """A tiktoken Encoding of `ranks_file` with the tokenizer.json's pre-tokenizer regex and special tokens,
    refused (DataError) unless every rank is the tokenizer.json's id of the same bytes — so the two encode alike.
    Special tokens in a text are encoded as their ids, as HF tokenizers does with added tokens."""
    import tiktoken

    spec = json.loads(path.read_text(encoding="utf-8"))
    pattern = next((p["pattern"]["Regex"] for p in (spec.get("pre_tokenizer") or {}).get("pretokenizers", [])
                    if p.get("type") == "Split"), None)
    ranks = read_tiktoken(ranks_file)
    specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
    b2u = _bytes_to_unicode()
    vocab = hf.get_vocab(with_added_tokens=False)
    model = spec.get("model") or {}
    if (pattern is None or model.get("type") != "BPE" or not model.get("ignore_merges") or len(vocab) != len(ranks)
            or any(vocab.get("".join(b2u[x] for x in tok)) != rank for tok, rank in ranks.items())):
        raise DataError(f"{ranks_file} does not match {path} (not the ranks it was converted from); delete "
                        f"{ranks_file.name} to encode with the tokenizer.json alone, or rebuild the tokenizer")
    return tiktoken.Encoding(path.parent.name or "tessera", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def read_tiktoken(path: str | Path) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken-format file (one `base64(token) rank` per line)."""
    import base64

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
        except ValueError as err:
            raise DataError(f"{path}:{n} is not `base64-token rank` ({line[:60]!r}); is it a tiktoken file?") from err
    return ranks


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's ranks: every split of a token into two vocabulary tokens, ordered by
    the token's rank (then the parts'), as transformers' tiktoken converter derives them."""
    out = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in ranks and b in ranks:
                out.append((rank, ranks[a], ranks[b], a, b))
    return [(a, b) for *_, a, b in sorted(out)]


def tiktoken_to_hf(path: str | Path, out: str | Path, *, pattern: str = CL100K_PATTERN,
                   special_tokens: Sequence[str] = ("<|endoftext|>",), eos_token: str | None = None,
                   bos_token: str | None = None) -> Path:
    """Write a `tokenizer.json` (and `tokenizer_config.json`) equal to a tiktoken-format BPE file: the same
    vocabulary and ids, merges recovered from the ranks, the same pre-tokenizer regex; special tokens get the ids
    after the last rank. Returns the tokenizer.json path."""
    ranks = read_tiktoken(path)
    b2u = _bytes_to_unicode()

    def show(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {show(tok): rank for tok, rank in ranks.items()}
    merges = [f"{show(a)} {show(b)}" for a, b in _merges(ranks)]
    first = max(ranks.values()) + 1
    added = [{"id": first + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(special_tokens)]
    spec: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": True, "vocab": vocab, "merges": merges}}
    return _write_hf(spec, Path(out), eos_token or (special_tokens[0] if special_tokens else None), bos_token)


def _write_hf(spec: dict[str, Any], out: Path, eos: str | None, bos: str | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    conf = {"eos_token": eos, "bos_token": bos, "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 1 << 30}
    for name, obj in (("tokenizer_config.json", conf), ("tokenizer.json", spec)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, ensure_ascii=False))
        tmp.replace(out / name)
    return out / "tokenizer.json"


def train_hf_bpe(lines: Sequence[str], out: str | Path, *, vocab_size: int,
                 special_tokens: Sequence[str] = ("<|endoftext|>",)) -> Path:
    """Train a byte-level BPE (GPT-2 style: every byte in the base alphabet, so nothing is unknown) with HF
    `tokenizers` and write `tokenizer.json` + `tokenizer_config.json` into `out`'s folder; returns the json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens) + 1:
        raise ConfigError(f"vocab_size={vocab_size} must be > 256 bytes + {len(special_tokens)} special tokens")
    if not lines:
        raise DataError("no text to train the tokenizer on; every source is empty after filtering")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Lines joined back into documents-sized pieces so newlines are learnt too.
    tok.train_from_iterator(("\n".join(lines[i:i + 64]) for i in range(0, len(lines), 64)), trainer=trainer)
    spec = json.loads(tok.to_str())
    return _write_hf(spec, Path(out).parent, special_tokens[0] if special_tokens else None, None)
