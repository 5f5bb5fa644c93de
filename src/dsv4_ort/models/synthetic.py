"""Deterministic random DeepSeek-V4 weights in numpy (no torch), directly in their stored formats.

These are the weights of every synthetic model: :func:`dsv4_ort.models.random_checkpoint.write_random_checkpoint` writes
them to safetensors (through torch) and ``export_model(None, out, preset=...)`` exports them straight from here, so
a preset export and the export of a random checkpoint with the same seed are the same model.

Each tensor depends only on the seed, the weight mode and its DeepSeek name (its own PCG64 stream, seeded with the
seed and the CRC-32 of the name), never on which other tensors are generated. Values (float32 draws, then stored):

* linears, experts, compressor / indexer projections, head and the mHC ``fn`` matrices: ``N(0, 1 / fan_in)``;
* embedding: ``N(0, 1)``; norm weights: ``1 + N(0, 0.01)``; attention sinks: ``N(0, 1)``;
* mHC ``base`` and compressor ``ape``: ``N(0, 0.25)``; mHC ``scale``: uniform on ``[0.5, 1.5)``;
* score-routing gate bias: ``N(0, 0.01)``; ``tid2eid``: ``k`` distinct expert ids per token, uniformly random.

Stored formats (see :func:`.inventory.storage_kind`): FP8 E4M3 with E8M0 128 x 128 block scales, FP4 E2M1 packed
two per byte with E8M0 1 x 32 scales, bfloat16 (``uint16`` bit patterns), float32, int64; quantisation as in
:mod:`.quant_np` (bit-identical to :mod:`.quant`).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from . import quant_np as QN
from .inventory import WEIGHT_MODES, TensorSpec, cfg_dict, deepseek_tensor_specs, storage_kind

__all__ = ["ArrayTensor", "random_arrays", "make_array", "generator"]

_CHUNK_ELEMS = 1 << 22


@dataclasses.dataclass
class ArrayTensor:
    """A tensor in its stored form, as numpy arrays (the numpy counterpart of ``checkpoint.RawTensor``).

    ``stored``: ``"fp8"`` (``data`` E4M3 codes ``uint8``, ``scale`` E8M0 ``uint8`` per ``block``), ``"fp4"``
    (``data`` packed ``uint8`` ``[out, in/2]``, ``scale`` E8M0 per 1 x 32), ``"bf16"`` (``data`` ``uint16`` bit
    patterns), ``"fp32"`` or ``"int64"``. ``fmt`` is ``"fp8"``, ``"fp4"`` or ``"dense"`` as for ``RawTensor``.
    """

    name: str
    data: np.ndarray
    scale: np.ndarray | None
    stored: str
    block: tuple[int, int] | None = None
    file: str = ""

    @property
    def fmt(self) -> str:
        return self.stored if self.stored in ("fp8", "fp4") else "dense"

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantised) shape."""
        if self.stored == "fp4":
            return (*self.data.shape[:-1], self.data.shape[-1] * 2)
        return tuple(self.data.shape)

    def dequantize(self) -> np.ndarray:
        """Exact value: float32 for floating tensors, int64 for ``tid2eid``."""
        if self.stored == "fp8":
            return QN.dequant_fp8_block(self.data, self.scale, self.block[0])
        if self.stored == "fp4":
            return QN.dequant_fp4(self.data, self.scale, self.block[1])
        if self.stored == "bf16":
            return QN.bf16_to_float(self.data)
        return self.data

    def __repr__(self) -> str:
        sc = "" if self.scale is None else f", scale={self.scale.dtype}{tuple(self.scale.shape)}"
        return f"ArrayTensor({self.name!r}, {self.stored}, data={self.data.dtype}{tuple(self.data.shape)}{sc})"


def generator(seed: int, name: str) -> np.random.Generator:
    """The random stream of one tensor."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed) % 2**64,
                                                                       zlib.crc32(name.encode())])))


def _draw(spec: TensorSpec, g: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Next ``shape`` float32 values of ``spec`` from its stream (``shape`` may be a row chunk)."""
    init = spec.init
    if init == "hc_scale":
        return g.random(shape, dtype=np.float32) + np.float32(0.5)  # positive, around 1
    x = g.standard_normal(shape, dtype=np.float32)
    if init in ("linear", "hc_fn"):
        x *= np.float32(spec.shape[-1] ** -0.5)  # unit-variance outputs for unit-variance inputs
    elif init == "norm":
        x *= np.float32(0.1)
        x += np.float32(1.0)
    elif init in ("hc_base", "ape"):
        x *= np.float32(0.5)
    elif init == "bias":
        x *= np.float32(0.1)
    elif init not in ("embed", "sink"):
        raise ValueError(f"unknown init {init!r}")
    return x


def _row_chunks(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about 4M elements, multiples of 128 rows (whole FP8 scale blocks)."""
    step = max(QN.FP8_BLOCK, _CHUNK_ELEMS // max(cols, 1) // QN.FP8_BLOCK * QN.FP8_BLOCK)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _random_tid2eid(name: str, vocab: int, k: int, n_experts: int, seed: int) -> np.ndarray:
    """Random ``[vocab, k]`` int64 table of distinct expert ids per row."""
    g = generator(seed, name)
    out = np.empty((vocab, k), dtype=np.int64)
    step = max(1, _CHUNK_ELEMS // max(n_experts, 1))
    for s in range(0, vocab, step):
        e = min(vocab, s + step)
        out[s:e] = g.random((e - s, n_experts)).argsort(axis=1, kind="stable")[:, :k]
    return out


def make_array(spec: TensorSpec, weights: str, seed: int, config: Any) -> ArrayTensor:
    """One tensor in its stored form, generated row chunk by row chunk (peak ~ stored size + 16 MB)."""
    kind = storage_kind(spec, weights)
    if kind == "int64":
        c = cfg_dict(config) if not isinstance(config, dict) else config
        V, K = spec.shape
        return ArrayTensor(spec.name, _random_tid2eid(spec.name, V, K, c["n_routed_experts"], seed), None, "int64")
    g = generator(seed, spec.name)
    shape = spec.shape
    if len(shape) != 2:
        x = _draw(spec, g, shape)
        return ArrayTensor(spec.name, x if kind == "fp32" else QN.float_to_bf16(x), None, kind)
    rows, cols = shape
    if kind == "fp8":
        data = np.empty(shape, np.uint8)
        scale = np.empty((math.ceil(rows / QN.FP8_BLOCK), math.ceil(cols / QN.FP8_BLOCK)), np.uint8)
    elif kind == "fp4":
        data = np.empty((rows, cols // 2), np.uint8)
        scale = np.empty((rows, math.ceil(cols / QN.FP4_BLOCK)), np.uint8)
    else:
        data, scale = np.empty(shape, np.float32 if kind == "fp32" else np.uint16), None
    for r0, r1 in _row_chunks(rows, cols):
        x = _draw(spec, g, (r1 - r0, cols))
        if kind == "fp8":
            b0 = r0 // QN.FP8_BLOCK
            q, s = QN.quant_fp8_block(x)
            data[r0:r1], scale[b0:b0 + s.shape[0]] = q, s
        elif kind == "fp4":
            data[r0:r1], scale[r0:r1] = QN.quant_fp4(x)
        else:
            data[r0:r1] = x if kind == "fp32" else QN.float_to_bf16(x)
    block = {"fp8": (QN.FP8_BLOCK, QN.FP8_BLOCK), "fp4": (1, QN.FP4_BLOCK)}.get(kind)
    return ArrayTensor(spec.name, data, scale, kind, block)


def random_arrays(config: Any, weights: str = "native", seed: int = 0,
                  names: Iterable[str] | None = None) -> Iterator[ArrayTensor]:
    """Every tensor of the model (MTP included, DeepSeek naming, file order) as :class:`ArrayTensor`, one at a
    time; ``names``: only these. ``weights``: ``native`` (the release formats), ``fp8``, ``bf16`` or ``fp32``
    (see :func:`dsv4_ort.models.random_checkpoint.write_random_checkpoint`)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    c = cfg_dict(config)
    keep = None if names is None else set(names)
    for spec in deepseek_tensor_specs(c):
        if keep is None or spec.name in keep:
            yield make_array(spec, weights, seed, c)
