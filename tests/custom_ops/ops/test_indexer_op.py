"""Indexer through onnxruntime vs models.functional.indexer_topk, every ISA level. Indices are compared exactly:
on integer-valued inputs with power-of-four head counts and widths (every score exact in float32, so ties are real
ties and nothing else is), and on random inputs whose score gaps exceed the rounding noise."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, run_op, session_error

from dsv4_ort.models import functional as Fn


def spec(q, weights, keys, start_pos, ratio, topk):
    def t(a):
        return torch.from_numpy(bf16_to_f32(a)).to(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)

    return Fn.indexer_topk(t(q), t(weights), t(keys), torch.from_numpy(start_pos), ratio=ratio,
                          index_topk=topk).numpy()


def op(q, weights, keys, start_pos, ratio, topk, isa):
    (idx,) = run_op("Indexer", {"q": q, "weights": weights, "keys": keys, "start_pos": start_pos},
                    dict(ratio=ratio, index_topk=topk), isa)
    return idx


def integer_inputs(rng, B, S, nI, cI, N):
    q = rng.integers(-3, 4, (B, S, nI, cI)).astype(np.float32)
    keys = rng.integers(-3, 4, (B, N, cI)).astype(np.float32)
    weights = rng.integers(-2, 5, (B, S, nI)).astype(np.float32)
    return q, weights, keys


@pytest.mark.parametrize("topk", [1, 3, 8, 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_indexer_exact(isa, topk, dtype):
    """Rows at different positions (row 0 sees 0..2 entries, row 1 up to all 12), k below, at and above visible and
    above N; integer inputs are exact in bf16 too, so the selection (ties included) must equal the spec."""
    rng = np.random.default_rng(topk)
    q, w, keys = integer_inputs(rng, 2, 9, 4, 16, 12)
    start_pos = np.array([0, 39], np.int64)
    cast = bf16 if dtype == "bfloat16" else (lambda a: a)
    got = op(cast(q), cast(w), cast(keys), start_pos, 4, topk, isa)
    ref = spec(cast(q), cast(w), cast(keys), start_pos, 4, topk)
    np.testing.assert_array_equal(got, ref)
    assert (got[0, :3] == -1).all()  # positions 0..2 see no entry
    assert got.shape == (2, 9, topk)


@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 5), (2, 7, 3, 20, 37), (3, 2, 8, 64, 70)])
def test_indexer_random(isa, shape):
    """Random inputs, odd sizes; scores are checked to be separated by far more than float32 rounding (or to be
    exactly zero)."""
    B, S, nI, cI, N = shape
    rng = np.random.default_rng(N)
    ratio, topk = 4, 6
    q = rng.standard_normal((B, S, nI, cI)).astype(np.float32)
    keys = rng.standard_normal((B, N, cI)).astype(np.float32)
    w = rng.standard_normal((B, S, nI)).astype(np.float32)
    start_pos = rng.integers(0, 4 * N - S + 1, B).astype(np.int64)
    got = op(q, w, keys, start_pos, ratio, topk, isa)
    ref = spec(q, w, keys, start_pos, ratio, topk)
    # score gaps among the selected prefix and the next candidate (float64 scores)
    s = np.einsum("bshc,bnc->bshn", q.astype(np.float64), keys.astype(np.float64))
    score = (np.maximum(s, 0) * cI**-0.5 * (w.astype(np.float64) * nI**-0.5)[..., None]).sum(2)
    for b in range(B):
        for t in range(S):
            vis = (start_pos[b] + t + 1) // ratio
            srt = np.sort(score[b, t, :vis])[::-1][: topk + 1]
            exact_zero_tie = (srt[:-1] == 0) & (srt[1:] == 0)  # every relu 0: exact in any order
            assert np.all((-np.diff(srt) > 1e-5) | exact_zero_tie), "inputs too close to a tie; change the seed"
    np.testing.assert_array_equal(got, ref)


def test_indexer_all_zero_scores_tie_to_lowest_index(isa):
    """Every head's dot product negative -> relu makes every score 0 (or -0): the lowest indices win, in order."""
    B, S, nI, cI, N = 2, 4, 4, 16, 20
    q = -np.ones((B, S, nI, cI), np.float32)
    keys = np.abs(np.random.default_rng(0).standard_normal((B, N, cI))).astype(np.float32) + 0.1
    w = np.random.default_rng(1).standard_normal((B, S, nI)).astype(np.float32)  # signs mixed: +0 and -0 scores
    start_pos = np.array([30, 76], np.int64)
    got = op(q, w, keys, start_pos, 4, 5, isa)
    np.testing.assert_array_equal(got, spec(q, w, keys, start_pos, 4, 5))
    np.testing.assert_array_equal(got, np.broadcast_to(np.arange(5), (B, S, 5)))


def test_indexer_partial_ties(isa):
    """Duplicate keys tie exactly; the lower index of each tied pair comes first."""
    rng = np.random.default_rng(5)
    q, w, keys = integer_inputs(rng, 1, 3, 4, 16, 16)
    keys[0, 8:] = keys[0, :8]
    start_pos = np.array([60], np.int64)
    for topk in (4, 16):
        got = op(q, w, keys, start_pos, 4, topk, isa)
        np.testing.assert_array_equal(got, spec(q, w, keys, start_pos, 4, topk))


def test_indexer_all_invalid_rows(isa):
    q, w, keys = integer_inputs(np.random.default_rng(2), 2, 3, 4, 16, 4)
    got = op(q, w, keys, np.array([0, 0], np.int64), 4, 7, isa)
    np.testing.assert_array_equal(got, np.full((2, 3, 7), -1))
    got = op(q, w, keys, np.array([0, 0], np.int64), 8, 7, isa)  # larger ratio: still nothing visible
    np.testing.assert_array_equal(got, np.full((2, 3, 7), -1))


def test_indexer_visible_below_topk_is_still_ordered_by_score(isa):
    rng = np.random.default_rng(9)
    q, w, keys = integer_inputs(rng, 1, 1, 4, 16, 8)
    start_pos = np.array([31], np.int64)  # sees all 8 entries, fewer than index_topk = 10
    got = op(q, w, keys, start_pos, 4, 10, isa)
    ref = spec(q, w, keys, start_pos, 4, 10)
    np.testing.assert_array_equal(got, ref)
    assert sorted(got[0, 0, :8].tolist()) == list(range(8)) and (got[0, 0, 8:] == -1).all()


def test_indexer_mixed_weight_type(isa):
    rng = np.random.default_rng(11)
    q, w, keys = integer_inputs(rng, 2, 4, 4, 16, 10)
    start_pos = np.array([3, 30], np.int64)
    got = op(q, bf16(w), keys, start_pos, 4, 4, isa)
    np.testing.assert_array_equal(got, spec(q, w, keys, start_pos, 4, 4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_indexer_model_sizes(isa, dtype):
    """DeepSeek-V4 indexer: 64 heads x 128, queries seeing 1, 71 and 192 entries, index_topk 128 (also above some
    visible counts). Scores of random inputs can come within rounding of each other, so the selection is compared
    through its scores (tie-tolerant): same scores position by position, and the same set where scores differ."""
    B, S, nI, cI, N, topk = 3, 2, 64, 128, 200, 128
    rng = np.random.default_rng(17)
    cast = bf16 if dtype == "bfloat16" else (lambda a: a)
    q = cast(rng.standard_normal((B, S, nI, cI)).astype(np.float32))
    keys = cast(rng.standard_normal((B, N, cI)).astype(np.float32))
    w = rng.standard_normal((B, S, nI)).astype(np.float32)
    start_pos = np.array([3, 4 * 71 - 2, 4 * 192 - 2], np.int64)
    got = op(q, w, keys, start_pos, 4, topk, isa)
    ref = spec(q, w, keys, start_pos, 4, topk)
    np.testing.assert_array_equal(got < 0, ref < 0)
    qf, kf = (bf16_to_f32(a) if a.dtype == np.uint16 else a for a in (q, keys))
    s = np.einsum("bshc,bnc->bshn", qf.astype(np.float64), kf.astype(np.float64))
    score = (np.maximum(s, 0) * cI**-0.5 * (w.astype(np.float64) * nI**-0.5)[..., None]).sum(2)
    pick = lambda idx: np.where(idx >= 0, np.take_along_axis(score, np.maximum(idx, 0), -1), 0)  # noqa: E731
    np.testing.assert_allclose(pick(got), pick(ref), rtol=1e-5, atol=1e-6)
    assert (got[2, :, :topk] >= 0).all() and (got[0, 0, 1:] == -1).all()


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_indexer_bad_inputs():
    q, w, keys = integer_inputs(np.random.default_rng(0), 2, 3, 4, 16, 4)
    ok = dict(q=q, weights=w, keys=keys, start_pos=np.array([0, 5], np.int64))
    attrs = dict(ratio=4, index_topk=2)
    msg = session_error("Indexer", {**ok, "start_pos": np.array([0, 17], np.int64)}, attrs)
    assert "Indexer" in msg and "keys" in msg and "holds only 4" in msg and "row 1" in msg
    msg = session_error("Indexer", {**ok, "weights": w[:, :, :3].copy()}, attrs)
    assert "weights" in msg
    msg = session_error("Indexer", {**ok, "keys": keys[..., :8].copy()}, attrs)
    assert "keys" in msg
    msg = session_error("Indexer", {**ok, "start_pos": np.array([-1, 0], np.int64)}, attrs)
    assert "start_pos" in msg and ">= 0" in msg
    msg = session_error("Indexer", ok, dict(ratio=0, index_topk=2))
    assert "Indexer" in msg and "ratio" in msg
    msg = session_error("Indexer", ok, dict(ratio=4, index_topk=0))
    assert "index_topk" in msg
