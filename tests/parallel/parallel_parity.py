"""Helpers of the parity tests: layouts as dicts, sub-world meshes inside one spawn, the cached reference."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from framework.config import Config, load_config
from framework.parallel.mesh import ParallelDims
from framework.testing.tiny import TINY
from framework.train.documents import resolve_documents
from models.documents import DocumentMasking

STEPS = 5


def make_config(overrides: tuple[str, ...] = ()) -> Config:
    return load_config(TINY, ["train.grad_clip=0.5", "train.warmup_steps=1", "train.lr=3.0e-3", *overrides])


def documents(cfg: Config) -> DocumentMasking | None:
    """data.document_mask / reset_position_ids resolved against the synthetic data's EOS, as the trainer does."""
    from data_pipeline.read.prepare import prepare_data

    return resolve_documents(cfg.data, prepare_data(cfg.data).eos_id, cfg.model.vocab_size)


def batches(cfg: Config, steps: int = STEPS) -> torch.Tensor:
    """(steps, global_batch, seq_len + 1) random token ids, the same for every layout.

    With document masking about one token in eight is the EOD (documents of ~8 tokens, some of length 1).
    """
    gen = torch.Generator().manual_seed(7)
    shape = (steps, cfg.train.global_batch_size, cfg.data.seq_len + 1)
    out = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    docs = documents(cfg)
    if docs is not None:
        out[torch.rand(shape, generator=torch.Generator().manual_seed(8)) < 0.125] = docs.eod_id
    return out


def rank_batch(step_batch: torch.Tensor, dp_rank: int, dp_size: int, micro: int) -> torch.Tensor:
    rows = step_batch.shape[0] // dp_size
    mine = step_batch[dp_rank * rows:(dp_rank + 1) * rows]
    return mine.reshape(-1, micro, mine.shape[-1])


Steps = list[tuple[float, float]]
"""(loss, grad norm) per step."""
Checksums = dict[str, tuple[float, float, float]]
"""Per parameter (canonical FQN): (sum of squares, position-weighted sum, norm of the weights), fp64 over the
full tensor."""


def param_checksums(engine: Any) -> Checksums:
    """Checksums of this rank's final parameters (every pipeline stage reports its own; DTensors gathered whole).

    The weighted sum (weights sin(0.7 i + 1) by flat position i) changes when elements move, e.g. KV heads
    swapped between tp ranks, which a plain sum or norm would miss.
    """
    from torch.distributed.tensor import DTensor

    from models.init import canonical_fqn

    out = {}
    for part in engine.model_parts:
        for fqn, p in part.named_parameters():
            out[canonical_fqn(fqn)] = checksum(p.full_tensor() if isinstance(p, DTensor) else p)
    return out


def checksum(full: torch.Tensor) -> tuple[float, float, float]:
    """`param_checksums`' figures of one whole tensor."""
    x = full.detach().double().flatten()
    w = torch.sin(torch.arange(x.numel(), dtype=torch.float64) * 0.7 + 1.0)
    return float(x.pow(2).sum()), float((w * x).sum()), float(w.norm())


def kept_outputs(engine: Any) -> int:
    """Micro-batch outputs (logits) the engine's pipeline schedules still hold after a step: the engine reads
    only the losses, so none should be kept (framework/parallel/pipeline.py `outputs_not_kept`)."""
    schedules = getattr(engine, "_schedules", {}).values()
    stages = [st for s in schedules for st in getattr(s, "_stages", None) or [s._stage]]
    return sum(len(st.output_chunks) for st in stages)


def train_engine(engine: Any, cfg: Config, steps: int = STEPS, start: int = 0, stop: int | None = None
                 ) -> tuple[Steps, Checksums]:
    """Steps [start, stop) of a `steps`-step run (a resumed engine starts later), and the checksums after them."""
    from framework.train.lr_schedule import lr_at

    out = []
    data = batches(cfg, steps)
    for step in range(start, steps if stop is None else stop):
        batch = rank_batch(data[step], engine.dp_rank, engine.dp_size, cfg.train.micro_batch_size)
        loss = engine.forward_backward(batch)
        assert not kept_outputs(engine), f"the last pipeline stage kept {kept_outputs(engine)} micro-batch outputs"
        norm = engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(lr_at(cfg.train, step))
        out.append((loss, norm))
    return out, param_checksums(engine)


@functools.cache
def reference(overrides: tuple[str, ...] = ()) -> tuple[Steps, Checksums]:
    """The 1-process LocalEngine run of the same config (computed once per config and cached)."""
    from framework.train.local_engine import LocalEngine

    torch.manual_seed(0)
    cfg = make_config(overrides)
    return train_engine(LocalEngine(cfg.model, cfg.train, torch.device("cpu"), documents(cfg)), cfg)


def layout_overrides(layout: dict[str, Any]) -> tuple[str, ...]:
    """`parallel.` overrides from a layout dict; keys with a dot (e.g. train.precision) pass through, keys
    starting with "_" are test switches (`BROKEN_KV`), not config."""
    return tuple(f"{k}={v}" if "." in k else f"parallel.{k}={v}" for k, v in layout.items() if not k.startswith("_"))


def extra_overrides(layout: dict[str, Any]) -> tuple[str, ...]:
    """The non-parallel overrides of a layout: they change the reference run."""
    return tuple(f"{k}={v}" for k, v in layout.items() if "." in k)


def layout_world(layout: dict[str, Any]) -> int:
    return int(layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp_shard", 1) * layout.get("dp_replicate", 1)
               * layout.get("cp", 1))


def pack_rounds(layouts: list[dict[str, Any]], world: int = 8) -> list[list[dict[str, Any]]]:
    """Greedy first-fit of layouts into rounds of at most `world` ranks (largest first)."""
    rounds: list[list[dict[str, Any]]] = []
    free: list[int] = []
    for layout in sorted(layouts, key=layout_world, reverse=True):
        n = layout_world(layout)
        for i, left in enumerate(free):
            if n <= left:
                rounds[i].append(layout)
                free[i] -= n
                break
        else:
            rounds.append([layout])
            free.append(world - n)
    return rounds


def run_rounds(rank: int, world: int, rounds: list[list[dict[str, Any]]]) -> list[dict[int, Any]]:
    import torch.distributed as dist

    out = [run_round(rank, world, r) for r in rounds]
    # Rank 0 hosts the TCPStore that gloo groups rendezvous through: a rank that finished early (e.g. rank 0 on a
    # fast layout) must not exit while another still creates its meshes ("Broken pipe" on the store, seen under
    # load with a 1-rank layout at the end of the last round).
    dist.barrier()
    return out


def compare(rounds: list[list[dict[str, Any]]], results: list[list[dict[int, Any]]], atol: float = 1e-5
            ) -> list[str]:
    """Mismatches (as text) of every layout against its cached reference: per-step (loss, grad norm), and for
    fp32 layouts the final parameters' checksums (`param_checksums`, merged over the layout's ranks)."""
    bad = []
    for i, layouts in enumerate(rounds):
        for j, layout in enumerate(layouts):
            runs = [per_rank[i][j] for per_rank in results if j in per_rank[i]]
            overrides, loss_tol, norm_tol = reference_and_tolerance(layout, atol)
            ref_steps, ref_params = reference(overrides)
            for step, (got, want) in enumerate(zip(runs[0][0], ref_steps, strict=True)):
                if abs(got[0] - want[0]) > loss_tol(want[0]) or abs(got[1] - want[1]) > norm_tol * max(1.0, want[1]):
                    bad.append(f"{layout} step {step}: (loss, grad norm) {got} vs 1-process {want} "
                               f"(loss within {loss_tol(want[0]):.2e}, grad norm {norm_tol:.2e} relative; "
                               f"reference {overrides or 'fp32'})")
            if "train.precision" not in layout:
                bad += [f"{layout}: {m}" for m in _param_mismatches([r[1] for r in runs], ref_params)]
    return bad


PARAM_RTOL = 1e-5
"""Final fp32 parameters: ||p - p_ref|| <= PARAM_RTOL ||p_ref|| per tensor, checked through its checksums:
|d sum p^2| <= 2 rtol sum p_ref^2 and |d sum w p| <= rtol ||w|| ||p_ref|| (Cauchy-Schwarz)."""


def _param_mismatches(per_rank: list[Checksums], ref: Checksums) -> list[str]:
    merged: Checksums = {}
    bad = []
    for sums in per_rank:
        for fqn, value in sums.items():
            if merged.setdefault(fqn, value) != value:  # replicas (dp, tp copies) must hold bitwise one value
                bad.append(f"replicas of {fqn} differ: {merged[fqn]} vs {value}")
    if "output.weight" in merged and "output.weight" not in ref:  # a pipeline's copy of a tied embedding
        ref = {**ref, "output.weight": ref["tok_embeddings.weight"]}
    if merged.keys() != ref.keys():
        bad.append(f"parameters {sorted(merged.keys() ^ ref.keys())} on one side only")
    for fqn in sorted(merged.keys() & ref.keys()):
        (sq, ws, _), (ref_sq, ref_ws, w_norm) = merged[fqn], ref[fqn]
        if abs(sq - ref_sq) > 2 * PARAM_RTOL * ref_sq or abs(ws - ref_ws) > PARAM_RTOL * w_norm * ref_sq ** 0.5:
            bad.append(f"final {fqn} checksums {merged[fqn]} vs 1-process {ref[fqn]}")
    return bad


# Unit roundoff of bf16: round-to-nearest with 8 significant bits.
BF16_U = 2.0 ** -8


def reference_and_tolerance(layout: dict[str, Any], atol: float
                            ) -> tuple[tuple[str, ...], Callable[[float], float], float]:
    """The reference run's overrides, the loss tolerance (of the reference loss) and the grad-norm tolerance
    (relative above 1) a layout is held to.

    fp32 layouts: the same config on one process, loss and grad norm to `atol`.
    bf16 layouts: the *fp32* one-process run. Every bf16 value a step produces (activations, logits, gradients)
    is within u = 2^-8 of its fp32 value, so the step's grad norm can differ by ~u in forward and ~u again in
    backward: 2u (7.8e-3) relative. The loss is a mean of B*T per-token losses, each within ~u, whose rounding
    errors are independent, so it is held to u / sqrt(B*T) relative (2.4e-4 for the tiny config's 256 tokens).
    Measured, worst over 5 steps of tp2 x dp_shard2, dp_shard2 ZeRO-3 and the bf16 1-process engine: grad norm
    1.05u (4.1e-3) and loss 8.2e-5 relative, the same with oneDNN's native bf16/AMX kernels and with oneDNN
    held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2: no native bf16, as on CPUs without avx512_bf16). The former 5e-3 bound
    against a bf16 reference compared two rounded runs and missed on an EPYC with avx512_bf16 (6.0e-3).
    With bf16 FSDP all-gathers (the default) FSDP also rounds the parameters and each unit's
    input to bf16 — one more rounding of the same u per value, inside the 2u forward + backward budget: measured
    worst 0.61 of the grad-norm tolerance and 0.29 of the loss's (tp2 x dp_shard2 and dp_shard2 ZeRO-3, with
    native bf16 kernels and under ONEDNN_MAX_CPU_ISA=AVX2), against 0.54 / 0.22 with fp32 all-gathers.
    fp16 layouts: the fp16 one-process run (loss scaling and its skipped steps must agree), to 5e-3.
    """
    overrides = extra_overrides(layout)
    precision = layout.get("train.precision", "fp32")
    if precision == "bf16":
        cfg = make_config()
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        fp32 = tuple(o for o in overrides if not o.startswith("train.precision="))
        return fp32, lambda loss: BF16_U / tokens ** 0.5 * abs(loss), 2 * BF16_U
    tol = 5e-3 if precision == "fp16" else atol
    return overrides, lambda loss: tol, tol


def run_round(rank: int, world: int, layouts: list[dict[str, Any]], extra: tuple[str, ...] = ()) -> dict[int, Any]:
    """Run layouts side by side on disjoint rank ranges; every rank builds every mesh (collective calls)."""
    from framework.train.parallel_engine import ParallelEngine

    torch.set_num_threads(1)
    offset, mine = 0, None
    meshes = []
    for i, layout in enumerate(layouts):
        cfg = make_config(layout_overrides(layout) + extra)
        dims = ParallelDims.from_config(cfg.parallel, layout_world(layout), cfg.model)
        meshes.append(dims.build_mesh("cpu", torch.arange(offset, offset + dims.world_size),
                                      experts=cfg.model.moe.enabled))
        if offset <= rank < offset + dims.world_size:
            mine = (i, cfg, dims)
        offset += dims.world_size
    assert offset <= world, f"round needs {offset} ranks, world has {world}"
    out = {}
    if mine is not None:
        i, cfg, dims = mine
        with broken_kv_replication(bool(layouts[i].get(BROKEN_KV))):
            engine = ParallelEngine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"), dims, meshes[i],
                                    documents(cfg))
        out = {i: train_engine(engine, cfg)}
    _assert_one_group_per_name(layouts)
    return out


def group_members() -> dict[str, tuple[int, ...]]:
    """This rank's process groups (the default one included) by name, with their global ranks."""
    from torch.distributed import distributed_c10d as c10d

    return {name: tuple(sorted(c10d._world.pg_group_ranks[pg])) for pg, name in c10d._world.pg_names.items()}


def group_name_conflicts(per_rank: list[dict[str, tuple[int, ...]]]) -> dict[str, set[tuple[int, ...]]]:
    """Group names that stand for different rank sets on different ranks (`group_members` of every rank).

    torch names groups by a per-process counter and ranks rendezvous under the name, so such a name wires
    ranks of two groups together: a collective deadlock or a cross-group sum (an older build_mesh had MoE
    layouts build their expert meshes on their own ranks only; `ParallelDims.build_mesh`).
    """
    seen: dict[str, set[tuple[int, ...]]] = {}
    for groups in per_rank:
        for name, ranks in groups.items():
            seen.setdefault(name, set()).add(ranks)
    return {name: sets for name, sets in seen.items() if len(sets) > 1}


def _assert_one_group_per_name(layouts: list[dict[str, Any]]) -> None:
    import torch.distributed as dist

    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, group_members())
    conflicts = group_name_conflicts(per_rank)
    assert not conflicts, f"round {layouts}: process-group names with different members on different ranks {conflicts}"


BROKEN_KV = "_broken_kv_replication"
"""Layout switch: pair each tp rank with the wrong replicated KV head (t % n_kv_heads): the parity must fail."""


@contextlib.contextmanager
def broken_kv_replication(on: bool) -> Iterator[None]:
    import framework.parallel.tensor as tensor

    real = tensor.kv_head_of
    if on:
        tensor.kv_head_of = lambda tp_rank, tp, n_kv_heads: tp_rank % n_kv_heads
    try:
        yield
    finally:
        tensor.kv_head_of = real
