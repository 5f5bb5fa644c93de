"""HcPre / HcPost / HcHead through onnxruntime vs models.functional (and HF's modules), every ISA level."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, run_op, session_error

from testutil import tol
from dsv4_ort.models import functional as Fn


def hc_params(rng, hc, d, heads):
    fn = (rng.standard_normal((heads, hc * d)) / np.sqrt(hc * d)).astype(np.float32)
    scale = rng.uniform(0.2, 1.5, 3 if heads != hc else 1).astype(np.float32)
    base = rng.standard_normal(heads).astype(np.float32) * 0.5
    return fn, scale, base


SHAPES = [((1,), 4, 7), ((3,), 4, 64), ((2, 5), 4, 129), ((17,), 2, 31), ((4,), 1, 16), ((1,), 4, 4096 + 13)]


@pytest.mark.parametrize("lead,hc,d", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hc_pre(isa, lead, hc, d, dtype):
    rng = np.random.default_rng(d + hc)
    x = rng.standard_normal((*lead, hc, d)).astype(np.float32)
    fn, scale, base = hc_params(rng, hc, d, (2 + hc) * hc)
    xin = bf16(x) if dtype == "bfloat16" else x
    attrs = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    h, post, comb = run_op("HcPre", {"x": xin, "fn": fn, "scale": scale, "base": base}, attrs, isa)
    xt = torch.from_numpy(bf16_to_f32(xin) if dtype == "bfloat16" else x)
    if dtype == "bfloat16":
        xt = xt.to(torch.bfloat16)
    rh, rpost, rcomb = Fn.hc_pre(xt, torch.from_numpy(fn), torch.from_numpy(scale), torch.from_numpy(base),
                                rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    assert h.shape == tuple(rh.shape) and post.shape == (*lead, hc) and comb.shape == (*lead, hc, hc)
    np.testing.assert_allclose(post, rpost.float().numpy(), **tol("float32_reduction"))
    np.testing.assert_allclose(comb, rcomb.float().numpy(), **tol("float32_reduction"))
    np.testing.assert_allclose(h, rh.float().numpy(), **tol("bfloat16" if dtype == "bfloat16" else "float32_reduction"))
    # Sinkhorn ends on a column normalisation: columns sum to ~1.
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-3)


@pytest.mark.parametrize("lead,hc,d", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hc_post(isa, lead, hc, d, dtype):
    rng = np.random.default_rng(11 * d + hc)
    f = rng.standard_normal((*lead, d)).astype(np.float32)
    r = rng.standard_normal((*lead, hc, d)).astype(np.float32)
    post = rng.uniform(0, 2, (*lead, hc)).astype(np.float32)
    comb = rng.uniform(0, 1, (*lead, hc, hc)).astype(np.float32)
    cast = bf16 if dtype == "bfloat16" else (lambda a: a)
    (out,) = run_op("HcPost", {"f": cast(f), "residual": cast(r), "post": post, "comb": comb}, {}, isa)
    tf, tr = torch.from_numpy(f), torch.from_numpy(r)
    if dtype == "bfloat16":
        tf, tr = tf.to(torch.bfloat16), tr.to(torch.bfloat16)
    ref = Fn.hc_post(tf, tr, torch.from_numpy(post), torch.from_numpy(comb))
    np.testing.assert_allclose(out, ref.float().numpy(), **tol("bfloat16" if dtype == "bfloat16" else "float32"))


@pytest.mark.parametrize("lead,hc,d", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hc_head(isa, lead, hc, d, dtype):
    rng = np.random.default_rng(5 * d + hc)
    x = rng.standard_normal((*lead, hc, d)).astype(np.float32)
    fn, scale, base = hc_params(rng, hc, d, hc)
    xin = bf16(x) if dtype == "bfloat16" else x
    (y,) = run_op("HcHead", {"x": xin, "fn": fn, "scale": scale, "base": base}, dict(rms_eps=1e-6, hc_eps=1e-6), isa)
    xt = torch.from_numpy(bf16_to_f32(xin)).to(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)
    ref = Fn.hc_head(xt, torch.from_numpy(fn), torch.from_numpy(scale), torch.from_numpy(base), rms_eps=1e-6,
                    hc_eps=1e-6)
    np.testing.assert_allclose(y, ref.float().numpy(), **tol("bfloat16" if dtype == "bfloat16" else "float32_reduction"))


def _hf_config(hc, d):
    from types import SimpleNamespace

    return SimpleNamespace(hc_mult=hc, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=d)


def test_hc_ops_match_hf_modules(isa):
    """HcPre and HcHead against HF transformers' own DeepseekV4HyperConnection / DeepseekV4HyperHead (the oracle)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    rng = np.random.default_rng(0)
    lead, hc, d = (2, 3), 4, 32
    x = rng.standard_normal((*lead, hc, d)).astype(np.float32)
    fn, scale, base = hc_params(rng, hc, d, (2 + hc) * hc)
    h, post, comb = run_op("HcPre", {"x": x, "fn": fn, "scale": scale, "base": base},
                           dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20), isa)
    mod = hf.DeepseekV4HyperConnection(_hf_config(hc, d))
    with torch.no_grad():
        mod.fn.copy_(torch.from_numpy(fn))
        mod.scale.copy_(torch.from_numpy(scale))
        mod.base.copy_(torch.from_numpy(base))
        rpost, rcomb, rh = mod(torch.from_numpy(x))
    np.testing.assert_allclose(h, rh.numpy(), **tol("float32_reduction"))
    np.testing.assert_allclose(comb, rcomb.numpy(), **tol("float32_reduction"))
    np.testing.assert_allclose(post, rpost.numpy(), **tol("float32_reduction"))

    hfn, hscale, hbase = hc_params(rng, hc, d, hc)
    (y,) = run_op("HcHead", {"x": x, "fn": hfn, "scale": hscale, "base": hbase}, dict(rms_eps=1e-6, hc_eps=1e-6), isa)
    head = hf.DeepseekV4HyperHead(_hf_config(hc, d))
    with torch.no_grad():
        head.hc_fn.copy_(torch.from_numpy(hfn))
        head.hc_scale.copy_(torch.from_numpy(hscale))
        head.hc_base.copy_(torch.from_numpy(hbase))
        ry = head(torch.from_numpy(x))
    np.testing.assert_allclose(y, ry.numpy(), **tol("float32_reduction"))


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_hc_pre_projection_shape_mismatch():
    x = np.zeros((2, 4, 8), np.float32)
    msg = session_error("HcPre", {"x": x, "fn": np.zeros((24, 31), np.float32), "scale": np.ones(3, np.float32),
                                  "base": np.zeros(24, np.float32)})
    assert "HcPre" in msg and "fn" in msg


def test_hc_pre_bad_scale_and_base():
    x = np.zeros((2, 4, 8), np.float32)
    fn = np.zeros((24, 32), np.float32)
    assert "scale" in session_error("HcPre", {"x": x, "fn": fn, "scale": np.ones(2, np.float32),
                                              "base": np.zeros(24, np.float32)})
    assert "base" in session_error("HcPre", {"x": x, "fn": fn, "scale": np.ones(3, np.float32),
                                             "base": np.zeros(23, np.float32)})


def test_hc_pre_bad_attribute():
    x = np.zeros((2, 4, 8), np.float32)
    msg = session_error("HcPre", {"x": x, "fn": np.zeros((24, 32), np.float32), "scale": np.ones(3, np.float32),
                                  "base": np.zeros(24, np.float32)}, dict(sinkhorn_iters=0))
    assert "HcPre" in msg and "sinkhorn_iters" in msg


def test_hc_post_shape_mismatch():
    msg = session_error("HcPost", {"f": np.zeros((2, 8), np.float32), "residual": np.zeros((2, 4, 9), np.float32),
                                   "post": np.zeros((2, 4), np.float32), "comb": np.zeros((2, 4, 4), np.float32)})
    assert "HcPost" in msg
    msg = session_error("HcPost", {"f": np.zeros((2, 8), np.float32), "residual": np.zeros((2, 4, 8), np.float32),
                                   "post": np.zeros((2, 4), np.float32), "comb": np.zeros((2, 3, 4), np.float32)})
    assert "HcPost" in msg and "comb" in msg


def test_hc_head_shape_mismatch():
    msg = session_error("HcHead", {"x": np.zeros((2, 4, 8), np.float32), "fn": np.zeros((4, 33), np.float32),
                                   "scale": np.ones(1, np.float32), "base": np.zeros(4, np.float32)})
    assert "HcHead" in msg and "fn" in msg
