"""The planner's walk through a pipeline rank's step (framework/plan/phases.py): the order it assumes is torch's,
and the peak it takes is the largest sum of what is alive at one moment, not the sum of each term's largest.
Pure: no processes (torch's interleaved schedule is built on the fake backend)."""

from __future__ import annotations

import pytest

from bench.schedule_sim import F, action_table, compute_actions, executed_single_stage_table
from framework.plan import phases
from framework.plan.phases import (
    ChunkBytes,
    fsdp_gathers,
    live_at_peak,
    moment_micro_batches,
    rank_ops,
    single_chunk_peak,
)


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 8, 2)])
def test_interleaved_order_is_torchs(pp: int, m: int, v: int) -> None:
    table = action_table("Interleaved1F1B", pp, m, v)
    for rank in range(pp):
        torch_order = [(a.computation_type == F, a.stage_index // pp) for a in compute_actions(table, rank)]
        assert list(rank_ops("Interleaved1F1B", pp, m, v, rank) or ()) == torch_order, (pp, m, v, rank)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_single_stage_order_is_torchs(schedule: str) -> None:
    for pp, m in ((4, 4), (4, 9), (8, 16)):
        table = executed_single_stage_table(schedule, pp, m)
        for rank in range(pp):
            torch_order = [(a.computation_type == F, 0) for a in compute_actions(table, rank)]
            assert list(rank_ops(schedule, pp, m, 1, rank) or ()) == torch_order, (schedule, pp, m, rank)
    assert rank_ops("ZBVZeroBubble", 4, 8, 2, 0) is None  # not modelled: the in-flight counts stay


def test_peak_moment_of_an_interleaved_first_stage_by_hand() -> None:
    """GPT-3's layout: p = m = 8, v = 2. Stage 0 runs all 16 chunk forwards, then chunk 1's 8 backwards, then
    chunk 0's. Each chunk's gradients appear at its first backward and go at its reduction after its last, so the
    two chunks' gradients never coexist: the peak is the end of chunk 1's first backward, 15 micro-batches' kept
    tensors and chunk 1's gradients (plus the transients there), not 16 + both chunks' gradients."""
    a, g = 1.0, 10.0
    chunks = [ChunkBytes(kept=a, grads=g), ChunkBytes(kept=a, grads=g)]
    ops = rank_ops("Interleaved1F1B", 8, 8, 2, 0)
    assert ops is not None
    moment = live_at_peak(ops, chunks, layer=0.5, backward=0.25)
    assert (moment.activations, moment.grads, moment.layer, moment.backward) == (15 * a, g, 0.5, 0.25)
    # with large activations the first backward's start wins: 16 micro-batches, no accumulated gradient yet, the
    # recomputed layer and its gradients
    big = live_at_peak(ops, [ChunkBytes(kept=20.0, grads=g)] * 2, layer=0.5, backward=0.25)
    assert (big.activations, big.grads, big.layer, big.backward) == (320.0, 0.0, 0.5, 0.25)


def test_the_last_stage_frees_its_head_before_its_backward_peaks() -> None:
    """1F1B's last stage, in steady state: the loss's moment holds the head and the log-probabilities; the
    backward's first moment has freed them (the loss and head run backward first) but still holds the logits torch
    keeps until the stage's backward returns, and adds the recomputed layer and a layer's gradients."""
    last = ChunkBytes(kept=1.0, head=3.0, probs=4.0, logits=2.0, grads=10.0)
    ops = rank_ops("1F1B", 4, 8, 1, 3)
    assert ops is not None and ops[:4] == ((True, 0), (False, 0), (True, 0), (False, 0))
    small = live_at_peak(ops, [last], layer=2.0, backward=1.0)  # the loss's moment: 1 + 3 + 4 + 2 + 10
    assert (small.activations, small.logits, small.grads, small.layer) == (4.0, 6.0, 10.0, 0.0)
    large = live_at_peak(ops, [last], layer=7.0, backward=1.0)  # the backward's: 1 + 2 + 10 + 7 + 1
    assert (large.activations, large.logits, large.grads, large.layer, large.backward) == (1.0, 2.0, 10.0, 7.0, 1.0)


def test_zero3_gathers_follow_the_pipelined_resharding() -> None:
    """Per chunk: (gathers of a block resharded after forward, of the stage's last block and root). Without pp
    each micro-batch gathers twice and once; under pp a backward leaves everything gathered, so a forward right
    after a backward gathers nothing (Llama-3-70B's PP4 dry run: 97 / 96 / 97 all-gathers of 20 blocks + root)."""
    flat = rank_ops("1F1B", 1, 3, 1, 0)
    assert flat is not None and fsdp_gathers(flat, 1, pipelined=False) == [(6, 3)]
    for rank, want in ((0, (5, 1)), (1, (5, 1)), (3, (5, 1))):
        ops = rank_ops("1F1B", 4, 4, 1, rank)
        assert ops is not None and fsdp_gathers(ops, 1, pipelined=True) == [want], rank
    assert 19 * 5 + 2 == 97  # first and last stage: 19 resharding blocks, the last block and the root's params


def test_the_walk_shortcuts_keep_every_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner walks fewer micro-batches than the step runs (`moment_micro_batches`: the steady state repeats)
    and long op lists with numpy: on random bytes, the same peak as the whole step walked op by op."""
    import random

    rng = random.Random(0)
    for schedule, pp, v, ms in (("1F1B", 1, 1, (1, 2, 9)), ("1F1B", 4, 1, (4, 5, 16, 19)),
                                ("Interleaved1F1B", 4, 2, (4, 8, 24, 36)), ("Interleaved1F1B", 2, 3, (2, 10))):
        for m in ms:
            for rank in range(pp):
                whole = rank_ops(schedule, pp, m, v, rank)
                short = rank_ops(schedule, pp, moment_micro_batches(schedule, pp, m, rank), v, rank)
                assert whole is not None and short is not None
                for _ in range(3):
                    chunks = [ChunkBytes(*(rng.random() for _ in range(5))) for _ in range(v)]
                    layer, backward = rng.random(), rng.random()
                    monkeypatch.setattr(phases, "SHORT", 10**9)
                    want = live_at_peak(whole, chunks, layer, backward)
                    monkeypatch.setattr(phases, "SHORT", -1)
                    got = [live_at_peak(ops, chunks, layer, backward) for ops in (whole, short)]
                    if v == 1:  # one chunk: the closed form
                        warm = 1 if pp == 1 else min(m, pp - rank)
                        got.append(single_chunk_peak(warm, m - warm, chunks[0], layer, backward))
                    assert all(g.total == pytest.approx(want.total, rel=1e-12) for g in got), (schedule, pp, m, rank)
