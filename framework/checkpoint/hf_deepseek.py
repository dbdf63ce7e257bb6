"""DeepSeek-V3 in Hugging Face's layout: its config.json keys, multi-head latent attention's tensor names, and the
multi-token prediction modules kept where DeepSeek's own checkpoints keep them.

- Attention: Tessera's MLA (models/mla.py) carries DeepSeek-V3's names, so `layers.{i}.attention.X` is
  `model.layers.{i}.self_attn.X`. Tessera rotates interleaved pairs, which is transformers' `rope_interleave=True`
  (DeepSeek's checkpoints); a `rope_interleave=False` checkpoint has its rotary rows (the last qk_rope_head_dim of
  every query head, and of kv_a_proj_with_mqa) permuted from halves to pairs on import. Export writes `true`.
- MTP: DeepSeek-V3's checkpoints keep the D modules as layers n_layers .. n_layers + D - 1 (layer 61 of the 671B
  model): the block's usual names plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and copies of the shared
  embedding (`embed_tokens`) and head (`shared_head.head`). Export writes that layout with
  `num_nextn_predict_layers = D`, so vLLM/SGLang speculative decoding can load it; transformers' own
  DeepseekV3ForCausalLM has no MTP modules and skips those tensors at load. `eh_proj`'s input is [emb; h] there
  (vLLM's and SGLang's DeepSeek MTP), [h; emb] in Tessera (the paper's order): its two column halves are swapped
  both ways. A config.json that announces MTP layers the weights lack (transformers saves none) imports without
  them.
- A dense MLA model (no MoE) is DeepSeek-V3 with `first_k_dense_replace = num_hidden_layers`.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.base.errors import CheckpointError
from models.config import ModelConfig

MLA_LEAVES = ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")
Q_LORA_LEAVES = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
MTP_LEAVES = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
              ("norm.weight", "shared_head.norm.weight"))
"""(Tessera leaf under mtp.depths.{k}., HF leaf under model.layers.{n_layers + k - 1}.) copied as they are."""
SHARED_COPIES = (("tok_embeddings.weight", "embed_tokens.weight"), ("output.weight", "shared_head.head.weight"))
# Keys of DeepSeek's own config.json (its remote code), beside transformers' ones: the value Tessera computes.
_ORIGINAL_REQUIRED: dict[str, tuple[Any, ...]] = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",),
                                                  "moe_layer_freq": (1,), "attention_bias": (False,)}
KEYS = frozenset({"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                  "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim",
                  "rope_interleave", "num_nextn_predict_layers", "aux_loss_alpha", "seq_aux", "ep_size",
                  *_ORIGINAL_REQUIRED})


def attention_names(cfg: ModelConfig) -> list[str]:
    """The attention leaves of one MLA layer (the same under `attention.` and `self_attn.`)."""
    return [*(Q_LORA_LEAVES if cfg.mla.q_lora_rank else ("q_proj.weight",)), *MLA_LEAVES]


def to_config(cfg: ModelConfig) -> dict[str, Any]:
    m, moe = cfg.mla, cfg.moe
    out: dict[str, Any] = {
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim,
        "head_dim": m.qk_rope_head_dim, "num_key_value_heads": cfg.n_heads, "rope_interleave": True,
        "num_nextn_predict_layers": cfg.mtp_depth}
    if not moe.enabled:  # every layer dense: the MoE keys are placeholders transformers' config validates
        return {**out, "first_k_dense_replace": cfg.n_layers, "n_routed_experts": 1, "num_experts_per_tok": 1,
                "n_shared_experts": 1, "moe_intermediate_size": cfg.ffn, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0, "norm_topk_prob": True}
    return {**out, "first_k_dense_replace": moe.first_dense_layers, "n_routed_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "n_shared_experts": moe.n_shared_experts,
            "moe_intermediate_size": moe.expert_hidden or cfg.ffn, "n_group": moe.n_groups,
            "topk_group": moe.topk_groups, "routed_scaling_factor": moe.routed_scale,
            "norm_topk_prob": moe.renormalize, "aux_loss_alpha": moe.aux_loss_coef}


def from_config(hf: dict[str, Any]) -> dict[str, Any]:
    for key, allowed in _ORIGINAL_REQUIRED.items():
        if key in hf and hf[key] not in allowed:
            raise CheckpointError(f"config.json {key}={hf[key]!r} cannot be imported: Tessera's DeepSeek-V3 blocks "
                                  f"compute {key} in {list(allowed)}")
    mla = {"q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
           "qk_rope_head_dim": hf["qk_rope_head_dim"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
           "v_head_dim": hf["v_head_dim"]}
    qk = hf.get("qk_head_dim")
    if qk is not None and qk != mla["qk_rope_head_dim"] + mla["qk_nope_head_dim"]:
        raise CheckpointError(f"config.json qk_head_dim={qk} must equal qk_nope_head_dim + qk_rope_head_dim = "
                              f"{mla['qk_nope_head_dim'] + mla['qk_rope_head_dim']}")
    out: dict[str, Any] = {"attention": "mla", "mla": mla, "mtp_depth": int(hf.get("num_nextn_predict_layers") or 0),
                           "ffn_hidden": hf["intermediate_size"]}
    dense = int(hf.get("first_k_dense_replace") or 0)
    if dense >= hf["num_hidden_layers"]:
        return out
    n_shared = int(hf.get("n_shared_experts") or 0)
    if not n_shared:
        raise CheckpointError("config.json n_shared_experts=0 cannot be imported: Tessera's DeepSeek-V3 mapping "
                              "keeps transformers' always-present shared expert block; set it >= 1")
    out["moe"] = {
        "n_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"],
        "expert_hidden": hf["moe_intermediate_size"], "n_shared_experts": n_shared, "first_dense_layers": dense,
        "router": "sigmoid", "n_groups": hf.get("n_group") or 1, "topk_groups": hf.get("topk_group") or 1,
        "routed_scale": float(hf.get("routed_scaling_factor", 1.0)),
        "topk_renormalize": bool(hf.get("norm_topk_prob", True)),
        "aux_loss_coef": float(hf.get("aux_loss_alpha", 0.0001))}
    return out


def without_absent_mtp(hf: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """`hf` with num_nextn_predict_layers = 0 where the weights hold no MTP layer (transformers saves none)."""
    if hf.get("num_nextn_predict_layers") and f"model.layers.{hf['num_hidden_layers']}.eh_proj.weight" not in names:
        return {**hf, "num_nextn_predict_layers": 0}
    return hf


def _rotary_rows(cfg: ModelConfig, leaf: str) -> tuple[int, int, int] | None:
    """(rows per group, first rotary row in a group, groups) of a weight with rotary rows, else None."""
    m = cfg.mla
    if leaf in ("q_proj.weight", "q_b_proj.weight"):
        return m.qk_head_dim, m.qk_nope_head_dim, cfg.n_heads
    if leaf == "kv_a_proj_with_mqa.weight":
        return m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank, 1
    return None


def interleave_rope_rows(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `rope_interleave=False` checkpoint's tensors with the rotary rows in interleaved pair order."""
    out = dict(hf)
    for name, w in hf.items():
        rows = _rotary_rows(cfg, name.rsplit("self_attn.", 1)[-1]) if ".self_attn." in name else None
        if rows is None:
            continue
        per, start, groups = rows
        r = per - start
        grouped = w.reshape(groups, per, -1).clone()
        # halves (i, i + R/2) -> pairs (2i, 2i + 1): the inverse of hf.py's _rope_permute, per group
        grouped[:, start:] = grouped[:, start:].reshape(groups, 2, r // 2, -1).transpose(1, 2).reshape(groups, r, -1)
        out[name] = grouped.reshape(w.shape)
    return out


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """eh_proj (D, 2D): [h; emb] columns <-> [emb; h] columns (the swap is its own inverse)."""
    first, second = w.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def mtp_blocks(cfg: ModelConfig) -> list[tuple[str, str, int]]:
    """(Tessera prefix, HF prefix, layer id) of each MTP depth's transformer block."""
    return [(f"mtp.depths.{k}.block.", f"model.layers.{cfg.n_layers + k - 1}.", cfg.n_layers + k - 1)
            for k in range(1, cfg.mtp_depth + 1)]


def mtp_to_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP depths' own tensors and the shared copies (their blocks map as layers: `mtp_blocks`)."""
    out: dict[str, torch.Tensor] = {}
    for k in range(1, cfg.mtp_depth + 1):
        t, h = f"mtp.depths.{k}.", f"model.layers.{cfg.n_layers + k - 1}."
        out.update({h + theirs: sd[t + ours] for ours, theirs in MTP_LEAVES})
        out[h + "eh_proj.weight"] = _swap_halves(sd[t + "eh_proj.weight"])
        out.update({h + theirs: sd["tok_embeddings.weight" if cfg.tied_embeddings else ours]
                    for ours, theirs in SHARED_COPIES})
    return out


def mtp_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """The inverse of `mtp_to_hf`; the per-depth embedding and head copies must equal the main ones (`sd`)."""
    out: dict[str, torch.Tensor] = {}
    for k in range(1, cfg.mtp_depth + 1):
        t, h = f"mtp.depths.{k}.", f"model.layers.{cfg.n_layers + k - 1}."
        out.update({t + ours: hf[h + theirs] for ours, theirs in MTP_LEAVES})
        out[t + "eh_proj.weight"] = _swap_halves(hf[h + "eh_proj.weight"])
        for ours, theirs in SHARED_COPIES:
            if h + theirs in hf and not torch.equal(hf[h + theirs], sd[ours]):
                raise CheckpointError(f"HF tensor {h}{theirs} differs from the main model's {ours}: Tessera's MTP "
                                      f"modules share the embedding and head (DeepSeek-V3 sec. 2.2)")
    return out
