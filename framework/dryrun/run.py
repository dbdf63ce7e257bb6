"""The dry run of one rank, the rank classes of a layout, and the same measurement on a real (gloo) rank.

    classes = rank_classes(cfg, world_size)                 # distinct kinds of rank, one representative each
    measure = dry_run_rank(cfg, classes[0].rank, world_size)    # fake backend + FakeTensorMode, no weights

Rank classes: ranks whose model slice, memory and traffic can differ. Pipeline position decides the slice
(which stages, hence which layers, the embedding on the first and the head on the last, the tied-embedding
swap between them), so ranks are grouped by the layer counts of their stages and whether they hold the first
or the last stage. Inside one pipeline rank every tp, cp, dp and ep position holds the same shapes: tp and ep
shard evenly (the layout's checks require it), cp chunks are equal, FSDP pads every shard to one size, and the
dry run routes MoE tokens evenly — so one representative per pipeline class stands for all of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from framework.config import Config
from framework.dryrun.fake import DataDependentScalars, DryRunError, StageInput, fake_world
from framework.dryrun.moe import even_routing
from framework.dryrun.step import StepMeasure, measure_step
from framework.dryrun.tracker import MemoryTracker
from framework.parallel.mesh import ParallelDims, stage_layers
from framework.parallel.pipeline_schedules import stages_of_rank


@dataclass(frozen=True)
class RankClass:
    """Pipeline ranks with the same slice of the model; `rank` represents all `members` ranks."""

    name: str
    rank: int
    members: int
    pp_ranks: tuple[int, ...]
    layers: int
    """Transformer blocks on one rank of this class."""


def rank_classes(cfg: Config, world_size: int) -> list[RankClass]:
    """The layout's rank classes in pipeline order (module docstring)."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p, world_size, cfg.model)
    n_stages = dims.pp * p.virtual_stages
    layers = stage_layers(cfg.model.n_layers, n_stages, p.pp_layer_split)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r in range(dims.pp):
        stages = stages_of_rank(r, dims.pp, p.virtual_stages, p.pp_schedule) if dims.pp > 1 else [0]
        key = (tuple(len(layers[s]) for s in stages), 0 in stages, n_stages - 1 in stages)
        groups.setdefault(key, []).append(r)
    out = []
    for (counts, first, last), pp_ranks in groups.items():
        role = "first+last" if first and last else "first" if first else "last" if last else "middle"
        where = f"pp{pp_ranks[0]}" if len(pp_ranks) == 1 else f"pp{pp_ranks[0]}..{pp_ranks[-1]}"
        name = "all ranks" if dims.pp == 1 else f"{where} ({role})"
        out.append(RankClass(name, dims.rank_of(pp=pp_ranks[0]), len(pp_ranks) * world_size // dims.pp,
                             tuple(pp_ranks), sum(counts)))
    return out


def stage_input(cfg: Config, dims: ParallelDims) -> StageInput:
    """What one pipeline stage receives from the previous one (framework/dryrun/fake.py point 3)."""
    from framework.parallel.zero import fsdp_mp_policy

    sp = dims.tp if cfg.parallel.sequence_parallel and dims.tp > 1 else 1
    # FSDP's mixed precision runs each stage in its parameter dtype, so the residual stream leaves it in that
    param_dtype = fsdp_mp_policy(cfg.parallel, cfg.train.precision).param_dtype if dims.fsdp_size > 1 else None
    return StageInput(cfg.train.micro_batch_size, cfg.data.seq_len // dims.cp // sp, cfg.model.hidden,
                      param_dtype or torch.float32)


def _batch(cfg: Config, n_micro: int, real: bool) -> torch.Tensor:
    shape = (n_micro, cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    if real:
        generator = torch.Generator().manual_seed(cfg.train.seed)
        return torch.randint(0, cfg.model.vocab_size, shape, generator=generator)
    return torch.zeros(shape, dtype=torch.long)


def _engine(cfg: Config, dims: ParallelDims, mesh: Any) -> Any:
    from framework.train.parallel_engine import ParallelEngine

    return ParallelEngine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"), dims, mesh)


def dry_run_rank(cfg: Config, rank: int, world_size: int, limit: int | None = None) -> StepMeasure:
    """One measured training step of `rank` in a world of `world_size`, on the fake backend without weights;
    stopped early (`StepMeasure.over_budget`) once live tensor bytes pass `limit`.

    Raises:
        ParallelismError: the layout does not fit the world or the model (before anything is built).
        DryRunError: the rehearsal could not be faithful (framework/dryrun/fake.py).
    """
    dims = ParallelDims.from_config(cfg.parallel, world_size, cfg.model)
    with fake_world(rank, world_size, stage_input(cfg, dims)) as world:
        mesh = dims.build_mesh("cpu", experts=cfg.model.moe.enabled)
        tracker = MemoryTracker(limit)
        routing = even_routing(fake=True) if cfg.model.moe.enabled else contextlib.nullcontext()
        with world.mode, DataDependentScalars(), routing, tracker:
            try:
                engine = _engine(cfg, dims, mesh)
            except Exception:
                if tracker.over is None:
                    raise
                over = tracker.over  # the states alone pass the budget: stopped while building
                return StepMeasure(rank, {}, over.total, over.by_label, over.phase, over_budget=True)
            return measure_step(engine, _batch(cfg, engine.n_micro, real=False), tracker, rank)


def dry_run_ranks(cfg: Config, ranks: list[int], world_size: int, limit: int | None = None) -> list[StepMeasure]:
    """`dry_run_rank` for each of `ranks`, each in a forked process of its own (a torch process group leaves
    caches keyed by group names behind it, so one process rehearses one rank)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = []
    for rank in ranks:
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(send, cfg, rank, world_size, limit))
        child.start()
        send.close()
        try:
            ok, value = receive.recv()
        except EOFError:
            child.join()
            ok, value = False, f"the dry run of rank {rank} died (exit code {child.exitcode})"
        child.join()
        if not ok:
            raise DryRunError(f"dry run of rank {rank} of {world_size} failed:\n{value}")
        out.append(value)
    return out


def _child(send: Any, cfg: Config, rank: int, world_size: int, limit: int | None) -> None:
    import traceback

    from framework.base.errors import TesseraError

    # One intra-op thread: a parent that ran OpenMP kernels before forking leaves libgomp believing its pool
    # exists, and the child's first multi-threaded GEMM waits at the team barrier forever (seen: a dry-run child
    # stuck in gomp_team_barrier_wait_end under a bf16 grouped_mm, after the pytest process had run MoE steps).
    torch.set_num_threads(1)
    try:
        send.send((True, dry_run_rank(cfg, rank, world_size, limit)))
    except TesseraError as err:
        send.send((False, f"{type(err).__name__}: {err}"))
    except BaseException:
        send.send((False, traceback.format_exc()))
    finally:
        send.close()


def real_rank(cfg: Config) -> StepMeasure:
    """The same measurement on this rank of an initialized (gloo) world, on real tensors: the ground truth."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    dims = ParallelDims.from_config(cfg.parallel, world_size, cfg.model)
    mesh = dims.build_mesh("cpu", experts=cfg.model.moe.enabled)
    tracker = MemoryTracker()
    routing = even_routing(fake=False) if cfg.model.moe.enabled else contextlib.nullcontext()
    with routing, tracker:
        engine = _engine(cfg, dims, mesh)
        return measure_step(engine, _batch(cfg, engine.n_micro, real=True), tracker, dist.get_rank())
