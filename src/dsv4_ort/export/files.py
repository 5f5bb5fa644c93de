"""The files of an exported model and what ties them together; read by the exporter and the runtime (no onnx, no
torch: the runtime imports this module).

A model directory holds ``model.onnx`` (the graph), ``model.onnx.data`` (its weights, external data),
``dsv4_ort.json`` (what the runtime needs: state tensors, capacity, config) and, when the checkpoint had them, the
tokenizer files. The three model files carry one export id, fresh for every export: ``export_id`` in the JSON,
``dsv4_ort.export_id`` in the graph's metadata and a trailer after the last tensor of the data file. The runtime
refuses a directory whose ids disagree, so files of two exports never run together.
"""

from __future__ import annotations

import os

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
META_FILE = "dsv4_ort.json"
FORMAT_VERSION = 3  # 2: the export id (JSON, graph metadata, data trailer); 3: element types spelled as ONNX does ("float")

_TRAILER_MAGIC = b"DSV4ORT-EXPORT-ID:"
TRAILER_SIZE = len(_TRAILER_MAGIC) + 32 + 1


def export_trailer(export_id: str) -> bytes:
    """The bytes ending model.onnx.data: a magic string and the export id (past the last tensor; ORT never reads
    them)."""
    return _TRAILER_MAGIC + export_id.encode() + b"\n"


def read_export_trailer(data_path: str | os.PathLike) -> str | None:
    """The export id at the end of a data file, or None when it has none."""
    with open(data_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < TRAILER_SIZE:
            return None
        f.seek(-TRAILER_SIZE, os.SEEK_END)
        tail = f.read(TRAILER_SIZE)
    if not tail.startswith(_TRAILER_MAGIC) or not tail.endswith(b"\n"):
        return None
    return tail[len(_TRAILER_MAGIC):-1].decode("ascii", "replace")
