"""DCP storage that never unpickles code.

DCP stores tensors with `torch.save` (read back with `weights_only=True`), but its `.metadata` file is a plain
pickle and non-tensor values (optimizer hyper-parameters) come back through an unrestricted torch load.
`SafeFileSystemReader` reads `.metadata` with an unpickler that only resolves DCP's own metadata classes and
torch dtypes/layouts, and `SafeLoadPlanner` loads byte items with `weights_only=True`: a crafted checkpoint can
make a load fail, never run code.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from framework.base.errors import CheckpointError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_PLAIN = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif (module, name) in _PLAIN:
            return super().find_class(module, name)
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
                return obj
        raise CheckpointError(
            f"checkpoint metadata references {module}.{name}, which is not a DCP metadata type; refusing to "
            f"unpickle it (the file is corrupt or was crafted); restore the checkpoint from a trusted copy")


def read_dcp_metadata(stream: Any) -> Metadata:
    """Unpickle a DCP `.metadata` stream, allowing only DCP metadata classes and torch dtypes."""
    try:
        meta = _MetadataUnpickler(stream).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"checkpoint metadata is unreadable ({err}); the checkpoint is corrupt") from err
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"checkpoint metadata holds a {type(meta).__name__}, not DCP Metadata; it is corrupt")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """A `FileSystemReader` whose metadata load resolves only allow-listed classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_dcp_metadata(stream)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
