"""The checkpoint error family (no torch here, so the exporter's preset path and its command line can use it).

Every error is a ``ValueError`` (``CheckpointNotFoundError`` is also a ``FileNotFoundError``) whose message names
the tensor and the file being read. :mod:`dsv4_ort.models.checkpoint` re-exports these classes.
"""

from __future__ import annotations

import os

__all__ = ["CheckpointError", "CheckpointNotFoundError", "MissingTensorError", "UnexpectedTensorError",
           "ShapeMismatchError", "DtypeMismatchError", "CorruptCheckpointError", "UnsupportedModelError"]


class CheckpointError(ValueError):
    """Base class; ``tensor`` and ``file`` name what was being read."""

    def __init__(self, message: str, tensor: str | None = None, file: str | os.PathLike | None = None):
        self.tensor = tensor
        self.file = os.fspath(file) if file is not None else None
        parts = [message]
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if self.file is not None:
            parts.append(f"file {self.file!r}")
        super().__init__(" | ".join(parts))


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A required file (config.json, a shard, the checkpoint itself) does not exist."""


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class DtypeMismatchError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    """Unreadable / truncated shard, bad header, invalid encodings."""


class UnsupportedModelError(CheckpointError):
    """config.json describes another architecture / model_type."""
