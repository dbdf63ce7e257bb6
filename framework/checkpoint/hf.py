"""Hugging Face export and import: Tessera checkpoints <-> the Llama (dense) or an MoE family's layout.

    export_hf(run_or_ckpt, out, step=None)   ->  out/model.safetensors, config.json, tokenizer files
    import_hf(hf_dir, run_dir)               ->  run_dir/checkpoints/step_0 (model-only) + `latest`

Differences the mapping bridges:
- RoPE: Tessera rotates interleaved channel pairs (2i, 2i+1), as Meta's Llama code; HF rotates halves
  (i, i + E/2). The rows of wq and wk are permuted per head on export (and back on import), exactly as HF's own
  convert_llama_weights_to_hf does, so logits agree.
- MoE models map to Mixtral, Qwen2-MoE or Qwen3-MoE (framework/checkpoint/hf_moe.py: one name table per family,
  and DeepSeek-V3's MoE part); HF keeps one tensor per expert, Tessera stacks them (E, F, D).
Features the target cannot hold (GELU/LayerNorm blocks, capacity drops, and per family e.g. shared experts,
sigmoid routers, a routing bias) make the export refuse with a `CheckpointError` naming the config field. Only
tensors are read and written (safetensors); nothing unpickles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.base.errors import CheckpointError
from framework.base.logs import get_logger
from framework.base.yaml_config import from_dict, to_dict
from framework.checkpoint import dcp as ckpt
from framework.checkpoint import hf_deepseek
from framework.checkpoint.hf_moe import ATTENTION_EXTRAS, FAMILIES, MLP_LEAVES, family_for, from_hf_block, to_hf_block
from framework.checkpoint.run_tokenizer import checkpoint_tokenizer, export_tokenizer
from models.config import ModelConfig
from models.decoder import build_model

SAFETENSORS = "model.safetensors"


def _rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved RoPE rows -> half-split rows, per head: (H*E, D) with pairs (2i, 2i+1) -> (i, i+E/2)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def check_exportable(cfg: ModelConfig) -> str:
    """The HF model_type ("llama", "mixtral", "qwen2_moe", ...) that holds `cfg` exactly; else a CheckpointError
    naming the field."""
    def refuse(field: str, value: Any, why: str) -> CheckpointError:
        return CheckpointError(f"cannot export to Hugging Face: {field}={value!r} — {why}; train without it or "
                               f"keep the Tessera checkpoint")

    if cfg.mlp != "swiglu":
        raise refuse("model.mlp", cfg.mlp, "Llama/Mixtral blocks are SwiGLU without biases")
    if cfg.norm != "rmsnorm":
        raise refuse("model.norm", cfg.norm, "Llama/Mixtral use RMSNorm")
    if cfg.moe.enabled or cfg.attention == "mla":
        return family_for(cfg).model_type
    for field in ("qkv_bias", "qk_norm"):
        if getattr(cfg, field):
            raise refuse(f"model.{field}", True, "Llama has no q/k/v-only biases and no q/k norms")
    return "llama"


# The one table of Tessera <-> Hugging Face names, read in both directions (export and import).
_REQUIRED: Any = object()
CONFIG_KEYS: tuple[tuple[str, str, str, Any], ...] = (
    # (ModelConfig field, config.json key, ModelConfig attribute exported, default on import)
    ("vocab_size", "vocab_size", "vocab_size", _REQUIRED),
    ("hidden", "hidden_size", "hidden", _REQUIRED),
    ("n_layers", "num_hidden_layers", "n_layers", _REQUIRED),
    ("n_heads", "num_attention_heads", "n_heads", _REQUIRED),
    ("n_kv_heads", "num_key_value_heads", "kv_heads", None),
    ("max_seq_len", "max_position_embeddings", "max_seq_len", 4096),
    ("norm_eps", "rms_norm_eps", "norm_eps", 1e-5),
    ("tied_embeddings", "tie_word_embeddings", "tied_embeddings", False),
)
TOP_NAMES: tuple[tuple[str, str], ...] = (
    # (Tessera FQN, HF name); the head is absent from both when the embeddings are tied
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
LAYER_NAMES: tuple[tuple[str, str, str | None], ...] = (
    # (under layers.{i}., under model.layers.{i}., the ModelConfig head count whose RoPE halves HF interleaves)
    ("attention_norm.weight", "input_layernorm.weight", None),
    ("ffn_norm.weight", "post_attention_layernorm.weight", None),
    ("attention.wq.weight", "self_attn.q_proj.weight", "n_heads"),
    ("attention.wk.weight", "self_attn.k_proj.weight", "kv_heads"),
    ("attention.wv.weight", "self_attn.v_proj.weight", None),
    ("attention.wo.weight", "self_attn.o_proj.weight", None),
)
def hf_config(cfg: ModelConfig, arch: str, eos_id: int | None = None, bos_id: int | None = None,
              dtype: str = "float32") -> dict[str, Any]:
    """config.json for the HF model (written for both the transformers 4.x and 5.x field names); the special-token
    ids are the tokenizer's, null where it has none (or no tokenizer is known); `dtype` the weights'."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else FAMILIES[arch].architecture],
        "model_type": arch,
        **{key: getattr(cfg, attr) for _, key, attr, _ in CONFIG_KEYS}, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn,
        "hidden_act": "silu", "rope_theta": cfg.rope_theta, "rope_parameters": rope_parameters(cfg),
        "rope_scaling": rope_scaling_4x(cfg), "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id,
    }
    if arch == "llama":
        out["mlp_bias"] = False
    else:
        out.update(FAMILIES[arch].to_config(cfg))
    return out


# RopeScaling field -> HF rope_parameters key, and the keys each rope type may carry (transformers' validators).
_ROPE_KEYS = {"factor": "factor", "original_max_seq_len": "original_max_position_embeddings",
              "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
              "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}
_ROPE_FIELDS = {"none": (), "linear": ("factor",),
                "llama3": ("factor", "original_max_seq_len", "low_freq_factor", "high_freq_factor"),
                "yarn": ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "attention_factor", "mscale",
                         "mscale_all_dim", "truncate")}
# Top-level config.json keys (docs/CHECKPOINTS.md holds the same table): read into ModelConfig, or ignored as
# harmless (bookkeeping, inference switches, training-only noise/dropout); `_REQUIRED_VALUES` must hold a value
# Tessera's blocks compute; any other key is refused by name.
_MAPPED = {key for _, key, _, _ in CONFIG_KEYS} | {
    "model_type", "head_dim", "intermediate_size", "rope_theta", "rope_parameters", "rope_scaling"}
_REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {"hidden_act": ("silu",), "attention_bias": (False,),
                                                "mlp_bias": (False,), "sliding_window": (None,),
                                                "partial_rotary_factor": (None, 1, 1.0)}
_IGNORED = {"architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
            "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "pretraining_tp",
            "output_router_logits", "router_jitter_noise", "id2label", "label2id", "chunk_size_feed_forward",
            "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
            "tokenizer_class"}


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of `cfg` (rope_type, rope_theta and the scaling's keys)."""
    s = cfg.rope_scaling
    out: dict[str, Any] = {"rope_type": "default" if s.type == "none" else s.type, "rope_theta": cfg.rope_theta}
    for name in _ROPE_FIELDS[s.type]:
        value = getattr(s, name)
        if value is not None and not (name in ("mscale", "mscale_all_dim") and value == 0):
            out[_ROPE_KEYS[name]] = value
    return out


def rope_scaling_4x(cfg: ModelConfig) -> dict[str, Any] | None:
    """transformers 4's `rope_scaling` (None for plain RoPE)."""
    if cfg.rope_scaling.type == "none":
        return None
    params = {k: v for k, v in rope_parameters(cfg).items() if k != "rope_theta"}
    return {**params, "type": params["rope_type"]}


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, model.rope_scaling fields) from `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    def kind(d: dict[str, Any]) -> str:
        return str(d.get("rope_type", d.get("type", "default")))

    given = {key: hf[key] for key in ("rope_parameters", "rope_scaling") if isinstance(hf.get(key), dict)}
    scaled = {key: d for key, d in given.items() if kind(d) != "default"}
    if len({kind(d) for d in scaled.values()}) > 1:
        raise CheckpointError(f"config.json rope_parameters (rope_type={kind(given['rope_parameters'])!r}) and "
                              f"rope_scaling (rope_type={kind(given['rope_scaling'])!r}) disagree; keep one")
    params = next(iter(scaled.values()), given.get("rope_parameters", {}))
    where = next((key for key, d in given.items() if d is params), "rope_parameters")
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = "none" if kind(params) == "default" else kind(params)
    if rope_type not in _ROPE_FIELDS:
        raise CheckpointError(f"config.json {where}.rope_type={rope_type!r} is not supported; Tessera implements "
                              f"default, linear, llama3 and yarn (models/rope.py)")
    allowed = {_ROPE_KEYS[f]: f for f in _ROPE_FIELDS[rope_type]}
    out: dict[str, Any] = {"type": rope_type}
    for key, value in params.items():
        if key in ("rope_type", "type", "rope_theta"):
            continue
        if key == "partial_rotary_factor" and value in (1, 1.0):
            continue
        if key not in allowed:
            raise CheckpointError(f"config.json {where}.{key}={value!r} is not supported for rope_type="
                                  f"{rope_type!r}; supported keys: {sorted(allowed)}")
        if value is not None:
            out[allowed[key]] = value
    if rope_type in ("llama3", "yarn") and "original_max_seq_len" not in out:
        out["original_max_seq_len"] = hf.get("max_position_embeddings", 4096)  # transformers' default
    return theta, out


def _check_keys(hf: dict[str, Any], family_keys: frozenset[str]) -> None:
    for key, value in hf.items():
        if key in family_keys:
            continue
        if key in _REQUIRED_VALUES:
            if value not in _REQUIRED_VALUES[key]:
                raise CheckpointError(f"config.json {key}={value!r} cannot be imported: Tessera's Llama blocks "
                                      f"need {key} in {list(_REQUIRED_VALUES[key])}")
        elif key not in _MAPPED and key not in _IGNORED:
            raise CheckpointError(f"config.json key {key!r} is not known to the importer (docs/CHECKPOINTS.md "
                                  f"lists every key it maps, ignores or refuses); remove it if it is harmless")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The Tessera ModelConfig of an HF Llama or MoE-family config.json (every key checked against the tables)."""
    arch = hf.get("model_type")
    if arch != "llama" and arch not in FAMILIES:
        raise CheckpointError(f"config.json has model_type={arch!r}; only llama, {', '.join(FAMILIES)} can be "
                              f"imported")
    family = FAMILIES.get(str(arch))
    _check_keys(hf, family.keys if family else frozenset())
    theta, scaling = _rope_from_hf(hf)
    data: dict[str, Any] = {"ffn_hidden": hf["intermediate_size"], "rope_theta": theta, "rope_scaling": scaling}
    if family is not None:
        data.update(family.from_config(hf))
    for field, key, _, default in CONFIG_KEYS:
        value = hf[key] if default is _REQUIRED else hf.get(key, default)
        data[field] = type(default)(value) if default is not None and default is not _REQUIRED else value
    if data.get("attention") == "mla":  # every head has its own K/V from the latent; head_dim is the rotary one
        data["n_kv_heads"] = None
    elif hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        data["kv_channels"] = hf["head_dim"]
    cfg = from_dict(ModelConfig, data, "model")
    cfg.moe.validate()
    cfg.rope_scaling.validate()
    cfg.validate()
    return cfg


def _attention_names(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """(Tessera leaf, HF leaf, heads whose RoPE halves to permute or None) of a layer's attention tensors."""
    if cfg.attention == "mla":
        return [(f"attention.{leaf}", f"self_attn.{leaf}", None) for leaf in hf_deepseek.attention_names(cfg)]
    out = [(ours, hf, getattr(cfg, heads) if heads else None) for ours, hf, heads in LAYER_NAMES[2:]]
    return out + [(ours, hf, 1 if heads == "one" else getattr(cfg, heads) if heads else None)
                  for ours, hf, flag, heads in ATTENTION_EXTRAS if getattr(cfg, flag)]


def _permute(w: torch.Tensor, heads: int | None, inverse: bool = False) -> torch.Tensor:
    if heads is None:
        return w
    fn = _rope_unpermute if inverse else _rope_permute
    return fn(w, heads) if w.dim() == 2 else fn(w.unsqueeze(-1), heads).squeeze(-1)


def _blocks(cfg: ModelConfig, arch: str) -> list[tuple[str, str, int]]:
    """(Tessera prefix, HF prefix, layer id) of every transformer block HF holds: the layers, and for DeepSeek-V3
    the MTP depths' blocks after them (framework/checkpoint/hf_deepseek.py)."""
    mtp = hf_deepseek.mtp_blocks(cfg) if arch == "deepseek_v3" else []
    return [(f"layers.{i}.", f"model.layers.{i}.", i) for i in range(cfg.n_layers)] + mtp


def to_hf_state(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tessera model state (FQN -> tensor) -> HF tensors, by the name tables above and the family's."""
    arch = check_exportable(cfg)
    family = FAMILIES.get(arch)
    out = {hf: sd[ours] for ours, hf in TOP_NAMES if not (cfg.tied_embeddings and ours == "output.weight")}
    for t, h, i in _blocks(cfg, arch):
        out.update({h + hf: _permute(sd[t + ours], heads) for ours, hf, heads in _attention_names(cfg)})
        out.update({h + hf: sd[t + ours] for ours, hf, _ in LAYER_NAMES[:2]})
        if family is not None and cfg.is_moe_layer(i):
            out.update(to_hf_block(family, cfg, sd, t, h))
        else:
            out.update({f"{h}mlp.{leaf}.weight": sd[f"{t}feed_forward.{k}.weight"] for k, leaf in MLP_LEAVES})
    if arch == "deepseek_v3":
        out.update(hf_deepseek.mtp_to_hf(cfg, sd))
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor], arch: str = "llama") -> dict[str, torch.Tensor]:
    """HF tensors of model_type `arch` -> Tessera model state (the inverse of `to_hf_state`)."""
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tied_embeddings else {}
    sd = {ours: hf[tied.get(name, name)] for ours, name in TOP_NAMES}
    for t, h, i in _blocks(cfg, arch):
        names = [*_attention_names(cfg), *((ours, name, None) for ours, name, _ in LAYER_NAMES[:2])]
        missing = [h + name for _, name, _ in names if h + name not in hf]
        if missing:
            raise CheckpointError(f"HF weights lack {missing[0]} (and {len(missing) - 1} more of layer {i})")
        sd.update({t + ours: _permute(hf[h + name], heads, inverse=True) for ours, name, heads in names})
        if cfg.is_moe_layer(i):
            sd.update(from_hf_block(FAMILIES[arch], cfg, hf, t, h))
        else:
            sd.update({f"{t}feed_forward.{k}.weight": hf[f"{h}mlp.{leaf}.weight"] for k, leaf in MLP_LEAVES})
    if arch == "deepseek_v3":
        sd.update(hf_deepseek.mtp_from_hf(cfg, hf, sd))
    return {k: v.contiguous() for k, v in sd.items()}


def resolve_checkpoint(path: Path, step: int | None = None, verify: bool = True) -> Path:
    """A checkpoint directory from a run dir, a checkpoints dir or a step_N dir (`step`: that step).

    With `verify`, its files are checked against its manifest (sizes) before anything reads them: a named
    checkpoint that fails raises a CheckpointError naming the file; the latest one that fails is passed over for
    the newest valid earlier step, with a warning, as `tessera train` resumes.
    """
    from framework.checkpoint.manager import find_valid_checkpoint, verify_checkpoint

    for root in (path / "checkpoints", path):
        if step is not None and (root / ckpt.step_dir_name(step) / "meta.json").exists():
            found = root / ckpt.step_dir_name(step)
            break
        if step is None and (root / ckpt.LATEST).exists():
            failures: list[tuple[Path, str]] = []
            valid = find_valid_checkpoint(root, "size", failures) if verify else ckpt.latest_checkpoint(root)
            if valid is None:
                raise CheckpointError(f"no checkpoint under {root} passes its manifest check: "
                                      + "; ".join(f"{p.name}: {why}" for p, why in failures))
            return valid
    else:
        if not ((path / "meta.json").exists() and step is None):
            raise CheckpointError(f"no checkpoint{f' of step {step}' if step is not None else ''} under {path}; pass "
                                  f"a run directory, its checkpoints/ or a step_N directory (tessera ckpt inspect "
                                  f"lists them)")
        found = path
    if verify:
        verify_checkpoint(found, "size")
    return found


def load_model(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The model of checkpoint `path`, built from its saved config on CPU in fp32, and the checkpoint's meta."""
    meta = ckpt.read_meta(path)
    cfg = from_dict(ModelConfig, meta["config"]["model"], "model")
    model = build_model(cfg, seed=0, device="cpu")
    state = {"model": ckpt.model_state([model])}
    ckpt.load_state(path, state)
    model.load_state_dict(state["model"])
    return model, meta


def export_hf(src: Path, out: Path, step: int | None = None, tokenizer: Path | None = None,
              dtype: str = "float32") -> Path:
    """Write checkpoint `src` (run dir or step dir; `step` picks one) as an HF model directory `out`, its weights
    in `dtype` (float32: the checkpoint's fp32 exactly; bfloat16: rounded to nearest, as models are published)."""
    from safetensors.torch import save_file

    path = resolve_checkpoint(src, step)
    model, meta = load_model(path)
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    arch = check_exportable(cfg)
    if cfg.mtp_depth and arch != "deepseek_v3":  # a training aid: the main model's logits do not read them
        get_logger("checkpoint").warning(
            f"export-hf: model.mtp_depth={cfg.mtp_depth}: {arch} has no place for multi-token prediction modules; "
            f"the {cfg.mtp_depth} MTP module(s) are not exported (DeepSeek-V3 keeps them as extra layers)")
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in to_hf_state(cfg, model.state_dict()).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SAFETENSORS), metadata={"format": "pt", "tessera_checkpoint": str(path),
                                                          "tessera_step": str(meta.get("step"))})
    tok = tokenizer or checkpoint_tokenizer(meta, path)
    bos = eos = None
    if tok is not None:
        export_tokenizer(tok, out)
        from data_pipeline.tokenizer import Tokenizer

        loaded = Tokenizer(tok)  # sentencepiece .model or tokenizer.json; -1: the tokenizer has no such token
        bos, eos = (i if i >= 0 else None for i in (loaded.bos_id, loaded.eos_id))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, arch, eos, bos, dtype), indent=2))
    return out


def import_hf(src: Path, run_dir: Path) -> Path:
    """Write HF model `src` (config.json + safetensors) as a model-only Tessera checkpoint `step_0` of `run_dir`.

    Training with `run.dir=<run_dir>` and the same model config then starts from these weights (fresh
    optimizer, step 0).
    """
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src} holds no *.safetensors file; export it with safe_serialization=True")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    hf_cfg = hf_deepseek.without_absent_mtp(json.loads((src / "config.json").read_text()), set(tensors))
    cfg = config_from_hf(hf_cfg)
    if hf_cfg.get("rope_interleave") is False:
        tensors = hf_deepseek.interleave_rope_rows(cfg, tensors)
    model = build_model(cfg, seed=0, device="cpu")
    reads = _ReadLog(tensors)
    model.load_state_dict(from_hf_state(cfg, reads, hf_cfg["model_type"]))
    unread = sorted(k for k in set(tensors) - reads.read if not k.endswith("rotary_emb.inv_freq")
                    and not (cfg.tied_embeddings and k == "lm_head.weight"))
    if unread:
        raise CheckpointError(f"{src}: {len(unread)} HF tensors have no place in the Tessera model, e.g. "
                              f"{unread[:3]}; their config.json fields are not mapped (nothing is dropped silently)")
    return save_model_only(model, run_dir, str(src))


class _ReadLog(dict[str, torch.Tensor]):
    """A tensor dict that records which names were read."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.read.add(key)
        return super().get(key, default)


def save_model_only(model: nn.Module, run_dir: Path, source: str) -> Path:
    """Write `model` (a Decoder on CPU) as the model-only checkpoint step_0 of `run_dir`."""
    root = run_dir / "checkpoints"
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    meta = {"model_only": True, "loader": {"consumed_samples": 0}, "source": source,
            "config": {"model": to_dict(cfg)}}
    tmp = ckpt.begin_save(root, 0)
    ckpt.write_shards({"model": ckpt.model_state([model])}, tmp)
    return ckpt.commit(root, 0, meta)
