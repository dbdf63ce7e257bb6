"""Phases of the GPU check (bench/gpu_bench.py runs them): attention kernels at Tessera's shapes, the plain-PyTorch
reference beside Tessera's step (framework tax), and the 70B rank-0 slice (bench/gpu_slice.py, its own process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

KERNEL_OPS = ("flash", "efficient", "cudnn", "math", "flex_attention")
"""Substrings of the aten op names that tell which SDPA kernel ran (`aten::_scaled_dot_product_flash_attention`,
`..._efficient_attention`, `..._cudnn_attention`, `..._flash_attention_for_cpu`, `..._attention_math`)."""


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, reps: int = 3) -> float:
    """Median seconds of fn() + backward after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        fn().float().sum().backward()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _kernels_run(fn: Callable[[], torch.Tensor]) -> list[str]:
    """The attention ops dispatched by one forward of fn (the profiler's aten op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    aten = {n for n in names if n.startswith("aten::") and "attention" in n and any(k in n for k in KERNEL_OPS)}
    compiled = {n for n in names if "compiled" in n.lower()}  # FlexAttention's kernel is an inductor-compiled region
    return sorted(aten | compiled)


def sdpa_rows(shapes: dict[str, tuple[int, int, int]], seq: int, device: torch.device) -> list[dict[str, Any]]:
    """For each model's (query heads, KV heads, head dim) at `seq`: which kernel each of Tessera's attention paths
    takes (models/attention.py `attend`, models/layers.py `masked_attention`), whether flash takes the plain
    causal call when forced (torch.nn.attention.sdpa_kernel), and the forward + backward time of each path."""
    return [_sdpa_row(name, *shape, seq, device) for name, shape in shapes.items()]


def _sdpa_row(name: str, h: int, kv: int, e: int, seq: int, device: torch.device) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.attention import DocumentMask, attend, dense_document_mask, document_mask
    from models.layers import masked_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def qkv(heads: int) -> torch.Tensor:  # (B, heads, T, E) as the layer makes it: a transposed (B, T, heads, E)
        x = torch.randn(1, seq, heads, e, generator=gen).to(device, dtype)
        return x.transpose(1, 2).requires_grad_(True)

    q, k, v = qkv(h), qkv(kv), qkv(kv)
    doc = torch.cumsum(torch.rand(1, seq, generator=gen) < 8.0 / seq, dim=1).to(device)  # ~8 documents
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    explicit = torch.zeros(1, 1, seq, seq, device=device, dtype=dtype).masked_fill_(~causal, float("-inf"))
    paths: dict[str, Callable[[], torch.Tensor]] = {
        "causal": lambda: attend(q, k, v, None),
        "document": lambda: attend(q, k, v, document_mask(doc)),  # FlexAttention on CUDA, dense on CPU
        "document_dense": lambda: attend(q, k, v, DocumentMask(doc, dense=dense_document_mask(doc))),
        "explicit_mask": lambda: masked_attention(q, k, v, explicit, expand_kv=device.type == "cuda"),
    }
    row: dict[str, Any] = {"model": name, "heads": h, "kv_heads": kv, "head_dim": e, "seq": seq, "dtype": str(dtype)}
    for path, fn in paths.items():
        try:
            row[f"{path}_kernels"] = _kernels_run(fn)
            row[f"{path}_ms"] = 1e3 * _timed(fn, device)
        except Exception as exc:  # one path's failure is its finding
            row[f"{path}_error"] = f"{type(exc).__name__}: {exc}"[:500]
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row["causal_flash_forced_ms"] = 1e3 * _timed(paths["causal"], device)
        row["causal_flash_eligible"] = True
    except RuntimeError as exc:  # "No available kernel": flash refuses this call
        row.update(causal_flash_eligible=False, causal_flash_error=str(exc)[:500])
    row["ok"] = row["causal_flash_eligible"] and any("flash" in n for n in row.get("causal_kernels", []))
    return row


def reference_model(cfg: Any, state: dict[str, torch.Tensor], device: torch.device | None = None) -> torch.nn.Module:
    """bench/ref_llama.py's Llama of a Tessera ModelConfig, holding the weights `state` (a Tessera state dict)."""
    from bench.ref_llama import Llama
    from models.init import canonical_fqn

    if (cfg.moe.enabled or cfg.attention != "gqa" or cfg.mlp != "swiglu" or cfg.norm != "rmsnorm" or cfg.qk_norm
            or cfg.mtp_depth or cfg.qkv_bias or cfg.rope_scaling.type != "none"
            or cfg.head_dim * cfg.n_heads != cfg.hidden):
        raise ValueError(f"the plain reference is a Llama: model {cfg.preset!r} is not one")
    with torch.device("meta"):
        model = Llama(cfg.vocab_size, cfg.hidden, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn, cfg.norm_eps,
                      cfg.rope_theta, tied=cfg.tied_embeddings)
    model.to_empty(device=device or torch.device("cpu"))
    if cfg.tied_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.load_state_dict({canonical_fqn(k): v for k, v in state.items()}, strict=True)
    return model


def reference_step_s(cfg: Any, state: dict[str, torch.Tensor], device: torch.device, batch: torch.Tensor,
                     compiled: bool, backend: str, steps: int) -> tuple[float, float]:
    """(steady step seconds, peak GiB) of the plain Llama training as Tessera's LocalEngine does: fp32 weights,
    bf16 autocast on CUDA, cross-entropy, grad clip 1.0, fused AdamW (foreach on CPU); blocks compiled alike."""
    model = reference_model(cfg, state, device)
    layers: torch.nn.ModuleDict = model.layers  # type: ignore[assignment]
    if compiled:
        for key in list(layers.keys()):
            layers[key] = torch.compile(layers[key], backend=backend, fullgraph=True, dynamic=False)  # type: ignore[assignment]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda, foreach=not cuda)
    inputs, labels = batch[..., :-1], batch[..., 1:]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[2:] or times)[: max(1, len(times[2:]) - 1)]  # as gpu_bench.throughput
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return sum(steady) / len(steady), peak


def rank0_slice(dry: bool, timeout_s: float) -> dict[str, Any]:
    """bench/gpu_slice.py in its own process (its fake world needs a process without a process group)."""
    cmd = [sys.executable, str(ROOT / "bench/gpu_slice.py"), *(["--dry"] if dry else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"gpu_slice.py exit {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
