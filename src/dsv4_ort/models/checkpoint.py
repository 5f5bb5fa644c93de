"""Checkpoint I/O for DeepSeek-V4: naming, streaming reads, exact dequantisation, model loading and
synthetic checkpoint writing.

Two namings are understood:

* ``"deepseek"`` - the released layout (``embed.weight``, ``layers.N.attn.wq_a.weight`` +
  ``layers.N.attn.wq_a.scale``, ``layers.N.ffn.experts.E.w1.weight``, ``mtp.0.*``, ...). This is
  also the naming of the state dict of :class:`dsv4_ort.models.model.DeepseekV4ForCausalLM`
  (minus the ``.scale`` tensors).
* ``"hf"`` - the module names of ``transformers``' ``DeepseekV4ForCausalLM``
  (``model.layers.N.self_attn.q_a_proj.weight``, fused ``model.layers.N.mlp.experts.gate_up_proj``
  ``[E, 2I, d]`` = per expert ``cat(w1, w3)`` and ``down_proj`` ``[E, d, I]`` = per expert ``w2``).
  No tensor is transposed. transformers has no MTP module; in this naming MTP tensors keep their
  DeepSeek names (``mtp.0.*``), which transformers ignores on load. Block scales are
  ``<weight>_scale_inv`` (``X.weight_scale_inv``, ``experts.gate_up_proj_scale_inv``).

Numerics: FP8 E4M3 weights with E8M0 128x128 block scales and FP4 E2M1 routed experts with E8M0
1x32 scales are dequantised exactly (see :mod:`.quant`).

transformers' ``from_pretrained`` loads both namings (the released one through its conversion
mapping). Quantised checkpoints in the ``"hf"`` naming store the fused expert tensors quantised as
a whole (``gate_up_proj`` + ``gate_up_proj_scale_inv``, FP4: int8 ``[E, 2I, d/2]`` + E8M0
``[E, 2I, d/32]``), exactly the parameters of transformers' ``FP8Experts`` and bit for bit what
transformers builds from the released layout; with FP8 experts this needs
``moe_intermediate_size % 128 == 0`` so that no 128-row scale block straddles gate and up.
transformers reads that layout only into its FP8 modules, i.e. with a CUDA / XPU device: its
dequantising load (the CPU path) decodes ``X.weight`` + ``X.weight_scale_inv`` pairs and the
released per-expert names, but not fused expert tensors. To load a quantised checkpoint into
transformers on a CPU, write it with ``naming="deepseek"``.

Main entry points: :func:`iter_checkpoint` (stream ``(name, dense tensor)`` or :class:`RawTensor`),
:func:`load_model`, :func:`write_random_checkpoint`, :func:`deepseek_to_hf` / :func:`hf_to_deepseek`,
:func:`hf_state_dict_to_deepseek` / :func:`deepseek_state_dict_to_hf`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from . import quant as Q
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, DtypeMismatchError,
                     MissingTensorError, ShapeMismatchError, UnexpectedTensorError, UnsupportedModelError)
from .inventory import WEIGHT_MODES, TensorSpec, cfg_dict, deepseek_tensor_specs, storage_kind
from .synthetic import make_array

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "MissingTensorError",
    "UnexpectedTensorError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "CorruptCheckpointError",
    "UnsupportedModelError",
    "HFSlot",
    "RawTensor",
    "TensorSpec",
    "deepseek_to_hf",
    "hf_to_deepseek",
    "scale_name",
    "hf_state_dict_to_deepseek",
    "deepseek_state_dict_to_hf",
    "detect_naming",
    "Checkpoint",
    "open_checkpoint",
    "iter_checkpoint",
    "read_config_dict",
    "load_model",
    "deepseek_tensor_specs",
    "random_tensors",
    "write_random_checkpoint",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"


# The error classes live in .errors (torch-free) and are re-exported here.


# ==============================================================================================
# Naming
# ==============================================================================================

# per-layer renames: DeepSeek suffix (after "layers.N.") -> HF suffix (after "model.layers.N.")
_LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
)
_TOP_RENAMES: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)
_LAYER_DS2HF = dict(_LAYER_RENAMES)
_LAYER_HF2DS = {v: k for k, v in _LAYER_RENAMES}
_TOP_DS2HF = dict(_TOP_RENAMES)
_TOP_HF2DS = {v: k for k, v in _TOP_RENAMES}
_EXPERT_PARTS = {"w1": ("gate_up_proj", "gate"), "w3": ("gate_up_proj", "up"), "w2": ("down_proj", None)}

_DS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_DS_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")


class HFSlot(NamedTuple):
    """Where a DeepSeek tensor lives in the transformers naming.

    ``expert`` is the index along dim 0 of a fused expert tensor; ``part`` is ``"gate"`` (rows
    ``[:I]`` of ``gate_up_proj``), ``"up"`` (rows ``[I:]``) or None (the whole per-expert slice,
    or a plain 1:1 tensor when ``expert`` is None too).
    """

    name: str
    expert: int | None = None
    part: str | None = None


def deepseek_to_hf(name: str) -> HFSlot:
    """Map a DeepSeek tensor name (weights, ``.scale`` block scales, buffers) to its HF slot.

    ``mtp.*`` names map to themselves (transformers has no MTP module and ignores them).
    Raises :class:`UnexpectedTensorError` for names outside the DeepSeek-V4 inventory.
    """
    if name.startswith("mtp."):
        return HFSlot(name)
    m = _DS_EXPERT_RE.match(name)
    if m:
        layer, expert, w, kind = m.groups()
        fused, part = _EXPERT_PARTS[w]
        suffix = "_scale_inv" if kind == "scale" else ""
        return HFSlot(f"model.layers.{layer}.mlp.experts.{fused}{suffix}", int(expert), part)
    is_scale = name.endswith(".scale") and not name.endswith("_scale")
    base = name[: -len(".scale")] + ".weight" if is_scale else name
    out = None
    if base in _TOP_DS2HF:
        out = _TOP_DS2HF[base]
    else:
        m = _DS_LAYER_RE.match(base)
        if m and m.group(2) in _LAYER_DS2HF:
            out = f"model.layers.{m.group(1)}.{_LAYER_DS2HF[m.group(2)]}"
    if out is None or (is_scale and not out.endswith(".weight")):
        raise UnexpectedTensorError("not a DeepSeek-V4 tensor name", tensor=name)
    return HFSlot(out + "_scale_inv" if is_scale else out)


def hf_to_deepseek(name: str, n_experts: int | None = None) -> list[str]:
    """Map an HF tensor name to the DeepSeek name(s) it holds.

    1:1 names give a one-element list. Fused expert tensors give, expert-major,
    ``[experts.0.w1, experts.0.w3, experts.1.w1, ...]`` for ``gate_up_proj`` and
    ``[experts.0.w2, ...]`` for ``down_proj`` (``.scale`` names for ``*_scale_inv``);
    ``n_experts`` is required for them.
    """
    if name.startswith("mtp."):
        return [name]
    m = _HF_EXPERT_RE.match(name)
    if m:
        layer, fused, sc = m.groups()
        if n_experts is None:
            raise ValueError(f"hf_to_deepseek: n_experts is needed to expand the fused tensor {name!r}")
        kind = "scale" if sc else "weight"
        ws = ("w1", "w3") if fused == "gate_up_proj" else ("w2",)
        return [f"layers.{layer}.ffn.experts.{e}.{w}.{kind}" for e in range(n_experts) for w in ws]
    is_scale = name.endswith(".weight_scale_inv") or name.endswith(".weight_scale")
    base = name.rsplit(".", 1)[0] + ".weight" if is_scale else name
    out = None
    if base in _TOP_HF2DS:
        out = _TOP_HF2DS[base]
    else:
        m = _HF_LAYER_RE.match(base)
        if m and m.group(2) in _LAYER_HF2DS:
            out = f"layers.{m.group(1)}.{_LAYER_HF2DS[m.group(2)]}"
    if out is None:
        raise UnexpectedTensorError("not a transformers DeepSeek-V4 tensor name", tensor=name)
    return [out[: -len(".weight")] + ".scale" if is_scale else out]


def scale_name(weight_name: str, naming: str = "deepseek") -> str:
    """Name of the block-scale tensor of a quantised weight in the given naming."""
    if naming == "deepseek":
        if not weight_name.endswith(".weight"):
            raise ValueError(f"{weight_name!r} is not a weight name")
        return weight_name[: -len(".weight")] + ".scale"
    return weight_name + "_scale_inv"


def _hf_expert_slice(t: torch.Tensor, part: str | None) -> torch.Tensor:
    if part is None:
        return t
    half = t.shape[0] // 2
    return t[:half] if part == "gate" else t[half:]


def hf_state_dict_to_deepseek(
    state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Convert a (dense) transformers state dict to DeepSeek names, splitting fused experts.

    Floating tensors are cast to ``dtype`` when given. Non-persistent / unknown HF buffers raise
    :class:`UnexpectedTensorError`; pass ``model.state_dict()`` (persistent entries only).
    """
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in state_dict.items():
        m = _HF_EXPERT_RE.match(hf_name)
        if m:
            if m.group(3):
                raise UnexpectedTensorError("quantised fused experts are not a dense state dict", tensor=hf_name)
            names = hf_to_deepseek(hf_name, t.shape[0])
            if m.group(2) == "gate_up_proj":
                for e in range(t.shape[0]):
                    out[names[2 * e]] = _hf_expert_slice(t[e], "gate")
                    out[names[2 * e + 1]] = _hf_expert_slice(t[e], "up")
            else:
                for e in range(t.shape[0]):
                    out[names[e]] = t[e]
        else:
            (name,) = hf_to_deepseek(hf_name)
            out[name] = t
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}
    return out


def deepseek_state_dict_to_hf(
    state_dict: dict[str, torch.Tensor], include_mtp: bool = False
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_state_dict_to_deepseek` (dense tensors): fuses per-expert w1/w3/w2.

    ``mtp.*`` entries are dropped unless ``include_mtp`` (transformers has no MTP module).
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, dict[str | None, torch.Tensor]]] = {}
    for name, t in state_dict.items():
        if name.startswith("mtp.") and not include_mtp:
            continue
        slot = deepseek_to_hf(name)
        if slot.expert is None:
            out[slot.name] = t
        else:
            fused.setdefault(slot.name, {}).setdefault(slot.expert, {})[slot.part] = t
    for hf_name, experts in fused.items():
        n = max(experts) + 1
        if sorted(experts) != list(range(n)):
            raise MissingTensorError(f"experts {sorted(set(range(n)) - set(experts))} missing for", tensor=hf_name)
        rows = []
        for e in range(n):
            parts = experts[e]
            if hf_name.endswith("gate_up_proj"):
                if set(parts) != {"gate", "up"}:
                    raise MissingTensorError(f"expert {e} lacks w1 or w3", tensor=hf_name)
                rows.append(torch.cat([parts["gate"], parts["up"]], dim=0))
            else:
                rows.append(parts[None])
        out[hf_name] = torch.stack(rows)
    return out


def detect_naming(names: Iterable[str]) -> str:
    """``"hf"`` if any name starts with ``model.`` or ``lm_head.``, else ``"deepseek"``."""
    for n in names:
        if n.startswith("model.") or n.startswith("lm_head."):
            return "hf"
    return "deepseek"


# ==============================================================================================
# safetensors headers (integrity checks and streaming writes)
# ==============================================================================================

_ST_DTYPES: dict[torch.dtype, tuple[str, int]] = {
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
    _ST_DTYPES[torch.float8_e8m0fnu] = ("F8_E8M0", 1)
if getattr(torch, "float8_e5m2", None) is not None:
    _ST_DTYPES[torch.float8_e5m2] = ("F8_E5M2", 1)
_ST_SIZES = {code: size for code, size in _ST_DTYPES.values()}


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header and check that every tensor's bytes are inside the file.

    Returns ``(header without __metadata__, data start offset)``. Raises
    :class:`CorruptCheckpointError` naming the first tensor whose bytes are missing.
    """
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError("shard file not found", file=path) from None
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


class _StreamingShardWriter:
    """Write one safetensors file whose tensor list is known up front, one tensor at a time."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        self.path = path
        self.order = [s[0] for s in specs]
        self.expect = {}
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        off = 0
        for name, dtype, shape in specs:
            code, size = _ST_DTYPES[dtype]
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


_ST_CODES = {code: dt for dt, (code, _) in _ST_DTYPES.items()}


class _ShardReader:
    """Reads tensors of one safetensors file with plain ``readinto`` calls.

    Every tensor gets its own memory (no memory map): the result never aliases the file, so the
    file may be rewritten while tensors or models loaded from it are alive, and resident memory
    holds only the tensors kept by the caller.
    """

    def __init__(self, path: str):
        self.path = path
        self.header, self.data_start = _read_header(path)
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


# ==============================================================================================
# Reading
# ==============================================================================================


@dataclasses.dataclass
class RawTensor:
    """A checkpoint tensor as stored, with its block scale.

    ``fmt``: ``"fp8"`` (E4M3 ``data``, E8M0 / float ``scale`` per ``block``), ``"fp4"`` (packed
    E2M1 ``data`` ``[out, in/2]``, scale per 1 x 32) or ``"dense"`` (``scale`` is None).
    ``name`` is the DeepSeek name of the weight; ``file`` the shard it came from.
    """

    name: str
    data: torch.Tensor
    scale: torch.Tensor | None
    fmt: str
    file: str
    block: tuple[int, int] | None = None

    def __repr__(self) -> str:
        sc = "" if self.scale is None else f", scale={self.scale.dtype}{tuple(self.scale.shape)}"
        return f"RawTensor({self.name!r}, {self.fmt}, data={self.data.dtype}{tuple(self.data.shape)}{sc})"

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantised) shape."""
        if self.fmt == "fp4":
            return (*self.data.shape[:-1], self.data.shape[-1] * 2)
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype | None = torch.float32, validate: bool = True) -> torch.Tensor:
        """Exact dense value; ``dtype=None`` keeps dense float tensors as stored (float32 for quantised)."""
        try:
            if self.fmt == "fp8":
                out = Q.dequant_fp8_block(self.data, self.scale, self.block, name=self.name, validate=validate)
            elif self.fmt == "fp4":
                out = Q.dequant_fp4(self.data, self.scale, self.block[1], name=self.name, validate=validate)
            else:
                out = self.data
        except Q.QuantFormatError as e:
            raise CorruptCheckpointError(str(e), tensor=self.name, file=self.file) from None
        if dtype is not None and out.is_floating_point() and out.dtype != dtype:
            out = out.to(dtype)
        return out


_FP4_DTYPES = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else set())
_DENSE_FLOAT = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
_INT_DTYPES = {torch.int64, torch.int32}
_INT_TENSOR_RE = re.compile(r"(^|\.)tid2eid$")


def read_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` of a checkpoint directory and check that it is a DeepSeek-V4 model."""
    path = os.fspath(path)
    d = path if os.path.isdir(path) else os.path.dirname(path)
    cfg_path = os.path.join(d, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise CheckpointNotFoundError("config.json not found", file=cfg_path)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"config.json is not valid JSON ({e})", file=cfg_path) from None
    mt = cfg.get("model_type")
    archs = cfg.get("architectures")
    if mt != MODEL_TYPE:
        raise UnsupportedModelError(f"model_type is {mt!r}, expected {MODEL_TYPE!r}", file=cfg_path)
    if archs is not None and ARCHITECTURE not in archs:
        raise UnsupportedModelError(f"architectures {archs!r} do not include {ARCHITECTURE!r}", file=cfg_path)
    return cfg


class Checkpoint:
    """Index of a safetensors checkpoint: files, tensor -> file map, naming, optional config.

    ``path``: a directory holding ``model.safetensors.index.json`` or a single
    ``*.safetensors`` file, an index json, or a ``.safetensors`` file.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise CheckpointNotFoundError("checkpoint path not found", file=path)
        index_path = None
        if os.path.isdir(path):
            self.dir = path
            if os.path.isfile(os.path.join(path, INDEX_FILE)):
                index_path = os.path.join(path, INDEX_FILE)
            elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
                single = os.path.join(path, SINGLE_FILE)
            else:
                cands = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
                if len(cands) != 1:
                    raise CheckpointNotFoundError(
                        f"no {INDEX_FILE} and {len(cands)} *.safetensors files (need the index or exactly one file)",
                        file=path,
                    )
                single = os.path.join(path, cands[0])
        elif path.endswith(".json"):
            self.dir, index_path = os.path.dirname(path), path
        else:
            self.dir, single = os.path.dirname(path), path
        self.index_path = index_path
        self.weight_map: dict[str, str] = {}
        if index_path is not None:
            try:
                with open(index_path, encoding="utf-8") as f:
                    idx = json.load(f)
                wm = idx["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"bad index json ({e!r})", file=index_path) from None
            for name, fn in wm.items():
                self.weight_map[name] = os.path.join(self.dir, fn)
            self.files = list(dict.fromkeys(sorted(self.weight_map.values())))
            for fn in self.files:
                if not os.path.isfile(fn):
                    some = next(n for n, f in self.weight_map.items() if f == fn)
                    raise CheckpointNotFoundError("shard listed in the index is missing", tensor=some, file=fn)
        else:
            self.files = [single]
            header, _ = _read_header(single)
            self.weight_map = {n: single for n in header}
        self.naming = detect_naming(self.weight_map)
        cfg_path = os.path.join(self.dir, CONFIG_FILE)
        self.config_dict: dict | None = None
        if os.path.isfile(cfg_path):
            with contextlib.suppress(json.JSONDecodeError, OSError):
                with open(cfg_path, encoding="utf-8") as f:
                    self.config_dict = json.load(f)
        self.fp8_block = (128, 128)
        qc = (self.config_dict or {}).get("quantization_config") or {}
        if isinstance(qc.get("weight_block_size"), (list, tuple)) and len(qc["weight_block_size"]) == 2:
            self.fp8_block = tuple(int(b) for b in qc["weight_block_size"])

    @property
    def location(self) -> str:
        return self.index_path or self.files[0]

    # -------------------------------------------------------------------- scale pairing

    def _scale_candidates(self, name: str) -> list[str]:
        if name.endswith(".weight"):
            stem = name[: -len(".weight")]
            return [stem + ".scale", name + "_scale_inv", name + "_scale"]
        return [name + "_scale_inv", name + "_scale"]

    def _is_scale_name(self, name: str) -> str | None:
        """If ``name`` is the scale of a weight present in the checkpoint, return that weight's name."""
        for suffix, repl in ((".scale", ".weight"), (".weight_scale_inv", ".weight"), (".weight_scale", ".weight"),
                             ("_scale_inv", ""), ("_scale", "")):
            if name.endswith(suffix):
                w = name[: -len(suffix)] + repl
                if w in self.weight_map and w != name:
                    return w
        return None

    def _looks_like_scale(self, name: str) -> bool:
        if self.naming == "deepseek" or name.startswith("mtp."):
            return name.endswith(".scale")
        return name.endswith("_scale_inv") or name.endswith(".weight_scale")

    # -------------------------------------------------------------------- iteration

    def iter_raw(self) -> Iterator[RawTensor]:
        """Yield every weight as stored (DeepSeek names; HF fused experts split per expert)."""
        consumed: set[str] = set()
        seen: set[str] = set()
        for file in self.files:
            listed = {n for n, f in self.weight_map.items() if f == file}
            try:
                reader = _ShardReader(file)
            except CorruptCheckpointError as e:
                if e.tensor is not None or not listed:
                    raise
                msg = e.args[0].split(" | ")[0]
                raise CorruptCheckpointError(f"{msg} (the shard of {len(listed)} tensors, including)",
                                             tensor=min(listed), file=file) from None
            with reader as f:
                header = f.header
                for n in sorted(listed - set(header)):
                    raise MissingTensorError("tensor listed in the index is not in its shard", tensor=n, file=file)
                for n in sorted(set(header) - listed):
                    raise UnexpectedTensorError("tensor in a shard but not in the index", tensor=n, file=file)
                for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
                    if self._is_scale_name(name) is not None:
                        continue
                    if self._looks_like_scale(name):
                        raise UnexpectedTensorError("block scale without its weight", tensor=name, file=file)
                    seen.add(name)
                    sname = next((c for c in self._scale_candidates(name) if c in self.weight_map), None)
                    if sname is not None:
                        consumed.add(sname)
                    yield from self._raw_items(f, file, name, sname)
        for n in self.weight_map:
            if n not in seen and n not in consumed:
                raise UnexpectedTensorError("scale tensor without a matching weight", tensor=n, file=self.weight_map[n])

    def _get(self, f: _ShardReader, file: str, name: str, index: int | None = None) -> torch.Tensor:
        try:
            return f.get(name, index)
        except CheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read tensor ({e})", tensor=name, file=file) from None

    def _get_scale(self, f: _ShardReader, file: str, sname: str, index: int | None = None) -> torch.Tensor:
        sfile = self.weight_map[sname]
        if sfile == file:
            return self._get(f, file, sname, index)
        with _ShardReader(sfile) as g:
            return self._get(g, sfile, sname, index)

    def _raw_items(self, f: _ShardReader, file: str, name: str, sname: str | None) -> Iterator[RawTensor]:
        if self.naming == "hf":
            m = _HF_EXPERT_RE.match(name)
            if m:
                n_exp = f.shape(name)[0]
                ds_names = hf_to_deepseek(name, n_exp)
                fused = m.group(2) == "gate_up_proj"
                per = 2 if fused else 1
                for e in range(n_exp):
                    data = self._get(f, file, name, e)
                    scale = self._get_scale(f, file, sname, e) if sname is not None else None
                    whole = self._classify(name, data, scale, file)
                    if not fused:
                        whole.name = ds_names[e]
                        yield whole
                        continue
                    for k, part in enumerate(("gate", "up")):
                        yield self._split_part(whole, part, ds_names[per * e + k])
                return
            try:
                (ds_name,) = hf_to_deepseek(name)
            except UnexpectedTensorError:
                raise UnexpectedTensorError(
                    "not a transformers DeepSeek-V4 tensor name", tensor=name, file=file) from None
        else:
            ds_name = name
            try:
                deepseek_to_hf(name)
            except UnexpectedTensorError:
                raise UnexpectedTensorError("not a DeepSeek-V4 tensor name", tensor=name, file=file) from None
        data = self._get(f, file, name)
        scale = self._get_scale(f, file, sname) if sname is not None else None
        rt = self._classify(name, data, scale, file)
        rt.name = ds_name
        yield rt

    def _classify(self, name: str, data: torch.Tensor, scale: torch.Tensor | None, file: str) -> RawTensor:
        if scale is None:
            if data.dtype == torch.float8_e4m3fn:
                raise MissingTensorError(
                    "FP8 weight without a block scale (expected one of "
                    f"{self._scale_candidates(name)})", tensor=name, file=file)
            if data.dtype in _INT_DTYPES:
                if not _INT_TENSOR_RE.search(name):
                    raise DtypeMismatchError(f"integer dtype {data.dtype} for a floating-point tensor", name, file)
            elif data.dtype in _DENSE_FLOAT:
                if _INT_TENSOR_RE.search(name):
                    raise DtypeMismatchError(f"dtype {data.dtype} for an integer table", name, file)
            else:
                raise DtypeMismatchError(f"unexpected dtype {data.dtype} for an unscaled tensor", name, file)
            return RawTensor(name, data, None, "dense", file)
        sd = scale.dtype
        if not (sd in (torch.uint8, torch.float32, torch.bfloat16) or sd == getattr(torch, "float8_e8m0fnu", None)):
            raise DtypeMismatchError(f"unexpected scale dtype {sd}", name, file)
        if data.dtype == torch.float8_e4m3fn:
            rows, cols = data.shape[-2:]
            want = (math.ceil(rows / self.fp8_block[0]), math.ceil(cols / self.fp8_block[1]))
            if tuple(scale.shape[-2:]) != want or data.dim() != 2:
                raise ShapeMismatchError(
                    f"FP8 weight {tuple(data.shape)} with scale {tuple(scale.shape)} "
                    f"(expected {want} for {self.fp8_block} blocks)", name, file)
            return RawTensor(name, data, scale, "fp8", file, self.fp8_block)
        if data.dtype in _FP4_DTYPES:
            if data.dim() != 2:
                raise ShapeMismatchError(f"FP4 weight must be 2-D, got {tuple(data.shape)}", name, file)
            rows, cols = data.shape[0], data.shape[1] * 2
            want = (rows, math.ceil(cols / Q.FP4_BLOCK))
            if tuple(scale.shape) != want:
                raise ShapeMismatchError(
                    f"packed FP4 weight {tuple(data.shape)} with scale {tuple(scale.shape)} (expected {want})",
                    name, file)
            return RawTensor(name, data, scale, "fp4", file, (1, Q.FP4_BLOCK))
        raise DtypeMismatchError(f"weight dtype {data.dtype} cannot carry a block scale", name, file)

    def _split_part(self, whole: RawTensor, part: str, ds_name: str) -> RawTensor:
        data, scale = whole.data, whole.scale
        rows = data.shape[0]
        if rows % 2:
            raise ShapeMismatchError(f"fused gate_up rows {rows} are odd", whole.name, whole.file)
        half = rows // 2
        if whole.fmt == "fp8":
            if half % whole.block[0]:
                raise ShapeMismatchError(
                    f"cannot split FP8 gate_up_proj: intermediate size {half} is not a multiple of the "
                    f"{whole.block[0]}-row scale block", whole.name, whole.file)
            hb = half // whole.block[0]
            sc = scale[:hb] if part == "gate" else scale[hb:]
        elif whole.fmt == "fp4":
            sc = scale[:half] if part == "gate" else scale[half:]
        else:
            sc = None
        d = data[:half] if part == "gate" else data[half:]
        return RawTensor(ds_name, d, sc, whole.fmt, whole.file, whole.block)

    def iter_dense(
        self, dtype: torch.dtype | None = torch.float32, validate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(deepseek_name, dense tensor)`` pairs; see :func:`iter_checkpoint`."""
        for rt in self.iter_raw():
            yield rt.name, rt.dequantize(dtype, validate=validate)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """:class:`Checkpoint` of ``path`` (files, weight map, naming, config dict)."""
    return Checkpoint(path)


def iter_checkpoint(
    path: str | os.PathLike,
    raw: bool = False,
    dtype: torch.dtype | None = torch.float32,
    validate: bool = True,
) -> Iterator[tuple[str, torch.Tensor]] | Iterator[RawTensor]:
    """Stream a checkpoint shard by shard, in either naming.

    Default: yields ``(deepseek_name, dense tensor)``; quantised weights are dequantised exactly,
    floating tensors are cast to ``dtype`` (``None``: keep the stored float dtype, float32 for
    dequantised weights); integer tables (``tid2eid``) are yielded as stored.
    ``raw=True``: yields :class:`RawTensor` (native data + scale + format tag) instead.
    ``validate``: reject FP8 / E8M0 NaN encodings.
    """
    ck = Checkpoint(path)
    return ck.iter_raw() if raw else ck.iter_dense(dtype, validate)


# ==============================================================================================
# Model loading
# ==============================================================================================


@contextlib.contextmanager
def _parameters_on_meta(model_cls=None):
    """Create module parameters on the meta device (buffers stay real, e.g. RoPE tables).

    ``model_cls.init_weights`` (random initialisation, pointless before loading) is disabled meanwhile.
    """
    orig = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(module, name, param)

    init = model_cls.__dict__.get("init_weights") if model_cls is not None else None
    torch.nn.Module.register_parameter = register
    if init is not None:
        model_cls.init_weights = lambda self, *a, **k: None
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = orig
        if init is not None:
            model_cls.init_weights = init


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    validate: bool = True,
    config: Any = None,
):
    """Build :class:`DeepseekV4ForCausalLM` from a checkpoint directory, streaming weights in.

    ``DeepseekV4ForCausalLM(config, dtype=dtype)`` is built with its parameters on the meta device;
    each checkpoint tensor (either naming, any of the weight formats) is dequantised exactly, cast to
    the dtype the model declares for it (``dtype`` for matrices and embeddings; the model keeps norms,
    mHC, sinks, ape and gate bias in float32) and assigned in place of the meta parameter, so no
    second copy of the model is ever held. Every model tensor must be present exactly once with the
    right shape, else a :class:`CheckpointError` subclass names the tensor and the file.
    ``config``: use this :class:`DeepseekV4Config` instead of the checkpoint's config.json
    (which must still exist and name a DeepSeek-V4 model).
    """
    from .config import DeepseekV4Config
    from .model import DeepseekV4ForCausalLM

    path = os.fspath(path)
    cfg_dict = read_config_dict(path)
    if config is None:
        try:
            config = DeepseekV4Config.from_dict(cfg_dict)
        except (TypeError, ValueError) as e:
            cfg_file = os.path.join(_dir_of(path), CONFIG_FILE)
            raise UnsupportedModelError(f"invalid config ({e})", file=cfg_file) from None
    ck = Checkpoint(path)
    with _parameters_on_meta(DeepseekV4ForCausalLM):
        model = DeepseekV4ForCausalLM(config, dtype=dtype)
    slots: dict[str, tuple[torch.nn.Module, str, bool, torch.Tensor]] = {}
    for mod_name, mod in model.named_modules():
        prefix = mod_name + "." if mod_name else ""
        for leaf, p in mod._parameters.items():
            if p is not None:
                slots[prefix + leaf] = (mod, leaf, True, p)
        for leaf, b in mod._buffers.items():
            if b is not None and leaf not in mod._non_persistent_buffers_set:
                slots[prefix + leaf] = (mod, leaf, False, b)
    loaded: dict[str, str] = {}
    for rt in ck.iter_raw():
        name = rt.name
        if name not in slots:
            raise UnexpectedTensorError("checkpoint tensor has no place in the model", tensor=name, file=rt.file)
        if name in loaded:
            raise UnexpectedTensorError(f"tensor appears twice (also in {loaded[name]})", tensor=name, file=rt.file)
        mod, leaf, is_param, ref = slots[name]
        if tuple(rt.shape) != tuple(ref.shape):
            raise ShapeMismatchError(
                f"shape {tuple(rt.shape)} in the checkpoint, {tuple(ref.shape)} in the model",
                tensor=name, file=rt.file)
        t = rt.dequantize(None, validate=validate)
        if ref.is_floating_point() != t.is_floating_point():
            raise DtypeMismatchError(f"dtype {t.dtype} in the checkpoint, {ref.dtype} in the model", name, rt.file)
        t = t.to(ref.dtype)
        if is_param:
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[leaf] = t
        loaded[name] = rt.file
        del t, rt
    missing = [n for n in slots if n not in loaded]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingTensorError(f"model tensor not found in the checkpoint{more}", tensor=missing[0], file=ck.location)
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:
        raise MissingTensorError("model tensor left uninitialised", tensor=still_meta[0], file=ck.location)
    model.eval()
    return model


def _dir_of(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(path)


# ==============================================================================================
# Synthetic checkpoints (the tensor inventory is in .inventory, the random values in .synthetic)
# ==============================================================================================

_WEIGHT_MODES = WEIGHT_MODES
_cfg_dict = cfg_dict
_storage_kind = storage_kind


def random_tensors(
    config: Any, weights: str = "bf16", seed: int = 0, raw: bool = False, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]] | Iterator[RawTensor]:
    """The tensors :func:`write_random_checkpoint` writes, one at a time, in DeepSeek naming.

    ``raw=False``: ``(name, exact dense value)`` (float32 for quantised weights, stored dtype
    otherwise); ``raw=True``: :class:`RawTensor` with the stored data and scale. ``names``: only
    generate these (each value depends only on seed, weights mode and name).
    """
    if weights not in _WEIGHT_MODES:
        raise ValueError(f"weights must be one of {_WEIGHT_MODES}, got {weights!r}")
    c = _cfg_dict(config)
    keep = None if names is None else set(names)
    for spec in deepseek_tensor_specs(c):
        if keep is not None and spec.name not in keep:
            continue
        rt = _make_raw(spec, weights, seed, c)
        yield rt if raw else (rt.name, rt.dequantize(None))


def _make_raw(spec: TensorSpec, weights: str, seed: int, c: dict) -> RawTensor:
    """One tensor of :mod:`.synthetic` in its stored form, as torch tensors sharing the numpy memory."""
    a = make_array(spec, weights, seed, c)
    if a.stored == "fp8":
        return RawTensor(spec.name, torch.from_numpy(a.data).view(torch.float8_e4m3fn),
                         torch.from_numpy(a.scale).view(torch.float8_e8m0fnu), "fp8", "", a.block)
    if a.stored == "fp4":
        return RawTensor(spec.name, torch.from_numpy(a.data).view(torch.int8),
                         torch.from_numpy(a.scale).view(torch.float8_e8m0fnu), "fp4", "", a.block)
    if a.stored == "bf16":
        return RawTensor(spec.name, torch.from_numpy(a.data.view(np.int16)).view(torch.bfloat16), None, "dense", "")
    return RawTensor(spec.name, torch.from_numpy(a.data), None, "dense", "")


_ST_FOR_KIND = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64, "fp8": torch.float8_e4m3fn,
                "fp4": torch.int8}


def _scale_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "fp8":
        return (*shape[:-2], math.ceil(shape[-2] / Q.FP8_BLOCK), math.ceil(shape[-1] / Q.FP8_BLOCK))
    return (*shape[:-1], math.ceil(shape[-1] / Q.FP4_BLOCK))


def _stored_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // 2) if kind == "fp4" else shape


@dataclasses.dataclass
class _Group:
    """Tensors written together (a weight and its scale, or a fused expert tensor and its scale)."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    make: Callable[[], dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * _ST_DTYPES[dt][1] for _, dt, s in self.specs)


def _file_groups(c: dict, naming: str, weights: str, seed: int) -> list[_Group]:
    specs = deepseek_tensor_specs(c)
    scale_dt = torch.float8_e8m0fnu
    groups: list[_Group] = []
    if naming == "deepseek":
        for spec in specs:
            kind = _storage_kind(spec, weights)
            items = [(spec.name, _ST_FOR_KIND[kind], _stored_shape(kind, spec.shape))]
            if kind in ("fp8", "fp4"):
                items.append((scale_name(spec.name), scale_dt, _scale_shape(kind, spec.shape)))

            def make(spec=spec, kind=kind):
                rt = _make_raw(spec, weights, seed, c)
                out = {spec.name: rt.data}
                if rt.scale is not None:
                    out[scale_name(spec.name)] = rt.scale
                return out

            groups.append(_Group(items, make))
        return groups

    # transformers naming: 1:1 tensors, then fused experts per layer (after that layer's tensors)
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    pending: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        slot = deepseek_to_hf(spec.name)
        kind = _storage_kind(spec, weights)
        if slot.expert is None:
            items = [(slot.name, _ST_FOR_KIND[kind], _stored_shape(kind, spec.shape))]
            sname = deepseek_to_hf(scale_name(spec.name)).name if spec.kind in ("linear", "expert") else None
            if kind in ("fp8", "fp4"):
                items.append((sname, scale_dt, _scale_shape(kind, spec.shape)))

            def make(spec=spec, slot=slot, sname=sname):
                rt = _make_raw(spec, weights, seed, c)
                out = {slot.name: rt.data}
                if rt.scale is not None:
                    out[sname] = rt.scale
                return out

            groups.append(_Group(items, make))
            continue
        pending.setdefault(slot.name, []).append(spec)
        if spec.name.endswith(f"experts.{E - 1}.w3.weight"):  # layer complete: emit its fused tensors
            for fused in (slot.name, slot.name.replace("gate_up_proj", "down_proj")):
                groups.append(_fused_group(fused, pending.pop(fused), kind, weights, seed, c, E, inter))
    assert not pending, sorted(pending)
    return groups


def _fused_group(hf_name: str, members: list[TensorSpec], kind: str, weights: str, seed: int, c: dict,
                 E: int, inter: int) -> _Group:
    gate_up = hf_name.endswith("gate_up_proj")
    per = {deepseek_to_hf(s.name)[1:]: s for s in members}  # (expert, part) -> spec
    one = members[0].shape
    shape = (E, 2 * inter, one[1]) if gate_up else (E, *one)
    if kind == "fp8" and gate_up and inter % Q.FP8_BLOCK:
        raise ValueError(
            f"FP8 experts in transformers naming need moe_intermediate_size % {Q.FP8_BLOCK} == 0 "
            f"(the fused gate_up_proj shares block scales), got {inter}")
    items = [(hf_name, _ST_FOR_KIND[kind], _stored_shape(kind, shape))]
    if kind in ("fp8", "fp4"):
        items.append((hf_name + "_scale_inv", torch.float8_e8m0fnu, _scale_shape(kind, shape)))

    def make():
        data = scale = None
        for e in range(E):
            parts = [per[(e, "gate")], per[(e, "up")]] if gate_up else [per[(e, None)]]
            rts = [_make_raw(s, weights, seed, c) for s in parts]
            d = torch.cat([r.data for r in rts]) if gate_up else rts[0].data
            if data is None:
                data = torch.empty((E, *d.shape), dtype=d.dtype)
            data[e] = d
            if rts[0].scale is not None:
                sc = torch.cat([Q.as_uint8(r.scale) for r in rts]) if gate_up else Q.as_uint8(rts[0].scale)
                if scale is None:
                    scale = torch.empty((E, *sc.shape), dtype=torch.uint8)
                scale[e] = sc
        out = {hf_name: data}
        if scale is not None:
            out[hf_name + "_scale_inv"] = scale.view(torch.float8_e8m0fnu)
        return out

    return _Group(items, make)


def _released_config(c: dict, weights: str) -> dict:
    d = dict(c)
    if weights in ("fp8", "native"):
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        d["expert_dtype"] = "fp4" if weights == "native" else "fp8"
    else:
        # explicit nulls: an absent key would mean the released FP8 / FP4 defaults
        d["quantization_config"] = None
        d["expert_dtype"] = "bf16" if weights == "bf16" else None
    d["torch_dtype"] = "float32" if weights == "fp32" else "bfloat16"
    return {k: v for k, v in d.items() if v is not None or k in ("quantization_config", "expert_dtype")}


def _hf_config(config: Any, c: dict, weights: str) -> dict:
    from .config import DeepseekV4Config

    cfg = config if isinstance(config, DeepseekV4Config) else DeepseekV4Config.from_dict(c)
    d = cfg.to_hf_dict()
    d["architectures"] = [ARCHITECTURE]
    d["model_type"] = MODEL_TYPE
    d["rope_theta"] = c["rope_theta"]
    d["compress_rope_theta"] = c["compress_rope_theta"]
    d["dtype"] = "float32" if weights == "fp32" else "bfloat16"
    if weights in ("fp8", "native"):
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                    "expert_dtype": "fp4" if weights == "native" else "fp8"}
        return {k: v for k, v in d.items() if v is not None}
    # explicit nulls: an absent key would mean the released FP8 / FP4 defaults
    d["quantization_config"] = None
    d["expert_dtype"] = "bf16" if weights == "bf16" else None
    return {k: v for k, v in d.items() if v is not None or k in ("quantization_config", "expert_dtype")}


def write_random_checkpoint(
    path: str | os.PathLike,
    config: Any,
    naming: str = "deepseek",
    weights: str = "bf16",
    seed: int = 0,
    shard_size_bytes: int = 2**30,
) -> dict[str, str]:
    """Write a deterministic random checkpoint laid out like the release (or as transformers names it).

    ``config``: a :class:`DeepseekV4Config` or a config dict. ``naming``: ``"deepseek"`` (released
    names, ``.scale`` companions, released-style config.json) or ``"hf"`` (transformers module names,
    fused experts, ``*_scale_inv`` companions, transformers-style config.json; MTP tensors keep
    their DeepSeek names; with ``"fp8"`` / ``"native"`` weights transformers loads it into its FP8
    modules, which it keeps only with a GPU - on a CPU use ``"deepseek"``, see the module
    docstring). ``weights``:

    * ``"bf16"`` - every FP8/FP4 tensor of the release stored bf16 (fp32 ones stay fp32);
    * ``"fp32"`` - every floating tensor float32;
    * ``"fp8"`` - FP8 E4M3 + E8M0 128x128 block scales for all linears including routed experts
      (``expert_dtype: "fp8"``);
    * ``"native"`` - as released: FP8 linears, FP4 E2M1 routed experts (int8, two per byte, E8M0
      per 1x32), bf16 norms / compressor / gate / embed / head, fp32 mHC / sinks / ape / gate bias,
      int64 ``tid2eid``.

    Values depend only on ``seed`` and the DeepSeek tensor name, so both namings hold identical
    dense tensors; they are generated by :mod:`.synthetic` (numpy), which a preset export streams
    directly. Tensors are generated and written one at a time (peak memory ~ the largest
    tensor, for ``hf`` naming the largest fused expert tensor). Returns the weight map.
    """
    if naming not in ("deepseek", "hf"):
        raise ValueError(f"naming must be 'deepseek' or 'hf', got {naming!r}")
    if weights not in _WEIGHT_MODES:
        raise ValueError(f"weights must be one of {_WEIGHT_MODES}, got {weights!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    c = _cfg_dict(config)
    groups = _file_groups(c, naming, weights, seed)

    shards: list[list[_Group]] = [[]]
    size = 0
    for g in groups:
        if shards[-1] and size + g.nbytes > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        specs = [s for g in shard for s in g.specs]
        w = _StreamingShardWriter(os.path.join(path, fname), specs)
        try:
            for g in shard:
                tensors = g.make()
                for name, _, _ in g.specs:
                    w.write(name, tensors[name])
                    weight_map[name] = fname
                del tensors
        finally:
            w.f.close()
        w.close()
        total += w.total
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg_out = _released_config(c, weights) if naming == "deepseek" else _hf_config(config, c, weights)
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(cfg_out, f, indent=2)
    return weight_map
