"""GPU check (run by bench/gpu_check.sh): what users will see on one GPU, in one prepared run of at most 8 minutes.

Phases, in this order (cheapest and most telling first, so a cut run keeps them), each row written to `--out`
(a JSON object, rewritten after every row so a cut run still reports):
  meta        torch, the device, its peak-FLOPs row (framework/observe/mfu.py: SXM / PCIe / NVL / H200 / A100 told
              apart; an unknown GPU: a named warning and MFU off) and the MFU convention (models.flops)
  attention   per model shape (1B, 8B) at seq 4096, bf16: the SDPA kernel each of Tessera's attention paths runs
              (plain causal, document mask, the dense document mask, an explicit mask), whether flash takes the
              causal call when forced (sdpa_kernel), and each path's forward + backward time (bench/gpu_phases.py)
  kernels     torch._grouped_mm (aligned groups) against the per-expert loop on unaligned counts with empty experts
  checkpoint  an async save (staged in host memory) of a trained engine and its reload, compared bitwise
  parity      the 1-process engine, the parallel engine (world 1; recompute none/full/selective) and a MoE model
              on the parallel engine, eager, on the GPU against the CPU eager 1-process run of the same model
              (fp32, TF32 off; 5 steps, tiny models)
  throughput  eager, then compiled, tokens/s, MFU (non-causal, as the observer and the planner count it) and peak
              memory (freed between rows) of a ~1B model and an 8B-shaped one at seq 4096 (Llama-3 8B
              width, fewer layers to fit), bf16 autocast with fp32 master weights, fused AdamW; beside each, the
              planner's predicted peak memory, and the plain-PyTorch Llama of bench/ref_llama.py with the same
              weights trained the same way (eager or compiled alike): framework_tax = Tessera's step time over it
  slice       (after the eager rows) rank 0 of the production 70B layout (TP8 PP4 FSDP32, 1,024 ranks) built on
              the fake backend with real tensors on the GPU: its measured peak against the planner's (gpu_slice.py)
  calibration `mm_efficiency` for the planner (`tessera plan --calibration FILE`): the achieved hardware FLOP/s of
              the fastest 8B-shaped step so far over the GPU's peak (written to `--calibration` after each such run)
  parity      compiled: the 1-process engine and the parallel engine with selective recompute, as above
A phase starts only while its estimated time (ESTIMATE_S) is left of `--budget-s`; one that does not fit is
reported as skipped. A case that raises is reported with its error and the run goes on; the exit status is 1
if any did. `--dry` runs every phase on CPU with tiny shapes, fp32 and the aot_eager backend (no inductor): the
CI test of this script.
Synthetic data only; imports nothing beyond torch and Tessera's training core (torch 2.11 API).

    python bench/gpu_bench.py --out gpu_check.json --calibration gpu_calibration.json [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_phases import rank0_slice, reference_step_s, sdpa_rows
from framework.config import load_config
from framework.observe.mfu import PEAK_TFLOPS, accelerator_row
from framework.train.local_engine import LocalEngine
from framework.train.lr_schedule import lr_at
from models.flops import MFU_CAUSAL, mfu_flops_per_token, num_params

TINY = ["train.grad_clip=0.5", "train.warmup_steps=1", "train.lr=3.0e-3"]


class Report:
    """The JSON written after every phase (and every case), with the wall time since the start."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        # The budget counts from gpu_check.sh's start (GPU_CHECK_T0, epoch seconds), whose hard timeout does too:
        # counted from here, the imports and CUDA start before it (~10-20 s) would let a last phase start that the
        # timeout then cuts instead of the gate skipping it.
        before = max(0.0, time.time() - float(os.environ.get("GPU_CHECK_T0") or time.time()))
        self.path, self.t0 = path, time.perf_counter() - before
        self.data: dict[str, Any] = {"meta": meta, "attention": [], "kernels": [], "checkpoint": [], "parity": [],
                                     "throughput": [], "slice": [], "calibration": None}

    def add(self, phase: str, row: Any) -> None:
        if isinstance(self.data[phase], list):
            self.data[phase].append(row)
        else:
            self.data[phase] = row
        self.data["meta"]["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.path.write_text(json.dumps(self.data, indent=1))
        print(json.dumps({phase: row}), flush=True)

    def left(self, budget_s: float) -> float:
        return budget_s - (time.perf_counter() - self.t0)


def _train(engine: Any, cfg: Any, data: torch.Tensor) -> list[tuple[float, float]]:
    out = []
    for step, batch in enumerate(data):
        loss = engine.forward_backward(batch.reshape(-1, cfg.train.micro_batch_size, batch.shape[-1]))
        norm = engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(lr_at(cfg.train, step))
        out.append((loss, norm))
    return out


PARITY_CASES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "local": (None, ()), "parallel/none": ("none", ()), "parallel/full": ("full", ()),
    "parallel/selective": ("selective", ()), "parallel/moe": ("none", ("model.preset=test-moe",))}
"""Engine name: (recompute of the parallel engine, None for LocalEngine; model overrides)."""
DRY_PARITY = ("local", "parallel/selective", "parallel/moe")
COMPILED_PARITY = ("local", "parallel/selective")
"""The engines also run compiled (on the GPU too: the other recompute modes' compiled parity is CPU-tested)."""


def parity(report: Report, device: torch.device, backend: str, names: tuple[str, ...], compiled: bool,
           steps: int = 5) -> None:
    """Each engine on `device` (eager or compiled) against the CPU eager 1-process run, fp32."""
    import torch.distributed as dist

    torch.set_float32_matmul_precision("highest")  # TF32 off (one API for both of torch's TF32 switches)
    cfg = load_config("configs/smoke/tiny.yaml", TINY)
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.model.vocab_size, (steps, cfg.train.global_batch_size, cfg.data.seq_len + 1),
                         generator=gen)
    refs: dict[tuple[str, ...], list[tuple[float, float]]] = {}  # the CPU eager 1-process run of each model
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    extra = [f"train.compile={str(compiled).lower()}", f"train.compile_backend={backend}"]
    for name in names:
        recompute, model = PARITY_CASES[name]
        row: dict[str, Any] = {"engine": name, "compiled": compiled}
        try:
            from framework.train.parallel_engine import build_parallel_engine  # an import error: this row's

            if model not in refs:
                r = load_config("configs/smoke/tiny.yaml", [*TINY, *model])
                refs[model] = _train(LocalEngine(r.model, r.train, torch.device("cpu")), r, data)
            ref = refs[model]
            c = load_config("configs/smoke/tiny.yaml", [*TINY, *model, *extra, "parallel.dp_shard=1",
                                                        f"parallel.recompute={recompute or 'none'}"])
            engine: Any = (LocalEngine(c.model, c.train, device) if recompute is None
                           else build_parallel_engine(c.model, c.train, c.parallel, device))
            got = _train(engine, c, data)
            diff = max(max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(got, ref, strict=True))
            row.update(max_abs_diff_vs_cpu=diff, ok=diff <= 1e-4, final_loss=got[-1][0])
        except Exception as exc:  # report and go on: one broken case must not cost the rest of the run
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        report.add("parity", row)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _predicted_peak(cfg: Any, seq: int, micro: int) -> float:
    from framework.plan.layout import Layout, Precision, Workload
    from framework.plan.memory import peak_memory

    work = Workload(model=cfg.model, seq_len=seq, global_batch=micro, precision=Precision.named("bf16"))
    return peak_memory(work, Layout(micro_batch=micro, zero_stage=0))[0]


def throughput(report: Report, device: torch.device, case: dict[str, Any], compiled: bool, backend: str,
               steps: int, peak_tflops: float | None) -> dict[str, Any]:
    """Steady-state tokens/s, MFU and peak memory of one model, eager or compiled, on one device."""
    seq, micro = case["seq"], case["micro"]
    overrides = [f"model.preset={case['preset']}", *case.get("model", []), f"data.seq_len={seq}",
                 f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
                 f"train.precision={'fp32' if device.type == 'cpu' else 'bf16'}",
                 "train.warmup_steps=1", f"train.steps={steps}", "data.kind=synthetic", "data.vocab_size=512",
                 f"train.compile={str(compiled).lower()}", f"train.compile_backend={backend}"]
    cfg = load_config("configs/smoke/tiny.yaml", overrides)
    torch.set_float32_matmul_precision("high")  # TF32 for what stays fp32 under bf16 autocast
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = LocalEngine(cfg.model, cfg.train, device)
    batch = torch.randint(0, cfg.model.vocab_size, (1, micro, seq + 1), device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.forward_backward(batch)
        engine.clip_grad_norm(1.0)
        engine.optimizer_step(lr_at(cfg.train, step))
        sync()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[2:] or times)[: max(1, len(times[2:]) - 1)]  # drop warm-up and the slowest step
    step_s = sum(steady) / len(steady)
    tok_s = micro * seq / step_s
    flops = mfu_flops_per_token(cfg.model, seq)  # the observer's and the planner's convention
    row = {"model": case["name"], "compiled": compiled, "params": num_params(cfg.model), "seq": seq,
           "micro_batch": micro, "tokens_per_s": tok_s,
           "mfu": tok_s * flops / (peak_tflops * 1e12) if peak_tflops else None,
           "flops_per_token": flops, "first_step_s": times[0], "step_s": step_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "planner_peak_gib": _predicted_peak(cfg, seq, micro) / 2**30}
    if row["peak_mem_gib"] is not None:
        row["measured_over_planner"] = row["peak_mem_gib"] / row["planner_peak_gib"]
    # The plain Llama with these weights (copied to the host first: two models' optimizer states may not fit)
    state = {k: v.detach().to("cpu", copy=True) for k, v in engine.model_parts[0].state_dict().items()}
    del engine
    free_memory(device)
    try:
        ref_s, ref_peak = reference_step_s(cfg.model, state, device, batch[0], compiled, backend, steps)
        ref_tok_s = micro * seq / ref_s
        row.update(reference_step_s=ref_s, reference_tokens_per_s=ref_tok_s, framework_tax=step_s / ref_s,
                   reference_mfu=ref_tok_s * flops / (peak_tflops * 1e12) if peak_tflops else None,
                   reference_peak_mem_gib=ref_peak if cuda else None)
    except Exception as exc:  # the Tessera row stands on its own
        row["reference_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    del state, batch
    free_memory(device)  # the next row's peak is its own
    report.add("throughput", row)
    return row


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def grouped_gemm(report: Report, device: torch.device) -> None:
    """torch._grouped_mm (groups padded to aligned starts) against the per-expert loop on unaligned counts with
    empty experts: forward and gradients, and the time of each."""
    from models.moe.experts import GroupedExperts, grouped_mm_available

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    row: dict[str, Any] = {"case": "grouped_gemm_vs_loop", "dtype": str(dtype),
                           "available": grouped_mm_available(device, dtype)}
    counts = torch.tensor([0, 301, 77, 0, 513, 5, 1024, 3], device=device)
    x0 = torch.randn(int(counts.sum()), 256, device=device, dtype=dtype)
    out = {}
    for impl in ("loop", "grouped_mm") if row["available"] else ("loop",):
        torch.manual_seed(0)
        layer = GroupedExperts(len(counts), 256, 512, impl=impl).to(device)  # type: ignore[arg-type]
        for w in (layer.w1, layer.w2, layer.w3):
            torch.nn.init.normal_(w, std=0.05)
        x = x0.clone().requires_grad_(True)
        t0 = time.perf_counter()
        for _ in range(3):
            y = layer(x, counts)
            y.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        row[f"{impl}_s"] = (time.perf_counter() - t0) / 3
        out[impl] = [y.float(), x.grad.float(), layer.w1.grad.float()]  # type: ignore[union-attr]
    if "grouped_mm" in out:
        row["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                                  for a, b in zip(out["grouped_mm"], out["loop"], strict=True))
        row["ok"] = row["max_rel_diff"] < (5e-2 if dtype == torch.bfloat16 else 1e-5)
    report.add("kernels", row)


def async_checkpoint(report: Report, device: torch.device, root: Path) -> None:
    """An async save of a trained engine's state (staged in host memory) and its reload, compared bitwise."""
    from framework.checkpoint.async_save import AsyncSaver
    from framework.checkpoint.dcp import load_checkpoint, training_state
    from framework.checkpoint.staging import _leaves

    cfg = load_config("configs/smoke/tiny.yaml", TINY)
    engine = LocalEngine(cfg.model, cfg.train, device)
    data = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.global_batch_size, cfg.data.seq_len + 1))
    _train(engine, cfg, data.to(device))
    want = {p: t.detach().cpu().clone() for p, t in _leaves(training_state(engine.model_parts, engine.optimizers))}
    saver = AsyncSaver(None, pin_budget_bytes=1 << 30)
    t0 = time.perf_counter()
    saver.save(root, 2, training_state(engine.model_parts, engine.optimizers), {}, keep_last=1, keep_every=0)
    staged_s = time.perf_counter() - t0
    saver.wait()
    fresh = LocalEngine(cfg.model, cfg.train, device)
    load_checkpoint(root / "step_2", fresh.model_parts, fresh.optimizers, restore_rng=False)
    got = {p: t.detach().cpu() for p, t in _leaves(training_state(fresh.model_parts, fresh.optimizers))}
    same = sorted(got) == sorted(want) and all(torch.equal(got[p], want[p]) for p in want)
    report.add("checkpoint", {"case": "async_save_reload", "staged_s": staged_s, "bitwise": same, "ok": same,
                              "host_bytes": saver.stager.host_bytes, "pinned_bytes": saver.stager.pinned_bytes})


def cases(dry: bool) -> list[dict[str, Any]]:
    if dry:
        return [{"name": "tiny", "preset": "test-tiny", "model": ["model.n_layers=2"], "seq": 32, "micro": 2}]
    return [{"name": "llama-1b", "preset": "llama-1b", "seq": 4096, "micro": 2},
            {"name": "llama3-8b-shaped (4 of 32 layers)", "preset": "llama3-8b", "model": ["model.n_layers=4"],
             "seq": 4096, "micro": 1}]


ESTIMATE_S = {"attention": 60.0, "eager": 40.0, "compiled": 160.0, "parity": 60.0, "slice": 60.0}
"""Seconds a phase may take on the GPU (inductor compiles one block graph per model shape, Tessera's and the plain
reference's): one is started only while that much of the budget is left, so the run ends inside it rather than
being cut by the hard timeout. Not yet measured on a GPU: first guesses, to be replaced by the first run's."""


def attention_shapes(dry: bool) -> tuple[dict[str, tuple[int, int, int]], int]:
    """(query heads, KV heads, head dim) of the throughput models, and the sequence length."""
    shapes = {}
    for case in cases(dry):
        m = load_config("configs/smoke/tiny.yaml", [f"model.preset={case['preset']}", "data.vocab_size=512"]).model
        shapes[case["name"]] = (m.n_heads, m.kv_heads, m.head_dim)
    return shapes, cases(dry)[0]["seq"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--calibration", type=Path, default=Path("gpu_calibration.json"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip the phases that would not fit; 0: 450 s on the GPU, 560 s dry (a loaded CI CPU)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="0: from the device name (framework/observe/mfu.py table); unknown GPU: MFU off")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, aot_eager: the CI run of this script")
    args = ap.parse_args()
    if args.dry:
        args.steps = min(args.steps, 3)
    args.budget_s = args.budget_s or (560.0 if args.dry else 450.0)
    device = torch.device("cpu" if args.dry else "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    row = accelerator_row(name) if device.type == "cuda" else None
    peak = args.peak_tflops or (PEAK_TFLOPS[row] if row else None) or (989.0 if args.dry else None)
    backend = "aot_eager" if args.dry else "inductor"
    report = Report(args.out, {"torch": torch.__version__, "device": name, "peak_tflops": peak, "backend": backend,
                               "dry": args.dry, "budget_s": args.budget_s, "peak_row": row,
                               "mfu_convention": {"causal": MFU_CAUSAL, "flops": "models.flops.mfu_flops_per_token"}})
    if peak is None:
        report.data["meta"]["warning"] = (f"no peak-FLOPs figure for GPU {name!r}: MFU off (pass --peak-tflops)")
        print(f"gpu_check: warning: {report.data['meta']['warning']}", file=sys.stderr)
    table = next((v for k, v in {"H200": "h200", "H100": "h100-80g", "A100-SXM4-80GB": "a100-80g"}.items()
                  if k in name), name)
    rows: list[dict[str, Any]] = []
    scale = 0.2 if args.dry else 1.0

    def fits(phase: str) -> bool:
        return report.left(args.budget_s) >= ESTIMATE_S[phase] * scale

    def calibrate() -> None:
        """`mm_efficiency` from the fastest 8B-shaped run so far (rewritten as a faster one comes in)."""
        shaped = [r for r in rows if r["model"] == cases(args.dry)[-1]["name"]]
        if not shaped:
            return
        best = max(shaped, key=lambda r: r["tokens_per_s"])
        if peak is None:
            return
        calib = {"gpu": table, "mm_efficiency": best["tokens_per_s"] * best["flops_per_token"] / (peak * 1e12),
                 "peak_tflops": peak, "from": {k: best[k] for k in ("model", "compiled", "seq", "micro_batch",
                                                                    "tokens_per_s", "mfu")},
                 "torch": torch.__version__}
        args.calibration.write_text(json.dumps(calib, indent=1))
        report.add("calibration", calib)

    # Cheapest and most telling first, so a cut run keeps them: attention kernels, eager parity, eager throughput
    # (and the calibration), the 70B slice, then the compiled runs, whose first steps compile.
    for key, phase in (("attention", lambda: _attention(report, device, args.dry)),
                       ("kernels", lambda: grouped_gemm(report, device)),
                       ("checkpoint", lambda: async_checkpoint(report, device, args.out.parent / "gpu_check_ckpt"))):
        try:
            if key != "attention" or fits("attention"):
                phase()
            else:
                report.add(key, {"skipped": "time budget"})
        except Exception as exc:  # report and go on
            report.add(key, {"error": f"{type(exc).__name__}: {exc}"[:2000]})
        free_memory(device)
    names = DRY_PARITY if args.dry else tuple(PARITY_CASES)
    parity(report, device, backend, names, compiled=False, steps=3 if args.dry else 5)
    for compiled in (False, True):
        if compiled:
            _slice(report, args.dry, fits("slice"), max(report.left(args.budget_s) - 5, 1.0))
        for case in cases(args.dry):
            if not fits("compiled" if compiled else "eager"):
                report.add("throughput", {"model": case["name"], "compiled": compiled, "skipped": "time budget"})
                continue
            try:
                rows.append(throughput(report, device, case, compiled, backend, args.steps, peak))
            except Exception as exc:  # e.g. out of memory: report it and go on
                report.add("throughput", {"model": case["name"], "compiled": compiled,
                                          "error": f"{type(exc).__name__}: {exc}"[:2000]})
            calibrate()
    if fits("parity"):
        parity(report, device, backend, COMPILED_PARITY, compiled=True, steps=3 if args.dry else 5)
    else:
        report.add("parity", {"engine": ", ".join(COMPILED_PARITY), "compiled": True, "skipped": "time budget"})
    failed = [r for phase in ("attention", "kernels", "checkpoint", "parity", "throughput", "slice")
              for r in report.data[phase] if "error" in r or r.get("ok") is False]
    return 1 if failed else 0


def _attention(report: Report, device: torch.device, dry: bool) -> None:
    shapes, seq = attention_shapes(dry)
    for row in sdpa_rows(shapes, seq, device):
        report.add("attention", row)


def _slice(report: Report, dry: bool, fits: bool, timeout_s: float) -> None:
    if not fits:
        report.add("slice", {"skipped": "time budget"})
        return
    try:
        report.add("slice", rank0_slice(dry, timeout_s))
    except Exception as exc:  # report and go on
        report.add("slice", {"error": f"{type(exc).__name__}: {exc}"[:2000]})


if __name__ == "__main__":
    sys.exit(main())
