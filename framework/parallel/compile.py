"""`train.compile`: torch.compile each transformer block (as torchtitan does), after TP and activation
checkpointing and before FSDP, so FSDP's hooks stay outside the compiled regions.

Per-block regions keep compile time bounded by one block rather than the depth, and FSDP's all-gathers and
reduce-scatters fall between graphs. FQNs gain `_orig_mod.`, which `canonical_fqn` and
torch.distributed.checkpoint's state-dict API strip, so checkpoints and per-FQN initialization are unchanged.
Which layouts are refused, and why, is `refusal` (checked at config load); which regions each block compiles
is `compile_blocks`.

Recompilations are logged (dynamo's `recompiles` artifact names the guard that failed) and counted
(`compiled_frames`: flat after the first step, tests/parallel/test_compile.py); a graph that kept recompiling
would hit dynamo's recompile limit and run eagerly with a warning, never wrongly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from framework.parallel.pipeline_schedules import schedule_spec

log = logging.getLogger(__name__)

BACKENDS = ("inductor", "aot_eager", "eager")




def refusal(backend: str, parallel: Any, model: Any) -> str | None:
    """Why `train.compile` cannot run this layout, or None where a compiled run matched eager.

    `parallel` is a ParallelConfig, `model` a ModelConfig. Every layout allowed here has a compiled-vs-eager
    parity case in tests/parallel/test_compile.py (loss and grad norm within 1e-5 over 5 steps): FSDP2 at ZeRO
    1/2/3 (with HSDP, CPU offload, 2-block units), DDP with document masks, TP with and without SP and loss
    parallel, TP x FSDP, PP under GPipe, 1F1B, Interleaved1F1B and LoopedBFS, cp, MoE with EP and with TP,
    full and selective recompute, NVMe-offloaded optimizer states; inductor on 1 process and DP2 ZeRO-3.
    """
    # Schedules that split each stage's backward into input and weight halves: torch.distributed.pipelining
    # refuses compiled stage modules for them ("not supported with stage modules that have used torch.compile").
    if parallel.pp > 1 and schedule_spec(parallel.pp_schedule).split_backward:
        return (f"train.compile=true with parallel.pp_schedule={parallel.pp_schedule}: zero-bubble schedules run "
                f"the input and weight halves of each stage's backward separately, which torch "
                f"{torch.__version__}'s pipelining refuses for compiled stages; use pp_schedule=1F1B or "
                f"Interleaved1F1B, or train.compile=false")
    return None


def compile_blocks(layers: nn.ModuleDict, backend: str, *, tensor_parallel: bool = False,
                   fullgraph: bool = True) -> int:
    """Compile every block of `layers` in place; returns how many regions were compiled.

    A dense block without tensor parallelism becomes one graph (its `torch.compile` wrapper replaces it). With
    tensor parallelism the attention and the MLP are compiled separately: a whole-block graph breaks the
    backward of the DTensor redistributions around it on torch 2.13 (bench/compile_tp_repro.py: the gradient of
    the block input reaches eager `Redistribute.backward` as a plain tensor), while the two sub-layers, each
    with its own input redistribution (PrepareModuleInput) and row-wise output inside the graph, match eager.
    In an MoE block only the attention is compiled: tracing the experts' `torch._grouped_mm` fails in fp32
    (its fake-tensor kernel demands bf16 on torch 2.13) and the loop path splits rows by data-dependent counts,
    a graph break per expert; dispatch over `ep` is eager autograd functions around all-to-alls anyway.
    `fullgraph=False` lets a region break where dynamo must (e.g. FSDP hooks of sharded sub-modules).
    """
    from models.moe import MoE

    if backend not in BACKENDS:
        raise ValueError(f"compile backend {backend!r} is not one of {BACKENDS}")
    if tensor_parallel and backend == "inductor":
        _no_cross_process_caches()
    regions = 0
    for key in list(layers.keys()):
        outer = layers[key]
        block = getattr(outer, "_checkpoint_wrapped_module", outer)  # recompute wraps the block, not its parts
        moe = isinstance(block.feed_forward, MoE)
        if not tensor_parallel and not moe:
            compiled = torch.compile(outer, backend=backend, fullgraph=fullgraph, dynamic=False)
            layers[key] = compiled  # type: ignore[assignment]
            regions += 1
            continue
        for name in ("attention",) if moe else ("attention", "feed_forward"):
            setattr(block, name, torch.compile(getattr(block, name), backend=backend, fullgraph=fullgraph,
                                               dynamic=False))
            regions += 1
    _raise_recompile_limit(regions)
    _log_recompiles()
    return regions


def _no_cross_process_caches() -> None:
    """Turn off inductor's FX-graph and AOT-autograd caches (on disk, shared by every process of the machine).

    A TP region's graph calls its collectives by process-group *name*, and names are handed out in creation
    order, so they differ between layouts and programs; torch 2.13's cache keys leave them out. Measured
    (bench/compile_tp_repro.py --cache-hazard): a TP2 run that hit the cache of an earlier run whose groups were
    numbered differently reduced over the wrong group and trained silently wrong (loss off by 0.57 at step 5).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if inductor_config.fx_graph_cache or functorch_config.enable_autograd_cache:
        log.info("train.compile with tensor parallelism: inductor's on-disk graph caches are off (their keys "
                 "omit process-group names, so a cached TP graph can reduce over another run's group)")
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


def _log_recompiles() -> None:
    # Dynamo reports every recompilation with the guard that failed; routed to our logger by torch's logging.
    try:
        torch._logging.set_logs(recompiles=True)
    except (AttributeError, TypeError) as exc:  # torch._logging is private: keep training if its API moves
        log.warning("cannot enable dynamo recompile logging: %s", exc)


def compiled_frames() -> int:
    """Graphs dynamo compiled so far in this process (first compiles and recompiles): flat after warm-up."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _raise_recompile_limit(regions: int) -> None:
    # Under TP, dynamo guards on each layer's DTensor specs, so each layer's region compiles once (a few frames
    # per region): the default limit of 8 per code object would send deep models back to eager.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 4 * regions))
