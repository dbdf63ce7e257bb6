"""ZeRO++ (Wang et al. 2023) communication quantization on FSDP2's own extension points, not a second engine.

qwZ: each sharded fp32 master weight is a `QuantizedAllGatherWeight`, a tensor subclass whose
`fsdp_pre_all_gather` hands FSDP2 one int8 buffer per shard, [int8 values | fp32 per-block scales as bytes], and
whose `fsdp_post_all_gather` dequantizes the gathered buffer into the compute dtype. The optimizer steps the fp32
shard itself (every op but FSDP's sharding ops unwraps to the plain fp32 tensor), so master weights are untouched.
qgZ: `QuantizedReduceScatter`, set with `FSDPModule.set_custom_reduce_scatter`: gradients are block-quantized to
int8 and exchanged with all-to-all (each rank sums, in fp32, the dequantized chunks it receives), in one hop or, as
ZeRO++ does, two: inside the node first, then across nodes on the node-reduced (1/node-size) volume.

Block quantization is symmetric absmax per `block` consecutive elements of the flattened tensor: a scale
s = max|x| / 127 (fp32), q = round(x / s) in [-127, 127]; the last block of a tensor may be shorter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

_QMAX = 127.0


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_numel(numel: int, block: int) -> int:
    """Bytes of one quantized tensor of `numel` elements: an int8 each, plus one fp32 scale per block."""
    return numel + 4 * n_blocks(numel, block)


def quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """Rows of `x` (2-D, or 1-D as one row) to int8 [values | scales as 4 bytes each], one packed row per row."""
    rows = x.reshape(1, -1) if x.dim() == 1 else x
    r, n = rows.shape
    nb = n_blocks(n, block)
    padded = torch.nn.functional.pad(rows.float(), (0, nb * block - n)).view(r, nb, block)
    scale = padded.abs().amax(dim=-1, keepdim=True).div_(_QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.round(padded / scale).clamp_(-_QMAX, _QMAX).to(torch.int8).view(r, nb * block)[:, :n]
    return torch.cat([q, scale.view(r, nb).view(torch.int8)], dim=1)


def dequantize(packed: torch.Tensor, n: int, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: packed int8 rows [r, packed_numel(n)] to [r, n] in `dtype`."""
    rows = packed.reshape(1, -1) if packed.dim() == 1 else packed
    r = rows.shape[0]
    nb = n_blocks(n, block)
    scale = rows[:, n:].contiguous().view(torch.float32).view(r, nb, 1)
    q = torch.nn.functional.pad(rows[:, :n].float(), (0, nb * block - n)).view(r, nb, block)
    return (q * scale).view(r, nb * block)[:, :n].to(dtype)


# Ops FSDP2 runs on a parameter while sharding it and moving shards, and `to_empty`'s allocation of a meta-built
# shard (parallelize wraps the meta weights): their results stay quantized-all-gather weights.
_PRESERVE = {
    torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.clone.default, torch.ops.aten.detach.default,
    torch.ops.aten.alias.default, torch.ops.aten.empty_like.default,
}


class QuantizedAllGatherWeight(torch.Tensor):
    """An fp32 (master) weight that FSDP2 all-gathers as block-quantized int8 (qwZ).

    Arithmetic on it (the optimizer step, clipping, checkpoint copies) runs on the plain inner tensor; FSDP2's
    sharding ops keep the wrapper so its sharded DTensor's local tensor still carries the all-gather hooks.
    """

    _inner: torch.Tensor
    block: int

    @staticmethod
    def __new__(cls, inner: torch.Tensor, block: int) -> QuantizedAllGatherWeight:
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=inner.device, requires_grad=inner.requires_grad)
        t._inner = inner
        t.block = block
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"QuantizedAllGatherWeight(block={self.block}, {self._inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        block = next(a.block for a in _flat(args, kwargs) if isinstance(a, QuantizedAllGatherWeight))
        unwrap = tree_map_only(QuantizedAllGatherWeight, lambda t: t._inner, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor, lambda t: cls(t, block), out)
        if func._schema.is_mutable and args and isinstance(args[0], QuantizedAllGatherWeight):
            return args[0]  # in place: the inner tensor changed, the wrapper is still the parameter
        return out

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, int]]:
        return ["_inner"], {"block": self.block}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, int], *_: Any) -> Any:
        return QuantizedAllGatherWeight(inner["_inner"], meta["block"])

    # --- FSDP2 all-gather extension (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) ------------------------
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: MixedPrecisionPolicy
                            ) -> tuple[tuple[torch.Tensor, ...], Any]:
        shard = self._inner.detach().reshape(-1)
        return (quantize(shard, self.block).view(-1),), (shard.numel(),)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (gathered,), (n,) = all_gather_outputs, metadata
        world = gathered.numel() // packed_numel(n, self.block)
        full = dequantize(gathered.view(world, -1), n, self.block, param_dtype).reshape(-1)  # fp32: a slice
        if out is not None:  # a re-gather (ZeRO-3 backward) into the parameter autograd saved: FSDP2's own copy-out
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.view(-1).copy_(full)
            return None
        return full, (full,)


def _flat(args: Any, kwargs: Any) -> list[Any]:
    flat: list[Any] = []
    for a in (*args, *(kwargs or {}).values()):
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def quantizable(p: nn.Parameter, shard_size: int) -> bool:
    """FSDP2 requires all-gather inputs of the padded shard's shape on unevenly sharded parameters, which a
    packed int8 buffer is not: only parameters whose dim 0 divides evenly over the shard group are quantized."""
    return p.dim() >= 1 and p.shape[0] % shard_size == 0 and p.dtype == torch.float32


def wrap_quantized_weights(modules: list[nn.Module], shard_size: int, block: int) -> int:
    """Swap the evenly shardable fp32 parameters of `modules` (before `fully_shard`) for `QuantizedAllGatherWeight`s,
    keeping tied parameters tied; parameters some earlier `fully_shard` already sharded (experts) stay plain.
    Returns how many parameters stay plain (all-gathered in the mp dtype)."""
    swapped: dict[int, nn.Parameter] = {}
    plain = 0
    for mod in modules:
        for sub in mod.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or isinstance(p.data, QuantizedAllGatherWeight):
                    continue
                if id(p) not in swapped:
                    # Already sharded by an earlier fully_shard (MoE's expert units over edp, parallelize.py step
                    # 9): FSDP holds that DTensor, so it stays plain and is gathered in the mp dtype.
                    if isinstance(p.data, DTensor) or not quantizable(p, shard_size):
                        plain += 1
                        continue
                    wrapped = QuantizedAllGatherWeight(p.data, block)
                    swapped[id(p)] = nn.Parameter(wrapped, requires_grad=p.requires_grad)
                sub._parameters[name] = swapped[id(p)]
    return plain


def plain_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
    """A `register_state_dict_post_hook` for the root: checkpoints hold the plain fp32 shards, never the wrapper
    (loading copies into the wrapper in place, so a quantized and a plain run read each other's checkpoints)."""
    from torch.distributed.tensor import DTensor

    for key, value in state_dict.items():
        if isinstance(value, DTensor) and isinstance(value._local_tensor, QuantizedAllGatherWeight):
            state_dict[key] = DTensor.from_local(value._local_tensor._inner, value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())
        elif isinstance(value, QuantizedAllGatherWeight):
            state_dict[key] = value._inner


class QuantizedReduceScatter(ReduceScatter):
    """qgZ: an int8 block-quantized reduce-scatter by all-to-all, for `FSDPModule.set_custom_reduce_scatter`.

    `intra`/`inter` (both or neither): the node's and the cross-node groups of the shard group's ranks (rank
    n * s + l is local rank l of node n); with them the exchange is ZeRO++'s two hops, else one all-to-all.
    """

    def __init__(self, block: int, intra: dist.ProcessGroup | None = None,
                 inter: dist.ProcessGroup | None = None) -> None:
        self.block = block
        self.intra, self.inter = intra, inter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        world = group.size()
        m = output_tensor.numel()
        rows = input_tensor.view(world, m).float()  # row d: the chunk destined for shard rank d
        if self.intra is None or self.inter is None:
            total = self._exchange(rows, group).sum(dim=0)
        else:
            s, nodes = self.intra.size(), self.inter.size()
            if s * nodes != world:
                raise ValueError(f"qgZ hierarchy {nodes} nodes x {s} ranks does not cover the shard group of {world}")
            # Hop 1, inside the node: local peer l' gets the chunks for ranks (n'', l') of every node n''.
            by_local = rows.view(nodes, s, m).transpose(0, 1).reshape(s * nodes, m)
            partial = self._exchange(by_local, self.intra).view(s, nodes, m).sum(dim=0)
            # Hop 2, across nodes, on 1/s of the volume: node n'' gets its partial sum.
            total = self._exchange(partial, self.inter).sum(dim=0)
        if op == dist.ReduceOp.AVG:
            total = total / world
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"qgZ reduce-scatter supports SUM and AVG, not {op}")
        output_tensor.copy_(total.view_as(output_tensor))
        return None

    def _exchange(self, rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """All-to-all of the quantized rows (split evenly over `group`); the received ones, dequantized (fp32)."""
        n = rows.shape[1]
        packed = quantize(rows, self.block)
        received = torch.empty_like(packed)
        dist.all_to_all_single(received, packed, group=group)
        return dequantize(received, n, self.block)
