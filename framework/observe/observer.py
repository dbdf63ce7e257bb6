"""The trainer's one hook into observability: extra sinks, MFU fields, perplexities and the end-of-run summary.

The trainer calls, in order:

    obs = Observer.for_config(cfg, run_dir, rank, world, device)   # wandb/TensorBoard sinks on rank 0
    obs.attach(engine.model_parts, engine.optimizers)    # the straggler detector's section hooks
    record.update(obs.on_step(record))                   # per train step: tokens/s per device, MFU, HFU, straggler/*,
                                                         # sniff/* (observe.sniff), exclude/* (a confirmed bad
                                                         # node stops the run for a requeue)
    out.update(obs.eval_metrics(out))                     # per evaluation: val_ppl/<domain>
    obs.summary(step, final_eval, checkpoint_time_s)      # once per start: a `summary` record
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from framework.base.logs import get_logger
from framework.observe.config import ObserveConfig
from framework.observe.exclusion import NodeExclusion
from framework.observe.mfu import FlopsMeter, detect_accelerator, peak_tflops
from framework.observe.straggler import StragglerDetector
from framework.parallel.config import ParallelConfig
from models.config import ModelConfig

if TYPE_CHECKING:
    from framework.config import Config

log = get_logger("observe")

BREAKDOWN = ("data_time_s", "fwd_bwd_time_s", "optim_time_s")


class Observer:
    """Observability of one Trainer (see module docstring).

    Args:
        obs: the observe section.
        model, seq_len, parallel: the model shape, sequence length and recompute setting feed the FLOPs count.
        run_dir: the run directory.
        run_name, run_config: the wandb run's name and config (the resolved tree).
        rank: this process's global rank; only rank 0 builds sinks.
        world: number of devices sharing each step.
        device: this rank's device (selects the peak-FLOPs row).
        fp8: the run trains its linears in FP8 (train.fp8.enabled): `observe.mfu_peak=auto` then divides by the
            FP8 peak.
    """

    def __init__(self, obs: ObserveConfig, model: ModelConfig, seq_len: int, parallel: ParallelConfig,
                 run_dir: Path, *, run_name: str, run_config: dict[str, Any], rank: int, world: int,
                 device: torch.device, fp8: bool = False) -> None:
        self.meter: FlopsMeter | None = None
        if obs.mfu:
            dtype: str = ("fp8" if fp8 else "bf16") if obs.mfu_peak == "auto" else obs.mfu_peak
            peak = peak_tflops(device, obs.accelerator, obs.peak_tflops, dtype)  # None: unknown GPU, warned, MFU off
            mode = "full" if obs.recompute else parallel.recompute
            every = max(1, parallel.recompute_every)
            fraction = len(range(0, model.n_layers, every)) / model.n_layers  # layers with i % k == 0
            row = detect_accelerator(device) if obs.accelerator == "auto" else obs.accelerator
            if obs.peak_tflops is None and row == "cpu":
                dtype = "cpu-fp32"  # a measured fp32 matmul rate: the CPU has no bf16 or FP8 table row
            if peak is not None:
                self.meter = FlopsMeter.for_model(model, seq_len, world, peak, mode, fraction, peak_dtype=dtype)
        self._n_steps, self._peak_mb = 0, 0.0
        self._last: dict[str, Any] | None = None
        self._sums: dict[str, float] = {}
        self.straggler = StragglerDetector(obs.straggler, rank, world, device)
        self.exclusion = NodeExclusion(obs.exclude, run_dir, rank)
        self.sniff_cfg, self.device = obs.sniff, device
        self.sinks: list[Any] = []
        if rank == 0:
            from framework.observe.sinks import build_sinks

            self.sinks = build_sinks(obs, run_dir, run_name, run_config)

    @classmethod
    def for_config(cls, cfg: Config, run_dir: Path, rank: int, world: int, device: torch.device) -> Observer:
        """The observer of a run of `cfg`: each part gets its own section."""
        from framework.config import to_dict

        return cls(cfg.observe, cfg.model, cfg.data.seq_len, cfg.parallel, run_dir, run_name=cfg.run.name,
                   run_config=to_dict(cfg), rank=rank, world=world, device=device, fp8=cfg.train.fp8.enabled)

    def attach(self, parts: list[torch.nn.Module], optimizers: list[Any]) -> None:
        """Hook the straggler detector's section timers (and any injected fault) into the engine's model parts."""
        self.straggler.attach(parts, optimizers)

    def on_step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Throughput per device, MFU (common and causal) and HFU of a train record, and the straggler verdict every
        observe.straggler.interval steps (a collective: every rank calls this every step); feeds the summary."""
        self._n_steps += 1
        self._last = record
        if self._n_steps > 1:  # steady state: the first step pays one-off allocation and warm-up costs
            for key in ("step_time_s", *BREAKDOWN):
                self._sums[key] = self._sums.get(key, 0.0) + float(record[key])
        self._peak_mb = max(self._peak_mb, float(record["memory_mb"]))
        out: dict[str, Any] = dict(self.meter.metrics(record["tokens_per_s"])) if self.meter else {}
        verdict = self.straggler.on_step(record)
        out.update(verdict)
        out.update(self.exclusion.on_straggler(verdict, int(record["step"])))  # observe.exclude: stop, requeue
        if (self._n_steps == 1 and self.sniff_cfg.at_start) or (
                self.sniff_cfg.interval and record["step"] % self.sniff_cfg.interval == 0):
            out.update(self._sniff(int(record["step"])))
        return out

    def _sniff(self, step: int) -> dict[str, Any]:
        """observe.sniff: the sniff tests on every rank; a named slow rank goes to the exclusion policy."""
        import torch.distributed as dist

        from framework.observe.sniff import sniff

        if not dist.is_initialized() or dist.get_world_size() < 3:  # two ranks cannot say which one is slow
            return {}
        rank, seconds = self.sniff_cfg.parse_inject()
        report = sniff(self.device, slow_gemm_s=seconds if rank == dist.get_rank() else 0.0)
        if dist.get_rank() == 0:
            level = logging.WARNING if report.slow else logging.INFO
            for line in report.lines():
                log.log(level, "sniff at step %d: %s", step, line)
        out: dict[str, Any] = {"sniff/slow_ranks": len(report.slow)}
        if report.slow:
            worst = report.slow[0]
            out.update({"sniff/rank": worst["rank"], "sniff/test": worst["test"], "sniff/slowdown": worst["slowdown"]})
        return out | self.exclusion.on_sniff(report.slow, self.straggler.gathered_hosts(), step)

    @staticmethod
    def eval_metrics(out: dict[str, float]) -> dict[str, float]:
        """Perplexity exp(loss) next to every validation loss (val_loss/x -> val_ppl/x)."""
        return {k.replace("val_loss/", "val_ppl/", 1): math.exp(min(v, 700.0))
                for k, v in out.items() if k.startswith("val_loss/")}

    def summary(self, step: int, final_eval: dict[str, float], checkpoint_time_s: float) -> dict[str, Any]:
        """The `summary` record of this start: final loss and eval, steady-state throughput and time breakdown."""
        out: dict[str, Any] = {"type": "summary", "step": step}
        last = self._last
        if last is not None:
            out["final_loss"] = last["loss"]
            out["tokens"] = last["tokens"]
            if self._n_steps > 1:
                n = self._n_steps - 1
                means = {key: total / n for key, total in self._sums.items()}
            else:
                means = {key: float(last[key]) for key in ("step_time_s", *BREAKDOWN)}
            out["mean_step_time_s"] = means["step_time_s"]
            out.update({f"mean_{key}": means[key] for key in BREAKDOWN})
            out["checkpoint_time_s"] = checkpoint_time_s
            tokens_per_step = last["tokens_per_s"] * last["step_time_s"]
            out["tokens_per_s"] = tokens_per_step / means["step_time_s"]
            if self.meter:
                out.update(self.meter.metrics(out["tokens_per_s"]))
            out["peak_memory_mb"] = self._peak_mb
        out.update(final_eval)
        return out
