"""Reading ``torch.distributed.checkpoint`` (DCP) directories without arbitrary unpickling.

DCP stores tensors with ``torch.save`` and reads them with ``weights_only=True``, but two
of its paths unpickle freely: the directory's ``.metadata`` file is a plain pickle
(``FileSystemReader.read_metadata``), and non-tensor values are read with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``).  A crafted
checkpoint could run code through either.  Here the metadata is read by an unpickler that
only builds DCP's own metadata classes, dtypes, sizes and paths, and byte items are
refused: roundpipe writes no values through DCP (they travel in ``roundpipe.pt``, read
with ``weights_only=True``), so a byte item in one of its checkpoints is a forgery.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointError

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"the checkpoint's DCP metadata names {module}.{name}, which DCP metadata never "
            "holds; roundpipe refuses to unpickle it (the file may be forged): load only "
            "checkpoints written by roundpipe.save_checkpoint")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata unpickling is restricted to DCP's classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata "
                                  f"(found {type(metadata).__name__})")
        for info in (metadata.storage_data or {}).values():
            name = getattr(info, "relative_path", "")
            if not isinstance(name, str) or os.path.basename(name) != name \
                    or name in ("", ".", ".."):
                raise CheckpointError(
                    f"the checkpoint's DCP metadata points at {name!r}, outside its "
                    "directory; roundpipe reads only the checkpoint's own files (the "
                    "metadata may be forged)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only: a byte item would be unpickled with ``weights_only=False``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"the checkpoint stores {read_item.dest_index.fqn!r} as pickled bytes, which "
            "roundpipe never writes and refuses to unpickle: load only checkpoints written "
            "by roundpipe.save_checkpoint")
