"""What the planner reasons about: a workload (model, sequence, batch, dtypes) and a candidate layout.

`layout_problem` states, as one sentence, why a layout cannot run at all (divisibility, node size, batch);
memory is checked afterwards by `framework.plan.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from framework.parallel.mesh import tp_problem
from framework.parallel.pipeline_schedules import schedule_micro_batch_problem, schedule_spec
from framework.plan.activations import AttnKernel, Recompute
from framework.plan.hardware import Hardware
from models.config import ModelConfig


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each model state and of activations."""

    param: int = 2
    """Compute copy of the parameters (bf16)."""
    master: int = 4
    """fp32 master copy, when params are 16-bit (0 when training in fp32)."""
    grad: int = 4
    """Gradient accumulation and reduction dtype (fp32, as Megatron's main_grad and FSDP reduce_dtype)."""
    optimizer: int = 8
    """AdamW exp_avg + exp_avg_sq in fp32."""
    act: int = 2

    @classmethod
    def named(cls, name: str) -> Precision:
        """"bf16" (mixed precision with fp32 master, gradients and states) or "fp32"."""
        if name == "fp32":
            return cls(param=4, master=0, grad=4, optimizer=8, act=4)
        return cls()


@dataclass(frozen=True)
class Workload:
    """The model and batch being planned."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    precision: Precision = Precision()
    kernel: AttnKernel = "flash"
    activations: Literal["tessera", "korthikanti"] = "tessera"
    """Activation model: Tessera's own block, or Korthikanti et al. 2022 (how Megatron-LM runs a GPT block)."""
    cp_comm: Literal["ring", "all_to_all", "allgather"] = "ring"
    """parallel.cp_comm: what a cp rank keeps for backward (framework/plan/memory.py, `cp_kv_bytes`)."""
    fp8_all_gather: bool = False
    """train.fp8 with fsdp_all_gather: ZeRO-3 gathers the block linears' weights in FP8, 1 byte per element
    (`fp8_linear_params`), the rest in `precision.param`."""
    moe_imbalance: float = 1.25
    """MoE: tokens routed to the busiest expert-parallel rank over the mean. Dropless routing under a balancing
    loss is uneven (Switch Transformer trains with capacity factor 1.25 for it, Fedus et al. 2021); that rank's
    expert matmuls and all-to-all set the pace of every rank."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """train.optimizer: under Muon the hidden matrices keep one fp32 momentum instead of AdamW's two moments, and
    each step adds the owner exchange and Newton-Schulz (framework/plan/muon.py)."""
    muon_ns_bytes: int = 2
    """Bytes per element of Muon's Newton-Schulz iteration (train.muon.ns_dtype: bf16 2, fp32 4)."""
    muon_overlap: bool = True
    """train.muon.overlap: the owner exchange leaves from backward where the layout allows (framework/plan/muon.py
    `overlapped`)."""


@dataclass(frozen=True)
class Layout:
    """One candidate: parallel degrees, ZeRO stage, recompute, micro-batch size and pipeline schedule."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (framework/parallel/context.py); cp is folded into
    the ZeRO sharding group, so model states and data-parallel traffic run over dp x cp ranks."""
    zero_stage: int = 1
    recompute: Recompute = "none"
    micro_batch: int = 1
    schedule: str = "1F1B"
    virtual: int = 1
    """Chunks (virtual stages) per pipeline rank."""
    prefetch: int = 1
    """FSDP units all-gathered ahead (parallel.fsdp_prefetch); 0: every ZeRO-3 gather waits in front of compute."""
    nvme_offload: bool = False
    """AdamW states on local NVMe (parallel.nvme_offload): off the GPU, streamed through host buffers each step."""
    qwz: bool = False
    """ZeRO++ int8 weight all-gathers (parallel.zero_quantized_weights), dense parameters."""
    hpz: int = 1
    """ZeRO++ secondary weight shard over this many consecutive shard ranks (parallel.zero_hpz_partition_size):
    ZeRO-3's backward all-gathers stay inside them. 1: off."""
    qgz: bool = False
    """ZeRO++ int8 all-to-all gradient reduce-scatter (parallel.zero_quantized_gradients), two hops with hpz."""
    layer_split: tuple[int, ...] | None = None
    """Layers of each pipeline chunk (parallel.pp_layer_split); None: n_layers // (pp x virtual) each."""

    @property
    def sp(self) -> bool:
        """Sequence parallelism is always on under TP (Tessera keeps SP on; docs/ARCHITECTURE.md, known torch traps)."""
        return self.tp > 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks that shard (ZeRO) and reduce the dense gradients: dp x cp."""
        return self.dp * self.cp

    def n_micro(self, global_batch: int) -> int:
        """Micro-batches per step (pipeline micro-batches = gradient-accumulation steps)."""
        return global_batch // (self.dp * self.micro_batch)

    def key(self) -> tuple[int, int, int, int]:
        """(tp, pp, ep, cp): what makes two layouts distinct for `--top`."""
        return (self.tp, self.pp, self.ep, self.cp)

    def describe(self) -> str:
        """'TP8 PP6 DP48 ZeRO-1 rc=none mbs=1 Interleaved1F1B v2'."""
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1 else "")
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        return (f"TP{self.tp}{cp} PP{self.pp} DP{self.dp}" + (f" EP{self.ep}" if self.ep > 1 else "")
                + f" ZeRO-{self.zero_stage}" + (" nvme" if self.nvme_offload else "")
                + (f" prefetch{self.prefetch}" if self.prefetch != 1 else "")
                + f" rc={self.recompute} mbs={self.micro_batch}{sched}")


def layout_problem(work: Workload, lay: Layout, hw: Hardware) -> str | None:
    """Why `lay` cannot run `work` on `hw` at all, or None (memory is checked separately)."""
    cfg = work.model
    t, p = lay.tp, lay.pp
    if t > hw.gpus_per_node:
        return f"tp={t} exceeds the {hw.gpus_per_node} GPUs of a node (TP must stay on NVLink)"
    problem = tp_problem(cfg, t, replicate_kv=False)  # the engine's rule (framework/parallel/mesh.py)
    if problem is not None:
        return f"tp={t} does not divide model.{problem[0]}={problem[1]}"
    if lay.sp and work.seq_len % t:
        return f"tp={t} does not divide seq_len={work.seq_len} (sequence parallel)"
    if lay.cp > 1:
        unit = 2 * lay.cp * (t if lay.sp else 1)
        if work.seq_len % unit:
            return f"cp={lay.cp} needs seq_len={work.seq_len} divisible by 2 x cp (x tp) = {unit}"
        if cfg.moe.enabled:
            return f"cp={lay.cp} is not supported with MoE models (the engine refuses it)"
        if lay.zero_stage == 0:
            return f"cp={lay.cp} folds cp into the ZeRO sharding group; zero_stage=0 does not shard"
    shape = schedule_spec(lay.schedule).shape
    if shape == "v" and lay.virtual != 2:
        return f"{lay.schedule} runs exactly 2 chunks per rank (virtual=2), not {lay.virtual}"
    if shape == "single" and lay.virtual != 1:
        return f"{lay.schedule} runs one chunk per rank (virtual=1), not {lay.virtual}"
    if p > cfg.n_layers or cfg.n_layers % (p * lay.virtual):
        return f"pp={p} x virtual={lay.virtual} does not divide n_layers={cfg.n_layers}"
    if lay.ep > 1:
        if not cfg.moe.enabled or cfg.moe.n_experts % lay.ep:
            return f"ep={lay.ep} does not divide n_experts={cfg.moe.n_experts}"
        if (lay.dp * t) % lay.ep:
            return f"ep={lay.ep} does not divide dp x tp = {lay.dp * t}"
    if work.global_batch % (lay.dp * lay.micro_batch):
        return (f"global batch {work.global_batch} is not a multiple of dp x micro-batch = "
                f"{lay.dp} x {lay.micro_batch}")
    m = lay.n_micro(work.global_batch)
    if p > 1:
        return schedule_micro_batch_problem(lay.schedule, p, m) or None  # the engine's own pre-launch check
    return None


__all__ = ["Layout", "Precision", "Workload", "layout_problem"]
