"""Linear / LinearFp8 / LinearFp4 through onnxruntime vs models.functional.linear (weights built with models.quant),
every ISA level."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, fp8_e4m3, run_op, run_op_const, session_error
from weight_formats import FORMATS, SUFFIX, make_weight

from testutil import tol
from dsv4_ort.models import functional as Fn
from dsv4_ort.models import quant


def activations(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        xb = bf16(x)
        return xb, torch.from_numpy(bf16_to_f32(xb)).to(torch.bfloat16)
    return x, torch.from_numpy(x)


def random_weight(rng, n, kw):
    return torch.from_numpy((rng.standard_normal((n, kw)) / np.sqrt(max(kw, 1))).astype(np.float32))


def reference(xt, wt, groups, block):
    """functional.linear, once per group for groups > 1 (on the exact dequantised weight)."""
    if groups == 1:
        args = wt.torch_args
        return Fn.linear(xt, *args, fp8_block=block) if len(args) == 2 else Fn.linear(xt, args[0])
    n, kw = wt.dense.shape
    ng = n // groups
    return torch.cat([Fn.linear(xt[..., g * kw:(g + 1) * kw], wt.dense[g * ng:(g + 1) * ng]) for g in range(groups)],
                     dim=-1)


def run_linear(fmt, x, wt, groups=1, block=128, isa=None):
    inputs = {"x": x, "weight": wt.data}
    attrs = {"groups": groups} if groups != 1 else {}
    if wt.scale is not None:
        inputs["scale"] = wt.scale
        if fmt.startswith("fp8") and block != 128:
            attrs["block_size"] = block
    return run_op("Linear" + SUFFIX[fmt], inputs, attrs, isa)[0]


def check(y, ref, dtype):
    assert y.shape == tuple(ref.shape)
    np.testing.assert_allclose(y, ref.float().numpy(), **tol("bfloat16" if dtype == "bfloat16" else "float32_reduction"))


# lead dims, K, N: tails of 8/16/32/128, T = 0 and leading dims [B, S]; 40 rows take the prefill paths (AVX512
# panels / AMX tiles) for both activation types, over more than one 512-column block.
DENSE_SHAPES = [((1,), 7, 5), ((2, 5), 129, 70), ((0,), 16, 8), ((17,), 300, 3), ((2, 20), 600, 67)]


@pytest.mark.parametrize("lead,k,n", DENSE_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_linear_dense(isa, lead, k, n, dtype, fmt):
    rng = np.random.default_rng(k * 31 + n)
    x, xt = activations(rng, (*lead, k), dtype)
    wt = make_weight(random_weight(rng, n, k), fmt)
    check(run_linear(fmt, x, wt, isa=isa), reference(xt, wt, 1, 128), dtype)


# N, Kw not multiples of 128 (partial blocks on both axes), and a small block size.
FP8_SHAPES = [((3,), 200, 130, 128), ((1,), 129, 1, 128), ((2, 3), 64, 257, 128), ((5,), 100, 72, 32),
              ((40,), 600, 70, 128)]


@pytest.mark.parametrize("lead,k,n,block", FP8_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["fp8_e8m0", "fp8_f32"])
def test_linear_fp8(isa, lead, k, n, block, dtype, fmt):
    rng = np.random.default_rng(k + 7 * n + block)
    x, xt = activations(rng, (*lead, k), dtype)
    wt = make_weight(random_weight(rng, n, k), fmt, block, seed=n)
    check(run_linear(fmt, x, wt, block=block, isa=isa), reference(xt, wt, 1, block), dtype)


@pytest.mark.parametrize("lead,k,n", [((1,), 32, 5), ((17,), 64, 40), ((2, 3), 96, 129), ((0,), 32, 3), ((3,), 96, 7),
                                      ((40,), 544, 33)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_fp4(isa, lead, k, n, dtype):
    rng = np.random.default_rng(k * 13 + n)
    x, xt = activations(rng, (*lead, k), dtype)
    wt = make_weight(random_weight(rng, n, k), "fp4")
    check(run_linear("fp4", x, wt, isa=isa), reference(xt, wt, 1, 128), dtype)


# groups > 1: every format; for FP8 the row blocks straddle groups (N/G = 48 with 32-row blocks).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_groups(isa, fmt, dtype):
    rng = np.random.default_rng(FORMATS.index(fmt))
    groups, kw, n = 4, 64, 192
    block = 32 if fmt.startswith("fp8") else 128
    x, xt = activations(rng, (2, 3, groups * kw), dtype)
    wt = make_weight(random_weight(rng, n, kw), fmt, block, seed=3)
    check(run_linear(fmt, x, wt, groups, block, isa), reference(xt, wt, groups, block), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_groups_is_grouped_out_proj(isa, dtype):
    """groups = o_groups reproduces the wo_a half of functional.grouped_out_proj (wo_b = identity)."""
    rng = np.random.default_rng(5)
    b, s, h, d, g, dg = 2, 3, 8, 16, 4, 24
    x, ot = activations(rng, (b, s, h, d), dtype)
    wo_a = random_weight(rng, g * dg, h * d // g)
    fmt = "bf16" if dtype == "bfloat16" else "f32"
    wt = make_weight(wo_a, fmt)
    y = run_linear(fmt, x.reshape(b, s, h * d), wt, groups=g, isa=isa)
    ref = Fn.grouped_out_proj(ot, wt.torch_args[0], torch.eye(g * dg, dtype=ot.dtype), n_groups=g)
    check(y, ref, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_constant_weights(isa, fmt, dtype):
    """Weight and scale as constant initializers (as exported): the same output as when they are fed as inputs."""
    rng = np.random.default_rng(60 + FORMATS.index(fmt))
    x, xt = activations(rng, (2, 11, 96), dtype)
    wt = make_weight(random_weight(rng, 70, 96), fmt, 32, seed=4)
    inputs = {"x": x, "weight": wt.data}
    attrs = {"block_size": 32} if fmt.startswith("fp8") else {}
    if wt.scale is not None:
        inputs["scale"] = wt.scale
    y = run_op_const("Linear" + SUFFIX[fmt], inputs, tuple(n for n in inputs if n != "x"), attrs, isa)[0]
    np.testing.assert_array_equal(y, run_linear(fmt, x, wt, block=32, isa=isa))
    check(y, reference(xt, wt, 1, 32), dtype)


@pytest.mark.parametrize("op", ["LinearFp8", "LinearFp4"])
def test_linear_constant_nan_scale_fails_at_creation(op):
    """A constant scale is validated once, when the session is created, with the per-call message."""
    if op == "LinearFp8":
        inputs = {"x": np.zeros((1, 200), np.float32), "weight": fp8_e4m3(np.zeros((130, 200), np.uint8)),
                  "scale": np.full((2, 2), 127, np.uint8)}
        inputs["scale"][1, 0] = 0xFF
    else:
        inputs = {"x": np.zeros((1, 64), np.float32), "weight": np.zeros((3, 32), np.uint8),
                  "scale": np.full((3, 2), 127, np.uint8)}
        inputs["scale"][1, 0] = 0xFF
    with pytest.raises(Exception) as e:
        run_op_const(op, inputs, ("weight", "scale"))
    assert op in str(e.value) and "'scale'" in str(e.value) and "0xFF" in str(e.value) and "[1, 0]" in str(e.value)


def test_linear_fp8_nan_code_propagates(isa):
    """E4M3 NaN codes are not an error: the outputs that read them are NaN, the others are not."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    wt = make_weight(random_weight(rng, 4, 16), "fp8_e8m0")
    codes = np.asarray(wt.data).copy()
    codes[1, 3] = 0x7F
    codes[2, 0] = 0xFF
    (y,) = run_op("LinearFp8", {"x": x, "weight": fp8_e4m3(codes), "scale": wt.scale}, {}, isa)
    assert np.isnan(y[:, [1, 2]]).all() and np.isfinite(y[:, [0, 3]]).all()


@pytest.mark.parametrize("m", [1, 2, 4, 9])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_fp8_constant_nan_code_propagates(isa, m, dtype):
    """A constant weight is scanned for NaN codes at creation; one that holds some keeps the NaN-propagating decode:
    the same outputs as the weight fed as an input, NaN exactly where a row holds a NaN code (even against a zero
    activation), and a NaN-free constant weight gives the same outputs as fed as an input."""
    rng = np.random.default_rng(19)
    x, _ = activations(rng, (m, 200), dtype)
    x[:, 3] = 0
    wt = make_weight(random_weight(rng, 37, 200), "fp8_e8m0")
    codes = np.asarray(wt.data).copy()
    codes[1, 3] = 0x7F
    codes[30, 199] = 0xFF
    for c in (codes, np.asarray(wt.data)):
        inputs = {"x": x, "weight": fp8_e4m3(c), "scale": wt.scale}
        (y,) = run_op_const("LinearFp8", inputs, ("weight", "scale"), {}, isa)
        (want,) = run_op("LinearFp8", inputs, {}, isa)
        np.testing.assert_array_equal(y, want)
        rows = [1, 30] if c is codes else []
        assert np.isnan(y[:, rows]).all() and np.isfinite(np.delete(y, rows, axis=1)).all()


def test_linear_k_zero_gives_zeros():
    (y,) = run_op("Linear", {"x": np.zeros((3, 0), np.float32), "weight": np.zeros((5, 0), np.float32)})
    np.testing.assert_array_equal(y, np.zeros((3, 5), np.float32))


def test_e8m0_extremes_decode_exactly():
    """Scale bytes 0 (2^-127, subnormal) and 254 (2^127) decode exactly; the product stays finite."""
    x = np.ones((1, 128), np.float32)
    codes = np.zeros((2, 128), np.uint8)
    codes[:, 0] = 0x38  # 1.0
    scale = np.array([[254]], np.uint8)
    (y,) = run_op("LinearFp8", {"x": x, "weight": fp8_e4m3(codes), "scale": scale})
    np.testing.assert_array_equal(y, [[2.0 ** 127, 2.0 ** 127]])
    codes[:, 0] = 0x70  # 128
    (y,) = run_op("LinearFp8", {"x": x, "weight": fp8_e4m3(codes), "scale": np.array([[0]], np.uint8)})
    np.testing.assert_array_equal(y, [[2.0 ** -120, 2.0 ** -120]])


def test_fp4_nibble_order():
    """Low nibble = even index: byte 0x72 holds codes 2 (1.0, index 0) and 7 (6.0, index 1)."""
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x72
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 1.0, 10.0
    (y,) = run_op("LinearFp4", {"x": x, "weight": packed, "scale": np.full((1, 1), 127, np.uint8)})
    np.testing.assert_array_equal(y, [[1.0 + 60.0]])
    ref = Fn.linear(torch.from_numpy(x), torch.from_numpy(packed), torch.full((1, 1), 127, dtype=torch.uint8))
    np.testing.assert_array_equal(y, ref.numpy())


# Exhaustive decodes (through the op, so that every ISA variant's own decoding is covered): y = 1 * W[n, 0].

def test_every_e4m3_code_decodes_like_torch(isa):
    codes = np.arange(256, dtype=np.uint8).reshape(256, 1)
    (y,) = run_op("LinearFp8", {"x": np.ones((1, 1), np.float32), "weight": fp8_e4m3(codes),
                                "scale": np.full((2, 1), 127, np.uint8)}, {}, isa)
    want = quant.fp8_e4m3_to_float(torch.from_numpy(codes[:, 0])).numpy()
    np.testing.assert_array_equal(y[0], want)  # NaN at 0x7F and 0xFF (a sum from +0 turns -0 into +0)


def test_every_e2m1_code_and_nibble_decodes_like_quant(isa):
    packed = np.zeros((16, 16), np.uint8)
    packed[:, 0] = np.arange(16) | ((15 - np.arange(16)) << 4)  # row n: code n at column 0, code 15-n at column 1
    x = np.eye(2, 32, dtype=np.float32)
    (y,) = run_op("LinearFp4", {"x": x, "weight": packed, "scale": np.full((16, 1), 127, np.uint8)}, {}, isa)
    lut = quant.fp4_e2m1_to_float(torch.arange(16)).numpy()
    np.testing.assert_array_equal(y[0], lut)
    np.testing.assert_array_equal(y[1], lut[::-1])


def test_every_e8m0_scale_decodes_like_quant(isa):
    packed = np.zeros((255, 16), np.uint8)
    packed[:, 0] = 0x02  # 1.0 at column 0
    scale = np.arange(255, dtype=np.uint8).reshape(255, 1)
    (y,) = run_op("LinearFp4", {"x": np.eye(1, 32, dtype=np.float32), "weight": packed, "scale": scale}, {}, isa)
    np.testing.assert_array_equal(y[0], quant.e8m0_to_float(torch.from_numpy(scale[:, 0])).numpy())


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_linear_k_mismatch():
    msg = session_error("Linear", {"x": np.zeros((2, 10), np.float32), "weight": np.zeros((4, 12), np.float32)})
    assert "Linear" in msg and "K=10" in msg
    msg = session_error("Linear", {"x": np.zeros((2, 10), np.float32), "weight": np.zeros((4, 4), np.float32)},
                        {"groups": 2})
    assert "groups=2" in msg and "K must be 8" in msg


def test_linear_rows_not_divisible_by_groups():
    msg = session_error("Linear", {"x": np.zeros((2, 8), np.float32), "weight": np.zeros((5, 4), np.float32)},
                        {"groups": 2})
    assert "N=5" in msg and "groups=2" in msg


def test_linear_bad_groups_attribute():
    msg = session_error("Linear", {"x": np.zeros((2, 8), np.float32), "weight": np.zeros((4, 8), np.float32)},
                        {"groups": 0})
    assert "Linear" in msg and "groups" in msg


@pytest.mark.parametrize("scale_shape", [(1, 2), (2, 2), (1, 1), (3,)])
def test_linear_fp8_bad_scale_shape(scale_shape):
    w = fp8_e4m3(np.zeros((130, 100), np.uint8))
    msg = session_error("LinearFp8", {"x": np.zeros((1, 100), np.float32), "weight": w,
                                      "scale": np.zeros(scale_shape, np.float32)})
    assert "LinearFp8" in msg and "scale" in msg
    if len(scale_shape) == 2:
        assert "[2, 1]" in msg


def test_linear_fp8_nan_scale():
    w = fp8_e4m3(np.zeros((130, 200), np.uint8))
    scale = np.full((2, 2), 127, np.uint8)
    scale[1, 0] = 0xFF
    msg = session_error("LinearFp8", {"x": np.zeros((1, 200), np.float32), "weight": w, "scale": scale})
    assert "LinearFp8" in msg and "'scale'" in msg and "0xFF" in msg and "[1, 0]" in msg
    fscale = np.ones((2, 2), np.float32)
    fscale[0, 1] = np.inf
    msg = session_error("LinearFp8", {"x": np.zeros((1, 200), np.float32), "weight": w, "scale": fscale})
    assert "non-finite" in msg and "[0, 1]" in msg


@pytest.mark.parametrize("kw", [16, 48, 40])
def test_linear_fp4_width_not_multiple_of_32(kw):
    msg = session_error("LinearFp4", {"x": np.zeros((1, kw), np.float32), "weight": np.zeros((3, kw // 2), np.uint8),
                                      "scale": np.zeros((3, 1), np.uint8)})
    assert "LinearFp4" in msg and f"Kw={kw}" in msg and "multiple of 32" in msg


def test_linear_fp4_bad_scale():
    inputs = {"x": np.zeros((1, 64), np.float32), "weight": np.zeros((3, 32), np.uint8)}
    msg = session_error("LinearFp4", {**inputs, "scale": np.zeros((3, 1), np.uint8)})
    assert "'scale'" in msg and "[3, 2]" in msg
    scale = np.full((3, 2), 127, np.uint8)
    scale[2, 1] = 0xFF
    msg = session_error("LinearFp4", {**inputs, "scale": scale})
    assert "0xFF" in msg and "[2, 1]" in msg


def test_quant_reference_roundtrip_sanity():
    """The test weights are what models.quant says: dequant(quant(w)) is close to w."""
    rng = np.random.default_rng(0)
    w = random_weight(rng, 70, 96)
    for fmt, rel in (("fp8_e8m0", 0.07), ("fp4", 0.3)):
        wt = make_weight(w, fmt)
        err = (wt.dense - w).abs().max() / w.abs().max()
        assert err < rel, (fmt, float(err))
    assert quant.FP8_BLOCK == 128


# ---- compute="bf16": fp32 activations multiplied as bf16 (x and W rounded to bf16, fp32 sums, fp32 output) ----

def bf16_products_reference(x: np.ndarray, wt, groups: int) -> np.ndarray:
    """x and the exact dequantised weight rounded to bf16 (nearest-even), products summed in float64."""
    xr = torch.from_numpy(x).to(torch.bfloat16).double()
    wr = wt.dense.to(torch.bfloat16).double()
    n, kw = wr.shape
    ng = n // groups
    return torch.cat([xr[..., g * kw:(g + 1) * kw] @ wr[g * ng:(g + 1) * ng].T for g in range(groups)], dim=-1)


# M = 1 (decode rows), 5 and 16 (rows path, several activation blocks), 40 (panels / AMX tiles); groups.
BF16_COMPUTE_CASES = [((1,), 96, 70, 1), ((5,), 608, 33, 1), ((16,), 256, 129, 1), ((40,), 544, 70, 1),
                      ((2, 3), 256, 192, 4)]


@pytest.mark.parametrize("lead,k,n,groups", BF16_COMPUTE_CASES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_bf16_compute(isa, lead, k, n, groups, fmt):
    rng = np.random.default_rng(k + n + groups + FORMATS.index(fmt))
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    wt = make_weight(random_weight(rng, n, k // groups), fmt, 32, seed=n)
    inputs = {"x": x, "weight": wt.data}
    attrs = {"compute": "bf16"}
    if groups != 1:
        attrs["groups"] = groups
    if wt.scale is not None:
        inputs["scale"] = wt.scale
        if fmt.startswith("fp8"):
            attrs["block_size"] = 32
    y = run_op("Linear" + SUFFIX[fmt], inputs, attrs, isa)[0]
    assert y.dtype == np.float32 and y.shape == (*lead, n)
    np.testing.assert_allclose(y, bf16_products_reference(x, wt, groups).float().numpy(), **tol("float32_reduction"))
    # the mode changes the products: against the exact fp32 result the difference is of bf16 size, not zero
    exact = run_op("Linear" + SUFFIX[fmt], inputs, {k_: v for k_, v in attrs.items() if k_ != "compute"}, isa)[0]
    if x.size and fmt != "bf16":
        assert not np.array_equal(y, exact)
    np.testing.assert_allclose(y, exact, rtol=0, atol=0.05 * float(np.abs(exact).max(initial=1.0)))


def test_linear_bf16_compute_leaves_bf16_activations_alone(isa):
    rng = np.random.default_rng(3)
    x = bf16(rng.standard_normal((4, 64)).astype(np.float32))
    wt = make_weight(random_weight(rng, 24, 64), "bf16")
    a = run_op("Linear", {"x": x, "weight": wt.data}, {"compute": "bf16"}, isa)[0]
    b = run_op("Linear", {"x": x, "weight": wt.data}, {}, isa)[0]
    np.testing.assert_array_equal(a, b)
