"""Parameter names and initial values, independent of layout: `canonical_fqn` strips wrapper prefixes, and every
parameter's initial value comes from a generator seeded by (run seed, canonical FQN), so a model built under any
parallel layout holds bitwise the 1-process model's parameters. Used by the decoder, the MoE step helpers, the
parallel engine and the checkpoint code (which is why it is not in models/decoder.py)."""

from __future__ import annotations

import hashlib
import math

import torch

from models.config import ModelConfig


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full value `full` into `param`: its local shard when `param` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                                  src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def fqn_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter's canonical FQN."""
    canonical = canonical_fqn(fqn)
    digest = hashlib.sha256(f"{seed}:{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_fqn(fqn: str) -> str:
    """Strip wrapper prefixes (activation checkpointing, torch.compile) so names match the plain model."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        fqn = fqn.replace(junk, "")
    return fqn


def _rule(cfg: ModelConfig, fqn: str) -> tuple[str, float | None, float]:
    """(canonical name, constant value or None, std of the normal draw) of parameter `fqn`."""
    name = canonical_fqn(fqn)
    if cfg.tied_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # a pipeline's last stage holds its own copy of the tied weight
    parts = name.split(".")
    leaf = parts[-1]
    if len(parts) >= 2 and parts[-2].endswith("norm"):
        return name, 1.0 if leaf == "weight" else 0.0, 0.0
    if leaf == "bias" or leaf.endswith("_bias"):
        return name, 0.0, 0.0
    std = cfg.init_std
    if cfg.depth_scaled_init and (".wo." in name or ".o_proj." in name or ".w2" in name or name.endswith(".w2")):
        std = std / math.sqrt(2 * cfg.n_layers)
    return name, None, std


def initial_value(cfg: ModelConfig, fqn: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value (fp32, CPU) of parameter `fqn`.

    Norm weights are ones, biases zeros; embeddings and input projections N(0, init_std); output projections of
    each block (`wo`, MLA's `o_proj`, `w2`) N(0, init_std / sqrt(2 n_layers)) when `depth_scaled_init`
    (GPT-2, Megatron).
    """
    name, constant, std = _rule(cfg, fqn)
    if constant is not None:
        return torch.full(shape, constant)
    gen = torch.Generator().manual_seed(fqn_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


DRAW_CHUNK = 1 << 20
"""Elements drawn at a time by `initial_shard` (a multiple of 16, see `_normal_box`)."""


def initial_shard(cfg: ModelConfig, fqn: str, shape: tuple[int, ...], seed: int, offset: tuple[int, ...],
                  local_shape: tuple[int, ...]) -> torch.Tensor:
    """`initial_value(cfg, fqn, shape, seed)` sliced to the box `offset : offset + local_shape`, bitwise, without
    ever holding the full tensor: a rank that owns a shard allocates only the shard and a bounded draw buffer."""
    name, constant, std = _rule(cfg, fqn)
    if constant is not None:
        return torch.full(local_shape, constant)
    gen = torch.Generator().manual_seed(fqn_seed(seed, name))
    return _normal_box(shape, std, gen, offset, local_shape)


def _normal_box(shape: tuple[int, ...], std: float, gen: torch.Generator, offset: tuple[int, ...],
                local_shape: tuple[int, ...], chunk: int | None = None) -> torch.Tensor:
    """The box of `torch.empty(shape).normal_(0, std, generator=gen)`, drawn `chunk` elements at a time.

    torch's CPU normal_ fills one uniform per element and transforms blocks of 16 (Box-Muller on elements i and
    i + 8); a tail that is not a multiple of 16 redraws the last 16. So consecutive draws of multiples of 16
    elements, the last of at least 16, continue the generator exactly as one draw of the whole would
    (tests/models/test_decoder.py checks it bitwise against `initial_value`).
    """
    chunk = chunk or DRAW_CHUNK
    out = torch.empty(local_shape)
    if out.numel() == 0 or not shape:
        return out if out.numel() == 0 else torch.empty(shape).normal_(0.0, std, generator=gen)
    if len(shape) == 1:  # as a column, so every "line" below is one element
        shape, offset, local_shape = (shape[0], 1), (offset[0], 0), (local_shape[0], 1)
    lead, width = shape[:-1], shape[-1]
    lo = torch.tensor(offset[:-1])
    hi = lo + torch.tensor(local_shape[:-1])
    c0, c1 = offset[-1], offset[-1] + local_shape[-1]
    rows = out.view(-1, local_shape[-1])
    last_line = _ravel(hi - 1, lead)
    n, drawn, line0 = math.prod(shape), 0, 0
    carry = torch.empty(0)
    while drawn < n and line0 <= last_line:
        k = n - drawn if n - drawn <= chunk + 16 else chunk
        vals = torch.cat([carry, torch.empty(k).normal_(0.0, std, generator=gen)])
        drawn += k
        m = vals.numel() // width
        carry = vals[m * width:]
        coords = _unravel(torch.arange(line0, line0 + m), lead)
        inside = ((coords >= lo) & (coords < hi)).all(dim=1)
        if bool(inside.any()):
            rows[_ravel(coords[inside] - lo, local_shape[:-1])] = vals[:m * width].view(m, width)[inside][:, c0:c1]
        line0 += m
    return out


def _unravel(index: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    coords = []
    for d in reversed(dims):
        coords.append(index % d)
        index = index // d
    return torch.stack(coords[::-1], dim=-1)


def _ravel(coords: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor | int:
    flat = torch.zeros(coords.shape[:-1], dtype=torch.int64)
    for i, d in enumerate(dims):
        flat = flat * d + coords[..., i]
    return flat if flat.dim() else int(flat)


def copy_initial_into(cfg: ModelConfig, fqn: str, param: torch.Tensor, seed: int) -> None:
    """Initialize `param` (a DTensor: only its local shard, drawn as such; see `initial_shard`)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.tensor import DTensor

    shape = tuple(param.shape)  # DTensor.shape: the global shape
    if is_fake(param.to_local() if isinstance(param, DTensor) else param):
        # A dry run's rank (`tessera dryrun`, FakeTensorMode): there are no values to draw, and the chunked draw's
        # data-dependent indexing has no fake implementation. The shard's storage exists; leave it as it is.
        return
    if isinstance(param, DTensor) and (box := local_box(param)) is not None:
        value = initial_shard(cfg, fqn, shape, seed, *box)
        param.to_local().copy_(value.to(param.device))
        return
    copy_full_into(param, initial_value(cfg, fqn, shape, seed))  # plain tensors; other placements (Partial)


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, local shape) of a DTensor's local tensor in the global tensor, or None when it is not one box.

    Shard placements split a dimension as torch.chunk does (ceil-sized pieces, trailing ones short or empty),
    outer mesh dimensions first; a `_StridedShard` (FSDP2 over a tensor-parallel dimension: FSDP shards the
    tp-local tensor) splits the piece the plain Shards left, so applying those after the others gives the box.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = param.placements  # type: ignore[attr-defined]
    if not all(isinstance(p, Shard | Replicate | _StridedShard) for p in placements):  # not a Shard subclass
        return None
    coord = param.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    if coord is None:
        return None
    offset, size = [0] * param.dim(), list(param.shape)
    order = [i for i, p in enumerate(placements) if type(p) is Shard]
    order += [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    for i in order:
        d, n = placements[i].dim, param.device_mesh.size(i)  # type: ignore[attr-defined]
        piece = -(-size[d] // n)
        start = min(coord[i] * piece, size[d])
        offset[d], size[d] = offset[d] + start, min(piece, size[d] - start)
    return tuple(offset), tuple(size)
