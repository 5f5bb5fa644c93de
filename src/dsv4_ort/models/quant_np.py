"""numpy counterparts of the codecs in :mod:`.quant` (no torch), bit-identical to them.

Storage conventions (numpy has no bfloat16 / float8 dtypes): bfloat16 values are ``uint16`` bit patterns, FP8 E4M3FN
values and E8M0 scales are ``uint8`` codes, FP4 E2M1 codes are packed two per ``uint8`` byte (low nibble = even
index). Rounding is to nearest, ties to even, everywhere. See :mod:`.quant` for the formats.

Used to generate the random preset weights (:mod:`.synthetic`) and by the exporter to convert them; the decoders
do not validate NaN encodings (the synthetic weights never contain any; checkpoints are read through
:mod:`.quant`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FP8_E4M3_MAX", "FP4_E2M1_MAX", "FP8_BLOCK", "FP4_BLOCK", "FP4_E2M1_VALUES", "float_to_bf16",
           "bf16_to_float", "e8m0_for_amax", "e8m0_to_float", "float_to_fp8_e4m3", "fp8_e4m3_to_float",
           "float_to_fp4_e2m1", "pack_fp4", "unpack_fp4", "quant_fp8_block", "quant_fp4", "dequant_fp8_block",
           "dequant_fp4"]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


# ---------------------------------------------------------------------------------------------- bfloat16


def float_to_bf16(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (``uint16``), round to nearest even; NaN stays a (quiet) NaN."""
    x = _f32(x)
    b = x.view(np.uint32)
    r = (b >> 16) & 1
    r += b
    r += np.uint32(0x7FFF)
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((b[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def bf16_to_float(u) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``) -> float32, exactly."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------- E8M0


def e8m0_for_amax(amax, qmax: float, min_amax: float = 1e-4) -> np.ndarray:
    """E8M0 bytes of the smallest power of two ``s`` with ``max(amax, min_amax) / s <= qmax``."""
    a = np.maximum(np.asarray(amax, dtype=np.float64), min_amax) / qmax
    mant, exp = np.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    e = exp.astype(np.int64) - (mant == 0.5)
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def e8m0_to_float(u) -> np.ndarray:
    """E8M0 bytes -> float32 ``2 ** (b - 127)`` (``b = 0``: the subnormal 2**-127; ``b = 255``: NaN)."""
    u = np.asarray(u, dtype=np.uint8)
    bits = u.astype(np.uint32) << 23
    bits = np.where(u == 0, np.uint32(0x00400000), bits)
    bits = np.where(u == 0xFF, np.uint32(0x7FC00000), bits)
    return np.ascontiguousarray(bits, dtype=np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------------- FP8 E4M3FN


def float_to_fp8_e4m3(x) -> np.ndarray:
    """float32 -> E4M3FN codes (``uint8``): nearest even, saturating at +-448; NaN -> 0x7F (with sign)."""
    x = np.clip(_f32(x), -FP8_E4M3_MAX, FP8_E4M3_MAX)  # NaN passes through
    b = x.view(np.uint32)
    a = b & np.uint32(0x7FFFFFFF)
    # normal range [2**-6, 448]: round the float32 mantissa to 3 bits (ties to even), rebias the exponent 127 -> 7
    r = (a >> 20) & 1
    r += a
    r += np.uint32(0x7FFFF)
    r >>= 20  # float32 exponent and 3 mantissa bits
    r -= np.uint32((127 - 7) << 3)  # wraps below 2**-6: those codes are replaced next
    code = r.astype(np.uint8)
    # subnormals (|x| < 2**-6) are multiples of 2**-9; code 8 (the smallest normal) when rounding up to 2**-6
    small = a < np.uint32(0x3C800000)
    if small.any():
        code[small] = np.rint(a[small].view(np.float32) * np.float32(512.0)).astype(np.uint8)
    nan = a > np.uint32(0x7F800000)
    if nan.any():
        code[nan] = 0x7F
    code |= ((b >> 24) & 0x80).astype(np.uint8)
    return code


def _fp8_table() -> np.ndarray:
    c = np.arange(256)
    e, m = (c >> 3) & 0xF, (c & 7).astype(np.float64)
    mag = np.where(e == 0, np.ldexp(m, -9), np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


_FP8_TABLE = _fp8_table()


def fp8_e4m3_to_float(codes) -> np.ndarray:
    """E4M3FN codes (``uint8``) -> float32, exactly."""
    return _FP8_TABLE[np.asarray(codes, dtype=np.uint8)]


# ---------------------------------------------------------------------------------------------- FP4 E2M1

_FP4_PAIRS = np.stack([np.array(FP4_E2M1_VALUES, np.float32)[np.arange(256) & 0xF],
                       np.array(FP4_E2M1_VALUES, np.float32)[np.arange(256) >> 4]], axis=-1)  # byte -> (lo, hi)


def _next_up(v: float) -> np.float32:
    return np.nextafter(np.float32(v), np.float32(np.inf))


# Rounding boundaries between consecutive magnitudes; a tie goes to the even code, so the boundaries whose tie
# rounds down (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4) are replaced by the next float up.
_FP4_BOUNDS = np.array([_next_up(0.25), 0.75, _next_up(1.25), 1.75, _next_up(2.5), 3.5, _next_up(5.0)], np.float32)


def float_to_fp4_e2m1(x) -> np.ndarray:
    """float32 -> E2M1 codes (``uint8`` 0..15): nearest even, saturating at 6 (infinities too); NaN -> 0; the
    sign bit follows the input's (``-0.0`` and tiny negatives give code 8)."""
    b = _f32(x).view(np.uint32)
    a = (b & np.uint32(0x7FFFFFFF)).view(np.float32)
    code = (a >= _FP4_BOUNDS[0]).view(np.uint8).copy()  # magnitude code = boundaries at or below |x|
    for v in _FP4_BOUNDS[1:]:
        code += (a >= v).view(np.uint8)
    code |= ((b >> 28) & 8).astype(np.uint8)
    return code


def pack_fp4(codes) -> np.ndarray:
    """``[..., n]`` codes (n even) -> ``[..., n/2]`` bytes, low nibble = even index."""
    c = np.asarray(codes, dtype=np.uint8) & 0xF
    if c.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({c.shape[-1]}) of FP4 codes per row")
    return np.ascontiguousarray(c[..., 0::2] | (c[..., 1::2] << 4))


def unpack_fp4(packed) -> np.ndarray:
    """``[..., n/2]`` bytes -> ``[..., n]`` codes."""
    u = np.asarray(packed, dtype=np.uint8)
    return np.stack((u & 0xF, u >> 4), axis=-1).reshape(*u.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------- blocks


def _block_amax(w: np.ndarray, bo: int, bi: int) -> np.ndarray:
    """max |w| per bo x bi block (partial trailing blocks allowed), as float32 ``[ceil(rows/bo), ceil(cols/bi)]``."""
    rows, cols = w.shape
    a = w.view(np.uint32) & np.uint32(0x7FFFFFFF)  # |w|: for non-negative floats the bit patterns sort like values
    pr, pc = (-rows) % bo, (-cols) % bi
    if pr or pc:
        a = np.pad(a, ((0, pr), (0, pc)))
    if bo == 1:
        m = a.reshape(a.shape[0], a.shape[1] // bi, bi).max(axis=2)
    else:
        m = a.reshape(a.shape[0] // bo, bo, a.shape[1] // bi, bi).max(axis=(1, 3))
    return m.view(np.float32)


def _mul_blocks(w: np.ndarray, f: np.ndarray, bo: int, bi: int) -> np.ndarray:
    """``w[i, j] * f[i // bo, j // bi]`` (f: one float32 per block; partial trailing blocks allowed)."""
    rows, cols = w.shape
    if rows % bo == 0 and cols % bi == 0:
        return (w.reshape(rows // bo, bo, cols // bi, bi) * f[:, None, :, None]).reshape(rows, cols)
    return w * np.repeat(np.repeat(f, bo, axis=0)[:rows], bi, axis=1)[:, :cols]


def quant_fp8_block(w, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``[out, in]`` float32 -> (E4M3 codes ``uint8`` ``[out, in]``, E8M0 scales ``uint8`` per block x block).

    Scale per block = ``2 ** ceil(log2(max(amax, 1e-4) / 448))`` (as :func:`.quant.quant_fp8_block`).
    """
    w = _f32(w)
    e = e8m0_for_amax(_block_amax(w, block, block), FP8_E4M3_MAX)
    return float_to_fp8_e4m3(_mul_blocks(w, 1.0 / e8m0_to_float(e), block, block)), e  # exact: 1 / 2**k


def quant_fp4(w, block: int = FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``[out, in]`` float32 (in even) -> (packed E2M1 ``uint8`` ``[out, in/2]``, E8M0 scales ``[out, in/32]``)."""
    w = _f32(w)
    e = e8m0_for_amax(_block_amax(w, 1, block), FP4_E2M1_MAX, min_amax=FP4_E2M1_MAX * 2.0**-126)
    return pack_fp4(float_to_fp4_e2m1(_mul_blocks(w, 1.0 / e8m0_to_float(e), 1, block))), e


def dequant_fp8_block(codes, scale, block: int = FP8_BLOCK) -> np.ndarray:
    """Exact float32 value of an FP8 block-quantised ``[out, in]`` weight (E8M0 ``uint8`` scales)."""
    return _mul_blocks(fp8_e4m3_to_float(codes), e8m0_to_float(scale), block, block)


def dequant_fp4(packed, scale, block: int = FP4_BLOCK) -> np.ndarray:
    """Exact float32 value ``[out, in]`` of packed FP4 ``[out, in/2]`` with E8M0 scales ``[out, in/32]``."""
    p = np.asarray(packed, dtype=np.uint8)
    return _mul_blocks(_FP4_PAIRS[p].reshape(p.shape[0], p.shape[1] * 2), e8m0_to_float(scale), 1, block)
