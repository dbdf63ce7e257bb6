"""FP8 training (train.fp8, torchao's emulation on CPU) under data parallelism matches the 1-process FP8 run.

Both sides run bf16 autocast with the same linears in FP8 (tensorwise recipe: e4m3 forward, e5m2 output
gradients) on the same micro-batches (each data rank gets whole micro-batches of the global batch), so every FP8
cast sees the same tensor up to what the layout changes before it: the order of fp32 gradient sums
(reduce-scatter vs accumulation) and, with FSDP's bf16 all-gathers, the weights rounded to bf16 before their FP8
cast. Tolerance, from the unit roundoffs u8 = 2^-4 (e4m3: 3 stored mantissa bits, round to nearest) and
u16 = 2^-8 (bf16):

- a value reaching an FP8 cast perturbed by a relative eps <= u16 lands on another FP8 grid point only when it
  lies within eps of a rounding boundary, i.e. for a fraction ~eps / (2 u8) of the values, and then moves by one
  FP8 step, 2 u8 of its size: the expected error per value is eps — FP8 adds no bias of its own, but each value's
  error is now a rare large jump rather than many small ones, so its spread is sqrt(2 u8 / eps) = 4x that of
  eps-sized noise for eps = u16.
- The grad norm sums many squared gradient entries: forward and backward each contribute <= u16 relative
  (as for bf16, tests/parallel/parallel_parity.py), times that 4x spread: 8 u16 = 2u8 / 2 = 3.1e-2 relative.
- The loss is a mean of B*T per-token losses with independent errors: 4 u16 / sqrt(B*T) relative
  (9.8e-4 for the tiny config's 256 tokens).

Measured (tiny config, 5 steps): with fp32 all-gathers the weights reach their casts exactly and DP2 matches to
4e-5 of the loss tolerance; with bf16 all-gathers (the default) to 0.43 of it and 0.30 of the grad-norm one.

The other layouts, held to the same tolerance against the 1-process FP8 run of their recipe:
- rowwise recipe (DP2 ZeRO-3): every cast is e4m3 (u8 = 2^-4, inputs, weights and output gradients alike), with
  one power-of-2 scale per row, so the derivation above holds as it stands.
- FP8 all-gathers (DP2 ZeRO-3, `train.fp8.fsdp_all_gather`): each rank casts its fp32 shard with the tensorwise
  scale of the whole weight (an all-reduced amax), so the converted weights reach the GEMM as the 1-process cast
  makes them; the norms and the units' inputs still go through FSDP's bf16, as in the bf16-all-gather layout, so
  the same tolerance (measured: not closer to the FP8 run than to the bf16 one, like that layout). Each block's
  all-gather moves one byte per converted weight element where the bf16 layout moves two (every other unit
  unchanged), from the comm logger, and the planner predicts the bytes saved per step exactly.
- TP2 + SP (both recipes) and PP2: tensorwise scales over a sharded DTensor are reduced over tp (the 1-process
  amax); the layouts change the order of the bf16 partial sums (tp) or nothing (pp) before a cast.
- DP2 over dp_replicate (DDP) and the rowwise DP2 ZeRO-3 layout, both compiled (aot_eager), against the eager
  1-process FP8 run: each replica runs the 1-process casts on its micro-batches, compile traces the same casts
  (measured on 1 process: bitwise equal to eager), and only the order of the fp32 gradient sums differs.

Alongside, each layout must really run FP8 (every converted linear a Float8Linear), and the fp32-all-gather
layout's losses must be closer to the FP8 reference than to the bf16 run (with FSDP's bf16 the rounding of
weights and unit inputs moves the run by as much as FP8 does on this tiny model, so there only the tolerance
holds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_parity import (
    STEPS,
    Steps,
    checksum,
    layout_overrides,
    make_config,
    param_checksums,
    reference,
    train_engine,
)

from framework.config import Config
from framework.testing import run_distributed

pytest.importorskip("torchao", reason="train.fp8 needs torchao (pip install 'torchao>=0.18,<0.19')")

U8, U16 = 2.0**-4, 2.0**-8
FP8 = {"train.precision": "bf16", "train.fp8.enabled": True}
ROWWISE = {**FP8, "train.fp8.recipe": "rowwise"}
AOT = {"train.compile": True, "train.compile_backend": "aot_eager"}
ROUND_TRIP: dict[str, Any] = {"dp_shard": 2, "zero_stage": 3, **FP8, "train.fp8.fsdp_all_gather": True,
                              "comm_log": True}
BF16_RESUME: dict[str, Any] = {"dp_shard": 2, "zero_stage": 3, "train.precision": "bf16"}
SAVE_AT = 3
LAYOUTS: list[dict[str, Any]] = [
    {"dp_shard": 2, "zero_stage": 3, **FP8, "comm_log": True},
    {"dp_shard": 2, "zero_stage": 1, "fsdp_mixed_precision": False, **FP8},
    ROUND_TRIP,
    {"dp_shard": 2, "zero_stage": 3, **ROWWISE, **AOT},
    {"dp_shard": 1, "tp": 2, "sequence_parallel": True, **FP8},
    {"dp_shard": 1, "tp": 2, "sequence_parallel": True, **ROWWISE},
    {"dp_shard": 1, "pp": 2, **FP8},
    {"dp_shard": 1, "dp_replicate": 2, "zero_stage": 0, **FP8, **AOT},
]
EXACT_WEIGHTS = ("fsdp_mixed_precision",)
"""Layouts whose values reach their FP8 casts as in the 1-process run: closer to it than to the bf16 run."""


def _layouts(rank: int, world: int, root: str) -> tuple[list[tuple[Steps, int, list[int]]], dict[str, Any]]:
    """Each layout on these 2 ranks in turn: its (loss, grad norm) per step, how many Float8Linear it runs and the
    bytes of each of its all-gathers, in order (with the comm logger on); and the FP8-all-gather layout's
    checkpoint round trip (`_round_trip`)."""
    from torchao.float8.float8_linear import Float8Linear

    from framework.train.parallel_engine import build_parallel_engine

    torch.set_num_threads(1)
    out, trip = [], {}
    for layout in LAYOUTS:
        cfg = make_config(layout_overrides(layout))
        engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
        n_fp8 = sum(isinstance(m, Float8Linear) for part in engine.model_parts for m in part.modules())
        if layout is ROUND_TRIP:
            steps, trip = _round_trip(engine, cfg, Path(root))
        else:
            steps = train_engine(engine, cfg)[0]
        gathers = [t.bytes for t in engine.comm.timings if t.op == "all_gather"] if engine.comm is not None else []
        out.append((steps, n_fp8, gathers))
    from framework.parallel.compile import compiled_frames

    return out, {**trip, "compiled_frames": compiled_frames()}


def _round_trip(engine: Any, cfg: Config, root: Path) -> tuple[Steps, dict[str, Any]]:
    """Train with a checkpoint before step SAVE_AT (its weights are torchao's FP8-all-gather wrapper tensors inside
    FSDP's DTensors); then from it a fresh FP8 engine and a bf16 one (same layout, no FP8) each load the model and
    optimizer and train the remaining steps. Returns the run's steps and what the test compares."""
    from framework.checkpoint.dcp import load_checkpoint, save_checkpoint
    from framework.config import to_dict
    from framework.train.parallel_engine import build_parallel_engine

    first, saved = train_engine(engine, cfg, stop=SAVE_AT)
    path = save_checkpoint(root, SAVE_AT, engine.model_parts, engine.optimizers, {"config": to_dict(cfg)})
    rest, final = train_engine(engine, cfg, start=SAVE_AT)
    trip: dict[str, Any] = {"path": str(path), "saved": saved, "rest": rest, "final": final}
    for name, c in (("fp8", cfg), ("bf16", make_config(layout_overrides(BF16_RESUME)))):
        resumed = build_parallel_engine(c.model, c.train, c.parallel, torch.device("cpu"))
        load_checkpoint(path, resumed.model_parts, resumed.optimizers)
        trip[f"{name}_loaded"] = param_checksums(resumed)
        trip[f"{name}_rest"], trip[f"{name}_final"] = train_engine(resumed, c, start=SAVE_AT)
    return first + rest, trip


def _block_sizes() -> tuple[int, int]:
    """Elements of one block of the tiny model, and of its weights that train in FP8."""
    from framework.numerics.config import FP8Config
    from framework.numerics.fp8 import convert_to_fp8
    from models.decoder import build_model

    model = build_model(make_config().model, seed=0, device=torch.device("cpu"))
    convert_to_fp8(model, FP8Config(enabled=True), "cpu")
    block = model.layers["0"]
    fp8 = sum(m.weight.numel() for m in block.modules() if type(m).__name__ == "Float8Linear")
    return sum(p.numel() for p in block.parameters()), fp8


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[list[tuple[Steps, int, list[int]]], dict[str, Any]]]:
    return run_distributed(_layouts, 2, timeout_s=600, root=str(tmp_path_factory.mktemp("fp8_ckpt")))


@pytest.mark.distributed
def test_fp8_layouts_match_one_process_fp8(spawn: list[Any]) -> None:
    results = [layouts for layouts, _ in spawn]
    assert spawn[0][1]["compiled_frames"] > 0, "the compiled layouts compiled nothing"
    bf16_ref, _ = reference(("train.precision=bf16",))
    cfg = make_config(tuple(f"{k}={v}" for k, v in FP8.items()))
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    loss_tol, norm_tol = 4 * U16 / tokens**0.5, 8 * U16
    n_linears = 7 * cfg.model.n_layers  # wq wk wv wo w1 w2 w3 per block; the head stays bf16
    bad = []
    for layout, (steps, n_fp8, _) in zip(LAYOUTS, results[0], strict=True):
        fp8_ref, _ = reference(tuple(f"{k}={v}" for k, v in layout.items() if k.startswith("train.")
                                     and k != "train.fp8.fsdp_all_gather" and not k.startswith("train.compile")))
        per_stage = n_linears // layout.get("pp", 1)
        n_fp8_all = n_fp8 if layout.get("pp", 1) == 1 else sum(r[LAYOUTS.index(layout)][1] for r in results)
        if n_fp8_all != n_linears:
            bad.append(f"{layout}: {n_fp8_all} Float8Linear, expected {n_linears} ({per_stage} per stage)")
        for s, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, fp8_ref, strict=True)):
            if abs(loss - ref_loss) > loss_tol * ref_loss or abs(norm - ref_norm) > norm_tol * ref_norm:
                bad.append(f"{layout} step {s}: (loss, grad norm) {(loss, norm)} vs 1-process FP8 "
                           f"{(ref_loss, ref_norm)} (loss within {loss_tol:.1e}, grad norm {norm_tol:.1e} relative)")
        gap_fp8 = max(abs(a[0] - b[0]) for a, b in zip(steps, fp8_ref, strict=True))
        gap_bf16 = max(abs(a[0] - b[0]) for a, b in zip(steps, bf16_ref, strict=True))
        if any(k in layout for k in EXACT_WEIGHTS) and not gap_fp8 < gap_bf16:
            bad.append(f"{layout}: closer to the bf16 run ({gap_bf16:.2e}) than to the FP8 one ({gap_fp8:.2e})")
    block, block_fp8 = _block_sizes()
    bf16_gathers, fp8_gathers = results[0][0][2], results[0][2][2]
    expected = [b - block_fp8 if b == 2 * block else b for b in bf16_gathers]  # 2 bytes -> 1 per FP8 element
    if fp8_gathers != expected or 2 * block not in bf16_gathers:
        bad.append(f"FP8 all-gather bytes per call {fp8_gathers}, expected {expected} (bf16 layout: "
                   f"{bf16_gathers}; a block: {block} elements, {block_fp8} of them in FP8)")
    planned = _planned_gather_saving(LAYOUTS[0], LAYOUTS[2])
    measured = (sum(bf16_gathers) - sum(fp8_gathers)) / 2 / STEPS  # wire bytes: (n-1)/n of the buffer at n = 2
    if abs(planned - measured) > 1e-9 * measured:
        bad.append(f"all-gather wire bytes saved per step by FP8 all-gathers: planner {planned}, measured {measured}")
    assert not bad, "\n".join(bad)


def _planned_gather_saving(bf16: dict[str, Any], fp8: dict[str, Any]) -> float:
    """The planner's all-gather wire bytes per step and rank, bf16 layout minus FP8-all-gather layout."""
    from framework.dryrun.planner import layout_of
    from framework.plan.comm import dp_comm_per_step
    from framework.plan.hardware import get_hardware
    from framework.plan.memory import rank_params

    out = []
    for layout in (bf16, fp8):
        work, lay = layout_of(make_config(layout_overrides(layout)), 2)
        out.append(dp_comm_per_step(work, lay, get_hardware("h100-80g"), rank_params(work.model, lay, 0))["gather"])
    return out[0].wire_bytes - out[1].wire_bytes


@pytest.mark.distributed
def test_fp8_all_gather_checkpoint_resumes_bitwise_loads_into_bf16_and_exports_to_hf(
        spawn: list[Any], tmp_path: Path) -> None:
    """The FP8-all-gather run's checkpoint (DP2 ZeRO-3): resumed by an FP8 engine it goes on bit for bit; a bf16
    engine loads exactly the saved weights and trains on; the 1-process loader reads the same weights, and
    `tessera ckpt export-hf --dtype bfloat16` writes them rounded to bf16 under the HF names."""
    from safetensors.torch import load_file

    from framework.checkpoint.hf import from_hf_state, load_model
    from framework.cli import main
    from models.init import canonical_fqn

    trip = spawn[0][1]
    assert trip["fp8_loaded"] == trip["saved"] and trip["bf16_loaded"] == trip["saved"]
    assert trip["fp8_rest"] == trip["rest"] and trip["fp8_final"] == trip["final"]  # bitwise
    # bf16 from the same weights: each step's loss within FP8's own gap to bf16 (measured < 1% here)
    assert all(abs(a[0] / b[0] - 1) < 0.01 for a, b in zip(trip["bf16_rest"], trip["rest"], strict=True))
    model, _ = load_model(Path(trip["path"]))
    assert {canonical_fqn(k): checksum(v) for k, v in model.named_parameters()} == trip["saved"]
    out = tmp_path / "hf"
    assert main(["ckpt", "export-hf", str(Path(trip["path"])), str(out), "--dtype", "bfloat16"]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    back = from_hf_state(model.cfg, {k: v.float() for k, v in exported.items()})  # type: ignore[arg-type]
    weights = model.state_dict()
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k].bfloat16().float()) for k in weights)

