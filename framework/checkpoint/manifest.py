"""The integrity manifest of a checkpoint: every file's size and 64-bit checksum (xxh3), verified on load.

`manifest.json` is written last, just before the checkpoint directory is renamed into place, so a checkpoint
whose manifest is missing was never committed, and a file whose size or checksum disagrees was truncated or
corrupted after the commit (a full disk, a bad copy, a bit flip). Either way `verify_manifest` raises a
`CheckpointError` that names the file, and the caller falls back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

from framework.base.errors import CheckpointError

try:
    import xxhash
except ImportError:  # a minimal install (the GPU machine) still trains: checksums fall back to blake2b
    xxhash = None  # type: ignore[assignment]

MANIFEST = "manifest.json"
VERSION = 1
_CHUNK = 1 << 22

VerifyMode = Literal["checksum", "size", "none"]


def default_algo() -> str:
    """xxh3 where the xxhash package is installed, else blake2b (slower, in the standard library)."""
    return "xxh3" if xxhash is not None else "blake2b64"


def file_checksum(path: Path, algo: str | None = None) -> str:
    """64-bit checksum of a file's bytes as 16 hex digits: xxh3 (several GB/s, fast enough for every load)."""
    algo = algo or default_algo()
    if algo == "xxh3" and xxhash is None:
        raise CheckpointError(f"{path}: the manifest uses xxh3 checksums but the xxhash package is not "
                              f"installed; pip install xxhash, or load with checkpoint.verify=size")
    h: Any = xxhash.xxh3_64() if algo == "xxh3" else hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """Checksum every file under `ckpt_dir` and write `manifest.json` (atomically); return the manifest."""
    algo = default_algo()
    files = {str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "checksum": file_checksum(p, algo)}
             for p in _files(ckpt_dir)}
    manifest = {"version": VERSION, "algo": algo, "files": files}
    tmp = ckpt_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, ckpt_dir / MANIFEST)
    return manifest


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} has no {MANIFEST}: the save never committed (it was interrupted); "
            f"delete the directory or resume from an earlier step")
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from err
    if manifest.get("version") != VERSION or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} has version {manifest.get('version')!r}, expected {VERSION}; it is corrupt "
                              f"or from an incompatible Tessera")
    return manifest


def verify_manifest(ckpt_dir: Path, mode: VerifyMode = "checksum") -> None:
    """Check every file listed in the manifest exists with its recorded size (and checksum).

    Raises:
        CheckpointError: naming the first missing, truncated or corrupt file.
    """
    if mode == "none":
        return
    manifest = read_manifest(ckpt_dir)
    if mode == "checksum" and manifest.get("algo", "xxh3") == "xxh3" and xxhash is None:
        # A minimal install must not condemn every checkpoint: sizes still catch truncation.
        logging.getLogger("tessera.checkpoint").warning(
            "%s: the manifest has xxh3 checksums but the xxhash package is not installed; verifying file sizes "
            "only (pip install xxhash for full verification)", ckpt_dir.name)
        mode = "size"
    for rel, want in manifest["files"].items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} listed in the manifest is missing; the checkpoint is "
                                  f"incomplete — restore it or resume from an earlier step")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"checkpoint file {path} has {size} bytes, the manifest records {want['size']}: it was truncated "
                f"or overwritten after the save; restore it or resume from an earlier step")
        if mode == "checksum":
            got = file_checksum(path, manifest.get("algo", "xxh3"))
            if got != want["checksum"]:
                raise CheckpointError(
                    f"checkpoint file {path} has checksum {got}, the manifest records {want['checksum']}: its "
                    f"bytes are corrupt; restore it or resume from an earlier step")
