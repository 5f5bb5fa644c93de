"""MoeRouteTopK / MoeRouteHash through onnxruntime vs models.functional.route_topk / route_hash, every ISA level."""

import numpy as np
import pytest
import torch
from onnx_helpers import run_op, session_error

from testutil import tol
from dsv4_ort.models import functional as Fn

SCORINGS = ["sqrtsoftplus", "softmax", "sigmoid"]


def tie_free_logits(rng, tokens, experts):
    # Distinct values per row (a permutation of a spread grid plus noise) -> no ties in scores or biased keys.
    base = np.stack([rng.permutation(experts) for _ in range(tokens)]).astype(np.float32)
    return (base / max(experts, 1) * 6.0 - 3.0 + rng.uniform(0, 1e-3, (tokens, experts))).astype(np.float32)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("tokens,experts,k", [(1, 1, 1), (3, 8, 2), (5, 17, 6), (7, 64, 6), (2, 257, 8), (4, 256, 6)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_topk_matches_reference(isa, scoring, tokens, experts, k, use_bias):
    rng = np.random.default_rng(tokens * 1000 + experts)
    logits = tie_free_logits(rng, tokens, experts)
    bias = (rng.permutation(experts) * 1e-2).astype(np.float32) if use_bias else None
    attrs = dict(top_k=k, scoring=scoring, norm_topk_prob=1, routed_scaling_factor=1.5)
    w, idx = run_op("MoeRouteTopK", {"logits": logits, "bias": bias}, attrs, isa)
    rw, ridx = Fn.route_topk(torch.from_numpy(logits), None if bias is None else torch.from_numpy(bias), top_k=k,
                            scoring=scoring, norm_topk_prob=True, routed_scaling_factor=1.5)
    np.testing.assert_array_equal(idx, ridx.numpy())
    np.testing.assert_allclose(w, rw.numpy(), **tol("float32"))


@pytest.mark.parametrize("norm", [0, 1])
def test_topk_without_renormalisation(isa, norm):
    rng = np.random.default_rng(7)
    logits = tie_free_logits(rng, 6, 32)
    w, idx = run_op("MoeRouteTopK", {"logits": logits}, dict(top_k=4, norm_topk_prob=norm, routed_scaling_factor=2.5), isa)
    rw, ridx = Fn.route_topk(torch.from_numpy(logits), None, top_k=4, scoring="sqrtsoftplus", norm_topk_prob=bool(norm),
                            routed_scaling_factor=2.5)
    np.testing.assert_array_equal(idx, ridx.numpy())
    np.testing.assert_allclose(w, rw.numpy(), **tol("float32"))


def test_topk_ties_pick_lowest_index(isa):
    # All logits equal: every expert ties, so the selection must be 0..k-1 in order, in every ISA path.
    logits = np.zeros((3, 33), np.float32)
    _, idx = run_op("MoeRouteTopK", {"logits": logits}, dict(top_k=5), isa)
    np.testing.assert_array_equal(idx, np.tile(np.arange(5), (3, 1)))
    # Pairwise ties at the cut: experts 3 and 9 equal and largest, then 1 and 30 equal.
    logits = np.full((1, 40), -5.0, np.float32)
    logits[0, [3, 9]] = 2.0
    logits[0, [30, 1]] = 1.0
    _, idx = run_op("MoeRouteTopK", {"logits": logits}, dict(top_k=3), isa)
    np.testing.assert_array_equal(idx, [[3, 9, 1]])
    _, ridx = Fn.route_topk(torch.from_numpy(logits), None, top_k=3, scoring="sqrtsoftplus", norm_topk_prob=True,
                           routed_scaling_factor=1.0)
    np.testing.assert_array_equal(ridx.numpy(), [[3, 9, 1]])


def test_topk_nan_logits_still_give_valid_distinct_experts(isa):
    logits = np.full((2, 16), np.nan, np.float32)
    logits[0, 5] = 1.0
    _, idx = run_op("MoeRouteTopK", {"logits": logits}, dict(top_k=4), isa)
    assert ((idx >= 0) & (idx < 16)).all()
    assert all(len(set(row)) == 4 for row in idx.tolist())
    assert idx[0, 0] == 5


def test_topk_zero_tokens(isa):
    w, idx = run_op("MoeRouteTopK", {"logits": np.zeros((0, 8), np.float32)}, dict(top_k=2), isa)
    assert w.shape == (0, 2) and idx.shape == (0, 2)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_hash_matches_reference(isa, scoring, table_dtype):
    rng = np.random.default_rng(3)
    tokens, experts, k, vocab = 9, 24, 6, 50
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    table = np.stack([rng.permutation(experts)[:k] for _ in range(vocab)]).astype(table_dtype)
    ids = rng.integers(0, vocab, tokens).astype(np.int64)
    attrs = dict(scoring=scoring, routed_scaling_factor=1.5)
    w, idx = run_op("MoeRouteHash", {"logits": logits, "input_ids": ids, "tid2eid": table}, attrs, isa)
    rw, ridx = Fn.route_hash(torch.from_numpy(logits), torch.from_numpy(ids), torch.from_numpy(table), scoring=scoring,
                            norm_topk_prob=True, routed_scaling_factor=1.5)
    np.testing.assert_array_equal(idx, ridx.numpy())
    np.testing.assert_array_equal(idx, table[ids])
    np.testing.assert_allclose(w, rw.numpy(), **tol("float32"))


# ---- bad input: clear errors naming the op and the offending value ------------------------------------------------

def test_topk_k_larger_than_experts():
    msg = session_error("MoeRouteTopK", {"logits": np.zeros((2, 4), np.float32)}, dict(top_k=5))
    assert "MoeRouteTopK" in msg and "top_k=5" in msg


def test_topk_bias_length_mismatch():
    msg = session_error("MoeRouteTopK", {"logits": np.zeros((2, 4), np.float32), "bias": np.zeros(3, np.float32)},
                        dict(top_k=2))
    assert "MoeRouteTopK" in msg and "bias" in msg


def test_topk_bad_attribute_values():
    logits = np.zeros((2, 4), np.float32)
    assert "top_k" in session_error("MoeRouteTopK", {"logits": logits}, dict(top_k=0))
    with pytest.raises(ValueError, match="scoring"):  # the table check in make_node
        run_op("MoeRouteTopK", {"logits": logits}, dict(top_k=1, scoring="relu"))


def test_topk_wrong_rank():
    msg = session_error("MoeRouteTopK", {"logits": np.zeros((2, 4, 1), np.float32)}, dict(top_k=1))
    assert "MoeRouteTopK" in msg and "rank" in msg


@pytest.mark.parametrize("bad_id", [-1, 50, 10**12])
def test_hash_token_id_out_of_range(bad_id):
    table = np.zeros((50, 2), np.int64)
    msg = session_error("MoeRouteHash", {"logits": np.zeros((2, 8), np.float32),
                                         "input_ids": np.array([0, bad_id], np.int64), "tid2eid": table})
    assert "MoeRouteHash" in msg and f"input_ids[1]={bad_id}" in msg


@pytest.mark.parametrize("bad_expert", [-1, 8])
def test_hash_table_entry_out_of_range(bad_expert):
    table = np.zeros((5, 2), np.int32)
    table[3, 1] = bad_expert
    msg = session_error("MoeRouteHash", {"logits": np.zeros((2, 8), np.float32),
                                         "input_ids": np.array([0, 3], np.int64), "tid2eid": table})
    assert "MoeRouteHash" in msg and f"tid2eid[3, 1]={bad_expert}" in msg


def test_hash_token_count_mismatch():
    msg = session_error("MoeRouteHash", {"logits": np.zeros((3, 8), np.float32),
                                         "input_ids": np.array([0, 1], np.int64), "tid2eid": np.zeros((5, 2), np.int64)})
    assert "MoeRouteHash" in msg and "input_ids" in msg


def test_routers_match_hf_modules(isa):
    """MoeRouteTopK / MoeRouteHash against HF transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter (the oracle).
    HF returns experts unsorted (torch.topk(sorted=False)); compare per token as expert -> weight maps."""
    from types import SimpleNamespace

    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    rng = np.random.default_rng(1)
    tokens, experts, k, d, vocab = 11, 64, 6, 32, 40
    cfg = SimpleNamespace(num_experts_per_tok=k, num_local_experts=experts, hidden_size=d, scoring_func="sqrtsoftplus",
                          routed_scaling_factor=1.5, vocab_size=vocab)
    x = torch.from_numpy(rng.standard_normal((tokens, d)).astype(np.float32))
    gate = torch.from_numpy(rng.standard_normal((experts, d)).astype(np.float32))
    bias = torch.from_numpy((rng.permutation(experts) * 1e-2).astype(np.float32))
    table = torch.from_numpy(np.stack([rng.permutation(experts)[:k] for _ in range(vocab)]).astype(np.int64))
    ids = torch.from_numpy(rng.integers(0, vocab, tokens).astype(np.int64))

    topk = hf.DeepseekV4TopKRouter(cfg)
    hashr = hf.DeepseekV4HashRouter(cfg)
    with torch.no_grad():
        topk.weight.copy_(gate)
        topk.e_score_correction_bias.copy_(bias)
        hashr.weight.copy_(gate)
        hashr.tid2eid.copy_(table)
        logits, rw, ridx = topk(x)
        _, hw, hidx = hashr(x, ids)
    w, idx = run_op("MoeRouteTopK", {"logits": logits.numpy(), "bias": bias.numpy()},
                    dict(top_k=k, routed_scaling_factor=1.5), isa)
    for t in range(tokens):
        ours = dict(zip(idx[t].tolist(), w[t].tolist()))
        theirs = dict(zip(ridx[t].tolist(), rw[t].tolist()))
        assert ours.keys() == theirs.keys()
        np.testing.assert_allclose([ours[e] for e in theirs], list(theirs.values()), **tol("float32"))
    w, idx = run_op("MoeRouteHash", {"logits": logits.numpy(), "input_ids": ids.numpy(), "tid2eid": table.numpy()},
                    dict(routed_scaling_factor=1.5), isa)
    np.testing.assert_array_equal(idx, hidx.numpy())
    np.testing.assert_allclose(w, hw.numpy(), **tol("float32"))
