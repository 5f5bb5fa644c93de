"""Checkpoint tensors -> ONNX initializers in one external-data file, streamed.

Every checkpoint tensor is converted (or kept in its native format) and written to the data file as soon as it is
read, then dropped; only the bookkeeping (name, element type, dims, offset, length) stays in memory. The routed
experts of a layer become stacked ``[E, ...]`` tensors: the first expert seen reserves the whole region
(``E x`` its byte size) and every expert is written into its slot, so experts may arrive in any order and no
stacked tensor is ever held in memory. Peak memory is therefore about one checkpoint tensor (plus its float32
dequantisation when converting) on top of the fixed overhead.

Weight modes (``--weights``):

* ``native`` - as stored: FP8 E4M3 weights as ``FLOAT8E4M3FN`` + block scales (E8M0 bytes as ``UINT8``, float
  scales as ``FLOAT``), packed FP4 E2M1 experts as ``UINT8`` ``[out, in/2]`` + E8M0 ``UINT8`` scales
  ``[out, in/32]``, bf16 as ``BFLOAT16``, float32 as ``FLOAT``;
* ``bf16`` - every matrix (linears, experts, embedding, head) dequantised exactly to float32 then rounded to
  ``BFLOAT16`` (FP8/FP4 values times power-of-two scales are exact in bf16); small parameters keep their type;
* ``fp32`` - every floating tensor ``FLOAT``.

Requantisation (``--head`` / ``--dense``, default ``native``): fewer bytes per decoded token. The LM head and / or
the dense projections (attention, compressor and indexer query/key projections and the shared experts; never the
routers, the embedding or the routed experts) are quantised from their exact value to FP8 E4M3 with E8M0 128 x 128
block scales (``fp8``, as the released linears) or FP4 E2M1 with E8M0 scales per 32 inputs (``fp4``, as the
released experts); see :func:`requantize`. A weight already in the asked format is kept as it is.

Small parameters (norm weights, mHC mixing tensors, sinks, ape, gate bias) are written ``FLOAT`` unless the op
consuming them accepts ``BFLOAT16`` and they are stored bf16 (see :func:`param_dtype`); ``tid2eid`` keeps its
integer type. float16 tensors (not used by DeepSeek, accepted anyway) become ``FLOAT``.

Sources: checkpoint tensors arrive as :class:`~dsv4_ort.models.checkpoint.RawTensor` (torch tensors); the random
preset weights as :class:`~dsv4_ort.models.synthetic.ArrayTensor` (numpy arrays), which are converted with numpy
alone, so a preset export needs neither torch nor safetensors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import re
import sys

import numpy as np
from onnx import TensorProto

from .schema import element_type

# File offsets of all tensors are multiples of this: onnxruntime memory-maps external data whose offset is
# aligned to the page size / allocation granularity instead of copying it.
ALIGNMENT = 4096

WEIGHT_MODES = ("native", "bf16", "fp32")
REQUANT_FORMATS = ("native", "fp8", "fp4")


_EXPERT_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")  # main or MTP block
_SHARED_RE = re.compile(r"^layers\.(\d+)\.ffn\.shared_experts\.(w[123])\.weight$")


class WeightFormatError(ValueError):
    """A checkpoint tensor's format cannot be exported (names the tensor and the file)."""


# ----------------------------------------------------------------------------------------------------- roles


def tensor_role(name: str) -> str:
    """``matrix`` (a linear / expert / embedding / head weight), ``index`` (tid2eid) or ``param``."""
    if name.endswith("tid2eid"):
        return "index"
    if name in ("embed.weight", "head.weight"):
        return "matrix"
    leaf = name.rsplit(".", 2)
    if name.endswith(".weight") and len(leaf) >= 2 and leaf[-2] in (
            "wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wgate", "weights_proj", "gate", "w1", "w2", "w3",
            "e_proj", "h_proj"):  # the last two: the MTP block's input projections
        return "matrix"
    return "param"


def stacked_name(name: str) -> tuple[str, int] | None:
    """``layers.L.ffn.experts.E.wX.weight`` -> (``layers.L.ffn.experts.wX.weight``, E) (``mtp.J.`` alike); else
    None."""
    m = _EXPERT_RE.match(name)
    if m is None:
        return None
    return f"{m.group(1)}.ffn.experts.{m.group(3)}.weight", int(m.group(2))


def scale_initializer_name(weight_name: str) -> str:
    """``X.weight`` -> ``X.scale`` (the block scales of a quantised weight)."""
    return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else weight_name + ".scale"


# ----------------------------------------------------------------------------------------------------- conversion


@dataclasses.dataclass
class Piece:
    """One converted tensor to write: initializer name, ONNX element type, dims and the bytes."""

    name: str
    dtype: int
    dims: tuple
    data: "torch.Tensor | np.ndarray"  # any dtype; written as its raw bytes


@dataclasses.dataclass
class Converted:
    """A checkpoint weight after conversion: the weight piece, its scale piece (quantised), the format tag."""

    weight: Piece
    scale: Piece | None
    fmt: str  # "fp8" | "fp4" | "bf16" | "fp32" | "int64" | "int32"
    block: tuple | None = None  # FP8 (rows, cols) block of the scales


def _scale_piece(name: str, scale: "torch.Tensor", fmt: str, rt) -> Piece:
    import torch

    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if scale.dtype == torch.uint8 or (e8m0 is not None and scale.dtype == e8m0):
        return Piece(name, TensorProto.UINT8, tuple(scale.shape), scale.view(torch.uint8))
    if fmt == "fp4":
        # The FP4 ops take E8M0 exponents only; float scales are accepted when they are exact powers of two.
        from dsv4_ort.models import quant as Q

        try:
            u = Q.float_to_e8m0(scale.float(), name=rt.name)
        except Q.QuantFormatError as e:
            raise WeightFormatError(f"FP4 weight with non-E8M0 scales ({e}); export with --weights bf16 | tensor "
                                    f"{rt.name!r} | file {rt.file!r}") from None
        return Piece(name, TensorProto.UINT8, tuple(scale.shape), u)
    return Piece(name, TensorProto.FLOAT, tuple(scale.shape), scale.to(torch.float32).contiguous())


def _dense_piece(name: str, t: "torch.Tensor", want: str | None) -> tuple[Piece, str]:
    """A dense float tensor as FLOAT / BFLOAT16 (``want`` None keeps bf16, anything else becomes float32)."""
    import torch

    if want == "bf16" or (want is None and t.dtype == torch.bfloat16):
        t = t.to(torch.bfloat16).contiguous()
        return Piece(name, TensorProto.BFLOAT16, tuple(t.shape), t), "bf16"
    t = t.to(torch.float32).contiguous()
    return Piece(name, TensorProto.FLOAT, tuple(t.shape), t), "fp32"


def convert(rt, out_name: str, mode: str, keep_bf16_param: bool = False) -> Converted:
    """Convert one :class:`~dsv4_ort.models.checkpoint.RawTensor` (torch) or
    :class:`~dsv4_ort.models.synthetic.ArrayTensor` (numpy) for the given weight mode."""
    if isinstance(rt.data, np.ndarray):
        return _convert_array(rt, out_name, mode, keep_bf16_param)
    import torch

    role = tensor_role(rt.name)
    if role == "index":
        if rt.data.dtype not in (torch.int64, torch.int32):
            raise WeightFormatError(f"integer table expected, got {rt.data.dtype} | tensor {rt.name!r} | "
                                    f"file {rt.file!r}")
        t = rt.data.contiguous()
        dt = TensorProto.INT64 if t.dtype == torch.int64 else TensorProto.INT32
        return Converted(Piece(out_name, dt, tuple(t.shape), t), None, "int64" if dt == TensorProto.INT64 else "int32")
    if role == "param":
        t = rt.dequantize(None)
        want = None if (keep_bf16_param and mode != "fp32") else "fp32"
        piece, fmt = _dense_piece(out_name, t, want)
        return Converted(piece, None, fmt)
    # matrices
    if mode == "native" and rt.fmt == "fp8":
        if rt.data.dim() != 2:
            raise WeightFormatError(f"FP8 weight must be 2-D | tensor {rt.name!r} | file {rt.file!r}")
        if rt.block is None or rt.block[0] != rt.block[1]:
            raise WeightFormatError(f"FP8 scale blocks {rt.block} are not square (the FP8 ops take b x b blocks); "
                                    f"export with --weights bf16 | tensor {rt.name!r} | file {rt.file!r}")
        w = rt.data.view(torch.uint8) if rt.data.dtype != torch.uint8 else rt.data
        return Converted(Piece(out_name, TensorProto.FLOAT8E4M3FN, tuple(w.shape), w),
                         _scale_piece(scale_initializer_name(out_name), rt.scale, "fp8", rt), "fp8", tuple(rt.block))
    if mode == "native" and rt.fmt == "fp4":
        from dsv4_ort.models import quant as Q

        w = Q.as_uint8(rt.data)
        return Converted(Piece(out_name, TensorProto.UINT8, tuple(w.shape), w),
                         _scale_piece(scale_initializer_name(out_name), rt.scale, "fp4", rt), "fp4", tuple(rt.block))
    t = rt.dequantize(None)  # exact: float32 for quantised weights, stored dtype otherwise
    if mode == "bf16":
        want = "bf16"
    elif mode == "fp32":
        want = "fp32"
    else:
        want = None  # native dense: bf16 stays bf16, float32 / float16 -> float32
    piece, fmt = _dense_piece(out_name, t, want)
    return Converted(piece, None, fmt)


def _convert_array(a, out_name: str, mode: str, keep_bf16_param: bool) -> Converted:
    """:func:`convert` for an ArrayTensor (numpy; bfloat16 as uint16 bit patterns, FP8 / FP4 / E8M0 as uint8)."""
    from dsv4_ort.models import quant_np as QN

    role = tensor_role(a.name)
    if role == "index":
        if a.data.dtype not in (np.int64, np.int32):
            raise WeightFormatError(f"integer table expected, got {a.data.dtype} | tensor {a.name!r} | file {a.file!r}")
        dt = TensorProto.INT64 if a.data.dtype == np.int64 else TensorProto.INT32
        return Converted(Piece(out_name, dt, tuple(a.data.shape), a.data), None,
                         "int64" if dt == TensorProto.INT64 else "int32")

    def dense(want: str | None) -> Converted:
        """want None keeps bf16 and float32 as stored; "bf16" / "fp32" converts (from the exact value)."""
        if a.stored == "bf16" and want in (None, "bf16"):
            return Converted(Piece(out_name, TensorProto.BFLOAT16, tuple(a.data.shape), a.data), None, "bf16")
        x = a.dequantize()
        if want == "bf16":
            return Converted(Piece(out_name, TensorProto.BFLOAT16, x.shape, QN.float_to_bf16(x)), None, "bf16")
        return Converted(Piece(out_name, TensorProto.FLOAT, x.shape, np.ascontiguousarray(x, np.float32)), None,
                         "fp32")

    if role == "param":
        return dense(None if (keep_bf16_param and mode != "fp32") else "fp32")
    if mode == "native" and a.stored in ("fp8", "fp4"):
        sc = Piece(scale_initializer_name(out_name), TensorProto.UINT8, tuple(a.scale.shape), a.scale)
        elem = TensorProto.FLOAT8E4M3FN if a.stored == "fp8" else TensorProto.UINT8
        return Converted(Piece(out_name, elem, tuple(a.data.shape), a.data), sc, a.stored, tuple(a.block))
    return dense({"bf16": "bf16", "fp32": "fp32"}.get(mode))


def requantize(rt, conv: Converted, fmt: str) -> Converted:
    """``conv`` (the converted 2-D / shared-expert matrix of ``rt``) quantised to ``fmt`` ("fp8" or "fp4") from
    ``rt``'s exact value: FP8 E4M3 codes with E8M0 scales per 128 x 128 block, or packed FP4 E2M1 with E8M0 scales
    per 32 inputs (``in`` must be a multiple of 32). Same rounding as the reference quantisers
    (:func:`dsv4_ort.models.quant_np.quant_fp8_block` / :func:`~dsv4_ort.models.quant_np.quant_fp4`)."""
    from dsv4_ort.models import quant_np as QN

    if conv.fmt == fmt:
        return conv
    x = rt.dequantize() if isinstance(rt.data, np.ndarray) else rt.dequantize(None).float().numpy()
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2:
        raise WeightFormatError(f"only 2-D weights can be requantised to {fmt}, got shape {list(x.shape)} | "
                                f"tensor {rt.name!r} | file {rt.file!r}")
    name, scale_name = conv.weight.name, scale_initializer_name(conv.weight.name)
    if fmt == "fp8":
        codes, e = QN.quant_fp8_block(x, QN.FP8_BLOCK)
        return Converted(Piece(name, TensorProto.FLOAT8E4M3FN, codes.shape, codes),
                         Piece(scale_name, TensorProto.UINT8, e.shape, e), "fp8", (QN.FP8_BLOCK, QN.FP8_BLOCK))
    if fmt == "fp4":
        if x.shape[1] % QN.FP4_BLOCK:
            raise WeightFormatError(f"FP4 needs a multiple of {QN.FP4_BLOCK} input features, the weight has "
                                    f"{x.shape[1]} | tensor {rt.name!r} | file {rt.file!r}")
        packed, e = QN.quant_fp4(x, QN.FP4_BLOCK)
        return Converted(Piece(name, TensorProto.UINT8, packed.shape, packed),
                         Piece(scale_name, TensorProto.UINT8, e.shape, e), "fp4", (1, QN.FP4_BLOCK))
    raise ValueError(f"requantize: format must be fp8 or fp4, got {fmt!r}")


# ----------------------------------------------------------------------------------------------------- memory


_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = None


def release_pages(t) -> None:
    """Drops the whole pages inside ``t``'s bytes from this process's resident set (Linux ``madvise``).

    safetensors hands out tensors that live in its memory map of the shard, so every tensor read stays resident
    (as file-backed pages) until the shard is closed: without this the RSS of an export grows by a whole shard.
    Only pages entirely inside the tensor are released and the tensor must not be read afterwards (anonymous pages
    read back as zeros, file pages are re-read from the file). numpy arrays (generated weights, freed right after)
    and non-contiguous tensors are left alone.
    """
    global _libc
    if isinstance(t, np.ndarray) or not sys.platform.startswith("linux") or t.numel() == 0 or not t.is_contiguous():
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if hi - lo < 16 * _PAGE:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
    except (OSError, AttributeError):  # pragma: no cover - best effort
        pass


# ----------------------------------------------------------------------------------------------------- data file


@dataclasses.dataclass
class Entry:
    """A tensor of the data file: where it lives, and which of its parts (experts) have been written."""

    name: str
    dtype: int
    dims: tuple
    offset: int
    length: int
    parts: int = 1
    written: set = dataclasses.field(default_factory=set)
    source: str = ""  # checkpoint tensor / file of the first part, for messages


class ExternalDataWriter:
    """Writes tensors into one file at :data:`ALIGNMENT`-aligned offsets.

    ``add`` writes a whole tensor; ``add_part`` writes slot ``index`` of a stacked tensor whose region is
    reserved on first use. :meth:`entries` lists what was written, for ``external_data`` references.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.end = 0
        self._entries: dict[str, Entry] = {}
        self.bytes_written = 0

    def _reserve(self, name: str, dtype: int, dims: tuple, parts: int, source: str) -> Entry:
        if name in self._entries:
            raise WeightFormatError(f"tensor written twice | tensor {source or name!r}")
        length = math.prod(dims) * element_type(dtype).bytes
        offset = -(-self.end // ALIGNMENT) * ALIGNMENT
        e = Entry(name, dtype, tuple(int(d) for d in dims), offset, length, parts, set(), source)
        self._entries[name] = e
        self.end = offset + length
        return e

    def _pwrite(self, data, offset: int, expect: int) -> None:
        if isinstance(data, np.ndarray):
            buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:  # a torch tensor
            import torch

            buf = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        if buf.nbytes != expect:
            raise AssertionError(f"{buf.nbytes} bytes for a {expect}-byte slot")
        mv = memoryview(buf)
        done = 0
        while done < expect:
            done += os.pwrite(self.fd, mv[done:], offset + done)
        self.bytes_written += expect

    def add(self, piece: Piece, source: str = "") -> Entry:
        e = self._reserve(piece.name, piece.dtype, piece.dims, 1, source)
        self._pwrite(piece.data, e.offset, e.length)
        e.written.add(0)
        return e

    def add_part(self, piece: Piece, index: int, parts: int, source: str = "") -> Entry:
        """Writes ``piece`` (one expert, dims ``d``) as slot ``index`` of the stacked tensor ``[parts, *d]``."""
        e = self._entries.get(piece.name)
        dims = (parts, *piece.dims)
        if e is None:
            e = self._reserve(piece.name, piece.dtype, dims, parts, source)
        elif e.dtype != piece.dtype or e.dims != dims:
            raise WeightFormatError(
                f"expert tensors of one layer differ in format: {element_type(piece.dtype).name}{list(piece.dims)} "
                f"vs {element_type(e.dtype).name}{list(e.dims[1:])} (first: {e.source}) | tensor {source!r}")
        if not 0 <= index < parts:
            raise WeightFormatError(f"expert index {index} outside [0, {parts}) | tensor {source!r}")
        if index in e.written:
            raise WeightFormatError(f"tensor appears twice | tensor {source!r}")
        slot = e.length // parts
        self._pwrite(piece.data, e.offset + index * slot, slot)
        e.written.add(index)
        return e

    def entries(self) -> dict[str, Entry]:
        return self._entries

    def incomplete(self) -> list[tuple[str, list[int]]]:
        """Stacked tensors with unwritten slots: (name, missing indices)."""
        return [(e.name, sorted(set(range(e.parts)) - e.written)) for e in self._entries.values()
                if len(e.written) != e.parts]

    def append_trailer(self, data: bytes) -> None:
        """Bytes after the last tensor (the export id): no entry refers to them."""
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.end + done)
        self.end += len(data)

    def close(self, sync: bool = True) -> None:
        if self.fd is None:
            return
        try:
            if self.end:
                os.ftruncate(self.fd, self.end)
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None


def external_initializer(entry: Entry, location: str) -> TensorProto:
    """A TensorProto whose data lives in ``location`` at the entry's offset."""
    t = TensorProto()
    t.name = entry.name
    t.data_type = entry.dtype
    t.dims.extend(entry.dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(entry.offset)), ("length", str(entry.length))):
        kv = t.external_data.add()
        kv.key, kv.value = k, v
    return t
