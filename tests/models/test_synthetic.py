"""The torch-free pieces behind the random preset weights: numpy codecs (bit-identical to models.quant), the numpy
random weights (the values write_random_checkpoint writes), the numpy RoPE table, and imports without torch."""

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import dsv4_ort.models as C
from dsv4_ort.models import functional as Fn
from dsv4_ort.models import quant as Q
from dsv4_ort.models import quant_np as QN
from dsv4_ort.models import rope, synthetic
from dsv4_ort.models.config import PRESETS, DeepseekV4Config
from dsv4_ort.models.inventory import deepseek_tensor_specs

TINY = DeepseekV4Config.from_preset("tiny")

# the numpy codecs handle NaN / infinities / out-of-range values without invalid casts
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _float32_sweep() -> np.ndarray:
    """Finite float32 values across every exponent (a stride through all bit patterns) plus small integers/8."""
    bits = np.arange(0, 2**32, 997, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    return np.concatenate([x[np.isfinite(x)], np.arange(-80, 81, dtype=np.float32) / 8])


# ----------------------------------------------------------------------------------------------------- codecs


def test_bf16_matches_torch():
    x = np.concatenate([_float32_sweep(), np.random.default_rng(0).standard_normal(100_000).astype(np.float32),
                        np.array([np.inf, -np.inf, 3.3895314e38], np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(QN.float_to_bf16(x), want)
    np.testing.assert_array_equal(QN.bf16_to_float(want), torch.from_numpy(want.view(np.int16)).view(
        torch.bfloat16).float().numpy())
    assert np.isnan(QN.bf16_to_float(QN.float_to_bf16(np.array([np.nan], np.float32)))).all()


def test_fp8_e4m3_matches_torch_including_ties_and_subnormals():
    grid = QN.fp8_e4m3_to_float(np.arange(256, dtype=np.uint8))
    np.testing.assert_array_equal(grid, torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy())
    g = np.unique(grid[np.isfinite(grid)]).astype(np.float64)
    mids = ((g[1:] + g[:-1]) / 2).astype(np.float32)  # exact ties: rounding to even decides
    x = np.concatenate([_float32_sweep(), g.astype(np.float32), mids, np.nextafter(mids, np.float32(np.inf)),
                        np.nextafter(mids, np.float32(-np.inf)), np.array([500.0, -1e30, 464.0], np.float32)])
    np.testing.assert_array_equal(QN.float_to_fp8_e4m3(x), _u8(Q.float_to_fp8_e4m3(torch.from_numpy(x))))
    assert QN.float_to_fp8_e4m3(np.array([np.nan], np.float32))[0] & 0x7F == 0x7F


def test_fp4_e2m1_matches_torch():
    x = np.concatenate([_float32_sweep(), np.random.default_rng(1).standard_normal(100_000).astype(np.float32) * 4,
                        np.array([-0.0, 0.25, 0.75, 2.5, 3.5, 5.0, 7.0, np.inf, -np.inf, np.nan], np.float32)])
    codes = QN.float_to_fp4_e2m1(x)
    np.testing.assert_array_equal(codes, Q.float_to_fp4_e2m1(torch.from_numpy(x)).numpy())
    even = codes[: codes.size // 2 * 2].reshape(-1, 2)
    np.testing.assert_array_equal(QN.pack_fp4(even), Q.pack_fp4(torch.from_numpy(even), as_dtype="uint8").numpy())
    np.testing.assert_array_equal(QN.unpack_fp4(QN.pack_fp4(even)), even)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 96), (1, 32), (129, 4)])
def test_block_quantisers_match_torch(shape):
    rng = np.random.default_rng(sum(shape))
    # rows of very different magnitudes: scales from 2**-40 to 2**0, blocks with an all-zero row
    w = (rng.standard_normal(shape) * rng.choice([0.0, 1e-9, 1e-3, 1.0, 300.0], size=(shape[0], 1))).astype(np.float32)
    q, s = QN.quant_fp8_block(w)
    tq, ts = Q.quant_fp8_block(torch.from_numpy(w), scale_dtype="uint8")
    np.testing.assert_array_equal(q, _u8(tq))
    np.testing.assert_array_equal(s, ts.numpy())
    np.testing.assert_array_equal(QN.dequant_fp8_block(q, s), Q.dequant_fp8_block(tq, ts).numpy())
    if shape[1] % 2 == 0:
        p, e = QN.quant_fp4(w)
        tp, te = Q.quant_fp4(torch.from_numpy(w), scale_dtype="uint8")
        np.testing.assert_array_equal(p, _u8(tp))
        np.testing.assert_array_equal(e, te.numpy())
        np.testing.assert_array_equal(QN.dequant_fp4(p, e), Q.dequant_fp4(tp, te).numpy())


def test_e8m0_matches_torch():
    u = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(QN.e8m0_to_float(u), Q.e8m0_to_float(torch.from_numpy(u)).numpy())
    amax = np.abs(_float32_sweep())
    for qmax, lo in ((448.0, 1e-4), (6.0, 6.0 * 2.0**-126)):
        np.testing.assert_array_equal(QN.e8m0_for_amax(amax, qmax, lo),
                                      Q.e8m0_for_amax(torch.from_numpy(amax), qmax, lo).numpy())


# ----------------------------------------------------------------------------------------------------- weights


@pytest.mark.parametrize("weights", ["native", "fp8", "bf16", "fp32"])
def test_random_tensors_are_the_numpy_weights(weights):
    """checkpoint.random_tensors (what write_random_checkpoint writes) holds exactly the synthetic arrays."""
    arrays = {a.name: a for a in synthetic.random_arrays(TINY, weights, seed=3)}
    raws = list(C.random_tensors(TINY, weights, seed=3, raw=True))
    assert [r.name for r in raws] == list(arrays) == [s.name for s in deepseek_tensor_specs(TINY)]
    for r in raws:
        a = arrays[r.name]
        assert r.fmt == a.fmt and tuple(r.shape) == a.shape and r.block == a.block, r.name
        data = r.data.numpy() if r.data.dtype in (torch.float32, torch.int64) else _u8(r.data)
        np.testing.assert_array_equal(data, a.data.view(np.uint8) if data.dtype == np.uint8 else a.data)
        if a.scale is not None:
            np.testing.assert_array_equal(_u8(r.scale), a.scale)
        dense = r.dequantize()
        np.testing.assert_array_equal(dense.numpy(), a.dequantize().astype(dense.numpy().dtype), err_msg=r.name)


def test_values_are_deterministic_per_name_and_seed():
    names = ["layers.1.attn.wq_b.weight", "layers.0.ffn.gate.tid2eid", "layers.2.ffn.experts.3.w2.weight"]
    a = {x.name: x for x in synthetic.random_arrays(TINY, "native", seed=5, names=names)}
    b = {x.name: x for x in synthetic.random_arrays(TINY, "native", seed=5, names=names[::-1])}
    c = {x.name: x for x in synthetic.random_arrays(TINY, "native", seed=6, names=names)}
    for n in names:
        np.testing.assert_array_equal(a[n].data, b[n].data)
        assert not np.array_equal(a[n].data, c[n].data)
    # a tensor larger than one generation chunk (several row chunks, a partial last FP8 block row)
    spec = C.TensorSpec("head.weight", (300, 20000), "linear", "linear")
    big = synthetic.make_array(spec, "native", 0, TINY)
    assert big.data.shape == (300, 20000) and big.scale.shape == (3, 157)
    x = big.dequantize()
    assert abs(float(x.std()) * math.sqrt(20000) - 1) < 0.02


def test_value_structure():
    """The properties the random model relies on: finite values, non-degenerate scales, valid routing tables."""
    c = TINY
    vals = {a.name: a for a in synthetic.random_arrays(c, "native", seed=0)}
    for name, a in vals.items():
        x = a.dequantize()
        assert np.isfinite(x).all(), name
        if a.scale is not None:
            assert (a.scale != 0xFF).all() and (a.scale > 100).all(), name
        if a.stored in ("fp8", "fp4"):
            rel = np.abs(x.std() * math.sqrt(x.shape[-1]) - 1)
            assert rel < 0.06, (name, rel)  # N(0, 1/fan_in) survives quantisation
    for layer in range(c.num_hidden_layers):
        p = f"layers.{layer}."
        assert np.all(vals[p + "attn.attn_sink"].data != 0)
        for which in ("attn", "ffn"):
            sc = vals[p + f"hc_{which}_scale"].data
            assert ((sc >= 0.5) & (sc < 1.5)).all()
            assert np.abs(vals[p + f"hc_{which}_base"].data).max() > 0.1
        norm = QN.bf16_to_float(vals[p + "attn_norm.weight"].data)
        assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.2
        if c.layer_ratios[layer] > 0:
            assert 0.3 < vals[p + "attn.compressor.ape"].data.std() < 0.7
        if layer < c.num_hash_layers:
            t = vals[p + "ffn.gate.tid2eid"].data
            assert t.shape == (c.vocab_size, c.num_experts_per_tok) and t.dtype == np.int64
            assert t.min() >= 0 and t.max() < c.n_routed_experts
            assert (np.sort(t, axis=1)[:, 1:] != np.sort(t, axis=1)[:, :-1]).all()  # distinct per token
            load = np.bincount(t.ravel(), minlength=c.n_routed_experts) / (t.size / c.n_routed_experts)
            assert 0.7 < load.min() and load.max() < 1.3  # every expert gets about its share of the tokens
        else:
            bias = vals[p + "ffn.gate.bias"].data
            assert bias.std() > 0.02 and len(np.unique(bias)) == bias.size


def test_unknown_weight_mode():
    with pytest.raises(ValueError, match="weights must be one of"):
        next(synthetic.random_arrays(TINY, "int4"))


# ----------------------------------------------------------------------------------------------------- RoPE


def _float32_table(config, compressed):
    """transformers' formula, all in float32 (torch)."""
    rd = config.qk_rope_head_dim
    base = float(config.compress_rope_theta if compressed else config.rope_theta)
    pos = base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    inv = 1.0 / pos
    rs = config.rope_scaling
    if not compressed or rs is None:
        return inv
    factor, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])

    def corr_dim(n):
        return rd * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rs["beta_slow"])), rd - 1)
    keep = 1 - ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (1.0 / (factor * pos)) * (1 - keep) + inv * keep


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rope_table_is_shared_and_within_ulps_of_float32(preset):
    from dsv4_ort.export.graph import _rope_table

    cfg = DeepseekV4Config.from_preset(preset)
    for compressed in (False, True):
        table = rope.inv_freq(cfg, compressed)
        assert table.dtype == np.float32 and table.shape == (cfg.qk_rope_head_dim // 2,)
        np.testing.assert_array_equal(Fn.rope_freqs(cfg, compressed=compressed).numpy(), table)
        np.testing.assert_array_equal(_rope_table(cfg, compressed), table)
        ulps = np.abs(table.view(np.int32).astype(np.int64) - _float32_table(cfg, compressed).numpy().view(np.int32))
        assert ulps.max() <= 2, (compressed, ulps.max())


# ----------------------------------------------------------------------------------------------------- imports


def test_torch_free_modules_import_without_torch(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch fails
        from dsv4_ort.models import DeepseekV4Config
        from dsv4_ort.models import config, errors, inventory, quant_np, rope, synthetic
        from dsv4_ort.export import weights
        cfg = DeepseekV4Config.from_preset("tiny")
        n = sum(1 for _ in synthetic.random_arrays(cfg, "native", seed=0))
        assert n == len(inventory.deepseek_tensor_specs(cfg)), n
        assert rope.inv_freq(cfg, True).dtype.name == "float32"
        assert issubclass(errors.CheckpointNotFoundError, FileNotFoundError)
        try:
            from dsv4_ort.models import DeepseekV4ForCausalLM  # needs torch
        except ImportError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def test_checkpoint_reexports_the_same_classes():
    from dsv4_ort.models import errors, inventory

    assert C.CheckpointError is errors.CheckpointError and C.MissingTensorError is errors.MissingTensorError
    assert C.TensorSpec is inventory.TensorSpec and C.deepseek_tensor_specs is inventory.deepseek_tensor_specs
