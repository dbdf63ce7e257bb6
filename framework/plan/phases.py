"""What a pipeline rank holds at each moment of a step: the order its forwards and backwards run in.

    ops = rank_ops("1F1B", pp=4, n_micro=8, virtual=1, rank=0)       # ((True, 0), (True, 0), ..., (False, 0))
    moment = live_at_peak(ops, unit, head, grads)                      # activations and gradients at the peak

A rank's peak is not the sum of each term's own largest size: its activations are largest at the end of the
warm-up, while the unsharded gradients that ZeRO-1 (and, under pp, ZeRO-2/3: torch's pipeline stages turn FSDP's
gradient sync off until the last backward) accumulate fill up during the backwards that free those activations.
The dry run's tracker sees the step in the order torch runs it; `rank_ops` lists that order for the schedules it
models — one micro-batch after another without pp, GPipe, 1F1B (torch's Schedule1F1B: min(m, p - r) warm-up
forwards, then backward/forward pairs) and Interleaved1F1B (torch's `_get_1f1b_rank_ops` with `_get_warmup_ops`'
warm-up, forward then backward in the steady state) — and `live_at_peak` walks it, taking the largest sum of the
activations alive and the gradients allocated at the end of each forward, at the start of each backward (its
stage's head tensors already freed: the loss and the head run backward first) and at its end (its micro-batch's
activations freed, its chunk's gradients allocated). Other schedules (zero bubble, V shapes) keep the planner's
in-flight counts (framework/parallel/pipeline_schedules.py).

`fsdp_gathers` counts, from the same order, the all-gathers FSDP issues per unit under ZeRO-3 with pp: a unit
gathered for a forward is resharded after it (every block but the stage's last), a backward gathers what is
resharded and, under pp, leaves it gathered (torch's stage turns `reshard_after_backward` off until its reduce after
the last backward), so the next forward or backward of that chunk gathers nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Op = tuple[bool, int]
"""(forward?, this rank's chunk index 0 .. v-1)."""

MODELLED = ("1F1B", "Interleaved1F1B", "GPipe")
SHORT = 64
"""Op lists up to this long are walked op by op, longer ones with numpy (the same moments)."""


@functools.lru_cache(maxsize=4096)
def rank_ops(schedule: str, pp: int, n_micro: int, virtual: int, rank: int) -> tuple[Op, ...] | None:
    """This rank's compute actions in torch's order, or None for a schedule not modelled here."""
    m = n_micro
    if pp == 1:
        return ((True, 0), (False, 0)) * m
    if schedule == "GPipe":
        return ((True, 0),) * m + ((False, 0),) * m
    if schedule == "1F1B":
        warm = min(m, pp - rank)
        return ((True, 0),) * warm + ((False, 0), (True, 0)) * (m - warm) + ((False, 0),) * warm
    if schedule != "Interleaved1F1B":
        return None
    per_round = m // max(1, m // pp)
    total = m * virtual
    warm = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), total)
    ops: list[Op] = []
    for op in range(total + warm):
        if op < total:
            ops.append((True, (op // per_round) % virtual))
        if op >= warm:
            ops.append((False, virtual - 1 - ((op - warm) // per_round) % virtual))
    return tuple(ops)


def moment_micro_batches(schedule: str, pp: int, n_micro: int, rank: int) -> int:
    """The fewest micro-batches whose walk has the same moments as `n_micro`'s (the steady state repeats): without
    pp 3, under 1F1B the warm-up and two backward/forward pairs, under Interleaved1F1B three rounds when the
    micro-batches fill whole rounds of pp (tests/plan/test_plan_phases.py compares the walks)."""
    if pp == 1:
        return min(n_micro, 3)
    if schedule == "1F1B":
        return min(n_micro, pp - rank + 2)
    if schedule == "Interleaved1F1B" and n_micro % pp == 0:
        return min(n_micro, 3 * pp)
    return n_micro


@dataclass(frozen=True)
class ChunkBytes:
    """One micro-batch's bytes on one chunk of the rank, by when its backward frees them."""

    kept: float
    """Activations freed as the backward ends (the blocks' saved tensors, the stage output torch keeps)."""
    head: float = 0.0
    """Activations the loss and head free first in the backward (final norm, head input, targets)."""
    probs: float = 0.0
    """The loss's fp32 log-probabilities, freed with the head."""
    logits: float = 0.0
    """The stage output when it is the logits: torch's stage holds it until its backward returns."""
    grads: float = 0.0
    """The chunk's accumulated gradients: allocated by its first backward, kept until its last backward ends and
    the stage reduces them (torch runs each stage's reduction after that stage's last backward)."""


@dataclass(frozen=True)
class Moment:
    """What lives at the rank's peak moment: activations (head included), logits and loss, gradients, and which
    transients: a layer's working set (its forward, or its recomputation in backward) and a layer's gradients
    before they are accumulated (backward only)."""

    activations: float
    logits: float
    grads: float
    layer: float = 0.0
    backward: float = 0.0

    @property
    def total(self) -> float:
        return self.activations + self.logits + self.grads + self.layer + self.backward


_ARRAYS: dict[int, tuple[Sequence[Op], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}


def _op_arrays(ops: Sequence[Op]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(forward?, chunk, first backward of its chunk?, last backward of its chunk?) per op; memoized by identity
    (`rank_ops` returns the same tuple for the same schedule), which spares hashing a long tuple per call."""
    hit = _ARRAYS.get(id(ops))
    if hit is not None and hit[0] is ops:
        return hit[1]
    if len(_ARRAYS) > 1024:
        _ARRAYS.clear()
    _ARRAYS[id(ops)] = (ops, _make_op_arrays(ops))
    return _ARRAYS[id(ops)][1]


def _make_op_arrays(ops: Sequence[Op]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    fwd = np.fromiter((f for f, _ in ops), dtype=bool, count=len(ops))
    c = np.fromiter((ch for _, ch in ops), dtype=np.int64, count=len(ops))
    bwd_idx = np.flatnonzero(~fwd)
    first = np.zeros(len(ops), dtype=bool)
    last = np.zeros(len(ops), dtype=bool)
    first[bwd_idx[np.unique(c[bwd_idx], return_index=True)[1]]] = True
    last[bwd_idx[len(bwd_idx) - 1 - np.unique(c[bwd_idx][::-1], return_index=True)[1]]] = True
    return fwd, c, first, last


def live_at_peak(ops: Sequence[Op], chunks: Sequence[ChunkBytes], layer: float = 0.0,
                 backward: float = 0.0) -> Moment:
    """The moment of `ops` with the most bytes of `chunks` alive, `layer` and `backward` the two transients (a
    layer's working set, a layer's unaccumulated gradients; module docstring).

    Moments: inside each forward (the blocks' tensors so far, a layer's working set), its end (the loss: head and
    logits, no layer), the start of each backward (its head and log-probabilities freed, the top layer
    recomputed) and its end (its micro-batch freed, its chunk's gradients allocated, the bottom layer's backward).
    """
    if len(ops) <= SHORT:  # numpy's per-call cost passes the loop's below this
        return _walk(ops, chunks, layer, backward)
    fwd, c, first, last = _op_arrays(ops)
    kept, head, probs, logit, grad = (np.array([getattr(ch, k) for ch in chunks], dtype=np.float64)[c]
                                      for k in ("kept", "head", "probs", "logits", "grads"))
    sign = np.where(fwd, 1.0, -1.0)
    acts = np.cumsum(sign * (kept + head))  # alive after each op
    logits = np.cumsum(sign * (probs + logit))
    # each chunk's gradients: allocated by its first backward, freed after its last (the stage's reduction)
    with_new = np.cumsum(np.where(first, grad, 0.0)) - np.cumsum(np.where(last, grad, 0.0)) + np.where(last, grad, 0.0)
    before = with_new - np.where(first, grad, 0.0)  # before this op allocates its chunk's gradients
    acts_before, logits_before = acts - sign * (kept + head), logits - sign * (probs + logit)
    candidates = [  # (mask, activations, logits, gradients, layer, backward)
        (fwd, acts - head, logits - probs - logit, before, layer, 0.0),  # a forward's last layer
        (fwd, acts, logits, before, 0.0, 0.0),  # a forward's end: the head and the loss
        (~fwd, acts_before - head, logits_before - probs, before, layer, backward),  # a backward's start
        (~fwd, acts, logits, with_new, layer, backward),  # a backward's end: its micro-batch freed
    ]
    best = Moment(0.0, 0.0, 0.0)
    for mask, a, lg, g, lay, bw in candidates:
        total = np.where(mask, a + lg + g + lay + bw, -np.inf)
        i = int(np.argmax(total))
        if total[i] > best.total:
            best = Moment(float(a[i]), float(lg[i]), float(g[i]), lay, bw)
    return best


def single_chunk_peak(warm: int, steady: int, ch: ChunkBytes, layer: float = 0.0, backward: float = 0.0) -> Moment:
    """`live_at_peak` in closed form for one chunk run as `warm` forwards, `steady` backward/forward pairs and
    `warm` backwards (no pp: 1 and m - 1; GPipe: m and 0; 1F1B: min(m, p - r) and the rest): the candidate
    moments are the last warm-up forward's, the first backward's, one steady pair's and the first cooldown
    backward's, in that order (ties go to the earliest, as in the walk)."""
    g = ch.grads
    top = warm if steady else warm - 1  # micro-batches alive at the first cooldown backward

    def fwd(k: int, grads: float) -> list[Moment]:  # the k-th alive's forward: its last layer, its end
        return [Moment((k - 1) * (ch.kept + ch.head) + ch.kept, (k - 1) * (ch.probs + ch.logits), grads, layer),
                Moment(k * (ch.kept + ch.head), k * (ch.probs + ch.logits), grads)]

    def bwd(k: int, before: float, after: float) -> list[Moment]:  # a backward with k alive: its start, its end
        return [Moment(k * (ch.kept + ch.head) - ch.head, k * (ch.probs + ch.logits) - ch.probs, before, layer,
                       backward),
                Moment((k - 1) * (ch.kept + ch.head), (k - 1) * (ch.probs + ch.logits), after, layer, backward)]

    cands = fwd(warm, 0.0) + bwd(warm, 0.0, g)
    if steady:
        cands += fwd(warm, g) + bwd(warm, g, g)
    if top >= 1 and warm > 1:
        cands += bwd(top, g, g)
    best = Moment(0.0, 0.0, 0.0)
    for cand in cands:
        if cand.total > best.total:
            best = cand
    return best


def _walk(ops: Sequence[Op], chunks: Sequence[ChunkBytes], layer: float, backward: float) -> Moment:
    """`live_at_peak` op by op (the same moments, in the same order)."""
    acts = logits = grads = 0.0
    started = [False] * len(chunks)
    left = [0] * len(chunks)
    for f, c in ops:
        left[c] += not f
    best, best_total = (0.0, 0.0, 0.0, 0.0, 0.0), 0.0
    for fwd, c in ops:
        ch = chunks[c]
        if fwd:
            acts, logits = acts + ch.kept + ch.head, logits + ch.probs + ch.logits
            cands = ((acts - ch.head, logits - ch.probs - ch.logits, grads, layer, 0.0),
                     (acts, logits, grads, 0.0, 0.0))
        else:
            start = (acts - ch.head, logits - ch.probs, grads, layer, backward)
            grads += 0.0 if started[c] else ch.grads
            started[c] = True
            acts, logits = acts - ch.kept - ch.head, logits - ch.probs - ch.logits
            cands = (start, (acts, logits, grads, layer, backward))
            left[c] -= 1
            grads -= ch.grads if left[c] == 0 else 0.0
        for cand in cands:
            total = cand[0] + cand[1] + cand[2] + cand[3] + cand[4]
            if total > best_total:
                best, best_total = cand, total
    return Moment(*best)


@functools.lru_cache(maxsize=1024)
def fsdp_gathers(ops: tuple[Op, ...], virtual: int, pipelined: bool) -> list[tuple[int, int]]:
    """Per chunk: (gathers of a unit that reshards after forward, gathers of the units that do not — the stage's
    last block and its root's own parameters), ZeRO-3, over one step of `ops` (module docstring).

    Without pp every backward reshards (the engine's `set_micro_batch_sync`), so each micro-batch gathers the
    resharding units twice and the others once.
    """
    out = []
    for chunk in range(virtual):
        state = "sharded"
        resharding = kept = 0
        for fwd, c in ops:
            if c != chunk:
                continue
            if fwd:
                resharding += state != "all"
                kept += state == "sharded"
                state = "kept"
            else:
                resharding += state == "kept"
                kept += state == "sharded"
                state = "all" if pipelined else "sharded"
        out.append((resharding, kept))
    return out


__all__ = ["MODELLED", "ChunkBytes", "Moment", "fsdp_gathers", "live_at_peak", "moment_micro_batches", "rank_ops",
           "single_chunk_peak"]
