"""`tessera ckpt` — look at, convert, export and import checkpoints.

    tessera ckpt inspect PATH [--step N] [--tensors]    checkpoints of a run, meta, manifest check, tensor shapes
    tessera ckpt convert SRC OUT [--step N] [--dtype bf16] [--model-only]
                                                         offline layout change: one consolidated shard file
    tessera ckpt export-hf RUN --step N OUT [--tokenizer tokenizer.model]
                                                         HF Llama (dense) / Mixtral (MoE) safetensors + tokenizer
    tessera ckpt import-hf HF_DIR RUN_DIR                HF weights -> RUN_DIR/checkpoints/step_0 (model only)

PATH/SRC/RUN may be a run directory, its checkpoints/ directory or one step_N directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def register(subparsers: Any) -> None:
    """Add `tessera ckpt ...` to the top-level parser (argparse only; imports happen in the handlers)."""
    p = subparsers.add_parser("ckpt", help="inspect, convert, export (Hugging Face) and import checkpoints")
    sub = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    q = sub.add_parser("inspect", help="list checkpoints, verify the manifest, show meta and tensors")
    q.add_argument("path", type=Path)
    q.add_argument("--step", type=int, default=None)
    q.add_argument("--tensors", action="store_true", help="list every tensor with shape and dtype")
    q.set_defaults(func=cmd_inspect)
    q = sub.add_parser("convert", help="rewrite a checkpoint as one consolidated shard (any layout loads it)")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path, help="run directory to write OUT/checkpoints/step_N into")
    q.add_argument("--step", type=int, default=None)
    q.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast model weights (not optimizer)")
    q.add_argument("--model-only", action="store_true", help="drop the optimizer state")
    q.set_defaults(func=cmd_convert)
    q = sub.add_parser("export-hf",
                       help="write a Hugging Face Llama, Mixtral, Qwen2/3-MoE or DeepSeek-V3 model directory")
    q.add_argument("run", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--step", type=int, default=None, help="default: latest")
    q.add_argument("--tokenizer", type=Path, default=None,
                   help="sentencepiece .model (default: the run's data build, when it has one)")
    q.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the exported weights' dtype (default float32, the checkpoint's values exactly)")
    q.set_defaults(func=cmd_export_hf)
    q = sub.add_parser("import-hf",
                       help="a Hugging Face Llama, Mixtral, Qwen2/3-MoE or DeepSeek-V3 directory as a Tessera "
                            "checkpoint")
    q.add_argument("src", type=Path)
    q.add_argument("run_dir", type=Path)
    q.set_defaults(func=cmd_import_hf)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_inspect(args: argparse.Namespace) -> int:
    from framework.base.errors import CheckpointError
    from framework.checkpoint import dcp as ckpt
    from framework.checkpoint.hf import resolve_checkpoint
    from framework.checkpoint.manager import verify_checkpoint
    from framework.checkpoint.storage import SafeFileSystemReader

    root = args.path / "checkpoints" if (args.path / "checkpoints").is_dir() else args.path
    if (root / ckpt.LATEST).exists() or list(root.glob("step_*")):
        latest = ckpt.latest_checkpoint(root)
        print(f"checkpoints in {root} (latest -> {latest.name if latest else None}):")
        for p in sorted(root.glob("step_*"), key=lambda p: ckpt.step_of(p) or 0):
            try:
                verify_checkpoint(p, "size")
                status = "ok"
            except CheckpointError as err:
                status = f"INVALID: {err}"
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            print(f"  {p.name:<12} {_human(size):>10}  {status}")
    path = resolve_checkpoint(args.path, args.step, verify=False)  # the verdict below names what fails
    try:
        verify_checkpoint(path, "checksum")
        verdict = "manifest verified (sizes and xxh3 checksums)"
    except CheckpointError as err:
        verdict = f"VERIFY FAILED: {err}"
    meta = ckpt.read_meta(path)
    print(f"\n{path}: {verdict}")
    for key in ("step", "world_size", "loader", "data_fingerprint", "guard", "model_only"):
        if key in meta:
            value = meta[key]
            if key == "guard":
                value = {k: v for k, v in value.items() if k != "history"}
            print(f"  {key:<17}: {json.dumps(value)}")
    model = (meta.get("config") or {}).get("model") or {}
    print("  model            : " + ", ".join(f"{k}={model[k]}" for k in ("preset", "hidden", "n_layers", "n_heads",
                                                                            "vocab_size") if k in model))
    md = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    n_params = sum(_numel(m) for k, m in md.items() if k.startswith("model."))
    print(f"  tensors          : {len(md)} entries, {n_params:,} model parameters")
    if args.tensors:
        for key, m in sorted(md.items()):
            shape = tuple(getattr(m, "size", ())) if hasattr(m, "size") else "bytes"
            dtype = str(m.properties.dtype).replace("torch.", "") if hasattr(m, "properties") else ""
            print(f"    {key:<60} {shape!s:<20} {dtype}")
    return 0


def _numel(m: Any) -> int:
    size = getattr(m, "size", None)
    if size is None:
        return 0
    n = 1
    for d in size:
        n *= int(d)
    return n


def cmd_convert(args: argparse.Namespace) -> int:
    from framework.checkpoint.convert import convert_checkpoint

    out = convert_checkpoint(args.src, args.out, step=args.step, dtype=_DTYPES.get(args.dtype or ""),
                             model_only=args.model_only)
    print(f"wrote {out}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from framework.checkpoint.hf import export_hf

    out = export_hf(args.run, args.out, step=args.step, tokenizer=args.tokenizer, dtype=args.dtype)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported to {out}: {files}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from framework.checkpoint.hf import import_hf

    path = import_hf(args.src, args.run_dir)
    print(f"imported {args.src} as {path}; train with run.dir={args.run_dir} and the same model config")
    return 0
