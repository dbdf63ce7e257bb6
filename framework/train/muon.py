"""Muon (Jordan et al. 2024) for the hidden matrices, AdamW for everything else, as one optimizer.

    opt = build_muon(modules, train_cfg, device)      # train.optimizer: muon (framework/train/optim.py)

For each 2-D hidden matrix W (A x B; each expert of a stacked (E, A, B) expert weight on its own), with
gradient G, learning rate lr and weight decay wd (`train.lr`, `train.weight_decay`, `train.muon`):
    buf <- mu buf + (1 - mu) G                             momentum (the EMA form of Jordan's and torch's Muon)
    U   <- (1 - mu) G + mu buf  (Nesterov)  or  buf
    O   <- NS_k(U)                                        k quintic Newton-Schulz steps, (a, b, c) coefficients
    W   <- (1 - lr wd) W - lr s O,   s = 0.2 sqrt(max(A, B))   (Liu et al. 2025: AdamW's update RMS, so AdamW's
                                                               lr and weight decay carry over)
The embeddings, the output head (a classifier, not a hidden layer), norms, biases and the MoE router stay on
AdamW with the usual decay groups (framework/train/optim.py), as Jordan et al. and Moonlight do.

`Muon` subclasses `torch.optim.AdamW`: its AdamW groups run AdamW's own kernel unchanged, its state is AdamW's
plus one `momentum_buffer` per Muon parameter placed like the parameter (a DTensor under FSDP/TP/EP), so
distributed checkpoints save and reshard it exactly like exp_avg (framework/checkpoint/dcp.py). The gradient
scaler and the loss guard see an ordinary optimizer: a skipped step never reaches `step`.

Sharded parameters: the momentum update is elementwise on the local shards; NS needs whole matrices, which
`framework/parallel/whole_matrix.py` assembles on owner ranks (bucketed all-to-all, round-robin owners, NS
batched per matrix shape there) and scatters back, so every layout computes the 1-process update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from framework.train.config import MuonConfig, TrainConfig

_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(g_NAB: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Approximate U V^T of each matrix's SVD U S V^T (n stacked A x B matrices), Jordan et al. 2024's quintic
    iteration X <- a X + (b X X^T + c (X X^T)^2) X from X = G / (||G||_F + eps), run on the wide orientation."""
    a, b, c = coefficients
    x = g_NAB.to(dtype)
    tall = g_NAB.size(-2) > g_NAB.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(g_NAB.dtype)


def update_scale(shape: torch.Size | tuple[int, ...], cfg: MuonConfig) -> float:
    """The factor on lr for an orthogonalized update of a (..., A, B) weight (`train.muon.lr_adjust`)."""
    a, b = shape[-2], shape[-1]
    if cfg.lr_adjust == "match_rms_adamw":
        return cfg.update_rms * math.sqrt(max(a, b))
    return math.sqrt(max(1.0, a / b))


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """A hidden matrix: 2-D (or a 3-D stack of expert matrices), not an embedding, the head, a norm or the router
    (both classifiers over a fixed set; Jordan et al. 2024 and Liu et al. 2025 keep them on AdamW)."""
    leaf = name.rsplit(".", 1)[0]
    return (p.ndim in (2, 3) and "embeddings" not in name and leaf != "output" and "norm" not in name
            and "router" not in name)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _grad_like_param(p: torch.Tensor) -> torch.Tensor:
    """p's gradient as the local piece matching p's local shard (a gradient may be placed unlike its parameter;
    Replicate -> Shard is a local slice)."""
    g = p.grad
    assert g is not None
    if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


class Muon(torch.optim.AdamW):
    """AdamW groups (`"muon": False`) stepped by AdamW; Muon groups (`"muon": True`) by `_muon_step`."""

    def __init__(self, groups: list[dict[str, Any]], cfg: TrainConfig, blocks: dict[int, int] | None = None,
                 **adamw_flags: bool) -> None:
        super().__init__(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **adamw_flags)
        self.muon_cfg = cfg.muon
        from framework.parallel.whole_matrix import WholeMatrices

        # `blocks` (train.muon.per_head): id(param) -> +k (rows in blocks of k) or -k (columns in blocks of k)
        self._blocks = [(blocks or {}).get(id(p), 0) for p in self._muon_params()]
        self._whole = WholeMatrices(self._muon_params(), self._blocks)
        self.overlapped = False  # set by framework/train/muon_overlap.py where the layout allows
        self._factors: list[tuple[float, bool]] = []  # (value, divide) applied to the gradients after they left
        self.launches = {"backward": 0, "step": 0}  # `launch` calls from inside backward / at the step

    def _muon_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups if g.get("muon") for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        try:
            self.param_groups = [g for g in groups if not g.get("muon")]
            super().step()
        finally:
            self.param_groups = groups
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        cfg = self.muon_cfg
        params = self._muon_params()
        if not params:
            return
        if any(p.grad is None for p in params):
            # Every rank of a group must take part in the collectives for every matrix: all or none.
            missing = [tuple(p.shape) for p in params if p.grad is None]
            raise RuntimeError(f"Muon step with {len(missing)} Muon parameter(s) lacking a gradient, shapes {missing}")
        if [id(p) for p in self._whole.params] != [id(p) for p in params]:
            raise RuntimeError("Muon's parameters changed after construction; build a new optimizer instead")
        dtype = _NS_DTYPES[cfg.ns_dtype]

        def fn(u: torch.Tensor) -> torch.Tensor:
            return newton_schulz(u, cfg.ns_coefficients, cfg.ns_steps, cfg.ns_eps, dtype)

        if self.overlapped:
            updates = self._owner_step(params, fn)
        else:
            updates = self._whole.apply([self._nesterov(p, _grad_like_param(p)) for p in params], fn)
        scale = {id(p): (g["lr"], g["weight_decay"]) for g in self.param_groups if g.get("muon") for p in g["params"]}
        for p, update, block in zip(params, updates, self._blocks, strict=True):
            lr, wd = scale[id(p)]
            w = _local(p)
            w.mul_(1 - lr * wd)
            w.add_(update, alpha=-lr * update_scale(block_shape(tuple(p.shape), block), cfg))

    def _nesterov(self, p: torch.Tensor, g: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        """The momentum update of `p`'s buffer with gradient `g` (its local piece, or under the overlapped exchange
        its owner's whole unit; `like` is then the unit), and what Newton-Schulz orthogonalizes."""
        state = self.state[p]
        if "step" not in state:  # a step count as AdamW keeps one: Adam's load_state_dict expects it everywhere
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p if like is None else like)
        buf = _local(state["momentum_buffer"])
        buf.lerp_(g, 1 - self.muon_cfg.momentum)
        return g.lerp(buf, self.muon_cfg.momentum) if self.muon_cfg.nesterov else buf

    # --- the owner exchange overlapped with backward (framework/train/muon_overlap.py) ------------------------
    def launch(self, params: Sequence[torch.Tensor]) -> None:
        """Send these Muon parameters' gradients, final now, to their owners (from a backward hook)."""
        ids = {id(p) for p in params}
        chosen = [i for i in self._exchanged() if id(self._whole.params[i]) in ids]
        self._whole.launch(chosen, [_grad_like_param(self._whole.params[i]) for i in chosen])
        self.launches["backward" if torch._C._current_graph_task_id() != -1 else "step"] += 1

    def grads_scaled(self, factor: float) -> None:
        """The engine multiplied every gradient by `factor` after the pieces left: the owners repeat it."""
        if factor != 1.0:
            self._factors.append((factor, False))

    def grads_divided(self, divisor: int) -> None:
        """The pipeline schedule divided the gradients by `divisor` (`Tensor.div_`, torch's `scale_grads`) after the
        pieces left: the owners repeat the same operation, not a multiplication by 1/divisor (which rounds
        differently unless divisor is a power of two). The pieces were copied into the all-to-all's send buffer on
        the compute stream before the division there, so the collective never reads a divided gradient."""
        if divisor != 1:
            self._factors.append((float(divisor), True))

    def _exchanged(self) -> list[int]:
        return [i for b in self._whole.buckets for i in b.members]

    def _owner_step(self, params: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]
                    ) -> list[torch.Tensor]:
        """The overlapped exchange's step: the raw gradients are with their owners (what no hook sent goes now),
        which unscale and clip them as the engine did the local pieces, keep the whole matrices' momentum and run
        Newton-Schulz; the updates come back as in `WholeMatrices.apply`. Elementwise operations are the same
        per element on a whole matrix as on its pieces, so every update equals the non-overlapped one bitwise."""
        from framework.parallel.whole_matrix import _batched

        rest = self._whole.unsent()
        if rest:
            self._whole.launch(rest, [_grad_like_param(params[i]) for i in rest])
            self.launches["step"] += 1
        got = self._whole.collect()
        raw = [g for i, g in got.items() if i not in set(rest)]  # sent from backward, before the engine's scaling
        for value, divide in self._factors if raw else ():  # in order; (_foreach_mul_ refuses an empty list)
            if divide:
                for g in raw:
                    g.div_(int(value))
            else:
                torch._foreach_mul_(raw, value)
        del raw
        self._factors.clear()
        units = {i: self._nesterov(p, _grad_like_param(p)).reshape(self._whole.layout[i].unit_shape)
                 for i, p in enumerate(params) if self._whole.layout[i].owner < 0}
        for i in list(got):  # each gradient unit freed once its Newton-Schulz input exists
            g = got.pop(i)
            units[i] = self._nesterov(params[i], g, like=g)
            del g
        # The matrices other ranks own: the step count, and an empty momentum, since checkpoint loading
        # (torch.distributed.checkpoint) reloads the keys the live state has.
        for i in set(self._exchanged()) - set(units):
            state = self.state[params[i]]
            state.setdefault("step", torch.tensor(0.0)).add_(1)
            state.setdefault("momentum_buffer", _local(params[i]).new_empty(0))
        locals_ = [_local(p) for p in params]
        return self._whole.scatter(_batched(units, fn, self._blocks), locals_)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops the exchanged gradients of a step not taken (the guard or the fp16 scaler said no)."""
        self._whole.discard()
        self._factors.clear()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Placed like the parameters whatever the mode: under the overlapped exchange the owners' whole momentum
        matrices go back to every rank's pieces first (a collective, as the step's return trip)."""
        params = self._muon_params()
        if not self.overlapped or not any("step" in self.state[p] for p in params):
            return super().state_dict()
        owned = {i: self.state[params[i]].pop("momentum_buffer") for i in self._exchanged()
                 if "momentum_buffer" in self.state[params[i]]}
        locals_ = [_local(p) for p in params]
        pieces = self._whole.scatter({**owned, **{i: locals_[i] for i, lay in enumerate(self._whole.layout)
                                                  if lay.owner < 0}}, locals_)
        for i in self._exchanged():
            self.state[params[i]]["momentum_buffer"] = _placed_like(params[i], pieces[i])
        try:
            sd = super().state_dict()
            sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
            return sd
        finally:
            for i in self._exchanged():
                self.state[params[i]].pop("momentum_buffer")
                if i in owned:
                    self.state[params[i]]["momentum_buffer"] = owned[i]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        params = self._muon_params()
        if not self.overlapped or not any("momentum_buffer" in self.state[p] for p in params):
            return
        ids = self._exchanged()
        self._whole.launch(ids, [_local(self.state[params[i]].pop("momentum_buffer")) for i in ids])
        owned = self._whole.collect()
        for i in ids:
            self.state[params[i]]["momentum_buffer"] = owned.get(i, _local(params[i]).new_empty(0))


def _placed_like(p: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    if not isinstance(p, DTensor):
        return piece.clone()
    return DTensor.from_local(piece.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def block_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The shape of one matrix Newton-Schulz sees: the whole (A, B), or a head block of it (`train.muon.per_head`)."""
    if block > 0:
        return (block, shape[-1])
    return (shape[-2], -block) if block < 0 else shape


def head_blocks(modules: Iterable[nn.Module]) -> dict[int, int]:
    """`train.muon.per_head`: id(weight) -> +head_dim for wq, wk, wv (one row block per head), -head_dim for wo (one
    column block per head) of every attention module."""
    from models.layers import Attention

    out: dict[int, int] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, Attention):
                out |= {id(lin.weight): m.head_dim for lin in (m.wq, m.wk, m.wv)}
                out[id(m.wo.weight)] = -m.head_dim
    return out


def muon_param_groups(modules: Iterable[nn.Module], adamw_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """[AdamW decay, AdamW no decay, Muon] from AdamW's two groups (`optim.param_groups`; the engines' tied-weight
    fix relies on that order): the hidden matrices move from the decay group into a third, decaying alike."""
    muon_ids = {id(p) for m in modules for n, p in m.named_parameters() if p.requires_grad and is_muon_param(n, p)}
    decay, no_decay = adamw_groups
    muon = [p for p in decay["params"] if id(p) in muon_ids]
    return [{**decay, "params": [p for p in decay["params"] if id(p) not in muon_ids], "muon": False},
            {**no_decay, "muon": False}, {"params": muon, "weight_decay": decay["weight_decay"], "muon": True}]
