"""Downstream tasks scored by log-likelihood, the lm-evaluation-harness way.

A task is a JSONL file, one item per line (the task's name is the file's stem):

    {"context": "def add(a, b):\\n", "choices": ["    return a + b", "    pass"], "label": 0}   multiple choice
    {"context": "The capital of France is", "continuation": " Paris"}                            cloze
    {"context_ids": [5, 9], "choices_ids": [[4], [7, 1]], "label": 1}       pre-tokenized (no tokenizer needed)
    {"context_ids": [5, 9], "continuation_ids": [4, 4]}

Each choice (or the continuation) is scored by the summed log-probability of its tokens given the context.
Multiple choice: `acc` picks the choice with the highest sum, `acc_norm` the highest sum per byte of the
choice's text (per token for pre-tokenized items), as lm-eval's acc_norm; with an unconditional prefix (the EOS
token: eval.mutual_info) `acc_mutual_info` picks the highest log p(choice | context) - log p(choice | EOS), as
lm-eval's acc_mutual_info. Cloze: `acc` counts items whose every continuation token is the model's argmax
(lm-eval's `is_greedy`). All report the standard error of the mean, sqrt(p (1 - p) / (n - 1)), and the mean
log-likelihood of the answer per item. Text is encoded as context + choice in one piece and split after the
context's tokens (lm-eval's `_encode_pair`: a choice's leading space belongs to the choice); contexts are cut
from the left to fit the sequence length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.base.errors import DataError

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Item:
    contexts: list[list[int]]
    """The context's tokens before each choice (they may differ where a token spans the boundary)."""
    choices: list[list[int]]
    """One entry per choice; a cloze item has exactly one (its continuation) and label -1."""
    label: int
    lengths: list[int]
    """Normalizer of each choice: bytes of its text, or its token count for pre-tokenized items."""

    @property
    def cloze(self) -> bool:
        return self.label < 0


@dataclass(frozen=True)
class Task:
    name: str
    items: list[Item]
    path: str


def _encode_pair(encode: Encode, context: str, choice: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:  # the space before a word belongs to the word's token
        context, choice = context[:-spaces], context[-spaces:] + choice
    whole = encode(context + choice)
    ctx = encode(context)
    return whole[:len(ctx)], whole[len(ctx):]


def _ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value):
        raise ValueError(f"{what} must be a non-empty list of token ids")
    return list(value)


def parse_item(obj: Any, encode: Encode | None, vocab_size: int) -> Item:
    """One task line (already JSON-decoded) -> an Item; ValueError with the reason when malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    cloze = "continuation" in obj or "continuation_ids" in obj
    if "context_ids" in obj:
        ctx = _ids(obj["context_ids"], "context_ids")
        raw = [obj["continuation_ids"]] if cloze else obj.get("choices_ids")
        if not isinstance(raw, list):
            raise ValueError("a pre-tokenized item needs choices_ids (list of id lists) or continuation_ids")
        choices = [_ids(c, "every choice") for c in raw]
        contexts = [ctx] * len(choices)
        lengths = [len(c) for c in choices]
    elif "context" in obj:
        if encode is None:
            raise ValueError("text items need the run's tokenizer, and this run has none (synthetic data); "
                             "give context_ids and choices_ids/continuation_ids instead")
        context = obj["context"]
        texts = [obj["continuation"]] if cloze else obj.get("choices")
        if not isinstance(context, str) or not context:
            raise ValueError("context must be a non-empty string")
        if not isinstance(texts, list) or not all(isinstance(c, str) and c for c in texts):
            raise ValueError("choices must be a list of non-empty strings (or give a continuation string)")
        pairs = [_encode_pair(encode, context, c) for c in texts]
        contexts, choices = [p[0] for p in pairs], [p[1] for p in pairs]
        if any(not c for c in choices) or any(not c for c in contexts):
            raise ValueError("the context or a choice encodes to no token")
        lengths = [len(c.encode()) for c in texts]
    else:
        raise ValueError("an item needs \"context\" (text) or \"context_ids\" (token ids)")
    label: Any = -1
    if not cloze:
        label = obj.get("label")
        if len(choices) < 2:
            raise ValueError(f"a multiple-choice item needs >= 2 choices, got {len(choices)}")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
            raise ValueError(f"label={label!r} must be an integer index into the {len(choices)} choices")
    if any(not 0 <= t < vocab_size for seq in contexts + choices for t in seq):
        raise ValueError(f"a token id is outside [0, model.vocab_size={vocab_size})")
    return Item(contexts, choices, label, lengths)


def load_task(path: str | Path, encode: Encode | None, vocab_size: int, max_items: int = 0) -> Task:
    """Read a JSONL task; a malformed line raises DataError naming the file, the line and the reason."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"eval task file {path} does not exist; check eval.tasks")
    items: list[Item] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                items.append(parse_item(json.loads(line), encode, vocab_size))
            except (json.JSONDecodeError, ValueError) as err:
                raise DataError(f"{path}:{n}: malformed task item: {err}; fix or remove that line "
                                f"(format: framework/infer/tasks.py, docs/TROUBLESHOOTING.md)") from err
            if max_items and len(items) >= max_items:
                break
    if not items:
        raise DataError(f"eval task file {path} holds no item; add JSONL lines or drop it from eval.tasks")
    return Task(path.stem, items, str(path))


def _requests(item: Item, seq_len: int) -> list[tuple[list[int], int]]:
    """(token sequence, number of continuation tokens) per choice, the context cut from the left to fit."""
    out = []
    for context, choice in zip(item.contexts, item.choices, strict=True):
        room = seq_len + 1 - len(choice)
        if room < 1:
            raise DataError(f"a choice of {len(choice)} tokens does not fit data.seq_len={seq_len}; shorten it")
        out.append((context[-room:] + choice, len(choice)))
    return out


@torch.no_grad()
def score_requests(model: nn.Module, requests: Sequence[tuple[list[int], int]], batch_size: int,
                   device: torch.device) -> list[tuple[float, bool]]:
    """(summed log-probability of the continuation, whether it is the greedy argmax) per request."""
    out: list[tuple[float, bool]] = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        width = max(len(seq) for seq, _ in chunk) - 1
        ids = torch.zeros(len(chunk), width + 1, dtype=torch.long)
        for row, (seq, _) in enumerate(chunk):  # right padding: causal attention never sees it
            ids[row, :len(seq)] = torch.tensor(seq)
        ids = ids.to(device)
        logp = F.log_softmax(model(ids[:, :-1]).float(), dim=-1)  # (B, T, V)
        for row, (seq, n) in enumerate(chunk):
            span = slice(len(seq) - 1 - n, len(seq) - 1)
            target = ids[row, span.start + 1:span.stop + 1]
            lp = logp[row, span]
            out.append((float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
    return out


def score_items(model: nn.Module, items: Sequence[Item], seq_len: int, batch_size: int, device: torch.device,
                unconditional: list[int] | None = None) -> torch.Tensor:
    """(N, 4) float64 per item: correct (summed), correct (length-normalised), log-likelihood of the answer, and
    correct by mutual information — log p(choice | context) - log p(choice | `unconditional`), lm-eval's
    acc_mutual_info, which cancels how likely a choice is on its own (NaN without `unconditional`)."""
    flat = [r for item in items for r in _requests(item, seq_len)]
    scores = score_requests(model, flat, batch_size, device)
    prior = None
    if unconditional is not None:
        alone = [(unconditional + c, len(c)) for item in items if not item.cloze for c in item.choices]
        prior = iter(score_requests(model, alone, batch_size, device))
    out = torch.full((len(items), 4), float("nan"), dtype=torch.float64)
    i = 0
    for row, item in enumerate(items):
        got = scores[i:i + len(item.choices)]
        i += len(item.choices)
        if item.cloze:
            out[row, :3] = torch.tensor([float(got[0][1]), float(got[0][1]), got[0][0]])
            continue
        sums = [s for s, _ in got]
        norm = [s / max(1, n) for s, n in zip(sums, item.lengths, strict=True)]
        out[row, 0] = float(_argmax(sums) == item.label)
        out[row, 1] = float(_argmax(norm) == item.label)
        out[row, 2] = sums[item.label]
        if prior is not None:
            pmi = [s - next(prior)[0] for s in sums]
            out[row, 3] = float(_argmax(pmi) == item.label)
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def metrics(name: str, per_item: torch.Tensor, cloze: bool) -> dict[str, float]:
    """downstream/<task>/{acc, acc_norm, acc_mutual_info (each with _stderr), loglik, n} from `score_items` rows."""
    n = per_item.shape[0]
    out: dict[str, float] = {}
    for col, key in ((0, "acc"), (1, "acc_norm"), (3, "acc_mutual_info")):
        if (cloze and key != "acc") or bool(per_item[:, col].isnan().any()):
            continue
        p = float(per_item[:, col].mean())
        out[f"downstream/{name}/{key}"] = p
        out[f"downstream/{name}/{key}_stderr"] = math.sqrt(p * (1 - p) / max(1, n - 1))
    out[f"downstream/{name}/loglik"] = float(per_item[:, 2].mean())
    out[f"downstream/{name}/n"] = float(n)
    return out
