"""safetensors files without the safetensors package's whole-file reads: header parsing with integrity checks, a
streaming shard reader (one tensor or one expert slice at a time) and a streaming shard writer."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from typing import Any

import torch

from .errors import CheckpointNotFoundError, CorruptCheckpointError, DtypeMismatchError, ShapeMismatchError

ST_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float64: ("F64", 8),
    torch.float32: ("F32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.int64: ("I64", 8),
    torch.int32: ("I32", 4),
    torch.int16: ("I16", 2),
    torch.int8: ("I8", 1),
    torch.uint8: ("U8", 1),
    torch.bool: ("BOOL", 1),
    torch.float8_e4m3fn: ("F8_E4M3", 1),
}
if getattr(torch, "float8_e8m0fnu", None) is not None:
    ST_DTYPES[torch.float8_e8m0fnu] = ("F8_E8M0", 1)
if getattr(torch, "float8_e5m2", None) is not None:
    ST_DTYPES[torch.float8_e5m2] = ("F8_E5M2", 1)
_ST_SIZES = {code: size for code, size in ST_DTYPES.values()}


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header and check that every tensor's bytes are inside the file.

    Returns ``(header without __metadata__, data start offset)``. Raises
    :class:`CorruptCheckpointError` naming the first tensor whose bytes are missing.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError("shard file not found", file=path) from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block the read (or never end)
        raise CorruptCheckpointError("shard is not a regular file", file=path)
    size = st.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"truncated shard ({size} bytes, no header)", file=path)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CorruptCheckpointError(f"truncated shard: header of {n} bytes in a {size}-byte file", file=path)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"unreadable safetensors header ({e})", file=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError("safetensors header is not a JSON object", file=path)
    header.pop("__metadata__", None)
    data_len = size - 8 - n

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for name, info in header.items():  # well-formed entries only (a crafted header must not reach the reader)
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(info.get("shape"), list) and all(map(count, info["shape"]))
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and all(map(count, info["data_offsets"]))):
            raise CorruptCheckpointError("malformed header entry", tensor=name, file=path)
        if info["data_offsets"][0] > info["data_offsets"][1]:
            raise CorruptCheckpointError(f"data_offsets {info['data_offsets']} end before they begin", tensor=name,
                                         file=path)
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        shape = info["shape"]
        code = info["dtype"]
        if end > data_len:
            raise CorruptCheckpointError(
                f"truncated shard: tensor bytes [{begin}, {end}) beyond the {data_len} data bytes present",
                tensor=name,
                file=path,
            )
        itemsize = _ST_SIZES.get(code)
        if itemsize is not None and math.prod(shape) * itemsize != end - begin:
            raise CorruptCheckpointError(
                f"header size mismatch: shape {shape} {code} needs {math.prod(shape) * itemsize} bytes, "
                f"offsets give {end - begin}",
                tensor=name,
                file=path,
            )
    return header, 8 + n

__all__ = ["ST_DTYPES", "read_header", "ShardReader", "StreamingShardWriter"]


class StreamingShardWriter:
    """Write one safetensors file whose tensor list is known up front, one tensor at a time."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        self.path = path
        self.order = [s[0] for s in specs]
        self.expect = {}
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        off = 0
        for name, dtype, shape in specs:
            code, size = ST_DTYPES[dtype]
            nbytes = math.prod(shape) * size
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self.expect[name] = (dtype, tuple(shape), nbytes)
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * ((-len(raw)) % 8)
        self.total = off
        self.pos = 0
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self.order[self.pos]
        dtype, shape, nbytes = self.expect[name]
        if name != want or t.dtype != dtype or tuple(t.shape) != shape:
            raise RuntimeError(f"writer got {name} {t.dtype} {tuple(t.shape)}, expected {want} {dtype} {shape}")
        if nbytes:
            self.f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
        self.pos += 1

    def close(self) -> None:
        if self.pos != len(self.order):
            raise RuntimeError(f"{self.path}: wrote {self.pos} of {len(self.order)} tensors")
        self.f.close()


_ST_CODES = {code: dt for dt, (code, _) in ST_DTYPES.items()}


class ShardReader:
    """Reads tensors of one safetensors file with plain ``readinto`` calls.

    Every tensor gets its own memory (no memory map): the result never aliases the file, so the
    file may be rewritten while tensors or models loaded from it are alive, and resident memory
    holds only the tensors kept by the caller.
    """

    def __init__(self, path: str):
        self.path = path
        self.header, self.data_start = read_header(path)
        self.f = open(path, "rb")

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (or its slice ``[index]`` along dim 0)."""
        info = self.header[name]
        code = info["dtype"]
        dtype = _ST_CODES.get(code)
        if dtype is None:
            raise DtypeMismatchError(f"unsupported safetensors dtype {code}", tensor=name, file=self.path)
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise ShapeMismatchError(f"index {index} outside dim 0 of shape {shape}", tensor=name, file=self.path)
            per = (end - begin) // shape[0]
            begin, end, shape = begin + index * per, begin + (index + 1) * per, shape[1:]
        out = torch.empty(shape, dtype=dtype)
        n = end - begin
        if n:
            self.f.seek(self.data_start + begin)
            got = self.f.readinto(memoryview(out.view(torch.uint8).reshape(-1).numpy()))
            if got != n:
                raise CorruptCheckpointError(f"short read: {got} of {n} bytes", tensor=name, file=self.path)
        return out
