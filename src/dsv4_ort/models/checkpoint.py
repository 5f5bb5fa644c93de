"""Reading DeepSeek-V4 checkpoints: the index of a safetensors checkpoint in any layout of :mod:`.naming`, streamed
as :class:`RawTensor` (native data + block scale + format) or dense tensors.

Numerics: FP8 E4M3 weights with E8M0 128x128 block scales and FP4 E2M1 routed experts with E8M0 1x32 scales are
dequantised exactly (see :mod:`.quant`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from . import quant as Q
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DtypeMismatchError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedModelError,
)
from .naming import HF_EXPERT_RE, deepseek_to_hf, detect_naming, hf_to_deepseek, saved_to_deepseek, unknown_name_error
from .safetensors_io import ShardReader, read_header

__all__ = [
    "INDEX_FILE", "SINGLE_FILE", "CONFIG_FILE", "RawTensor", "Checkpoint", "open_checkpoint", "iter_checkpoint",
    "read_config_dict"
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"


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
                if os.path.exists(fn) and not os.path.isfile(fn):  # a FIFO or device would block the read
                    raise CorruptCheckpointError("shard listed in the index is not a regular file", file=fn)
                if not os.path.isfile(fn):
                    some = next(n for n, f in self.weight_map.items() if f == fn)
                    raise CheckpointNotFoundError("shard listed in the index is missing", tensor=some, file=fn)
        else:
            self.files = [single]
            header, _ = read_header(single)
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
    def has_mtp(self) -> bool:
        """Whether the checkpoint holds multi-token-prediction tensors (``mtp.*``; transformers writes none)."""
        return any(n.startswith("mtp.") for n in self.weight_map)

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
        if self.naming == "transformers":
            return name.endswith(".scale") or name.endswith("_scale_inv") or name.endswith(".weight_scale")
        return name.endswith("_scale_inv") or name.endswith(".weight_scale")

    # -------------------------------------------------------------------- iteration

    def iter_raw(self) -> Iterator[RawTensor]:
        """Yield every weight as stored (DeepSeek names; HF fused experts split per expert)."""
        consumed: set[str] = set()
        seen: set[str] = set()
        for file in self.files:
            listed = {n for n, f in self.weight_map.items() if f == file}
            try:
                reader = ShardReader(file)
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

    def _get(self, f: ShardReader, file: str, name: str, index: int | None = None) -> torch.Tensor:
        try:
            return f.get(name, index)
        except CheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read tensor ({e})", tensor=name, file=file) from None

    def _get_scale(self, f: ShardReader, file: str, sname: str, index: int | None = None) -> torch.Tensor:
        sfile = self.weight_map[sname]
        if sfile == file:
            return self._get(f, file, sname, index)
        with ShardReader(sfile) as g:
            return self._get(g, sfile, sname, index)

    def _raw_items(self, f: ShardReader, file: str, name: str, sname: str | None) -> Iterator[RawTensor]:
        if self.naming == "hf":
            m = HF_EXPERT_RE.match(name)
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
                raise unknown_name_error(name, self.naming, file) from None
        else:
            try:
                ds_name = saved_to_deepseek(name) if self.naming == "transformers" else name
                deepseek_to_hf(ds_name)
            except UnexpectedTensorError:
                raise unknown_name_error(name, self.naming, file) from None
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
