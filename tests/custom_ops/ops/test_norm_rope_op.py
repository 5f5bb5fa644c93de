"""RmsNorm / NormRope / Rope through onnxruntime vs models.functional, every ISA level."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, run_op, session_error

from testutil import tol
from dsv4_ort.models import functional as Fn


def as_input(a, dtype):
    return bf16(a) if dtype == "bfloat16" else np.ascontiguousarray(a, np.float32)


def as_torch(a, dtype):
    """The exact tensor the op sees (bf16 inputs rounded first)."""
    if dtype == "bfloat16":
        return torch.from_numpy(bf16_to_f32(bf16(a))).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a, np.float32))


def inv_freq(rd, base=10000.0):
    return (1.0 / base ** (np.arange(0, rd, 2, dtype=np.float32) / rd)).astype(np.float32)


def cos_sin(start_pos, S, freqs):
    pos = torch.from_numpy(start_pos)[:, None] + torch.arange(S)
    return Fn.rope_cos_sin(pos, torch.from_numpy(freqs))


def check(out, ref, dtype, kind="float32"):
    assert out.shape == tuple(ref.shape)
    np.testing.assert_allclose(out, ref.float().numpy(), **tol("bfloat16" if dtype == "bfloat16" else kind))


# ---- RmsNorm ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (2, 5, 129), (2, 4096 + 13)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weight", [None, "float32", "bfloat16"])
def test_rms_norm(isa, shape, dtype, weight):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32) if weight else None
    (y,) = run_op("RmsNorm", {"x": as_input(x, dtype), "weight": None if w is None else as_input(w, weight)},
                  dict(eps=1e-6), isa)
    ref = Fn.rms_norm(as_torch(x, dtype), None if w is None else as_torch(w, weight), 1e-6)
    check(y, ref, dtype, "float32_reduction")


def test_rms_norm_empty_rows(isa):
    (y,) = run_op("RmsNorm", {"x": np.zeros((0, 8), np.float32)}, {}, isa)
    assert y.shape == (0, 8)


# ---- NormRope -----------------------------------------------------------------------------------------------------

NORM_ROPE_CASES = [  # (x shape, rd, weight type)
    ((2, 5, 3, 40), 16, None),          # q: [B, S, H, D], tails
    ((2, 7, 72), 64, "float32"),        # kv: [B, S, D]
    ((2, 3, 72), 16, "bfloat16"),       # kv with a bf16 norm weight
    ((2, 2, 5, 24), 8, "float32"),      # per-head norm with a weight
    ((1, 1, 8, 64), 64, None),          # rope over the whole head
    ((3, 4, 2, 33), 0, None),           # no rope channels
    ((1, 64, 64, 512), 64, None),       # DeepSeek-V4 q: 64 tokens x 64 heads x 512, rope 64
    ((1, 64, 512), 64, "float32"),      # DeepSeek-V4 kv
]


@pytest.mark.parametrize("shape,rd,weight", NORM_ROPE_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_rope(isa, shape, rd, weight, dtype):
    rng = np.random.default_rng(shape[-1] + rd)
    B, S, D = shape[0], shape[1], shape[-1]
    x = rng.standard_normal(shape).astype(np.float32) * 2
    w = rng.uniform(0.5, 1.5, D).astype(np.float32) if weight else None
    start_pos = rng.integers(0, 70000, B).astype(np.int64)  # rows at different (large) positions
    freqs = inv_freq(rd)
    (y,) = run_op("NormRope", {"x": as_input(x, dtype), "weight": None if w is None else as_input(w, weight),
                               "start_pos": start_pos, "inv_freq": freqs}, dict(eps=1e-6), isa)
    cos, sin = cos_sin(start_pos, S, freqs)
    xt = as_torch(x, dtype)
    if len(shape) == 4:
        wt = None if w is None else as_torch(w, weight)
        ref = Fn.apply_rope(Fn.rms_norm(xt, wt, 1e-6), cos.unsqueeze(-2), sin.unsqueeze(-2))
        if w is None:
            ref_q = Fn.q_norm_rope(xt, cos, sin, rms_eps=1e-6)
            assert torch.equal(ref, ref_q)
    else:
        wt = torch.ones(D) if w is None else as_torch(w, weight)
        ref = Fn.kv_norm_rope(xt, wt, cos, sin, rms_eps=1e-6)
    check(y, ref, dtype, "float32_reduction")


def test_norm_rope_matches_model_attention_prep(isa):
    """NormRope for q (no weight) and kv (weight) equals the two preparation functions at the model's rope table."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(qk_rope_head_dim=16, rope_theta=10000.0, compress_rope_theta=160000.0,
                          rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                        "beta_fast": 32, "beta_slow": 1})
    freqs = Fn.rope_freqs(cfg, compressed=True).numpy()
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 4, 48)).astype(np.float32)
    kv = rng.standard_normal((2, 3, 48)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    start_pos = np.array([5, 100003], np.int64)
    (yq,) = run_op("NormRope", {"x": q, "start_pos": start_pos, "inv_freq": freqs}, dict(eps=1e-6), isa)
    (ykv,) = run_op("NormRope", {"x": kv, "weight": w, "start_pos": start_pos, "inv_freq": freqs}, dict(eps=1e-6), isa)
    cos, sin = cos_sin(start_pos, 3, freqs)
    check(yq, Fn.q_norm_rope(torch.from_numpy(q), cos, sin, rms_eps=1e-6), "float32", "float32_reduction")
    check(ykv, Fn.kv_norm_rope(torch.from_numpy(kv), torch.from_numpy(w), cos, sin, rms_eps=1e-6), "float32",
          "float32_reduction")


# ---- Rope ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,rd", [((2, 5, 4, 24), 8), ((1, 9, 64), 64), ((2, 3, 2, 3, 20), 12),
                                      ((1, 17, 8, 512), 64),     # attention output (inverse): D 512, rope 64
                                      ((1, 257, 64, 128), 64)])  # indexer q: 64 heads x 128
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("inverse", [0, 1])
def test_rope(isa, shape, rd, dtype, inverse):
    rng = np.random.default_rng(rd + inverse)
    B, S = shape[:2]
    x = rng.standard_normal(shape).astype(np.float32)
    start_pos = np.array([0, 1234567][:B], np.int64)
    freqs = inv_freq(rd, 160000.0)
    (y,) = run_op("Rope", {"x": as_input(x, dtype), "start_pos": start_pos, "inv_freq": freqs},
                  dict(inverse=inverse), isa)
    cos, sin = cos_sin(start_pos, S, freqs)
    for _ in range(len(shape) - 3):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    ref = Fn.apply_rope(as_torch(x, dtype), cos, sin, inverse=bool(inverse))
    check(y, ref, dtype)
    if dtype == "float32":  # the channels before the rope slice are copied bit for bit
        np.testing.assert_array_equal(y[..., : shape[-1] - rd], x[..., : shape[-1] - rd])


def test_rope_inverse_undoes_rope(isa):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 3, 32)).astype(np.float32)
    start_pos = np.array([7, 4000], np.int64)
    freqs = inv_freq(32)
    (y,) = run_op("Rope", {"x": x, "start_pos": start_pos, "inv_freq": freqs}, dict(inverse=0), isa)
    (z,) = run_op("Rope", {"x": y, "start_pos": start_pos, "inv_freq": freqs}, dict(inverse=1), isa)
    np.testing.assert_allclose(z, x, rtol=1e-5, atol=1e-5)


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_rms_norm_weight_mismatch():
    msg = session_error("RmsNorm", {"x": np.zeros((2, 8), np.float32), "weight": np.ones(7, np.float32)})
    assert "RmsNorm" in msg and "weight" in msg and "8" in msg


def test_norm_rope_bad_inputs():
    x = np.zeros((2, 3, 16), np.float32)
    ok = dict(x=x, start_pos=np.zeros(2, np.int64), inv_freq=inv_freq(8))
    msg = session_error("NormRope", {**ok, "start_pos": np.array([0, -1], np.int64)})
    assert "NormRope" in msg and "start_pos" in msg and ">= 0" in msg
    msg = session_error("NormRope", {**ok, "start_pos": np.zeros(3, np.int64)})
    assert "start_pos" in msg and "[2]" in msg
    msg = session_error("NormRope", {**ok, "inv_freq": inv_freq(18)})
    assert "inv_freq" in msg and "16" in msg
    msg = session_error("NormRope", {**ok, "weight": np.ones(15, np.float32)})
    assert "weight" in msg
    msg = session_error("NormRope", {**ok, "x": np.zeros((2, 16), np.float32)})
    assert "NormRope" in msg and "x" in msg


def test_rope_bad_attribute():
    msg = session_error("Rope", {"x": np.zeros((1, 1, 8), np.float32), "start_pos": np.zeros(1, np.int64),
                                 "inv_freq": inv_freq(8)}, dict(inverse=2))
    assert "Rope" in msg and "inverse" in msg
