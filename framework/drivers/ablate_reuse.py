"""Earlier swarms in a new fit: when sources are added or removed, finished runs of earlier ablations (spec key
`reuse`) re-enter the per-domain fits for the domains they evaluated.

An earlier run's weights are mapped onto the current sources as they were: a source it did not mix has weight 0
there, and the share it gave a source that is no longer mixed is no current weight (its row sums to less than 1).
A current domain it did not evaluate is a hole (NaN), never a zero. ablate_fit.fit then uses each row where it
means something: the own-weight law takes every row that evaluated the domain; the linear model only rows on the
current simplex; the GP, which models the whole objective, none (ablate_surrogate.all_surrogates).

Losses are comparable only when both swarms read the same tokenizer and the same held-out documents of a domain,
so an earlier run with another tokenizer or another held-out sample count for a shared domain is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from framework.base.errors import ConfigError


def earlier_rows(dirs: list[str], sources: list[str], tokenizer: str,
                 val_samples: dict[str, int]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Weights (m, k) and per-domain losses (m, k; NaN where not evaluated) of the earlier ablations' mixtures
    (seeds averaged), and a label per row (`<dir>:<mixture>`).

    Args:
        dirs: Earlier ablation output directories (they hold runs/*/result.json).
        sources: The current sources, in order.
        tokenizer: The tokenizer path the current runs read.
        val_samples: Held-out samples per domain of the current runs.

    Raises:
        ConfigError: a directory holds no finished run, or a run read another tokenizer or held-out split.
    """
    groups: dict[str, list[dict]] = {}
    for d in dirs:
        files = sorted(Path(d).glob("runs/*/result.json"))
        if not files:
            raise ConfigError(f"reuse: {d} holds no finished run (runs/*/result.json); name the output directory of "
                              f"an earlier `tessera ablate`")
        for f in files:
            r = json.loads(f.read_text())
            _check(r, f, tokenizer, val_samples)
            groups.setdefault(f"{d}:{r['mixture_id']}", []).append(r)
    W, L = [], []
    for rows in groups.values():
        W.append([float(rows[0]["weights"].get(s, 0.0)) for s in sources])
        L.append(np.mean([[r["val"].get(f"val_loss/{s}", np.nan) for s in sources] for r in rows], axis=0))
    k = len(sources)
    return np.array(W).reshape(-1, k), np.array(L, dtype=np.float64).reshape(-1, k), list(groups)


def _check(r: dict, path: Path, tokenizer: str, val_samples: dict[str, int]) -> None:
    if r["tokenizer_path"] != tokenizer:
        raise ConfigError(f"reuse: {path} read the tokenizer {r['tokenizer_path']}, this swarm {tokenizer}: their "
                          f"losses are not comparable; reuse only ablations of the same data build")
    other = {s: n for s, n in r["val_samples"].items() if s in val_samples and val_samples[s] != n}
    if other:
        raise ConfigError(f"reuse: {path} held out {other} samples where this swarm holds out "
                          f"{ {s: val_samples[s] for s in other} }; a domain's loss must come from the same held-out "
                          f"documents — reuse only ablations with the same data.val_fraction and build")
