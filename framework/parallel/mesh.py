"""The device mesh: `ParallelDims` validates a layout and lays ranks out as a pure function, then builds meshes.

world = pp x dp_replicate x dp_shard x cp x tp, row-major with tp fastest (ranks of one tensor-parallel group are
neighbours, so on GPUs they share a node's NVLink; pipeline stages are the slowest axis). Expert parallelism is
carved out of the data ranks: the flattened (dp_shard, cp, tp) ranks of one (pp, dp_replicate) slice are cut
into contiguous blocks of `ep` ranks; dense gradients reduce over all data ranks, expert gradients over the
"edp" ranks (same position inside an ep block, any block, any dp_replicate index).

Everything here except `build_mesh` / `build_ep_mesh` / `groups_created` is arithmetic: no process group is
needed to validate a layout or to know which ranks talk to which, so the layout is golden-tested at thousands of
ranks. `build_mesh` creates the process groups of a layout (the engine may add more only on the whole world).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.base.errors import ParallelismError, divisors
from framework.parallel.config import ParallelConfig

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from models.config import ModelConfig

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh axes, slowest first."""
EP_AXES: tuple[str, ...] = ("pp", "dp_replicate", "edp", "ep")
"""Axes of the expert mesh: edp = (dp_shard x cp x tp) / ep blocks."""
_EXPERT_MESH = "_tessera_expert_mesh"
"""Attribute of a mesh from `ParallelDims.build_mesh(..., experts=True)` holding its expert mesh."""
_DP_TP_GROUP = "_tessera_dp_tp_group"
"""Attribute of a mesh from `build_mesh` under FSDP x TP: the NAME of its dp_shard x tp group (a string: torch.compile
deep-copies a DTensor's mesh with its attributes, and a ProcessGroup cannot be copied)."""



def tp_problem(model: ModelConfig, tp: int, *, replicate_kv: bool = True) -> tuple[str, int] | None:
    """The first model dimension tensor parallelism of degree `tp` cannot split, as (config field, value), or
    None: the one divisibility rule the engine (`ParallelDims.validate`) and the planner (`layout_problem`) apply.

    tp shards the heads, the vocabulary and the FFN, so it must divide them; the KV heads are sharded when tp
    divides them, else (`replicate_kv`, as the engine does) replicated when tp is a multiple of them
    (framework/parallel/tensor.py). The planner's activation model still assumes sharded KV heads
    (`replicate_kv=False`).
    """
    for field, value in (("n_heads", model.n_heads), ("vocab_size", model.vocab_size), ("ffn_hidden", model.ffn)):
        if value % tp:
            return field, value
    kv = model.kv_heads
    if kv % tp and (not replicate_kv or tp % kv):
        return "n_kv_heads", kv
    return None


def valid_tp(model: ModelConfig) -> list[int]:
    """Tensor-parallel degrees `model` admits (`tp_problem` finds nothing)."""
    return [t for t in divisors(math.gcd(model.n_heads, model.vocab_size, model.ffn)) if tp_problem(model, t) is None]

@dataclass(frozen=True)
class ParallelDims:
    """A validated layout. Sizes are all resolved (no -1)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1

    # --- construction and validation ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, model: ModelConfig | None = None) -> ParallelDims:
        """Resolve `dp_shard=-1` from `world_size` and validate against the world and (optionally) the model.

        Raises:
            ParallelismError: the layout does not fit the world size or the model; the message names the fix.
        """
        fixed = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ParallelismError(
                    f"world size {world_size} is not divisible by pp x dp_replicate x cp x tp = {cfg.pp} x "
                    f"{cfg.dp_replicate} x {cfg.cp} x {cfg.tp} = {fixed}, so parallel.dp_shard=-1 cannot be "
                    f"inferred; launch a multiple of {fixed} ranks or change the degrees")
            dp_shard = world_size // fixed
        dims = cls(pp=cfg.pp, dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep)
        if dims.world_size != world_size:
            raise ParallelismError(
                f"layout pp={dims.pp} x dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} x cp={dims.cp} "
                f"x tp={dims.tp} = {dims.world_size} ranks, but the world size is {world_size}; launch "
                f"{dims.world_size} ranks or set parallel.dp_shard=-1 to infer it")
        dims.validate(cfg, model)
        return dims

    def validate(self, cfg: ParallelConfig, model: ModelConfig | None = None) -> None:
        """Check the layout against the ZeRO stage, the experts and the model shape."""
        data_tp = self.dp_shard * self.cp * self.tp
        if data_tp % self.ep:
            raise ParallelismError(
                f"parallel.ep={self.ep} must divide dp_shard x cp x tp = {data_tp} (experts are carved out of the "
                f"data and tensor ranks); valid ep: {divisors(data_tp)}")
        if cfg.zero_stage == 0 and self.dp_shard > 1:
            raise ParallelismError(
                f"parallel.zero_stage=0 (replicate only) cannot shard over parallel.dp_shard={self.dp_shard}; set "
                f"parallel.zero_stage to 1, 2 or 3, or move the data ranks to parallel.dp_replicate")
        if self.cp > 1:
            self._validate_context(cfg, model)
        if cfg.cpu_offload and self.dp_shard == 1:
            raise ParallelismError(
                "parallel.cpu_offload=true needs FSDP sharding (parallel.dp_shard > 1); raise dp_shard or disable it")
        if problem := zeropp_layout_problem(cfg, self):
            raise ParallelismError(problem)
        if model is not None:
            self._validate_model(cfg, model)

    def _validate_context(self, cfg: ParallelConfig, model: ModelConfig | None) -> None:
        """Combinations context parallelism is not proven with (tests/parallel/test_context.py) are refused."""
        if cfg.zero_stage == 0:
            raise ParallelismError(
                f"parallel.cp={self.cp} folds cp into the FSDP sharding group (dp_shard x cp), but "
                f"parallel.zero_stage=0 does not shard; set parallel.zero_stage to 1, 2 or 3")
        if cfg.cpu_offload:
            raise ParallelismError(
                f"parallel.cp={self.cp} with parallel.cpu_offload=true is not supported (not checked against one "
                f"process); set parallel.cpu_offload=false or parallel.cp=1")
        if model is not None and cfg.cp_comm == "all_to_all" and (model.n_heads // self.tp) % self.cp:
            raise ParallelismError(
                f"parallel.cp_comm=all_to_all scatters each rank's n_heads / tp = {model.n_heads} / {self.tp} query "
                f"heads over cp={self.cp}, which does not divide them; use parallel.cp_comm=ring or a cp dividing "
                f"{model.n_heads // self.tp}")
        if model is not None and model.moe.enabled:
            raise ParallelismError(
                f"parallel.cp={self.cp} with a mixture-of-experts model (model.moe.n_experts="
                f"{model.moe.n_experts}) is not supported: routing statistics and the auxiliary losses would be "
                f"computed per cp shard; set parallel.cp=1 for MoE models")

    def _validate_model(self, cfg: ParallelConfig, model: ModelConfig) -> None:
        problem = tp_problem(model, self.tp)
        if problem is not None and problem[0] != "n_kv_heads":
            raise ParallelismError(
                f"parallel.tp={self.tp} must divide model.{problem[0]}={problem[1]} (tensor parallelism shards it); "
                f"valid tp for this model: {valid_tp(model)}")
        if problem is not None:
            raise ParallelismError(
                f"parallel.tp={self.tp} and model.n_kv_heads={model.kv_heads}: tp must divide the KV heads (shard "
                f"them) or be a multiple of them (replicate each over tp / n_kv_heads ranks); valid tp for this "
                f"model: {valid_tp(model)}")
        stages = self.pp * cfg.virtual_stages
        if cfg.pp_layer_split is not None:
            split = list(cfg.pp_layer_split)
            if len(split) != stages or sum(split) != model.n_layers or min(split) < 1:
                raise ParallelismError(
                    f"parallel.pp_layer_split={split} must have pp x virtual stages = {stages} entries, each >= 1, "
                    f"summing to model.n_layers={model.n_layers}; e.g. {even_split(model.n_layers, stages)}")
        else:
            if self.pp > model.n_layers:
                raise ParallelismError(
                    f"parallel.pp={self.pp} is larger than model.n_layers={model.n_layers}: every stage needs a "
                    f"layer; set parallel.pp <= {model.n_layers}")
            if model.n_layers % stages:
                raise ParallelismError(
                    f"pp x virtual stages = {self.pp} x {cfg.virtual_stages} = {stages} stages do not divide "
                    f"model.n_layers={model.n_layers}; choose virtual stages so that pp x v divides "
                    f"{model.n_layers}, or give parallel.pp_layer_split explicitly")
        if self.ep > 1:
            if not model.moe.enabled:
                raise ParallelismError(f"parallel.ep={self.ep} needs a mixture-of-experts model (model.moe.n_experts"
                                       f" > 0); set parallel.ep=1 for a dense model")
            if model.moe.n_experts % self.ep:
                raise ParallelismError(
                    f"parallel.ep={self.ep} must divide model.moe.n_experts={model.moe.n_experts}; valid ep: "
                    f"{[d for d in divisors(model.moe.n_experts) if (self.dp_shard * self.cp * self.tp) % d == 0]}")

    # --- sizes -----------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks that read different data (the loader's dp_size)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks one FSDP shard group spans: dp_shard x cp (cp folded in, as torchtitan's dp_shard_cp)."""
        return self.dp_shard * self.cp

    @property
    def edp_size(self) -> int:
        """Ranks over which expert gradients are reduced."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp // self.ep

    def size(self, axis: str) -> int:
        return self.shape[AXES.index(axis)]

    # --- the rank layout (pure) -------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of `rank` by axis name."""
        if not 0 <= rank < self.world_size:
            raise ParallelismError(f"rank {rank} is outside the world of {self.world_size} ranks")
        out: dict[str, int] = {}
        for axis, n in zip(reversed(AXES), reversed(self.shape)):
            out[axis] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes are 0)."""
        rank = 0
        for axis, n in zip(AXES, self.shape):
            rank = rank * n + coords.get(axis, 0)
        return rank

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def groups(self, axes: str | Sequence[str]) -> list[list[int]]:
        """Every group of ranks that differ only along `axes` (one group per fixed value of the other axes)."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ParallelismError(f"unknown mesh axes {unknown}; axes are {AXES}")
        others = [a for a in AXES if a not in axes]
        out = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            base = dict(zip(others, fixed))
            members = []
            for var in itertools.product(*(range(self.size(a)) for a in AXES if a in axes)):
                members.append(self.rank_of(**base, **dict(zip([a for a in AXES if a in axes], var))))
            out.append(sorted(members))
        return sorted(out)

    def group_of(self, rank: int, axes: str | Sequence[str]) -> list[int]:
        """The ranks that share every coordinate with `rank` except along `axes`."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        c = self.coords(rank)
        ranges = [range(self.size(a)) if a in axes else [c[a]] for a in AXES]
        return sorted(self.rank_of(**dict(zip(AXES, combo))) for combo in itertools.product(*ranges))

    def ep_layout(self) -> list[list[list[list[int]]]]:
        """Ranks as a nested list [pp][dp_replicate][edp][ep] (contiguous blocks of the flattened data x tp)."""
        block = self.dp_shard * self.cp * self.tp
        out = []
        for p in range(self.pp):
            per_rep = []
            for r in range(self.dp_replicate):
                start = self.rank_of(pp=p, dp_replicate=r)
                flat = list(range(start, start + block))
                per_rep.append([flat[i:i + self.ep] for i in range(0, block, self.ep)])
            out.append(per_rep)
        return out

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups: each holds all experts between its ranks."""
        return sorted(g for p in self.ep_layout() for r in p for g in r)

    def edp_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups: the ranks holding the same experts (reduce expert gradients over them)."""
        out = []
        for per_rep in self.ep_layout():
            for pos in range(self.ep):
                out.append(sorted(g[pos] for rep in per_rep for g in rep))
        return sorted(out)

    # --- process groups ---------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str, ranks: torch.Tensor | None = None, *, experts: bool = False
                   ) -> DeviceMesh:
        """The 5-axis `DeviceMesh` over the world, or over `ranks` (a sub-world); with `experts` (an MoE model)
        also its expert mesh (`build_ep_mesh`). Every rank of the world must call this, in the same order.

        With cp > 1 the mesh is unflattened from a root whose third axis is dp_shard x cp ("dp_shard_cp"), so
        FSDP's shard mesh (framework/parallel/zero.py: `fsdp_mesh`) and the tp mesh share one root, as FSDP + TP
        requires, and the flattened group is created collectively with the others (also on a sub-world).

        All of a layout's process groups are created here, none later by the engine: torch names a group by a
        per-process counter and ranks rendezvous under that name, so a group created only by a sub-world's ranks
        shifts their names against every other rank's, and two sub-worlds that each create "their" group at once
        create one name with two member sets — gloo then wires ranks of different groups together (a collective
        deadlock or a silent cross-group sum; a compiled-layouts spawn once hung this way on two MoE layouts).
        """
        mesh = self._build_mesh(device_type, ranks)
        if experts:
            setattr(mesh, _EXPERT_MESH, self._build_expert_mesh(mesh))
        if self.tp > 1 and self.fsdp_size > 1:
            group = self._build_dp_tp_group(mesh)
            setattr(mesh, _DP_TP_GROUP, None if group is None else group.group_name)
        return mesh

    def _build_dp_tp_group(self, mesh: DeviceMesh) -> Any:
        """This rank's group of the (dp_shard, cp, tp) ranks of its (pp, dp_replicate) slice, one group per slice,
        created by every rank of the world (`build_mesh`): Muon's owner exchange under FSDP x TP sends each
        matrix's pieces to one owner among them (framework/parallel/whole_matrix.py)."""
        import torch.distributed as dist

        mine = None
        for ranks in mesh.mesh.reshape(self.pp * self.dp_replicate, -1).tolist():
            group = dist.new_group(ranks)
            mine = group if dist.get_rank() in ranks else mine
        return mine

    def _build_mesh(self, device_type: str, ranks: torch.Tensor | None) -> DeviceMesh:
        import torch
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if ranks is None and self.cp == 1:
            return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)
        ranks = torch.arange(self.world_size) if ranks is None else ranks
        if self.cp == 1:
            return DeviceMesh(device_type, ranks.reshape(self.shape), mesh_dim_names=AXES)
        root = DeviceMesh(device_type, ranks.reshape(self.pp, self.dp_replicate, self.fsdp_size, self.tp),
                          mesh_dim_names=("pp", "dp_replicate", "dp_shard_cp", "tp"))
        return root._unflatten(2, (self.dp_shard, self.cp), ("dp_shard", "cp"))

    def build_ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The expert mesh (pp, dp_replicate, edp, ep) over the ranks of `mesh` (this layout's 5-axis mesh, from
        `build_mesh`); sub-meshes `["ep"]`, `["edp"]`.

        ep blocks are contiguous in the flattened (dp_shard, cp, tp) ranks, so the expert mesh is a reshape of
        the same rank tensor (equal to `ep_layout()`). It is the one `build_mesh(..., experts=True)` created
        with `mesh`; only a mesh over the whole world may have it created now (every rank calls this then).

        Raises:
            ParallelismError: `mesh` is a sub-world mesh built without `experts=True` (creating its groups now,
                on its ranks only, would desynchronize process-group names across the world).
        """
        import torch.distributed as dist

        built: DeviceMesh | None = getattr(mesh, _EXPERT_MESH, None)
        if built is not None:
            return built
        if mesh.size() != dist.get_world_size():
            raise ParallelismError(
                f"the expert mesh of a sub-world mesh ({mesh.size()} of {dist.get_world_size()} ranks) must be "
                f"created with it, by every rank: build the mesh with ParallelDims.build_mesh(..., experts=True)")
        built = self._build_expert_mesh(mesh)
        setattr(mesh, _EXPERT_MESH, built)  # once per mesh; the communication logger names its groups from it
        return built

    def _build_expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        from torch.distributed.device_mesh import DeviceMesh

        ranks = mesh.mesh.reshape(self.pp, self.dp_replicate, -1, self.ep)
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=EP_AXES)


def dp_tp_group(mesh: DeviceMesh) -> Any:
    """The (dp_shard, cp, tp) group `build_mesh` created for FSDP x TP, else None."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = getattr(mesh, _DP_TP_GROUP, None)
    return None if name is None else _resolve_process_group(name)


def groups_created() -> int:
    """Process groups this process has created so far (torch's per-process counter that names them).

    Equal on every rank of the world whenever all ranks created the same groups in the same order: what
    `build_mesh` requires. A sub-world's code that changes it on its own ranks breaks that (see `build_mesh`).
    """
    from torch.distributed import distributed_c10d

    return int(distributed_c10d._world.group_count)


def even_split(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def stage_layers(n_layers: int, stages: int, split: Sequence[int] | None = None) -> list[list[int]]:
    """Layer indices of every pipeline stage, in stage order."""
    counts = list(split) if split is not None else even_split(n_layers, stages)
    bounds = list(itertools.accumulate(counts, initial=0))
    return [list(range(bounds[i], bounds[i + 1])) for i in range(stages)]


def zeropp_compile_problem(cfg: ParallelConfig, compile: bool) -> str:
    """Why qwZ cannot run with `train.compile` ("" when it can); checked at config load (framework/config)."""
    if compile and cfg.zero_quantized_weights:
        return ("parallel.zero_quantized_weights with train.compile=true is not proven: the blocks are compiled "
                "before fully_shard wraps their weights as QuantizedAllGatherWeight, and no compiled-vs-eager parity "
                "case covers the dequantized gather (tests/parallel/test_compile.py has none); set "
                "train.compile=false, or drop qwZ (zero_quantized_gradients runs outside the compiled blocks "
                "but is unproven with compile too)")
    return ""


def zeropp_layout_problem(cfg: ParallelConfig, dims: ParallelDims) -> str:
    """Why the ZeRO++ keys cannot run on this layout ("" when they can); checked with the layout, before launch
    (`ParallelDims.validate`; the ZeRO++ options themselves are applied in framework/parallel/zero.py)."""
    on = cfg.zero_quantized_weights or cfg.zero_quantized_gradients or cfg.zero_hpz_partition_size > 1
    if not on:
        return ""
    shard = dims.dp_shard * dims.cp
    if shard == 1:
        return "ZeRO++ compresses FSDP's collectives and needs dp_shard x cp > 1"
    if cfg.cpu_offload or dims.pp > 1 or (cfg.zero_quantized_weights and cfg.nvme_offload.enabled):
        return ("ZeRO++ is not proven with parallel.cpu_offload, pp > 1, or qwZ with parallel.nvme_offload "
                f"(got cpu_offload={cfg.cpu_offload}, pp={dims.pp}, nvme_offload={cfg.nvme_offload.enabled}); "
                "drop one of them")
    if dims.tp > 1 or dims.ep > 1:
        # FSDP2 refuses to reshard DTensor (tp) parameters to a smaller mesh; the quantized paths are checked
        # against the plain one on dense, tp=1 layouts only (tests/parallel/test_zeropp.py).
        return f"ZeRO++ is proven on tp=1 dense layouts only (got tp={dims.tp}, ep={dims.ep})"
    import torch
    from torch.distributed.fsdp import FSDPModule

    if cfg.zero_quantized_gradients and not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        return f"parallel.zero_quantized_gradients needs FSDP2's set_custom_reduce_scatter (torch {torch.__version__})"
    s = cfg.zero_hpz_partition_size
    if s > 1 and (shard % s or s == shard):
        return (f"parallel.zero_hpz_partition_size={s} must divide the data-sharding group dp_shard x cp = {shard} "
                f"and be smaller than it (valid: {[d for d in range(2, shard) if shard % d == 0] or 'none'})")
    return ""
