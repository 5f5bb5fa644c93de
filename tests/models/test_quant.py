"""Bit-exact tests of the E8M0 / FP8 E4M3 / FP4 E2M1 codecs in ``dsv4_ort.models.quant``."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from dsv4_ort.models import quant as Q


def _ref_e4m3(byte: int) -> float:
    """Independent decoder from the bit layout (sign, 4-bit exponent bias 7, 3-bit mantissa)."""
    s = -1.0 if byte & 0x80 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return s * m * 2.0**-9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


# ------------------------------------------------------------------------------------------ E8M0


def test_e8m0_all_codes():
    u = torch.arange(256, dtype=torch.uint8)
    f = Q.e8m0_to_float(u)
    assert f.dtype == torch.float32
    for b in range(255):
        assert f[b].item() == 2.0 ** (b - 127), b
    assert math.isnan(f[255].item())
    # torch's own e8m0 dtype decodes the same way
    ref = u.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(f[:255], ref[:255])
    # float8_e8m0fnu input is accepted and identical
    assert torch.equal(Q.e8m0_to_float(u.view(torch.float8_e8m0fnu))[:255], f[:255])


@pytest.mark.parametrize("b", [0, 1, 126, 127, 128, 253, 254])
def test_e8m0_edge_exponents_roundtrip(b):
    v = Q.e8m0_to_float(torch.tensor([b], dtype=torch.uint8))
    assert v.item() == 2.0 ** (b - 127)
    assert Q.float_to_e8m0(v).item() == b
    assert Q.float_to_e8m0(v, as_dtype="e8m0").dtype == torch.float8_e8m0fnu


def test_e8m0_nan_rejected_with_name():
    u = torch.tensor([[127, 1], [0xFF, 3]], dtype=torch.uint8)
    with pytest.raises(Q.QuantFormatError, match=r"0xFF.*'layers\.0\.attn\.wq_a\.scale'"):
        Q.e8m0_to_float(u, name="layers.0.attn.wq_a.scale", validate=True)
    assert isinstance(Q.QuantFormatError("x"), ValueError)


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, 2.0**128, 2.0**-128, float("inf"), float("nan")])
def test_float_to_e8m0_rejects_non_pow2(bad):
    with pytest.raises(Q.QuantFormatError):
        Q.float_to_e8m0(torch.tensor([bad]), name="s")


def test_e8m0_for_amax():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, 448.0 * 2.0**-20])
    e = Q.e8m0_for_amax(amax, 448.0)
    s = Q.e8m0_to_float(e)
    assert s.tolist() == [1.0, 2.0, 2.0**-8, 2.0 ** math.ceil(math.log2(1e-4 / 448)), 2.0**-20]


# ------------------------------------------------------------------------------------------ FP8


def test_fp8_all_256_codes_vs_ml_dtypes_and_torch():
    u = torch.arange(256, dtype=torch.uint8)
    ours = Q.fp8_e4m3_to_float(u).numpy()
    via_ml = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    via_torch = u.view(torch.float8_e4m3fn).float().numpy()
    ref = np.array([_ref_e4m3(b) for b in range(256)], dtype=np.float32)
    for other in (via_ml, via_torch, ref):
        np.testing.assert_array_equal(ours, other)  # NaN positions compare equal too
    # signed zero preserved
    assert np.signbit(ours[0x80]) and not np.signbit(ours[0])
    nan_codes = [b for b in range(256) if math.isnan(ours[b])]
    assert nan_codes == [0x7F, 0xFF]
    assert ours[0x7E] == 448.0 and ours[0xFE] == -448.0


def test_fp8_subnormals():
    u = torch.arange(1, 8, dtype=torch.uint8)
    assert Q.fp8_e4m3_to_float(u).tolist() == [m * 2.0**-9 for m in range(1, 8)]
    assert Q.fp8_e4m3_to_float(u | 0x80).tolist() == [-m * 2.0**-9 for m in range(1, 8)]
    # smallest normal
    assert Q.fp8_e4m3_to_float(torch.tensor([0x08], dtype=torch.uint8)).item() == 2.0**-6


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_rejected(code):
    w = torch.zeros(4, 4, dtype=torch.uint8)
    w[2, 3] = code
    with pytest.raises(Q.QuantFormatError, match=r"NaN.*\(2, 3\).*'blk\.w'"):
        Q.fp8_e4m3_to_float(w, name="blk.w", validate=True)
    with pytest.raises(Q.QuantFormatError, match="blk.w"):
        Q.dequant_fp8_block(w.view(torch.float8_e4m3fn), torch.full((1, 1), 127, dtype=torch.uint8), name="blk.w")


def test_fp8_encode_all_finite_codes_roundtrip():
    u = torch.arange(256, dtype=torch.uint8)
    keep = (u & 0x7F) != 0x7F
    vals = Q.fp8_e4m3_to_float(u[keep])
    back = Q.as_uint8(Q.float_to_fp8_e4m3(vals))
    assert torch.equal(back, u[keep])


def test_fp8_encode_rounding_and_saturation():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1e9, 2.0**-10, 3 * 2.0**-11])
    got = Q.float_to_fp8_e4m3(x).float()
    exp = np.array(x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    exp[2], exp[3] = 448.0, -448.0  # we saturate
    np.testing.assert_array_equal(got.numpy(), exp)
    assert got[0].item() == 1.0 and got[1].item() == 1.25  # ties to even


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 1), (129, 127), (128, 130)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "uint8", "float32"])
def test_dequant_fp8_block_matches_elementwise(shape, scale_kind):
    g = torch.Generator().manual_seed(1)
    rows, cols = shape
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01
    sb = (math.ceil(rows / 128), math.ceil(cols / 128))
    e = torch.randint(100, 150, sb, generator=g, dtype=torch.uint8)
    scale = {"e8m0": e.view(torch.float8_e8m0fnu), "uint8": e, "float32": Q.e8m0_to_float(e)}[scale_kind]
    got = Q.dequant_fp8_block(codes.view(torch.float8_e4m3fn), scale, name="t")
    ref = np.empty(shape, dtype=np.float64)
    v = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ef = e.numpy().astype(np.float64) - 127
    for i in range(rows):
        ref[i] = v[i] * np.exp2(ef[i // 128][np.arange(cols) // 128])
    np.testing.assert_array_equal(got.numpy().astype(np.float64), ref)
    # bf16 output is the float32 result rounded
    assert torch.equal(Q.dequant_fp8_block(codes, e, out_dtype=torch.bfloat16), got.to(torch.bfloat16))


def test_dequant_fp8_block_shape_mismatch_names_tensor():
    w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(Q.QuantFormatError, match=r"expected \(2, 2\).*'x\.weight'"):
        Q.dequant_fp8_block(w, torch.zeros(2, 3, dtype=torch.uint8), name="x.weight")


def test_quant_fp8_block_roundtrip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(257, 300, generator=g) * 0.03
    w[:128, :128] = 0.0  # all-zero block
    q, s = Q.quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 3)
    d = Q.dequant_fp8_block(q, s)
    assert torch.all(d[:128, :128] == 0)
    # per-block relative error of e4m3 rounding (half ulp = 2**-4 relative to the block max)
    for bi in range(3):
        for bj in range(3):
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            amax = w[blk].abs().max().item()
            if amax:
                assert (d[blk] - w[blk]).abs().max().item() <= amax * 2.0**-4 + 1e-30
    # re-quantising the dequantised tensor reproduces the same values (codes may differ when a
    # block max lands exactly on 224 * scale, which halves the scale)
    assert torch.equal(Q.dequant_fp8_block(*Q.quant_fp8_block(d)), d)


# ------------------------------------------------------------------------------------------ FP4


def test_fp4_all_16_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    v = Q.fp4_e2m1_to_float(codes)
    assert v.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert torch.signbit(v[8]) and not torch.signbit(v[0])
    # independent decode from bits: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0
    for c in range(16):
        s = -1.0 if c & 8 else 1.0
        e, m = (c >> 1) & 3, c & 1
        ref = s * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
        assert v[c].item() == ref
    # ml_dtypes agrees
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(v.numpy(), ref)
    # encoding the decoded values returns the same codes
    assert torch.equal(Q.float_to_fp4_e2m1(v), codes)


def test_fp4_encoder_ties_to_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 4.9, 100.0, -0.1, -5.5])
    got = Q.fp4_e2m1_to_float(Q.float_to_fp4_e2m1(x)).tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 4.0, 6.0, -0.0, -6.0]
    ml = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.array(got[:9], dtype=np.float32), ml[:9])


def test_fp4_nibble_order():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)
    assert Q.unpack_fp4(packed).tolist() == [[1, 2, 8, 15]]
    d = Q.dequant_fp4(packed.view(torch.int8), torch.full((1, 1), 127, dtype=torch.uint8))
    assert d.tolist() == [[0.5, 1.0, -0.0, -6.0]]
    assert torch.equal(Q.pack_fp4(torch.tensor([[1, 2, 8, 15]]), as_dtype="uint8"), packed)
    # float4_e2m1fn_x2 input accepted
    one = torch.full((1, 1), 127, dtype=torch.uint8)
    assert torch.equal(Q.dequant_fp4(packed.view(torch.float4_e2m1fn_x2), one), d)


@pytest.mark.parametrize("cols", [64, 96, 40])
def test_dequant_fp4_matches_elementwise(cols):
    g = torch.Generator().manual_seed(3)
    rows = 5
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    packed = Q.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (rows, cols // 2)
    e = torch.randint(110, 140, (rows, math.ceil(cols / 32)), generator=g, dtype=torch.uint8)
    got = Q.dequant_fp4(packed, e.view(torch.float8_e8m0fnu), name="exp")
    lut = np.array(Q.FP4_E2M1_VALUES)
    ref = lut[codes.numpy()] * np.exp2(e.numpy().astype(np.float64)[:, np.arange(cols) // 32] - 127)
    np.testing.assert_array_equal(got.numpy().astype(np.float64), ref)


def test_dequant_fp4_bad_scale():
    packed = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(Q.QuantFormatError, match="ffn.experts.0.w1.weight"):
        Q.dequant_fp4(packed, torch.zeros(4, 3, dtype=torch.uint8), name="ffn.experts.0.w1.weight")
    bad = torch.full((4, 2), 127, dtype=torch.uint8)
    bad[1, 1] = 0xFF
    with pytest.raises(Q.QuantFormatError, match="0xFF"):
        Q.dequant_fp4(packed, bad, name="e")


def test_quant_fp4_roundtrip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 128, generator=g) * 0.02
    packed, s = Q.quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 64)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (6, 4)
    d = Q.dequant_fp4(packed, s)
    # block max maps to <= 6 and error <= half the largest grid step (1.0) times the scale
    sf = Q.e8m0_to_float(s).repeat_interleave(32, 1)
    assert torch.all((d - w).abs() <= sf * 1.0 + 0)
    # re-quantising reproduces the same values
    assert torch.equal(Q.dequant_fp4(*Q.quant_fp4(d)), d)


def test_fp4_encoder_dense_sweep_vs_ml_dtypes():
    v = torch.cat([torch.linspace(-8, 8, 40001),
                   torch.tensor([2.0 - 2**-20, 4.0 - 2**-20, 1e-30, -1e-30, float("inf"), float("-inf")])])
    ours = Q.fp4_e2m1_to_float(Q.float_to_fp4_e2m1(v)).numpy()
    ref = np.clip(v.numpy(), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(np.signbit(ours), np.signbit(ref))
