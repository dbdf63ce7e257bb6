"""`assign_removals` (data_pipeline/build/dedup.py) on a rank range [lo, hi) with lo > 0, as the sharded near stage
calls it: every edge's kept candidate decided in an earlier range takes the vectorized path. Checked against the
rule written out from its docstring, by brute force over random graphs: in rank order, a document is removed iff
it has an edge to a kept document of better rank, and its representative is the best-ranked such one."""

from __future__ import annotations

import numpy as np


def _brute(edges: list[tuple[int, int]], n: int) -> tuple[dict[int, int], np.ndarray]:
    removed = np.zeros(n, dtype=bool)
    rep: dict[int, int] = {}
    for b in range(n):
        kept = sorted(a for bb, a in edges if bb == b and not removed[a])
        if kept:
            removed[b], rep[b] = True, kept[0]
    return rep, removed


def test_a_later_range_matches_the_rule() -> None:
    from data_pipeline.build.dedup import assign_removals

    rng = np.random.default_rng(5)
    for trial in range(40):
        n, lo = int(rng.integers(6, 30)), int(rng.integers(1, 5))
        pairs = {(int(b), int(a)) for b, a in rng.integers(0, n, size=(3 * n, 2)) if a < b}
        edges = sorted(pairs)  # by (b, a)
        rep, removed = _brute(edges, n)
        # the range [lo, n) with only edges to documents before lo: the vectorized path
        mine = [(b, a) for b, a in edges if b >= lo and a < lo]
        _, removed_early = _brute([(b, a) for b, a in edges if b < lo], n)
        want = {b: min((a for bb, a in mine if bb == b and not removed_early[a]), default=None)
                for b in range(lo, n)}
        b_arr = np.array([b for b, _ in mine], dtype=np.int64)
        a_arr = np.array([a for _, a in mine], dtype=np.int64)
        chosen, got = assign_removals(b_arr, a_arr, lo, n, lambda r, early=removed_early: early[r])
        assert [int(x) for x in np.flatnonzero(got) + lo] == [b for b, a in want.items() if a is not None], trial
        assert {int(b_arr[k]): int(a_arr[k]) for k in chosen} == {b: a for b, a in want.items() if a is not None}
        # control: the whole graph in one call (the loop path) is the brute-force rule too
        b_all = np.array([b for b, _ in edges], dtype=np.int64)
        a_all = np.array([a for _, a in edges], dtype=np.int64)
        chosen_all, got_all = assign_removals(b_all, a_all, 0, n, lambda r: np.zeros(len(r), dtype=bool))
        assert np.array_equal(got_all, removed)
        assert {int(b_all[k]): int(a_all[k]) for k in chosen_all} == rep
