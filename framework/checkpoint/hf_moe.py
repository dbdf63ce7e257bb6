"""The Hugging Face MoE families Tessera maps both ways: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3.

One `Family` per transformers `model_type`: its config.json keys (read into `model.moe` and the attention
switches, or written from them), its tensor names under `model.layers.{i}.`, and what a Tessera model must not
have for the family to hold it exactly (`blockers`, each naming the config field). framework/checkpoint/hf.py
maps what every family shares (embeddings, norms, attention, dense MLPs, RoPE) and calls in here for the rest.

Tensors are written in the hub layout (one tensor per expert: `...experts.{e}.gate_proj.weight`), which
transformers 4 reads as it is and transformers 5 converts on load; import also reads transformers 5's fused
layout (`mlp.experts.gate_up_proj` (E, 2F, D), `mlp.experts.down_proj` (E, D, F)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from framework.base.errors import CheckpointError
from framework.checkpoint import hf_deepseek
from models.config import ModelConfig

Blocker = tuple[str, Any, str]
"""(config field, its value, why the family cannot hold it)."""


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    block: str
    """The HF module of a layer's MoE block: `block_sparse_moe` (Mixtral) or `mlp`."""
    expert_leaves: tuple[str, str, str]
    """HF per-expert Linear names of Tessera's w1 (gate), w2 (down), w3 (up)."""
    shared: str | None
    """HF name of the shared-expert MLP inside the block (None: the family has none)."""
    blockers: Callable[[ModelConfig], list[Blocker]]
    to_config: Callable[[ModelConfig], dict[str, Any]]
    """config.json keys of the family's MoE and attention fields."""
    from_config: Callable[[dict[str, Any]], dict[str, Any]]
    """ModelConfig fields (the `moe` dict among them) of a config.json's family keys."""
    keys: frozenset[str]
    """Every family-specific config.json key `from_config` reads (the rest are shared or refused)."""
    required: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """Keys that must hold one of these values (a feature Tessera's blocks lack otherwise)."""


def _common_blockers(cfg: ModelConfig) -> list[Blocker]:
    moe = cfg.moe
    out: list[Blocker] = []
    if moe.capacity_factor:
        out.append(("model.moe.capacity_factor", moe.capacity_factor, "HF MoE blocks are dropless"))
    return out


def _gqa_moe_blockers(cfg: ModelConfig, name: str) -> list[Blocker]:
    """What a family of Llama attention and MoE on some layers cannot hold."""
    out = _common_blockers(cfg)
    if cfg.attention == "mla":
        out.append(("model.attention", "mla", f"{name}'s attention is grouped-query, not multi-head latent"))
    if not cfg.moe.enabled:
        out.append(("model.moe.n_experts", 0, f"{name} is a mixture-of-experts model"))
    return out


def _softmax_blockers(cfg: ModelConfig, name: str) -> list[Blocker]:
    moe = cfg.moe
    out: list[Blocker] = []
    if moe.router != "softmax":
        out.append(("model.moe.router", moe.router, f"{name} routes with a softmax"))
    if moe.bias_update_rate:
        out.append(("model.moe.bias_update_rate", moe.bias_update_rate, f"{name} has no routing bias"))
    if moe.n_groups > 1:
        out.append(("model.moe.n_groups", moe.n_groups, f"{name} has no group-limited routing"))
    if moe.routed_scale != 1.0:
        out.append(("model.moe.routed_scale", moe.routed_scale, f"{name} does not scale routed weights"))
    return out


def _layout_blockers(cfg: ModelConfig, name: str, qk_norm: bool, qkv_bias: bool) -> list[Blocker]:
    out: list[Blocker] = []
    if cfg.qk_norm != qk_norm:
        out.append(("model.qk_norm", cfg.qk_norm, f"{name} {'always has' if qk_norm else 'has no'} q/k norms"))
    if cfg.qkv_bias and not qkv_bias:
        out.append(("model.qkv_bias", cfg.qkv_bias, f"{name} has no q/k/v biases"))
    return out


def _shared_blockers(cfg: ModelConfig, name: str, shared: bool, gated: bool) -> list[Blocker]:
    moe = cfg.moe
    if bool(moe.n_shared_experts) != shared:
        return [("model.moe.n_shared_experts", moe.n_shared_experts,
                 f"{name} {'always has a' if shared else 'has no'} shared expert")]
    if shared and moe.shared_expert_gate != gated:
        return [("model.moe.shared_expert_gate", moe.shared_expert_gate,
                 f"{name} {'gates' if gated else 'does not gate'} its shared expert")]
    return []


def _mixtral_blockers(cfg: ModelConfig) -> list[Blocker]:
    moe = cfg.moe
    out = _gqa_moe_blockers(cfg, "Mixtral") + _softmax_blockers(cfg, "Mixtral")
    out += _shared_blockers(cfg, "Mixtral", False, False)
    out += _layout_blockers(cfg, "Mixtral", qk_norm=False, qkv_bias=False)
    if not moe.renormalize:
        out.append(("model.moe.topk_renormalize", moe.topk_renormalize,
                    "Mixtral renormalizes the top-k softmax weights to sum to 1"))
    if moe.every_k_layers != 1 or moe.first_dense_layers:
        out.append(("model.moe.first_dense_layers" if moe.first_dense_layers else "model.moe.every_k_layers",
                    moe.first_dense_layers or moe.every_k_layers, "every Mixtral layer is MoE"))
    return out


def _qwen_blockers(cfg: ModelConfig, name: str, qwen3: bool) -> list[Blocker]:
    out = _gqa_moe_blockers(cfg, name) + _softmax_blockers(cfg, name)
    out += _shared_blockers(cfg, name, shared=not qwen3, gated=True)
    return out + _layout_blockers(cfg, name, qk_norm=qwen3, qkv_bias=not qwen3)


def _deepseek_blockers(cfg: ModelConfig) -> list[Blocker]:
    moe = cfg.moe
    out = _common_blockers(cfg) + _layout_blockers(cfg, "DeepSeek-V3", qk_norm=False, qkv_bias=False)
    # transformers' DeepSeek-V3 attention is MLA (DeepseekV3Attention: q/kv LoRA, decoupled RoPE key) only
    if cfg.attention != "mla":
        out.append(("model.attention", cfg.attention, "DeepSeek-V3 has multi-head latent attention only"))
    if not moe.enabled:  # a dense MLA model: every layer is one of DeepSeek-V3's first dense layers
        return out
    if moe.router != "sigmoid":
        out.append(("model.moe.router", moe.router, "DeepSeek-V3 routes with sigmoid scores"))
    if not moe.n_shared_experts:
        out.append(("model.moe.n_shared_experts", 0, "DeepSeek-V3's MoE blocks always have shared experts"))
    if moe.shared_expert_gate:
        out.append(("model.moe.shared_expert_gate", True, "DeepSeek-V3 does not gate its shared experts"))
    if moe.every_k_layers != 1:
        out.append(("model.moe.every_k_layers", moe.every_k_layers, "DeepSeek-V3's layers after the first dense "
                    "ones are all MoE"))
    return out


def _sparse_layers(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {"decoder_sparse_step": moe.every_k_layers, "mlp_only_layers": list(range(moe.first_dense_layers))}


def _qwen_to_config(cfg: ModelConfig, qwen3: bool) -> dict[str, Any]:
    moe = cfg.moe
    out: dict[str, Any] = {
        "num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize,
        "moe_intermediate_size": moe.expert_hidden or cfg.ffn, "intermediate_size": cfg.ffn,
        "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False, "use_sliding_window": False,
        "sliding_window": None, **_sparse_layers(cfg)}
    if qwen3:
        out.update(attention_bias=False, head_dim=cfg.head_dim)
    else:
        out.update(qkv_bias=cfg.qkv_bias, layer_types=["full_attention"] * cfg.n_layers,
                   shared_expert_intermediate_size=moe.n_shared_experts * (moe.expert_hidden or cfg.ffn))
    return out


def _dense_prefix(hf: dict[str, Any]) -> int:
    """first_dense_layers of Qwen's `mlp_only_layers` (only a prefix 0..k-1 maps onto Tessera's layer rule)."""
    only = sorted(hf.get("mlp_only_layers") or [])
    if only != list(range(len(only))):
        raise CheckpointError(f"config.json mlp_only_layers={only} cannot be imported: Tessera keeps a dense MLP on "
                              f"the first model.moe.first_dense_layers layers only (a prefix 0..k-1)")
    return len(only)


def _qwen_from_config(hf: dict[str, Any], qwen3: bool) -> dict[str, Any]:
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    moe: dict[str, Any] = {
        "n_experts": n_experts, "top_k": hf["num_experts_per_tok"], "expert_hidden": hf["moe_intermediate_size"],
        "topk_renormalize": bool(hf.get("norm_topk_prob", False)), "every_k_layers": hf.get("decoder_sparse_step", 1),
        "first_dense_layers": _dense_prefix(hf), "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}
    out: dict[str, Any] = {"ffn_hidden": hf["intermediate_size"], "moe": moe}
    if hf.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true cannot be imported: Tessera attends over the "
                              "whole causal context in every layer")
    if qwen3:
        out["qk_norm"] = True
        return out
    shared = int(hf["shared_expert_intermediate_size"])
    if shared <= 0 or shared % moe["expert_hidden"]:
        raise CheckpointError(f"config.json shared_expert_intermediate_size={shared} cannot be imported: Tessera's "
                              f"shared experts are n x moe_intermediate_size={moe['expert_hidden']} wide")
    moe.update(n_shared_experts=shared // moe["expert_hidden"], shared_expert_gate=True)
    out["qkv_bias"] = bool(hf.get("qkv_bias", True))  # transformers' default: Qwen1.5/2 attention has biases
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds or hf.get("use_sliding_window"):
        raise CheckpointError(f"config.json layer_types={kinds} / use_sliding_window={hf.get('use_sliding_window')}"
                              f" cannot be imported: Tessera attends over the whole causal context in every layer")
    return out


def _mixtral_to_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {"num_local_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "sliding_window": None,
            "intermediate_size": moe.expert_hidden or cfg.ffn, "router_aux_loss_coef": moe.aux_loss_coef,
            "output_router_logits": False, "router_jitter_noise": 0.0}


def _mixtral_from_config(hf: dict[str, Any]) -> dict[str, Any]:
    return {"ffn_hidden": hf["intermediate_size"], "moe": {
        "n_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"],
        "expert_hidden": hf["intermediate_size"], "topk_renormalize": True,
        "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.01))}}


_QWEN_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                        "moe_intermediate_size", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers",
                        "max_window_layers", "use_sliding_window", "sliding_window", "layer_types"})
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w2", "w3"), None, _mixtral_blockers,
           _mixtral_to_config, _mixtral_from_config,
           frozenset({"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"}),
           (("sliding_window", (None,)),)),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "down_proj", "up_proj"), "shared_expert",
           lambda c: _qwen_blockers(c, "Qwen2-MoE", qwen3=False), lambda c: _qwen_to_config(c, qwen3=False),
           lambda h: _qwen_from_config(h, qwen3=False), _QWEN_KEYS | {"shared_expert_intermediate_size", "qkv_bias"}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "down_proj", "up_proj"), None,
           lambda c: _qwen_blockers(c, "Qwen3-MoE", qwen3=True), lambda c: _qwen_to_config(c, qwen3=True),
           lambda h: _qwen_from_config(h, qwen3=True), _QWEN_KEYS),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "down_proj", "up_proj"), "shared_experts",
           _deepseek_blockers, hf_deepseek.to_config, hf_deepseek.from_config, hf_deepseek.KEYS),
)}


def family_for(cfg: ModelConfig) -> Family:
    """The first family that holds `cfg` exactly; else a CheckpointError listing the nearest family's blockers."""
    found = {name: f.blockers(cfg) for name, f in FAMILIES.items()}
    for name, blockers in found.items():
        if not blockers:
            return FAMILIES[name]
    name, blockers = min(found.items(), key=lambda kv: len(kv[1]))
    why = "; ".join(f"{field}={value!r} — {reason}" for field, value, reason in blockers)
    raise CheckpointError(f"cannot export to Hugging Face: no MoE family transformers ships holds this model; the "
                          f"nearest, {name}, refuses: {why}; train without them or keep the Tessera checkpoint")


# Attention tensors some families add, present when the config flag is set: (Tessera leaf under layers.{i}.,
# HF leaf under model.layers.{i}., ModelConfig flag, head count whose RoPE halves HF interleaves; "one": per head)
ATTENTION_EXTRAS: tuple[tuple[str, str, str, str], ...] = (
    ("attention.wq.bias", "self_attn.q_proj.bias", "qkv_bias", "n_heads"),
    ("attention.wk.bias", "self_attn.k_proj.bias", "qkv_bias", "kv_heads"),
    ("attention.wv.bias", "self_attn.v_proj.bias", "qkv_bias", ""),
    ("attention.q_norm.weight", "self_attn.q_norm.weight", "qk_norm", "one"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight", "qk_norm", "one"),
)
ROUTER = "feed_forward.router.weight"
ROUTER_BIAS = "feed_forward.router.expert_bias"
SHARED_GATE = ("feed_forward.shared_gate.weight", "shared_expert_gate.weight")
MLP_LEAVES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
"""Tessera SwiGLU Linear -> HF MLP Linear, for dense layers and shared experts alike."""


def to_hf_block(fam: Family, cfg: ModelConfig, sd: dict[str, torch.Tensor], t: str, h: str
                ) -> dict[str, torch.Tensor]:
    """One layer's MoE block: Tessera tensors under `t` (layers.{i}.) -> HF tensors under `h` (model.layers.{i}.)."""
    b = f"{h}{fam.block}."
    bias = sd.get(t + ROUTER_BIAS)
    if bias is not None and bool(bias.any()) and fam.model_type != "deepseek_v3":
        raise CheckpointError(f"cannot export to Hugging Face: {t}{ROUTER_BIAS} is non-zero (auxiliary-loss-free "
                              f"balancing); {fam.architecture} has no routing bias")
    out = {b + "gate.weight": sd[t + ROUTER]}
    if fam.model_type == "deepseek_v3":
        out[b + "gate.e_score_correction_bias"] = sd[t + ROUTER_BIAS]
    for k, leaf in zip(("w1", "w2", "w3"), fam.expert_leaves, strict=True):
        stacked = sd[f"{t}feed_forward.experts.{k}"]
        out.update({f"{b}experts.{e}.{leaf}.weight": stacked[e] for e in range(cfg.moe.n_experts)})
    out.update({name: sd[ours] for ours, name in _shared_names(fam, cfg, t, b)})
    return out


def _shared_names(fam: Family, cfg: ModelConfig, t: str, b: str) -> list[tuple[str, str]]:
    """(Tessera, HF) names of the shared expert and its gate, where the family and the model have them."""
    names = [(f"{t}feed_forward.shared_experts.{k}.weight", f"{b}{fam.shared}.{leaf}.weight")
             for k, leaf in MLP_LEAVES] if fam.shared is not None else []
    return names + ([(t + SHARED_GATE[0], b + SHARED_GATE[1])] if cfg.moe.shared_expert_gate else [])


def _experts(fam: Family, hf: dict[str, torch.Tensor], b: str, k: str, n: int) -> torch.Tensor:
    """Stacked (E, ., .) Tessera weight `k` from the hub layout or transformers 5's fused experts."""
    leaf = dict(zip(("w1", "w2", "w3"), fam.expert_leaves, strict=True))[k]
    if f"{b}experts.0.{leaf}.weight" in hf:
        return torch.stack([hf[f"{b}experts.{e}.{leaf}.weight"] for e in range(n)])
    fused = "mlp.experts." + ("down_proj" if k == "w2" else "gate_up_proj")
    name = b.removesuffix(fam.block + ".") + fused
    if name not in hf:
        raise CheckpointError(f"HF weights lack the experts of {b.rstrip('.')} ({b}experts.0.{leaf}.weight or {name})")
    if k == "w2":
        return hf[name]
    gate, up = hf[name].chunk(2, dim=1)
    return gate if k == "w1" else up


def from_hf_block(fam: Family, cfg: ModelConfig, hf: dict[str, torch.Tensor], t: str, h: str
                  ) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf_block` (hub or fused layout)."""
    b = f"{h}{fam.block}."
    router = hf.get(b + "gate.weight", hf.get(h + "mlp.gate.weight"))
    if router is None:
        raise CheckpointError(f"HF weights lack the router of {h.rstrip('.')} ({b}gate.weight)")
    out = {t + ROUTER: router,
           t + ROUTER_BIAS: hf.get(b + "gate.e_score_correction_bias", torch.zeros(cfg.moe.n_experts)).float()}
    for k in ("w1", "w2", "w3"):
        out[f"{t}feed_forward.experts.{k}"] = _experts(fam, hf, b, k, cfg.moe.n_experts)
    out.update({ours: hf[name] for ours, name in _shared_names(fam, cfg, t, b)})
    return out
