"""acc_norm of text items divides each choice's log-likelihood by the UTF-8 bytes of its text (lm-eval's
byte-length normalisation), not by its token count; pre-tokenized items divide by tokens. Checked on a model whose
per-token log-probabilities are known exactly (they depend on the token only), with an encoder whose tokens
span 1 to 4 bytes, so the two normalisations disagree on many items (a negative control asserts they do)."""

from __future__ import annotations

import random

import torch
from torch import nn

from framework.infer.tasks import parse_item, score_items

ALPHABET = "abcdefghé日本🙂ñ語"  # 1, 2, 3 and 4 bytes per character; one token per character
VOCAB = len(ALPHABET) + 4


def _encode(text: str) -> list[int]:
    return [ALPHABET.index(c) + 1 if c in ALPHABET else VOCAB - 1 for c in text]


class ContextFree(nn.Module):
    """Logits that depend on the token id only: log p(token) is a fixed table, whatever came before."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.linspace(-2.0, 2.0, VOCAB, dtype=torch.float64).roll(5).float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*ids.shape, VOCAB)


def test_text_items_normalise_by_bytes_and_token_items_by_tokens() -> None:
    model = ContextFree()
    logp = torch.log_softmax(model.logits.double(), -1)
    rng = random.Random(4)
    items, objs = [], []
    for _ in range(60):
        choices = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(2, 4))]
        obj = {"context": "xy z", "choices": choices, "label": rng.randrange(len(choices))}
        objs.append(obj)
        items.append(parse_item(obj, _encode, VOCAB))
    rows = score_items(model, items, seq_len=16, batch_size=7, device=torch.device("cpu"))

    disagree = 0
    for obj, row in zip(objs, rows, strict=True):
        sums = [float(sum(logp[t] for t in _encode(c))) for c in obj["choices"]]
        by_bytes = [s / len(c.encode("utf-8")) for s, c in zip(sums, obj["choices"], strict=True)]
        by_tokens = [s / len(_encode(c)) for s, c in zip(sums, obj["choices"], strict=True)]
        pick_bytes, pick_tokens = (max(range(len(v)), key=v.__getitem__) for v in (by_bytes, by_tokens))
        assert row[1] == float(pick_bytes == obj["label"]), (obj, by_bytes, row)
        disagree += (pick_bytes == obj["label"]) != (pick_tokens == obj["label"])
    assert disagree >= 5, disagree  # negative control: a per-token acc_norm would score differently here

    # pre-tokenized items have no text: their normaliser is the token count
    tok = parse_item({"context_ids": [1, 2], "choices_ids": [[3], [4, 5, 6]], "label": 1}, None, VOCAB)
    assert tok.lengths == [1, 3]
    text = parse_item({"context": "ab", "choices": ["é日", "a🙂"], "label": 0}, _encode, VOCAB)
    assert text.lengths == [5, 5] and [len(c) for c in text.choices] == [2, 2]
