"""Exact codecs for the number formats of the DeepSeek-V4 checkpoints.

Formats
-------
* **E8M0** (``ue8m0``, ``torch.float8_e8m0fnu``): one byte ``b`` encodes ``2 ** (b - 127)``;
  ``b = 0xFF`` is NaN. There is no sign, no zero and no mantissa.
* **FP8 E4M3FN** (``torch.float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
  no infinities, ``S.1111.111`` (``0x7F`` / ``0xFF``) is NaN, largest finite value 448.
  Linear weights are stored with one E8M0 scale per 128 x 128 block:
  ``W[i, j] = q[i, j] * scale[i // 128, j // 128]``.
* **FP4 E2M1**: 1 sign (bit 3), 2 exponent, 1 mantissa bit; the 8 magnitudes are
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Two codes per byte along the input dimension, the LOW nibble
  holding the even index. Routed experts carry one E8M0 scale per 1 x 32 block:
  ``W[i, j] = fp4(q[i, j]) * scale[i, j // 32]``.

All decoders are exact: every decoded value (and every product with a power-of-two scale that
stays inside the float32 range) is representable in float32.

The ``quant_*`` functions are the inverse quantisers used to write synthetic checkpoints; they
use power-of-two scales ``2 ** ceil(log2(amax / qmax))`` and round to nearest, ties to even.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "FP4_E2M1_VALUES",
    "FP8_BLOCK",
    "FP4_BLOCK",
    "QuantFormatError",
    "as_uint8",
    "e8m0_to_float",
    "float_to_e8m0",
    "e8m0_for_amax",
    "check_e8m0",
    "fp8_e4m3_to_float",
    "float_to_fp8_e4m3",
    "check_fp8_e4m3",
    "fp4_e2m1_to_float",
    "float_to_fp4_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "scale_to_float",
    "dequant_fp8_block",
    "dequant_fp4",
    "quant_fp8_block",
    "quant_fp4",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32

# Code k (0..15) -> value. Bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
_FP4X2_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)


class QuantFormatError(ValueError):
    """A quantised tensor holds an invalid encoding (NaN code) or has an inconsistent shape."""


def _where(name: str | None) -> str:
    return f" in tensor {name!r}" if name else ""


def as_uint8(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor (uint8, int8, float8_*, float4_e2m1fn_x2) as uint8, no copy."""
    if x.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype, got {x.dtype}")
    if x.dtype == torch.uint8:
        return x
    return x.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# E8M0
# ----------------------------------------------------------------------------------------------


def check_e8m0(x: torch.Tensor, name: str | None = None) -> None:
    """Raise :class:`QuantFormatError` if any byte is 0xFF (the E8M0 NaN encoding)."""
    u = as_uint8(x)
    bad = u == 0xFF
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise QuantFormatError(
            f"E8M0 scale NaN encoding 0xFF at index {idx}{_where(name)} ({int(bad.sum())} such entries)"
        )


def e8m0_to_float(x: torch.Tensor, name: str | None = None, validate: bool = False) -> torch.Tensor:
    """Decode E8M0 bytes (uint8 or float8_e8m0fnu) to float32 ``2 ** (b - 127)``, exactly.

    ``b = 0`` gives ``2**-127`` (a float32 subnormal); ``b = 255`` gives NaN, or raises
    :class:`QuantFormatError` naming ``name`` when ``validate`` is set.
    """
    u = as_uint8(x)
    if validate:
        check_e8m0(u, name)
    bits = u.to(torch.int32) << 23  # exponent field = b  ->  2 ** (b - 127) for 1 <= b <= 254
    bits = torch.where(u == 0, torch.full_like(bits, 0x00400000), bits)  # 2**-127: subnormal
    bits = torch.where(u == 0xFF, torch.full_like(bits, 0x7FC00000), bits)  # quiet NaN
    return bits.view(torch.float32)


def float_to_e8m0(x: torch.Tensor | float, name: str | None = None, as_dtype: str = "uint8") -> torch.Tensor:
    """Encode exact powers of two in ``[2**-127, 2**127]`` as E8M0 bytes.

    ``as_dtype``: ``"uint8"`` or ``"e8m0"`` (``torch.float8_e8m0fnu``). Anything that is not an
    exact power of two in range raises :class:`QuantFormatError`.
    """
    t = torch.as_tensor(x, dtype=torch.float64)
    mant, exp = torch.frexp(t)  # t = mant * 2**exp, mant in [0.5, 1)
    ok = (mant == 0.5) & torch.isfinite(t)
    e = exp.to(torch.int64) - 1 + 127
    ok &= (e >= 0) & (e <= 254)
    if not bool(ok.all()):
        bad = t[~ok].flatten()[0].item()
        raise QuantFormatError(f"value {bad!r}{_where(name)} is not a power of two in [2**-127, 2**127]")
    u = e.to(torch.uint8)
    return _to_scale_dtype(u, as_dtype)


def _to_scale_dtype(u: torch.Tensor, as_dtype: str) -> torch.Tensor:
    if as_dtype == "uint8":
        return u
    if as_dtype == "e8m0":
        if _E8M0_DTYPE is None:  # pragma: no cover - torch < 2.7
            raise RuntimeError("this torch has no float8_e8m0fnu dtype")
        return u.view(_E8M0_DTYPE)
    raise ValueError(f"unknown scale dtype {as_dtype!r} (expected 'uint8' or 'e8m0')")


def e8m0_for_amax(amax: torch.Tensor, qmax: float, min_amax: float = 1e-4) -> torch.Tensor:
    """E8M0 bytes (uint8) of the smallest power of two ``s`` with ``amax / s <= qmax``.

    ``amax`` is clamped below by ``min_amax`` (all-zero blocks get a small valid scale).
    """
    a = amax.to(torch.float64).clamp_min(min_amax) / qmax
    mant, exp = torch.frexp(a)
    # a = mant * 2**exp; ceil(log2 a) = exp - 1 if mant == 0.5 else exp
    e = exp.to(torch.int64) - (mant == 0.5).to(torch.int64)
    return (e + 127).clamp(0, 254).to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# FP8 E4M3FN
# ----------------------------------------------------------------------------------------------


def check_fp8_e4m3(x: torch.Tensor, name: str | None = None) -> None:
    """Raise :class:`QuantFormatError` if any byte is an E4M3FN NaN encoding (0x7F or 0xFF)."""
    u = as_uint8(x)
    bad = (u & 0x7F) == 0x7F
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise QuantFormatError(
            f"FP8 E4M3 NaN encoding 0x{int(u[idx]):02X} at index {idx}{_where(name)} "
            f"({int(bad.sum())} such entries)"
        )


def fp8_e4m3_to_float(x: torch.Tensor, name: str | None = None, validate: bool = False) -> torch.Tensor:
    """Decode E4M3FN (float8_e4m3fn or raw uint8/int8 bytes) to float32, exactly."""
    if x.dtype != torch.float8_e4m3fn:
        x = as_uint8(x).view(torch.float8_e4m3fn)
    if validate:
        check_fp8_e4m3(x, name)
    return x.to(torch.float32)


def float_to_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E4M3FN (nearest, ties to even), saturating at +-448. NaN stays NaN."""
    x = x.to(torch.float32)
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ----------------------------------------------------------------------------------------------
# FP4 E2M1
# ----------------------------------------------------------------------------------------------


def fp4_e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (integers 0..15, one per element) to float32."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.to(torch.int64) & 0xF]


# magnitude * 2 (0, 1, 2, 3, 4, 6, 8, 12) -> code
_FP4_CODE_OF_2X = (0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7)


def float_to_fp4_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E2M1 codes (uint8 in 0..15): nearest, ties to even, saturating at 6.

    The grid spacing is 0.5 below 2, 1 on [2, 4) and 2 from 4, so rounding is ``round(a / step) *
    step`` with torch's round-half-to-even, which is exactly ties-to-even on the E2M1 mantissa. The
    sign bit follows the sign of the input (``-0.0`` and tiny negatives give code 8); NaN gives 0.
    """
    x = x.to(torch.float32)
    a = torch.nan_to_num(x.abs(), nan=0.0)
    step = (a >= 2.0).to(torch.float32).add_((a >= 4.0).to(torch.float32)).exp2_().mul_(0.5)  # .5 / 1 / 2
    twice = a.div_(step).round_().mul_(step).clamp_(max=FP4_E2M1_MAX).mul_(2.0).to(torch.uint8)
    lut = torch.tensor(_FP4_CODE_OF_2X, dtype=torch.uint8, device=x.device)
    code = lut[twice.to(torch.int64)]
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n/2]`` packed bytes -> ``[..., n]`` uint8 codes (low nibble = even index)."""
    u = as_uint8(packed)
    lo = u & 0xF
    hi = u >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor, as_dtype: str = "int8") -> torch.Tensor:
    """``[..., n]`` codes (n even) -> ``[..., n/2]`` bytes; ``as_dtype`` in int8 | uint8 | fp4x2."""
    if codes.shape[-1] % 2:
        raise QuantFormatError(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes per row")
    c = codes.to(torch.uint8) & 0xF
    u = c[..., 0::2] | (c[..., 1::2] << 4)
    if as_dtype == "uint8":
        return u.contiguous()
    if as_dtype == "int8":
        return u.contiguous().view(torch.int8)
    if as_dtype == "fp4x2":
        if _FP4X2_DTYPE is None:  # pragma: no cover
            raise RuntimeError("this torch has no float4_e2m1fn_x2 dtype")
        return u.contiguous().view(_FP4X2_DTYPE)
    raise ValueError(f"unknown packed dtype {as_dtype!r}")


# ----------------------------------------------------------------------------------------------
# Block dequantisation
# ----------------------------------------------------------------------------------------------


def scale_to_float(scale: torch.Tensor, name: str | None = None, validate: bool = False) -> torch.Tensor:
    """Scale tensor -> float32 multipliers.

    uint8 and float8_e8m0fnu are E8M0 exponents; float32 / bfloat16 / float16 are taken as plain
    multipliers (the ``weight_scale_inv`` convention: ``W = q * scale``).
    """
    if scale.dtype == torch.uint8 or (_E8M0_DTYPE is not None and scale.dtype == _E8M0_DTYPE):
        return e8m0_to_float(scale, name=name, validate=validate)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        s = scale.to(torch.float32)
        if validate and not bool(torch.isfinite(s).all()):
            raise QuantFormatError(f"non-finite scale{_where(name)}")
        return s
    raise QuantFormatError(f"unsupported scale dtype {scale.dtype}{_where(name)}")


def _apply_col_blocks(out: torch.Tensor, s: torch.Tensor, block: int) -> None:
    """In place: ``out[i, j] *= s[i, j // block]`` for 2-D ``out`` and ``s`` with s.shape[1] blocks."""
    cols = out.shape[1]
    full = cols // block
    main = full * block
    if full:
        out[:, :main].unflatten(1, (full, block)).mul_(s[:, :full, None])
    if main < cols:
        out[:, main:].mul_(s[:, full : full + 1])


def dequant_fp8_block(
    w: torch.Tensor,
    scale: torch.Tensor,
    block: int | tuple[int, int] = FP8_BLOCK,
    name: str | None = None,
    validate: bool = True,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Exact dequantisation of an FP8 E4M3 weight ``[out, in]`` with block scales.

    ``scale`` is ``[ceil(out/bo), ceil(in/bi)]`` in E8M0 (uint8 / float8_e8m0fnu) or float32
    (``weight_scale_inv`` style). Trailing partial blocks are supported. With ``validate`` the
    FP8 NaN codes and E8M0 NaN bytes raise :class:`QuantFormatError` naming ``name``.
    """
    bo, bi = (block, block) if isinstance(block, int) else block
    if w.dim() != 2:
        raise QuantFormatError(f"FP8 block weight must be 2-D, got shape {tuple(w.shape)}{_where(name)}")
    rows, cols = w.shape
    want = (math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale.shape) != want:
        raise QuantFormatError(
            f"scale shape {tuple(scale.shape)} does not match weight shape {(rows, cols)} with "
            f"{bo}x{bi} blocks (expected {want}){_where(name)}"
        )
    out = fp8_e4m3_to_float(w, name=name, validate=validate)
    if out.data_ptr() == w.data_ptr():  # pragma: no cover - defensive, .to() always copies here
        out = out.clone()
    s = scale_to_float(scale, name=name, validate=validate)
    s = s.repeat_interleave(bo, dim=0)[:rows]  # [rows, ceil(cols/bi)] - small
    _apply_col_blocks(out, s, bi)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


_PAIR_LUTS: dict = {}


def _fp4_pair_lut(device) -> torch.Tensor:
    key = str(device)
    if key not in _PAIR_LUTS:
        v = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        _PAIR_LUTS[key] = torch.stack((v[b & 0xF], v[b >> 4]), dim=-1).to(device)  # [256, 2]
    return _PAIR_LUTS[key]


def dequant_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    block: int = FP4_BLOCK,
    name: str | None = None,
    validate: bool = True,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Exact dequantisation of packed FP4 E2M1 ``[out, in/2]`` with E8M0 scales ``[out, ceil(in/32)]``.

    ``packed`` may be uint8, int8 or float4_e2m1fn_x2 (two codes per byte, low nibble = even
    input index). Returns ``[out, in]``.
    """
    if packed.dim() != 2:
        raise QuantFormatError(f"FP4 weight must be 2-D, got shape {tuple(packed.shape)}{_where(name)}")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    want = (rows, math.ceil(cols / block))
    if tuple(scale.shape) != want:
        raise QuantFormatError(
            f"scale shape {tuple(scale.shape)} does not match packed FP4 weight shape "
            f"{tuple(packed.shape)} (= {rows}x{cols} values, 1x{block} blocks, expected {want}){_where(name)}"
        )
    pair = _fp4_pair_lut(packed.device)  # byte -> (value of low nibble, value of high nibble)
    out = pair[as_uint8(packed).to(torch.int64)].reshape(rows, cols)
    s = scale_to_float(scale, name=name, validate=validate)
    _apply_col_blocks(out, s, block)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Quantisers (for writing checkpoints)
# ----------------------------------------------------------------------------------------------


def _block_amax(w: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    rows, cols = w.shape
    pr, pc = (-rows) % bo, (-cols) % bi
    a = w.abs()
    if pr or pc:
        a = torch.nn.functional.pad(a, (0, pc, 0, pr))
    return a.unflatten(0, (-1, bo)).unflatten(2, (-1, bi)).amax(dim=(1, 3))


def quant_fp8_block(
    w: torch.Tensor,
    block: int | tuple[int, int] = FP8_BLOCK,
    scale_dtype: str = "e8m0",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``[out, in]`` to (E4M3 ``float8_e4m3fn``, E8M0 scales ``[ceil(out/bo), ceil(in/bi)]``).

    Scale per block = ``2 ** ceil(log2(max(amax, 1e-4) / 448))``; values are rounded to nearest
    (ties to even). ``scale_dtype``: ``"e8m0"`` (float8_e8m0fnu) or ``"uint8"``.
    """
    bo, bi = (block, block) if isinstance(block, int) else block
    w = w.to(torch.float32)
    e = e8m0_for_amax(_block_amax(w, bo, bi), FP8_E4M3_MAX)
    s = e8m0_to_float(e).repeat_interleave(bo, dim=0)[: w.shape[0]]
    x = w.clone()
    # divide by a power of two == multiply by its reciprocal, exactly
    _apply_col_blocks(x, s.reciprocal(), bi)
    return float_to_fp8_e4m3(x), _to_scale_dtype(e, scale_dtype)


def quant_fp4(
    w: torch.Tensor,
    block: int = FP4_BLOCK,
    scale_dtype: str = "e8m0",
    packed_dtype: str = "int8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``[out, in]`` (in even) to (packed E2M1 ``[out, in/2]``, E8M0 scales ``[out, ceil(in/32)]``).

    Scale per 1 x ``block`` = ``2 ** ceil(log2(max(amax, 6 * 2**-126) / 6))``.
    """
    w = w.to(torch.float32)
    e = e8m0_for_amax(_block_amax(w, 1, block), FP4_E2M1_MAX, min_amax=FP4_E2M1_MAX * 2.0**-126)
    x = w.clone()
    _apply_col_blocks(x, e8m0_to_float(e).reciprocal(), block)
    packed = pack_fp4(float_to_fp4_e2m1(x), as_dtype=packed_dtype)
    return packed, _to_scale_dtype(e, scale_dtype)
