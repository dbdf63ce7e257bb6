"""Parallel layout configuration (world = pp x dp_replicate x dp_shard x cp x tp; ep carved from data ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from framework.base.errors import ConfigError
from framework.parallel.pipeline_schedules import schedule_spec


@dataclass(kw_only=True, frozen=True)
class NVMeOffloadConfig:
    path: str = ""
    """Local directory for the optimizer-state files (a local NVMe mount); "" keeps the states in memory."""
    buffer_count: int = 4
    """Staging buffers of one group each: 1 serializes read, update and write; >= 2 overlaps them."""
    group_mb: float = 64.0
    """State bytes (exp_avg + exp_avg_sq) per group, in MiB: the unit of one read and one write."""
    overlap: bool = True
    """Read ahead and write behind on background threads; false does each group's I/O inline (for measuring)."""
    pin_memory: bool = True
    """Pin the staging buffers when parameters live on an accelerator (faster, asynchronous copies)."""

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def validate(self) -> None:
        if self.buffer_count < 1:
            raise ConfigError(f"parallel.nvme_offload.buffer_count={self.buffer_count} must be >= 1 (2+ overlaps "
                              f"I/O with the update)")
        if not self.group_mb > 0:
            raise ConfigError(f"parallel.nvme_offload.group_mb={self.group_mb} must be > 0 (MiB of state per read)")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree; must divide model.n_heads and model.n_kv_heads."""
    pp: int = 1
    """Pipeline-parallel degree (ranks along the pipeline)."""
    dp_shard: int = -1
    """ZeRO/FSDP sharding degree; -1 infers it from the world size."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (DDP, or HSDP with dp_shard > 1)."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (2 x cp load-balanced chunks);
    cp is folded into the FSDP sharding group (dp_shard x cp), so it needs zero_stage >= 1."""
    cp_comm: Literal["ring", "all_to_all", "allgather"] = "ring"
    """How attention spans the cp ranks (framework/parallel/context.py): ring (K/V blocks passed around, flash
    kernels, K/V memory T/cp), all_to_all (Ulysses: heads scattered, whole sequence per rank; n_heads / tp must
    be divisible by cp) or allgather (K/V of the whole sequence gathered, one dense mask of b x T^2/cp)."""
    ep: int = 1
    """Expert parallelism, carved out of dp_shard x tp."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """0: replicate (DDP all-reduce); 1: shard optimizer state, reduce-scatter gradients once per step;
    2: + reduce-scatter every micro-batch; 3: + parameters resharded after forward."""
    cpu_offload: bool = False
    """ZeRO-Offload: FSDP2 `CPUOffloadPolicy` (sharded parameters, gradients and the optimizer step on CPU)."""
    fsdp_layers_per_unit: int = 1
    """Transformer blocks per FSDP unit: the all-gather / reduce-scatter bucket is one unit's parameters."""
    fsdp_prefetch: int = 1
    """Units all-gathered ahead in forward and backward (FSDP2 explicit prefetching); 0 keeps FSDP2's default."""
    fsdp_mixed_precision: bool | None = None
    """All-gather parameters in train.precision's dtype (FSDP2 MixedPrecisionPolicy), reducing gradients in fp32,
    fp32 master weights kept. None (default): on for bf16 (half the ZeRO-3 all-gather bytes), off for fp16/fp32;
    false: parameters are all-gathered in fp32 and only autocast lowers the matmuls
    (framework/parallel/zero.py `fsdp_mp_policy`)."""
    sequence_parallel: bool = True
    """With tp > 1, shard norms and residuals over the sequence (Korthikanti et al. 2022)."""
    loss_parallel: bool = True
    """With tp > 1, compute cross-entropy on vocab-sharded logits without gathering them."""
    pp_schedule: str = "1F1B"
    """One of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV
    (the table in framework/parallel/pipeline_schedules.py)."""
    pp_virtual_stages: int = 0
    """Stages per pipeline rank; 0 means 1 for GPipe/1F1B and 2 for the multi-stage schedules."""
    pp_layer_split: list[int] | None = None
    """Explicit layers per stage (pp x virtual stages entries summing to model.n_layers); None splits evenly."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recomputation: full (keep only block inputs) or selective (keep matmul/attention outputs)."""
    recompute_every: int = 1
    """Recompute on every k-th block (layer index % k == 0)."""
    ddp_bucket_mb: float = 25.0
    """ZeRO-0 / DDP: MiB per all-reduce bucket over dp_replicate, each launched from backward once its gradients
    are ready (framework/parallel/ddp.py); torch DDP and Megatron use 25-40."""
    comm_log: bool = False
    """Count bytes per collective per mesh axis per step (reported in extra_metrics and by the logger)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: all-gather parameters as block-quantized int8 (one fp32 scale per `zero_quant_block_size`
    elements), dequantized into the compute dtype; fp32 master weights untouched. Takes precedence over the bf16
    all-gather of `fsdp_mixed_precision` (framework/parallel/zero.py `fsdp_mp_policy`)."""
    zero_hpz_partition_size: int = 1
    """ZeRO++ hpZ: after forward keep a secondary weight shard over groups of this many consecutive data-sharding
    ranks (dp_shard x cp; one node), so backward's all-gather stays inside them (FSDP2 reshard_after_forward=<int>).
    1: off. Also the node size of qgZ's two-hop reduce-scatter."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: reduce-scatter gradients as block-quantized int8 over all-to-all (two hops, inside then across
    nodes, when zero_hpz_partition_size > 1), summed in fp32 (FSDP2 set_custom_reduce_scatter)."""
    zero_quant_block_size: int = 256
    """Elements per quantization block of qwZ and qgZ (one fp32 scale each: 4 / block bytes of overhead)."""
    nvme_offload: NVMeOffloadConfig = field(default_factory=NVMeOffloadConfig)
    """ZeRO-Infinity: AdamW states in files on local NVMe (framework/parallel/offload.py); off while path is ""."""

    @property
    def virtual_stages(self) -> int:
        if self.pp_virtual_stages:
            return self.pp_virtual_stages
        return schedule_spec(self.pp_schedule).default_virtual()

    def validate(self) -> None:
        for name in ("tp", "pp", "dp_replicate", "cp", "ep", "recompute_every", "fsdp_layers_per_unit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 to infer from the world size")
        shape = schedule_spec(self.pp_schedule).shape  # ConfigError naming the closest schedules
        v = self.virtual_stages
        if v < 1:
            raise ConfigError(f"parallel.pp_virtual_stages={self.pp_virtual_stages} must be >= 0 (0: automatic)")
        if shape == "single" and v != 1:
            raise ConfigError(
                f"parallel.pp_virtual_stages={v} needs a multi-stage schedule; {self.pp_schedule} runs one stage "
                f"per rank: set parallel.pp_virtual_stages=1 or parallel.pp_schedule=Interleaved1F1B")
        if shape == "v" and v != 2:
            raise ConfigError(
                f"parallel.pp_virtual_stages={v}: {self.pp_schedule} places exactly 2 stages per rank (a V); "
                f"set parallel.pp_virtual_stages=2 or 0")
        if not self.ddp_bucket_mb > 0:
            raise ConfigError(f"parallel.ddp_bucket_mb={self.ddp_bucket_mb} must be > 0 (MiB per DDP all-reduce "
                              f"bucket; 25 is torch DDP's default)")
        if self.fsdp_prefetch < 0:
            raise ConfigError(f"parallel.fsdp_prefetch={self.fsdp_prefetch} must be >= 0 (0: FSDP2 default)")
        self.nvme_offload.validate()
        self._validate_zeropp()

    def _validate_zeropp(self) -> None:
        """ZeRO++ keys on their own; against the layout in `framework/parallel/mesh.py` `zeropp_layout_problem`."""
        if self.zero_quant_block_size < 8 or self.zero_quant_block_size % 4:
            raise ConfigError(f"parallel.zero_quant_block_size={self.zero_quant_block_size} must be a multiple of 4 "
                              f"and >= 8 (one fp32 scale per block; 256 costs 1.6% extra bytes)")
        if self.zero_hpz_partition_size < 1:
            raise ConfigError(f"parallel.zero_hpz_partition_size={self.zero_hpz_partition_size} must be >= 1 "
                              f"(1: off; else the ranks per node)")
        zeropp = self.zero_quantized_weights or self.zero_quantized_gradients or self.zero_hpz_partition_size > 1
        if zeropp and self.zero_stage == 0:
            raise ConfigError("ZeRO++ (parallel.zero_quantized_weights / zero_quantized_gradients / "
                              "zero_hpz_partition_size) acts on FSDP's collectives: set parallel.zero_stage >= 1")
        if self.zero_hpz_partition_size > 1 and self.zero_stage != 3:
            raise ConfigError(f"parallel.zero_hpz_partition_size={self.zero_hpz_partition_size} reshards weights "
                              f"after forward, which only ZeRO-3 does: set parallel.zero_stage=3 or the size to 1")
        if self.zero_hpz_partition_size > 1 and self.zero_quantized_weights:
            raise ConfigError(
                "parallel.zero_quantized_weights with parallel.zero_hpz_partition_size > 1 is refused: FSDP2 cannot "
                "all-gather a tensor-subclass (quantized) weight from its post-forward secondary shard (torch "
                "2.11-2.13 _fsdp_param.py all_gather_inputs raises NotImplementedError in SHARDED_POST_FORWARD); "
                "use one of them (with zero_quantized_gradients if wanted) - docs/PARALLELISM.md, ZeRO++")


def context_problem(seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> str:
    """Why `seq_len` cannot be split over `cp` (and then over `tp` by sequence parallelism); "" when it can."""
    if cp == 1:
        return ""
    unit = 2 * cp * (tp if tp > 1 and sequence_parallel else 1)
    if seq_len % unit == 0:
        return ""
    fits = sorted({seq_len - seq_len % unit, seq_len - seq_len % unit + unit} - {0})
    what = f"2 x cp = {2 * cp}" if unit == 2 * cp else f"2 x cp x tp = {unit} (sequence parallelism)"
    return (f"data.seq_len={seq_len} must be divisible by {what}: context parallelism cuts every sequence into "
            f"2 x cp load-balanced chunks; use data.seq_len={' or '.join(map(str, fits))}")


def mtp_problem(mtp_depth: int, pp: int, schedule: str = "1F1B", tied: bool = False) -> str | None:
    """Why multi-token prediction cannot run this layout, or None (under pp the last stage holds the MTP modules
    and a copy of the embedding: framework/parallel/pipeline.py; under cp the engine shifts the labels on whole
    rows before the cp cut: models/mtp.py)."""
    if mtp_depth and tied and pp > 1 and schedule_spec(schedule).split_backward:
        # The last stage's tied head doubles as the MTP modules' embedding copy. A split-backward schedule runs
        # torch's stage_backward_weight (pipelining/_backward.py), which frees each weight group's graph as it
        # goes; the tied weight's group starts at the head and reaches the embedding lookup through the MTP block
        # whose graph an earlier group already freed ("backward through the graph a second time", reproduced on
        # one process with stage_backward_input/weight). Untied models keep a separate copy and run.
        return (f"model.mtp_depth={mtp_depth} with model.tied_embeddings=true and parallel.pp={pp} under "
                f"pp_schedule={schedule} (split backward): torch's weight-gradient pass cannot reach the tied "
                f"head's second use; use a schedule without split backward (1F1B, Interleaved1F1B, GPipe), "
                f"model.tied_embeddings=false, or pp=1")
    return None
