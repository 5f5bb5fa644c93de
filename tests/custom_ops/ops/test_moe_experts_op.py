"""MoeExperts / MoeExpertsFp8 / MoeExpertsFp4 through onnxruntime vs models.functional.moe_ffn / expert_ffn (weights
built with models.quant), every ISA level."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, fp8_e4m3, run_op, run_op_const, session_error
from weight_formats import FORMATS, SUFFIX, make_stacked

from testutil import tol
from dsv4_ort.models import functional as Fn


def activations(rng, tokens, dim, dtype):
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    if dtype == "bfloat16":
        xb = bf16(x)
        return xb, torch.from_numpy(bf16_to_f32(xb)).to(torch.bfloat16)
    return x, torch.from_numpy(x)


def routing(rng, tokens, experts, k, unused=()):
    """Distinct experts per token drawn from the experts not in `unused`; positive weights."""
    pool = np.array([e for e in range(experts) if e not in unused])
    idx = np.array([rng.permutation(pool)[:k] for _ in range(tokens)], np.int64).reshape(tokens, k)
    return rng.uniform(0.2, 1.5, (tokens, k)).astype(np.float32), idx


def expert_weights(rng, experts, inter, dim, fmt, block=128, gain=2.0, down_gain=1.0):
    """w1, w2, w3 in `fmt`; gain scales w1/w3 so that |gate|, |up| reach a few units (the clamp matters for L ~ 2)."""
    def rnd(shape, fan_in, g):
        return torch.from_numpy((g * rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32))

    return (make_stacked(rnd((experts, inter, dim), dim, gain), fmt, block, seed=1),
            make_stacked(rnd((experts, dim, inter), inter, down_gain), fmt, block, seed=2),
            make_stacked(rnd((experts, inter, dim), dim, gain), fmt, block, seed=3))


def run_moe(fmt, x, weights, indices, ws, limit=None, block=128, isa=None, threads=2):
    w1, w2, w3 = ws
    inputs = {"x": x, "weights": weights, "indices": indices, "w1": w1.data, "w2": w2.data, "w3": w3.data}
    attrs = {}
    if w1.scale is not None:
        inputs.update(s1=w1.scale, s2=w2.scale, s3=w3.scale)
        if fmt.startswith("fp8") and block != 128:
            attrs["block_size"] = block
    if limit is not None:
        attrs["swiglu_limit"] = limit
    return run_op("MoeExperts" + SUFFIX[fmt], inputs, attrs, isa, threads)[0]


def reference(xt, weights, indices, ws, limit=10.0):
    w1, w2, w3 = (w.dense for w in ws)
    if indices is None:
        return Fn.expert_ffn(xt, w1[0], w2[0], w3[0], swiglu_limit=limit)
    return Fn.moe_ffn(xt, torch.from_numpy(weights), torch.from_numpy(indices), w1, w2, w3, swiglu_limit=limit)


def check(y, ref, dtype):
    assert y.shape == tuple(ref.shape)
    np.testing.assert_allclose(y, ref.float().numpy(), **tol("bfloat16" if dtype == "bfloat16" else "float32_reduction"))


# T, E, k, d, I (d, I multiples of 32 for FP4); the last expert is never routed to. T = 0: test_no_tokens.
SHAPES = [(1, 4, 2, 64, 96), (17, 6, 2, 96, 64), (64, 3, 2, 96, 160)]  # the last: ~43 tokens per expert (prefill paths)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_experts(isa, fmt, dtype, shape):
    tokens, experts, k, dim, inter = shape
    rng = np.random.default_rng(tokens * 100 + dim + FORMATS.index(fmt))
    x, xt = activations(rng, tokens, dim, dtype)
    weights, indices = routing(rng, tokens, experts, k, unused=(experts - 1,))
    ws = expert_weights(rng, experts, inter, dim, fmt)
    check(run_moe(fmt, x, weights, indices, ws, isa=isa), reference(xt, weights, indices, ws), dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_tokens(isa, fmt):
    rng = np.random.default_rng(1)
    ws = expert_weights(rng, 4, 32, 64, fmt)
    x = np.zeros((0, 64), np.float32)
    y = run_moe(fmt, x, np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int64), ws, isa=isa)
    assert y.shape == (0, 64)
    assert run_moe(fmt, bf16(x), None, None, expert_weights(rng, 1, 32, 64, fmt), isa=isa).shape == (0, 64)


# FP8 with d and I not multiples of the block (partial blocks on both axes of every matrix).
@pytest.mark.parametrize("fmt,shape,block", [("fp8_e8m0", (3, 3, 2, 160, 200), 128),
                                             ("fp8_f32", (3, 3, 2, 160, 200), 128),
                                             ("fp8_e8m0", (5, 3, 2, 72, 40), 32)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_experts_fp8_partial_blocks(isa, fmt, dtype, shape, block):
    tokens, experts, k, dim, inter = shape
    rng = np.random.default_rng(dim + inter)
    x, xt = activations(rng, tokens, dim, dtype)
    weights, indices = routing(rng, tokens, experts, k)
    ws = expert_weights(rng, experts, inter, dim, fmt, block)
    check(run_moe(fmt, x, weights, indices, ws, block=block, isa=isa), reference(xt, weights, indices, ws), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_mlp_mode(isa, fmt, dtype):
    """No weights/indices: the shared expert (E = 1, weight 1) == functional.expert_ffn without a routing weight."""
    rng = np.random.default_rng(40 + FORMATS.index(fmt))
    x, xt = activations(rng, 5, 64, dtype)
    ws = expert_weights(rng, 1, 96, 64, fmt)
    check(run_moe(fmt, x, None, None, ws, isa=isa), reference(xt, None, None, ws), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("limit", [1.5, 0.0, -1.0])
def test_swiglu_limit(isa, dtype, limit):
    """L > 0 clamps (gate from above, up both ways; with gain 2 many values exceed 1.5); L <= 0 disables the clamp,
    as DeepSeek's reference does (compared with an effectively infinite limit)."""
    rng = np.random.default_rng(77)
    x, xt = activations(rng, 9, 64, dtype)
    weights, indices = routing(rng, 9, 4, 2)
    ws = expert_weights(rng, 4, 64, 64, "f32", gain=3.0)
    y = run_moe("f32", x, weights, indices, ws, limit=limit, isa=isa)
    check(y, reference(xt, weights, indices, ws, limit if limit > 0 else 1e30), dtype)
    if limit > 0:  # the clamp changed the result
        unclamped = reference(xt, weights, indices, ws, 1e30).float().numpy()
        assert np.abs(y - unclamped).max() > 0.1


def test_every_token_on_one_expert(isa):
    """k = 1 and every token on expert 2 of 4 (the other experts unused)."""
    rng = np.random.default_rng(3)
    x, xt = activations(rng, 6, 32, "float32")
    weights = rng.uniform(0.5, 1.0, (6, 1)).astype(np.float32)
    indices = np.full((6, 1), 2, np.int64)
    ws = expert_weights(rng, 4, 64, 32, "fp4")
    check(run_moe("fp4", x, weights, indices, ws, isa=isa), reference(xt, weights, indices, ws), "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_constant_weights(isa, fmt, dtype):
    """Expert weights and scales as constant initializers (as exported): the same output as when fed as inputs."""
    rng = np.random.default_rng(90 + FORMATS.index(fmt))
    x, xt = activations(rng, 13, 64, dtype)
    weights, indices = routing(rng, 13, 5, 2)
    ws = expert_weights(rng, 5, 96, 64, fmt, 32)
    inputs = {"x": x, "weights": weights, "indices": indices, "w1": ws[0].data, "w2": ws[1].data, "w3": ws[2].data}
    attrs = {"block_size": 32} if fmt.startswith("fp8") else {}
    if ws[0].scale is not None:
        inputs.update(s1=ws[0].scale, s2=ws[1].scale, s3=ws[2].scale)
    consts = tuple(n for n in inputs if n.startswith(("w", "s")) and n != "weights")
    y = run_op_const("MoeExperts" + SUFFIX[fmt], inputs, consts, attrs, isa)[0]
    np.testing.assert_array_equal(y, run_moe(fmt, x, weights, indices, ws, block=32, isa=isa))
    check(y, reference(xt, weights, indices, ws), dtype)


@pytest.mark.parametrize("tokens", [1, 13])
def test_constant_fp8_weights_with_nan_codes(isa, tokens):
    """Constant FP8 expert weights holding NaN codes keep the NaN-propagating decode: the same outputs as the weights
    fed as inputs, with NaN where the reference has it (a NaN code in W2 row 5 of a used expert: column 5 of its
    tokens)."""
    rng = np.random.default_rng(91)
    x, xt = activations(rng, tokens, 64, "float32")
    weights, indices = routing(rng, tokens, 5, 2)
    ws = expert_weights(rng, 5, 96, 64, "fp8_e8m0", 32)
    w2 = np.asarray(ws[1].data).copy()
    used = int(indices[0, 0])
    w2[used, 5, 7] = 0x7F
    inputs = {"x": x, "weights": weights, "indices": indices, "w1": ws[0].data, "w2": fp8_e4m3(w2),
              "w3": ws[2].data, "s1": ws[0].scale, "s2": ws[1].scale, "s3": ws[2].scale}
    consts = ("w1", "w2", "w3", "s1", "s2", "s3")
    y = run_op_const("MoeExpertsFp8", inputs, consts, {"block_size": 32}, isa)[0]
    np.testing.assert_array_equal(y, run_op("MoeExpertsFp8", inputs, {"block_size": 32}, isa)[0])
    hit = (indices == used).any(axis=1)
    assert np.isnan(y[hit, 5]).all() and np.isfinite(np.delete(y, 5, axis=1)).all() and np.isfinite(y[~hit]).all()


def test_result_independent_of_threads():
    rng = np.random.default_rng(8)
    x, _ = activations(rng, 23, 64, "bfloat16")
    weights, indices = routing(rng, 23, 8, 3)
    ws = expert_weights(rng, 8, 96, 64, "fp8_e8m0", 32)
    y1 = run_moe("fp8_e8m0", x, weights, indices, ws, block=32, threads=1)
    y2 = run_moe("fp8_e8m0", x, weights, indices, ws, block=32, threads=2)
    np.testing.assert_array_equal(y1, y2)


def test_token_chunks():
    """More tokens than one activation chunk holds (64 MiB of fp32: 1024 tokens at k = 8, I = 2048): two chunks."""
    rng = np.random.default_rng(12)
    tokens, experts, k, dim, inter = 1030, 8, 8, 32, 2048
    x, xt = activations(rng, tokens, dim, "float32")
    weights, indices = routing(rng, tokens, experts, k)
    # Outputs of order 1, so that fp32 summation-order differences (I = 2048, 8 experts) stay below atol.
    ws = expert_weights(rng, experts, inter, dim, "bf16", down_gain=0.2)
    check(run_moe("bf16", x, weights, indices, ws), reference(xt, weights, indices, ws), "float32")


# ---- bad input ----------------------------------------------------------------------------------------------------

def dense_inputs(tokens=3, experts=4, k=2, dim=32, inter=64, **override):
    rng = np.random.default_rng(0)
    weights, indices = routing(rng, tokens, experts, k)
    inputs = {"x": rng.standard_normal((tokens, dim)).astype(np.float32), "weights": weights, "indices": indices,
              "w1": np.zeros((experts, inter, dim), np.float32), "w2": np.zeros((experts, dim, inter), np.float32),
              "w3": np.zeros((experts, inter, dim), np.float32)}
    inputs.update(override)
    return inputs


@pytest.mark.parametrize("bad", [4, -1, 1 << 40])
def test_index_out_of_range(bad):
    inputs = dense_inputs()
    inputs["indices"][2, 1] = bad
    msg = session_error("MoeExperts", inputs)
    assert "MoeExperts" in msg and "token 2" in msg and f"={bad}" in msg and "[0, 4)" in msg


def test_weights_and_indices_together():
    inputs = dense_inputs()
    msg = session_error("MoeExperts", {**inputs, "indices": None})
    assert "MoeExperts" in msg and "both" in msg and "'weights'" in msg
    msg = session_error("MoeExperts", {**inputs, "weights": None})
    assert "both" in msg and "'indices'" in msg


def test_routing_shape_mismatch():
    inputs = dense_inputs()
    msg = session_error("MoeExperts", {**inputs, "weights": np.ones((3, 3), np.float32)})
    assert "'weights'" in msg and "[3, 2]" in msg
    msg = session_error("MoeExperts", {**inputs, "weights": np.ones((2, 2), np.float32),
                                       "indices": np.zeros((2, 2), np.int64)})
    assert "'indices'" in msg and "3 tokens" in msg


def test_weight_shape_mismatch():
    msg = session_error("MoeExperts", dense_inputs(w2=np.zeros((4, 32, 63), np.float32)))
    assert "MoeExperts" in msg and "'w2'" in msg and "[4, 32, 64]" in msg
    msg = session_error("MoeExperts", dense_inputs(w3=np.zeros((4, 64, 31), np.float32)))
    assert "'w3'" in msg
    msg = session_error("MoeExperts", dense_inputs(w1=np.zeros((4, 64, 33), np.float32)))
    assert "'w1'" in msg and "d=32" in msg


def test_dense_mode_needs_one_expert():
    msg = session_error("MoeExperts", dense_inputs(weights=None, indices=None))
    assert "MoeExperts" in msg and "dense" in msg and "E=4" in msg


def fp8_inputs(scale_dtype=np.uint8, **override):
    from onnx_helpers import fp8_e4m3

    e, inter, dim = 4, 200, 160  # scales [4, 2, 2]
    inputs = dense_inputs(experts=e, dim=dim, inter=inter)
    one = 127 if scale_dtype == np.uint8 else 1.0
    inputs.update(w1=fp8_e4m3(np.zeros((e, inter, dim), np.uint8)), w2=fp8_e4m3(np.zeros((e, dim, inter), np.uint8)),
                  w3=fp8_e4m3(np.zeros((e, inter, dim), np.uint8)), s1=np.full((e, 2, 2), one, scale_dtype),
                  s2=np.full((e, 2, 2), one, scale_dtype), s3=np.full((e, 2, 2), one, scale_dtype))
    inputs.update(override)
    return inputs


def test_fp8_bad_scale_shape():
    msg = session_error("MoeExpertsFp8", fp8_inputs(s2=np.full((4, 2, 1), 127, np.uint8)))
    assert "MoeExpertsFp8" in msg and "'s2'" in msg and "[4, 2, 2]" in msg
    msg = session_error("MoeExpertsFp8", fp8_inputs(s1=np.full((3, 2, 2), 127, np.uint8)))
    assert "'s1'" in msg


def test_fp8_nan_scale_of_used_expert():
    inputs = fp8_inputs()
    used = int(inputs["indices"][1, 0])
    inputs["s2"][used, 1, 0] = 0xFF
    msg = session_error("MoeExpertsFp8", inputs)
    assert "MoeExpertsFp8" in msg and "'s2'" in msg and "0xFF" in msg and f"[{used}, 1, 0]" in msg
    inputs = fp8_inputs(scale_dtype=np.float32)
    inputs["s3"][used, 0, 0] = np.nan
    msg = session_error("MoeExpertsFp8", inputs)
    assert "'s3'" in msg and "non-finite" in msg


def test_nan_scale_of_unused_expert_is_not_read():
    inputs = fp8_inputs()
    unused = sorted(set(range(4)) - set(inputs["indices"].ravel().tolist()))
    if not unused:
        inputs["indices"][:] = np.array([0, 1])
        unused = [3]
    inputs["s1"][unused[0]] = 0xFF
    (y,) = run_op("MoeExpertsFp8", inputs)
    assert np.isfinite(y).all()


def test_constant_nan_scale_fails_at_creation():
    """Constant scales are validated whole (every expert, used or not) when the session is created."""
    inputs = fp8_inputs()
    unused = sorted(set(range(4)) - set(inputs["indices"].ravel().tolist()))
    if not unused:
        inputs["indices"][:] = np.array([0, 1])
        unused = [3]
    inputs["s1"][unused[0], 0, 1] = 0xFF
    with pytest.raises(Exception) as e:
        run_op_const("MoeExpertsFp8", inputs, ("w1", "w2", "w3", "s1", "s2", "s3"))
    msg = str(e.value)
    assert "MoeExpertsFp8" in msg and "'s1'" in msg and "0xFF" in msg and f"[{unused[0]}, 0, 1]" in msg


def fp4_inputs(dim=64, inter=96, **override):
    e = 4
    inputs = dense_inputs(experts=e, dim=dim, inter=inter)
    inputs.update(w1=np.zeros((e, inter, dim // 2), np.uint8), w2=np.zeros((e, dim, inter // 2), np.uint8),
                  w3=np.zeros((e, inter, dim // 2), np.uint8), s1=np.full((e, inter, dim // 32), 127, np.uint8),
                  s2=np.full((e, dim, inter // 32), 127, np.uint8), s3=np.full((e, inter, dim // 32), 127, np.uint8))
    inputs.update(override)
    return inputs


def test_fp4_width_not_multiple_of_32():
    e, inter, dim = 4, 64, 48
    inputs = dense_inputs(experts=e, dim=dim, inter=inter)
    inputs.update(w1=np.zeros((e, inter, dim // 2), np.uint8), w2=np.zeros((e, dim, inter // 2), np.uint8),
                  w3=np.zeros((e, inter, dim // 2), np.uint8), s1=np.zeros((e, inter, 1), np.uint8),
                  s2=np.zeros((e, dim, 2), np.uint8), s3=np.zeros((e, inter, 1), np.uint8))
    msg = session_error("MoeExpertsFp4", inputs)
    assert "MoeExpertsFp4" in msg and "'w1'" in msg and "d=48" in msg and "multiple of 32" in msg
    e, inter, dim = 4, 48, 64
    inputs = dense_inputs(experts=e, dim=dim, inter=inter)
    inputs.update(w1=np.zeros((e, inter, dim // 2), np.uint8), w2=np.zeros((e, dim, inter // 2), np.uint8),
                  w3=np.zeros((e, inter, dim // 2), np.uint8), s1=np.zeros((e, inter, 2), np.uint8),
                  s2=np.zeros((e, dim, 1), np.uint8), s3=np.zeros((e, inter, 2), np.uint8))
    msg = session_error("MoeExpertsFp4", inputs)
    assert "'w2'" in msg and "I=48" in msg and "multiple of 32" in msg


def test_fp4_bad_scale():
    msg = session_error("MoeExpertsFp4", fp4_inputs(s1=np.full((4, 96, 1), 127, np.uint8)))
    assert "'s1'" in msg and "[4, 96, 2]" in msg
    inputs = fp4_inputs()
    used = int(inputs["indices"][0, 1])
    inputs["s1"][used, 5, 1] = 0xFF
    msg = session_error("MoeExpertsFp4", inputs)
    assert "'s1'" in msg and "0xFF" in msg and f"[{used}, 5, 1]" in msg


# ---- compute="bf16": fp32 x through the bf16 slot (x rounded to bf16, y widened back to float) ----

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_experts_bf16_compute(isa, fmt, shape):
    """Bit for bit the op on bf16(x), widened: routed and dense-MLP mode; and within bf16 distance of the exact fp32
    result (the reference of the bf16 slot is test_moe_experts' bfloat16 case)."""
    tokens, experts, k, dim, inter = shape
    rng = np.random.default_rng(tokens + dim + FORMATS.index(fmt))
    x, _ = activations(rng, tokens, dim, "float32")
    weights, indices = routing(rng, tokens, experts, k, unused=(experts - 1,))
    routed, dense = expert_weights(rng, experts, inter, dim, fmt), expert_weights(rng, 1, inter, dim, fmt)
    for wt, idx, w in ((weights, indices, routed), (None, None, dense)):
        w1, w2, w3 = w
        inputs = {"x": x, "weights": wt, "indices": idx, "w1": w1.data, "w2": w2.data, "w3": w3.data}
        if w1.scale is not None:
            inputs.update(s1=w1.scale, s2=w2.scale, s3=w3.scale)
        op = "MoeExperts" + SUFFIX[fmt]
        y = run_op(op, inputs, {"compute": "bf16"}, isa)[0]
        assert y.dtype == np.float32 and y.shape == x.shape
        want = run_op(op, {**inputs, "x": bf16(x)}, {}, isa)[0]  # bf16 outputs come back as float32
        np.testing.assert_array_equal(y, want)
        exact = run_op(op, inputs, {}, isa)[0]
        assert not np.array_equal(y, exact)
        np.testing.assert_allclose(y, exact, rtol=0, atol=0.05 * float(np.abs(exact).max(initial=1.0)))


def test_moe_experts_bf16_compute_leaves_bf16_activations_alone(isa):
    rng = np.random.default_rng(5)
    x, _ = activations(rng, 9, 64, "bfloat16")
    weights, indices = routing(rng, 9, 4, 2)
    w1, w2, w3 = expert_weights(rng, 4, 96, 64, "bf16")
    inputs = {"x": x, "weights": weights, "indices": indices, "w1": w1.data, "w2": w2.data, "w3": w3.data}
    np.testing.assert_array_equal(run_op("MoeExperts", inputs, {"compute": "bf16"}, isa)[0],
                                  run_op("MoeExperts", inputs, {}, isa)[0])


# ---- MoeExpertsFp4 compute="int8": bf16 activations, matmul inputs quantised per 32 columns ----

@pytest.mark.parametrize("shape", SHAPES)
def test_moe_experts_fp4_int8_compute(isa, shape):
    """Against functional.moe_ffn(int8=True) / expert_ffn(int8=True) (float64 block products) within bf16
    tolerance, routed and dense-MLP mode; fp32 x gives bit for bit the op on bf16(x); and the result is not the
    compute="bf16" one, but within its quantisation distance of it."""
    tokens, experts, k, dim, inter = shape
    rng = np.random.default_rng(tokens * 7 + dim)
    x, _ = activations(rng, tokens, dim, "float32")
    xt = torch.from_numpy(bf16_to_f32(bf16(x))).to(torch.bfloat16)
    weights, indices = routing(rng, tokens, experts, k, unused=(experts - 1,))
    routed, dense = expert_weights(rng, experts, inter, dim, "fp4"), expert_weights(rng, 1, inter, dim, "fp4")
    for wt, idx, w in ((weights, indices, routed), (None, None, dense)):
        w1, w2, w3 = w
        inputs = {"x": x, "weights": wt, "indices": idx, "w1": w1.data, "w2": w2.data, "w3": w3.data,
                  "s1": w1.scale, "s2": w2.scale, "s3": w3.scale}
        y = run_op("MoeExpertsFp4", inputs, {"compute": "int8"}, isa)[0]
        d1, d2, d3 = (v.dense for v in w)
        if idx is None:
            want = Fn.expert_ffn(xt, d1[0], d2[0], d3[0], swiglu_limit=10.0, int8=True)
        else:
            want = Fn.moe_ffn(xt, torch.from_numpy(wt), torch.from_numpy(idx), d1, d2, d3, swiglu_limit=10.0,
                              int8=True)
        # A one-ulp difference at a bf16 rounding point (h1, h3, a: fp32 against float64 sums) can move a block's
        # amax and with it all 32 codes of that block by a step: most outputs agree to bf16 precision, the rest to
        # within a quantisation step of the output scale.
        want = want.float().numpy()
        close = np.isclose(y, want, **tol("bfloat16"))
        assert close.mean() > 0.98, f"{(~close).sum()} of {close.size} outputs beyond bf16 tolerance"
        np.testing.assert_allclose(y, want, rtol=2**-6, atol=0.02 * float(np.abs(want).max(initial=1.0)))
        np.testing.assert_array_equal(y, run_op("MoeExpertsFp4", {**inputs, "x": bf16(x)}, {"compute": "int8"},
                                                isa)[0])
        products_bf16 = run_op("MoeExpertsFp4", inputs, {"compute": "bf16"}, isa)[0]
        assert not np.array_equal(y, products_bf16)
        np.testing.assert_allclose(y, products_bf16, rtol=0,
                                   atol=0.05 * float(np.abs(products_bf16).max(initial=1.0)))


def test_moe_experts_int8_compute_is_fp4_only():
    inputs = {"x": np.ones((1, 64), np.float32), "weights": np.ones((1, 1), np.float32),
              "indices": np.zeros((1, 1), np.int64), "w1": np.ones((2, 32, 64), np.float32),
              "w2": np.ones((2, 64, 32), np.float32), "w3": np.ones((2, 32, 64), np.float32)}
    msg = session_error("MoeExperts", inputs, {"compute": "int8"})
    assert "compute" in msg and "int8" in msg


def test_quantize_int8_blocks_spec():
    """The Python spec of the codes: half-even ties, amax 0, NaN and infinity blocks."""
    v = torch.zeros(4, 32)
    v[0, :5] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.49])
    v[2, 3] = float("nan")
    v[3, 1] = float("inf")
    q, s = Fn.quantize_int8_blocks(v)
    assert q[0, :5].tolist() == [127.0, 2.0, -4.0, 0.0, -0.0] and s[0].item() == 1.0
    assert not q[1].any() and s[1].item() == 0.0
    assert not q[2].any() and torch.isnan(s[2]).all() and not q[3].any() and torch.isnan(s[3]).all()
