"""Observability configuration (`cfg.observe`): extra metric sinks, MFU accounting and the preflight ladder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from framework.base.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class WandbConfig:
    """Weights & Biases sink. Offline unless the user asks for online explicitly.

    The API key is never a config field: wandb reads it from WANDB_API_KEY or ~/.netrc itself, so it is never in
    config.yaml, metrics.jsonl, the log or the wandb run files Tessera writes.
    """

    enabled: bool = False
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline writes run files under the run directory (sync later with `wandb sync`); online needs a project."""
    project: str | None = None
    """wandb project; None means 'tessera'. Required for mode=online."""
    entity: str | None = None
    group: str | None = None
    """Groups runs in the UI (ablations set it to the sweep name)."""
    tags: list[str] = field(default_factory=list)
    dir: str | None = None
    """Where the `wandb/` folder goes; None means inside the run directory."""

    def validate(self) -> None:
        if self.enabled and self.mode == "online" and not self.project:
            raise ConfigError(
                "observe.wandb.mode='online' needs observe.wandb.project; set observe.wandb.project=<name> or keep "
                "observe.wandb.mode=offline (sync later with `wandb sync`)")


@dataclass(kw_only=True, frozen=True)
class PreflightConfig:
    """Budgets and thresholds of `tessera preflight` (see framework/drivers/preflight.py)."""

    overfit_steps: int = 60
    """Stage 1: optimizer steps on one sample."""
    overfit_lr: float = 3e-3
    """Stage 1 learning rate (constant): the stage asks whether the model can memorize, not whether train.lr is
    good — stage 2 checks the configured optimizer settings."""
    overfit_loss: float = 0.5
    """Stage 1 passes when the final loss on the sample is below this (nats/token)."""
    batch_steps: int = 20
    """Stage 2: steps on one small fixed batch with the run's optimizer settings and compressed LR schedule."""
    batch_sequences: int = 4
    min_loss_drop: float = 0.1
    """Stage 2 passes when the last loss is at least this fraction below the first (and all values finite)."""
    full_steps: int = 6
    """Stage 3: steps of a real Trainer run on a small dataset; it checkpoints at the end and reloads."""
    disk_headroom: float = 2.0
    """Free space needed on the checkpoint filesystem, as a multiple of the estimated checkpoint size."""
    layout_rtol: float = 1e-2
    """Stage 4 passes when every loss of the configured layout is within this relative distance of stage 3's
    single-process loss (fp32 TP/PP/DP agree to ~1e-6; bf16 reductions in another order drift further)."""

    def validate(self) -> None:
        for name in ("overfit_steps", "batch_steps", "batch_sequences", "full_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"observe.preflight.{name}={getattr(self, name)} must be >= 1")
        if self.overfit_lr <= 0 or self.overfit_loss <= 0:
            raise ConfigError(f"observe.preflight.overfit_lr={self.overfit_lr} and overfit_loss="
                              f"{self.overfit_loss} must be > 0; e.g. 3e-3 and 0.5")
        if not 0 <= self.min_loss_drop < 1:
            raise ConfigError(f"observe.preflight.min_loss_drop={self.min_loss_drop} must be in [0, 1); e.g. 0.1")
        if not self.layout_rtol > 0:
            raise ConfigError(f"observe.preflight.layout_rtol={self.layout_rtol} must be > 0; e.g. 1e-2")
        if self.disk_headroom < 1:
            raise ConfigError(f"observe.preflight.disk_headroom={self.disk_headroom} must be >= 1; e.g. 2")


@dataclass(kw_only=True, frozen=True)
class StragglerConfig:
    """Per-rank step sections and the slow-rank detector (framework/observe/straggler.py)."""

    enabled: bool = True
    interval: int = 10
    """Steps per window: the per-rank section means are all-gathered once per window (one small collective)."""
    threshold: float = 6.0
    """Robust z-score ((x - median) / (1.4826 MAD) over the ranks) above which a rank is slow in a window."""
    min_ratio: float = 1.3
    """...and its section time must be at least this multiple of the median."""
    persist: int = 3
    """Windows in a row the same rank and section must be slow before it is named."""
    inject: str = ""
    """Fault injection for tests and drills: "RANK:SECTION:SECONDS" sleeps that long in that section
    (forward, backward or optimizer) of that rank every step; empty: none."""

    def parse_inject(self) -> tuple[int, str, float] | None:
        if not self.inject:
            return None
        rank, section, seconds = self.inject.split(":")
        return int(rank), section, float(seconds)

    def validate(self) -> None:
        if self.interval < 1 or self.persist < 1 or self.threshold <= 0 or self.min_ratio < 1:
            raise ConfigError(f"observe.straggler: interval={self.interval} and persist={self.persist} must be >= 1, "
                              f"threshold={self.threshold} > 0 and min_ratio={self.min_ratio} >= 1; e.g. 10, 3, 6, 1.3")
        if self.inject:
            parts = self.inject.split(":")
            ok = len(parts) == 3 and parts[0].isdigit() and parts[1] in ("forward", "backward", "optimizer")
            try:
                ok = ok and float(parts[2]) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"observe.straggler.inject={self.inject!r} must read RANK:SECTION:SECONDS with "
                                  f"SECTION forward, backward or optimizer; e.g. '2:forward:0.05'")


@dataclass(kw_only=True, frozen=True)
class SniffConfig:
    """Sniff tests inside a training run (framework/observe/sniff.py): GEMM, P2P, all-reduce, all-to-all on every
    rank at once, each rank against its peers; a named slow rank confirms its node for observe.exclude."""

    at_start: bool = False
    """Run them at the first step of every start (the preflight of each job and requeue)."""
    interval: int = 0
    """And every this many steps (0: never); each run costs a few ms per test on a GPU, seconds on gloo."""
    inject: str = ""
    """Fault injection for tests and drills: "RANK:gemm:SECONDS" sleeps that long in each GEMM call of that rank
    (the straggler's RANK:SECTION:SECONDS form; a bare 1:0.03 would read as a YAML sexagesimal number)."""

    def parse_inject(self) -> tuple[int, float]:
        rank, _, seconds = self.inject.split(":") if self.inject else ("-1", "gemm", "0")
        return int(rank), float(seconds)

    def validate(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"observe.sniff.interval={self.interval} must be >= 0 (0: never); e.g. 1000")
        try:
            rank, seconds = self.parse_inject()
            ok = not self.inject or (rank >= 0 and seconds >= 0 and self.inject.split(":")[1] == "gemm")
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"observe.sniff.inject={self.inject!r} must read RANK:gemm:SECONDS; e.g. 1:gemm:0.03")


@dataclass(kw_only=True, frozen=True)
class ExcludeConfig:
    """Exclude a confirmed bad node and requeue (framework/observe/exclusion.py, launch/exclude.py)."""

    enabled: bool = False
    """On a confirmed bad node: commit a checkpoint, write the node with its evidence into <run>/exclude.json and
    exit with checkpoint.requeue_exit_code; the `launch slurm` script requeues the job with every node of that
    file in its ExcNodeList. Off: the verdicts are only logged."""
    windows: int = 3
    """A straggler (observe.straggler) confirms a node once named for this many windows in a row."""
    min_slowdown: float = 1.5
    """...and at least this many times the median of its peers in its section."""
    sniff: bool = True
    """A rank named slow by the sniff tests (observe.sniff) confirms its node."""
    max_nodes: int = 1
    """At most this many nodes excluded by the policy over the run (manual entries do not count): a slowdown
    that moves from node to node is not one bad node. Past it the verdict is logged and the run goes on."""
    shrink: bool = False
    """Requeue with one node fewer per excluded node of the allocation (a cluster without spare nodes); the
    layout must fit the smaller world (`launch slurm` checks it). Off: the job keeps its node count and SLURM
    picks replacement nodes."""

    def validate(self) -> None:
        if self.windows < 1 or self.max_nodes < 1 or self.min_slowdown < 1:
            raise ConfigError(f"observe.exclude: windows={self.windows} and max_nodes={self.max_nodes} must be >= 1 "
                              f"and min_slowdown={self.min_slowdown} >= 1; e.g. 3, 1, 1.5")


@dataclass(kw_only=True, frozen=True)
class ObserveConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = False
    """Also write TensorBoard event files to <run dir>/tensorboard (needs the `tensorboard` package)."""
    mfu: bool = True
    """Add per-device throughput, MFU and HFU to every train record."""
    accelerator: str = "auto"
    """Row of the peak-FLOPs table (a100, h100, h100-nvl, h100-pcie, h200, h200-nvl, cpu); auto detects it from
    the device name (an unknown GPU: a warning and no MFU)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device, overriding the table (and the CPU measurement)."""
    mfu_peak: Literal["auto", "bf16", "fp8"] = "auto"
    """Which peak MFU divides by: the dense bf16 or FP8 one of the accelerator (auto: fp8 when train.fp8.enabled).
    Every record states it (`mfu_peak`, `peak_tflops`)."""
    recompute: bool = False
    """Count full activation recomputation in HFU even when parallel.recompute does not say so (an engine that
    recomputes on its own); otherwise HFU follows parallel.recompute and parallel.recompute_every."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    sniff: SniffConfig = field(default_factory=SniffConfig)
    exclude: ExcludeConfig = field(default_factory=ExcludeConfig)

    def validate(self) -> None:
        from framework.observe.mfu import PEAK_TFLOPS

        known = ("auto", "cpu", *PEAK_TFLOPS)
        if self.accelerator not in known:
            raise ConfigError(f"observe.accelerator={self.accelerator!r} is not known; use one of {', '.join(known)}"
                              f" or set observe.peak_tflops")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"observe.peak_tflops={self.peak_tflops} must be > 0 (TFLOP/s per device) or null")
