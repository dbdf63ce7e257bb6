"""`tessera plan` — search the parallel layouts of a cluster for a model and print the best ones.

    tessera plan --model llama3-405b --gpus 1024 --gpu h100-80g --seq 4096 --global-batch 1536
    tessera plan --layers 96 --hidden 12288 --heads 96 --vocab 131072 --mlp gelu --gpus 2304 --seq 4096 ...
    tessera plan ... --top 5 --write-config configs/plan.yaml --check-params
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from framework.base.errors import ConfigError
from framework.parallel.pipeline_schedules import SCHEDULES
from framework.plan.estimate import Estimate
from framework.plan.hardware import GIB, HARDWARE, Hardware, get_hardware, load_calibration, parse_overrides
from framework.plan.layout import Precision, Workload
from framework.plan.memory import checkpoint_staging_bytes
from framework.plan.search import (
    DEFAULT_SCHEDULES,
    PlanResult,
    SearchSpace,
    describe_workload,
    plan_or_explain,
    rejection_lines,
)
from models.config import ModelConfig

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k", "mlp", "norm", "tied")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `plan` flags (shared by `tessera plan` and `python -m framework.plan.cli`)."""
    p.add_argument("--model", help="a preset of models.config.PRESETS (or give the shape flags below)")
    shape = p.add_argument_group("custom shape (instead of --model)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "experts", "top-k"):
        shape.add_argument(f"--{flag}", type=int)
    shape.add_argument("--mlp", choices=("swiglu", "gelu"))
    shape.add_argument("--norm", choices=("rmsnorm", "layernorm"), help="default: layernorm for --mlp gelu")
    shape.add_argument("--tied", action="store_true", help="tie the input embedding and the output head")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="h100-80g", choices=sorted(HARDWARE))
    p.add_argument("--hw", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a hardware-table field, e.g. ib_gbps=25 or mm_efficiency=0.5")
    p.add_argument("--calibration", metavar="JSON",
                   help="a GPU check's calibration (bench/gpu_check.sh: gpu_calibration.json): its measured "
                        "mm_efficiency replaces the table's; explicit --hw still wins")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--activations", choices=("tessera", "korthikanti"), default="tessera",
                   help="activation model: Tessera's block, or Korthikanti et al. 2022 (Megatron-LM's GPT block)")
    p.add_argument("--kernel", choices=("flash", "math"), default="flash")
    p.add_argument("--cp-comm", choices=("ring", "all_to_all", "allgather"), default="ring",
                   help="parallel.cp_comm of cp layouts: what a cp rank keeps for backward")
    p.add_argument("--moe-imbalance", type=float, default=1.25,
                   help="MoE: tokens on the busiest expert-parallel rank over the mean (1: perfect balance); "
                        "its expert matmuls and all-to-all set the step's pace")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="train.optimizer: muon keeps one fp32 momentum per hidden-matrix element and adds the owner "
                        "exchange, Newton-Schulz and its transient (framework/plan/muon.py)")
    p.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                   help=f"comma-separated pipeline schedules to consider, of {', '.join(SCHEDULES)}")
    p.add_argument("--micro-batches", default="1,2,4,8", help="micro-batch sizes to consider")
    p.add_argument("--memory-margin", type=float, default=0.1, help="fraction of GPU memory kept free")
    p.add_argument("--nvme-offload", action="store_true",
                   help="also try every sharded layout with its AdamW states on local NVMe (ZeRO-Infinity)")
    p.add_argument("--prefetch", type=int, default=1, help="FSDP units all-gathered ahead under ZeRO-3 (0: none)")
    p.add_argument("--zeropp", default="", help="ZeRO++ on sharded tp=1 dense layouts: comma-separated of qwz "
                   "(int8 weight gathers), hpz (node-local backward gathers), qgz (int8 gradient all-to-all)")
    p.add_argument("--top", type=int, default=5, help="distinct (tp, pp, ep) layouts to show")
    p.add_argument("--write-config", metavar="PATH", help="write the best layout as a Tessera YAML config")
    p.add_argument("--dryrun", type=int, default=0, metavar="K",
                   help="rehearse the top K layouts at full world size (`tessera dryrun`, minutes each) and print "
                        "the measured memory terms beside the formulas")
    p.add_argument("--check-params", action="store_true",
                   help="count the best layout's parameters per rank on a meta-device build and compare")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `tessera plan` to the top-level CLI (called by framework.cli)."""
    p = subparsers.add_parser("plan", help="search parallel layouts: memory, step time and MFU per layout")
    add_arguments(p)
    p.set_defaults(func=run)


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The preset, or the custom shape built from the shape flags (validated by ModelConfig)."""
    from models.config import model_config

    given = {f: getattr(args, f) for f in SHAPE_FLAGS if getattr(args, f) not in (None, False)}
    if args.model:
        if given:
            raise ConfigError(f"--model {args.model} cannot be combined with shape flags {sorted(given)}; "
                              f"use one or the other")
        return model_config(args.model, max_seq_len=args.seq)
    missing = [f"--{f}" for f in ("layers", "hidden", "heads", "vocab") if f not in given]
    if missing:
        raise ConfigError(f"give --model PRESET or a shape: missing {', '.join(missing)}")
    fields: dict[str, object] = {"n_layers": args.layers, "hidden": args.hidden, "n_heads": args.heads,
                                 "vocab_size": args.vocab, "max_seq_len": args.seq, "tied_embeddings": args.tied}
    if args.kv_heads:
        fields["n_kv_heads"] = args.kv_heads
    if args.ffn:
        fields["ffn_hidden"] = args.ffn
    if args.mlp:
        fields["mlp"] = args.mlp
    fields["norm"] = args.norm or ("layernorm" if args.mlp == "gelu" else "rmsnorm")
    if args.experts:
        fields["moe"] = {"n_experts": args.experts, "top_k": args.top_k or 2}
    return model_config(None, **fields)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r} must be comma-separated integers, e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r} must list positive integers")
    return values


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    """The search space from --schedules, --micro-batches and --memory-margin (validated)."""
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise ConfigError(f"--schedules {args.schedules!r}: unknown {bad}; valid: {', '.join(SCHEDULES)}")
    if not 0 <= args.memory_margin < 1:
        raise ConfigError(f"--memory-margin {args.memory_margin} must be in [0, 1); e.g. 0.1")
    if args.prefetch < 0:
        raise ConfigError(f"--prefetch {args.prefetch} must be >= 0 (FSDP units gathered ahead)")
    zeropp = frozenset(o.strip() for o in args.zeropp.split(",") if o.strip())
    if zeropp - {"qwz", "hpz", "qgz"} or {"qwz", "hpz"} <= zeropp:
        raise ConfigError(f"--zeropp {args.zeropp!r}: options are qwz, hpz, qgz, and qwz with hpz is refused (FSDP2 "
                          f"cannot all-gather a quantized weight from its secondary shard; docs/PARALLELISM.md)")
    return SearchSpace(schedules=schedules, micro_batches=_ints(args.micro_batches, "--micro-batches"),
                       memory_margin=args.memory_margin, prefetch=args.prefetch,
                       nvme_offload=(False, True) if args.nvme_offload else (False,), zeropp=zeropp)


def format_row(i: int, est: Estimate) -> str:
    """One line of the layout table: layout, memory breakdown, step time, throughput, MFU and HFU."""
    m = est.memory
    states = sum(m.get(k, 0.0) for k in ("params", "master", "grads", "optimizer"))
    act = m.get("activations", 0.0) + m.get("logits", 0.0)
    buf = m.get("recompute_buffer", 0.0) + m.get("comm_buffers", 0.0) + m.get("layer_grads", 0.0)
    return (f"{i:>2}  {est.layout.describe():<64} {est.memory_bytes / GIB:6.1f} = {states / GIB:5.1f} + "
            f"{act / GIB:5.1f} + {buf / GIB:4.1f}  {est.step_s:8.2f}  {est.tokens_per_s:>10,.0f}  "
            f"{est.mfu * 100:5.1f}  {est.hfu * 100:5.1f}")


def report(work: Workload, result: PlanResult, hw: Hardware, space: SearchSpace, top: int) -> str:
    """The printed report: top layouts, the best one's breakdown, and the rejection summary."""
    from models.flops import flops_per_token

    lines = [f"{describe_workload(work)} on {result.gpus} x {hw.name}: {flops_per_token(work.model, work.seq_len):.3g}"
             f" model FLOPs/token; {len(result.feasible)} of {result.evaluated} candidate layouts fit "
             f"{hw.memory_gib * (1 - space.memory_margin):.1f} GiB",
             f" #  {'layout':<64} {'GiB/GPU = states + act + buffers':<32}  {'step s':>8}  {'tokens/s':>10}  "
             f"{'MFU%':>5}  {'HFU%':>5}"]
    best = result.top(top)
    lines += [format_row(i + 1, est) for i, est in enumerate(best)]
    if best:
        est = best[0]
        lines.append(f"\nbest layout, rank {est.memory_rank} of the pipeline at peak: "
                     + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in est.memory.items() if v))
        staging = checkpoint_staging_bytes(work, est.layout, est.memory_rank)
        lines.append(f"  host memory per rank for async checkpoints (checkpoint.async_save): "
                     f"{staging['host'] / GIB:.2f} GiB, {staging['pinned'] / GIB:.2f} GiB of it pinned")
        lines.append(f"  FLOPs per step: model {est.flops[0]:.3g}, hardware {est.flops[1]:.3g} "
                     f"({est.flops[1] / est.layout.world:.3g} per GPU); pipeline bubble {est.bubble * 100:.1f}%")
        lines.append("  time per step: " + ", ".join(f"{k} {v:.3f}s" for k, v in est.time.items() if v))
        lines.append("  communication per rank per step: " + ", ".join(
            f"{axis} {c.wire_bytes / 1e9:.2f} GB in {c.seconds:.3f}s" for axis, c in est.comm.items() if c.messages))
    if work.model.moe.enabled:
        lines.append(f"  MoE assumptions: expert all-to-alls on the critical path (the engine overlaps them with "
                     f"no compute, DualPipeV included); the busiest expert rank routes {work.moe_imbalance:g}x the "
                     f"mean tokens (--moe-imbalance); expert matmuls at the same mm_efficiency "
                     f"{hw.mm_efficiency:g} as dense ones (calibrate with --calibration)")
    lines.append("\nrejected:")
    lines += rejection_lines(result)
    return "\n".join(lines)


def _dry_run_top(work: Workload, result: PlanResult, hw: Hardware, k: int) -> None:
    """The dry run's figures beside the formulas for the top `k` layouts (framework/dryrun/planner.py)."""
    from framework.config import config_from_dict
    from framework.dryrun.cli import dry_run
    from framework.dryrun.planner import compare, format_rows
    from framework.plan.export import config_dict

    for est in result.feasible[:k]:
        cfg = config_from_dict(config_dict(work, est.layout))
        verdicts = dry_run(cfg, est.layout.world, gpu=hw.name)
        print(f"\ndry run of {est.layout.describe()} at {est.layout.world} ranks:")
        print(format_rows(compare(cfg, est.layout.world, verdicts)))


def run(args: argparse.Namespace) -> int:
    """Handler of `tessera plan`: search, print the report, optionally check parameters and write a config."""
    cfg = model_from_args(args)
    overrides = parse_overrides(args.hw)
    if args.calibration:
        overrides = {**load_calibration(args.calibration, args.gpu), **overrides}
    hw = get_hardware(args.gpu, overrides)
    space = space_from_args(args)
    if args.optimizer == "muon" and args.nvme_offload:
        raise ConfigError("--optimizer muon with --nvme-offload: a Muon run cannot keep its states on NVMe "
                          "(train.optimizer=muon refuses parallel.nvme_offload); drop one of the two")
    if args.moe_imbalance < 1:
        raise ConfigError(f"--moe-imbalance {args.moe_imbalance} must be >= 1 (the busiest rank over the mean)")
    work = Workload(cfg, args.seq, args.global_batch, Precision.named(args.precision), args.kernel,
                    args.activations, moe_imbalance=args.moe_imbalance, cp_comm=args.cp_comm, optimizer=args.optimizer)
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be >= 1")
    result = plan_or_explain(work, args.gpus, hw, space, progress=sys.stderr.isatty())
    print(report(work, result, hw, space, args.top))
    best = result.feasible[0]
    if args.check_params:
        from framework.plan.memory import rank_params
        from framework.plan.meta import meta_rank_params

        counted = meta_rank_params(cfg, best.layout)
        formula = [rank_params(cfg, best.layout, r).total for r in range(best.layout.pp)]
        verdict = "exact match" if counted == formula else "MISMATCH"
        print(f"\nparameters per pipeline rank (meta-device build vs formula): {verdict}; "
              f"rank 0 {counted[0]:,} vs {formula[0]:,}, last {counted[-1]:,} vs {formula[-1]:,}")
        if counted != formula:
            return 1
    if args.dryrun:
        _dry_run_top(work, result, hw, args.dryrun)
    if args.write_config:
        from framework.plan.export import write_config

        write_config(args.write_config, work, best.layout, hw)
        print(f"\nwrote {args.write_config} (loads with framework.config.load_config)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: `python -m framework.plan.cli --model ... --gpus ...`."""
    from framework.base.errors import TesseraError

    parser = argparse.ArgumentParser(prog="tessera plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TesseraError as err:
        print(f"tessera plan: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
