"""The manifest catches a file that *grew* since the save (a second writer appended, a copy onto a non-empty file),
in both verification modes, and a same-size change in checksum mode only (the negative control: size mode is
not expected to see it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.base.errors import CheckpointError
from framework.checkpoint.manifest import verify_manifest, write_manifest


def _ckpt(root: Path) -> Path:
    root.mkdir()
    (root / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (root / "meta.json").write_text('{"step": 3}')
    write_manifest(root)
    verify_manifest(root, "checksum")
    verify_manifest(root, "size")
    return root


@pytest.mark.parametrize("mode", ["size", "checksum"])
def test_a_file_that_grew_fails_verification(tmp_path: Path, mode: str) -> None:
    ckpt = _ckpt(tmp_path / "step_3")
    with (ckpt / "__0_0.distcp").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match=r"has 10241 bytes, the manifest records 10240"):
        verify_manifest(ckpt, mode)  # type: ignore[arg-type]


def test_same_size_corruption_needs_checksums(tmp_path: Path) -> None:
    ckpt = _ckpt(tmp_path / "step_3")
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[5000] ^= 0x01
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    verify_manifest(ckpt, "size")
    with pytest.raises(CheckpointError, match=r"bytes are corrupt"):
        verify_manifest(ckpt, "checksum")
