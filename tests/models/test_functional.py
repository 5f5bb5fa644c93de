"""Unit tests of the op specifications in ``dsv4_ort.models.functional``.

Each function is compared with a deliberately naive re-statement of the architecture (per-token /
per-query loops, complex-number RoPE) and with hand-derived values; index outputs are checked
exactly, including on inputs built to tie.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dsv4_ort.models import DeepseekV4Config
from dsv4_ort.models import functional as Fn

EPS = 1e-6


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=gen(seed)) * scale


# ---------------------------------------------------------------------------------------------- naive helpers


def rope_complex(x, pos, inv_freq, inverse=False):
    """Reference RoPE on the last 2*len(inv_freq) channels via complex multiplication (test only)."""
    rd = 2 * inv_freq.shape[0]
    # the spec rounds the angle to float32: angle = float32(pos) * inv_freq
    ang = (torch.as_tensor(pos, dtype=torch.float32)[..., None] * inv_freq.float()).double()
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
    z = torch.view_as_complex(x[..., -rd:].double().unflatten(-1, (-1, 2)).contiguous())
    while rot.dim() < z.dim():
        rot = rot.unsqueeze(-2)
    y = torch.view_as_real(z * rot).flatten(-2)
    return torch.cat([x[..., :-rd].double(), y], -1)


def naive_norm(x, w=None):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    return y if w is None else y * w.double()


def naive_compressor(kv, score, ape, norm_w, inv_freq, ratio):
    """Per-token compressor of one sequence, following the architecture's pseudo-code. kv/score [T, W]."""
    T, W = kv.shape
    c = norm_w.shape[0]
    coff = W // c
    st_kv = torch.zeros(coff * ratio, W, dtype=torch.float64)
    st_sc = torch.full((coff * ratio, W), -math.inf, dtype=torch.float64)
    out = []
    for p in range(T):
        slot = (ratio if coff == 2 else 0) + p % ratio
        st_kv[slot] = kv[p].double()
        st_sc[slot] = score[p].double() + ape[p % ratio].double()
        if (p + 1) % ratio:
            continue
        if coff == 2:
            K = torch.cat([st_kv[:ratio, :c], st_kv[ratio:, c:]])
            Z = torch.cat([st_sc[:ratio, :c], st_sc[ratio:, c:]])
        else:
            K, Z = st_kv, st_sc
        pooled = (torch.softmax(Z, dim=0) * K).sum(0)
        if coff == 2:
            st_kv[:ratio] = st_kv[ratio:].clone()
            st_sc[:ratio] = st_sc[ratio:].clone()
        out.append(rope_complex(naive_norm(pooled, norm_w), p + 1 - ratio, inv_freq))
    return torch.stack(out) if out else torch.zeros(0, c, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- basics


def test_rms_norm_formula_and_dtype():
    x, w = randn(3, 5, 64), randn(64, seed=1)
    torch.testing.assert_close(Fn.rms_norm(x, w, EPS).double(), naive_norm(x, w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(Fn.rms_norm(x, None, EPS).double(), naive_norm(x), rtol=1e-5, atol=1e-6)
    assert Fn.rms_norm(x.bfloat16(), w, EPS).dtype == torch.bfloat16


def test_linear_checkpoint_formats():
    from dsv4_ort.models import quant

    x, w = randn(4, 256), randn(192, 256, seed=1, scale=0.1)
    q8, s8 = quant.quant_fp8_block(w)
    torch.testing.assert_close(Fn.linear(x, q8, s8), x @ quant.dequant_fp8_block(q8, s8).T)
    q4, s4 = quant.quant_fp4(w)
    torch.testing.assert_close(Fn.linear(x, q4, s4), x @ quant.dequant_fp4(q4, s4).T)
    torch.testing.assert_close(Fn.linear(x, w), x @ w.T)


# ---------------------------------------------------------------------------------------------- RoPE


def test_rope_matches_complex_and_inverts():
    inv = Fn.rope_freqs(DeepseekV4Config.from_preset("tiny"), compressed=True)
    x = randn(2, 7, 3, 128)
    pos = torch.arange(7)[None].expand(2, 7) + torch.tensor([[0], [1000]])
    cos, sin = Fn.rope_cos_sin(pos, inv)
    y = Fn.apply_rope(x, cos[:, :, None], sin[:, :, None])
    torch.testing.assert_close(y.double(), rope_complex(x, pos, inv), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[..., :64], x[..., :64])  # nope channels untouched
    back = Fn.apply_rope(y, cos[:, :, None], sin[:, :, None], inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_rope_freqs_plain_and_yarn():
    c = DeepseekV4Config.from_preset("flash")
    plain = Fn.rope_freqs(c, compressed=False)
    torch.testing.assert_close(plain, 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    base = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    yarn = Fn.rope_freqs(c, compressed=True).double()
    # Flash / Pro: low = 15, high = 25 -> pairs 0..15 keep f, 25..31 use f / 16, 16..24 blend linearly
    torch.testing.assert_close(yarn[:16], base[:16], rtol=1e-6, atol=0)
    torch.testing.assert_close(yarn[25:], base[25:] / 16, rtol=1e-6, atol=0)
    ramp = (torch.arange(16, 25, dtype=torch.float64) - 15) / 10
    torch.testing.assert_close(yarn[16:25], base[16:25] / 16 * ramp + base[16:25] * (1 - ramp), rtol=1e-6, atol=0)
    torch.testing.assert_close(Fn.rope_freqs(c.replace(rope_scaling=None), compressed=True).double(), base,
                               rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- mHC


def naive_hc_pre(x, fn, scale, base, iters):
    hc = x.shape[-2]
    v = x.flatten(-2).double()
    mix = (v @ fn.double().T) / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS)
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + EPS
    post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    m = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    m = torch.exp(m - m.amax(-1, keepdim=True))
    m = m / m.sum(-1, keepdim=True) + EPS
    m = m / (m.sum(-2, keepdim=True) + EPS)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + EPS)
        m = m / (m.sum(-2, keepdim=True) + EPS)
    h = torch.einsum("...k,...kd->...d", pre, x.double())
    return h, post, m


@pytest.mark.parametrize("hc", [4, 2])
def test_hc_pre_post_head(hc):
    d = 32
    x = randn(3, 5, hc, d)
    fn, base, scale = randn((2 + hc) * hc, hc * d, seed=1, scale=0.1), randn((2 + hc) * hc, seed=2), randn(3, seed=3)
    h, post, comb = Fn.hc_pre(x, fn, scale, base, rms_eps=EPS, hc_eps=EPS, sinkhorn_iters=20)
    nh, npost, ncomb = naive_hc_pre(x, fn, scale.double(), base.double(), 20)
    assert h.shape == (3, 5, d) and post.shape == (3, 5, hc) and comb.shape == (3, 5, hc, hc)
    torch.testing.assert_close(h.double(), nh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post.double(), npost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), ncomb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, 5, hc), rtol=0, atol=1e-5)  # ends on columns
    assert ((post > 0) & (post < 2)).all()

    f = randn(3, 5, d, seed=4)
    out = Fn.hc_post(f, x, post, comb)
    ref = post.double()[..., None] * f.double()[..., None, :] + torch.einsum("...kj,...kd->...jd", comb.double(),
                                                                               x.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)

    hfn, hbase, hscale = randn(hc, hc * d, seed=5, scale=0.1), randn(hc, seed=6), randn(1, seed=7)
    y = Fn.hc_head(x, hfn, hscale, hbase, rms_eps=EPS, hc_eps=EPS)
    v = x.flatten(-2).double()
    mix = (v @ hfn.double().T) / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS)
    pre = torch.sigmoid(mix * hscale.double() + hbase.double()) + EPS
    torch.testing.assert_close(y.double(), torch.einsum("...k,...kd->...d", pre, x.double()), rtol=1e-5, atol=1e-5)


def test_hc_bf16_dtypes():
    x = randn(2, 3, 4, 16).bfloat16()
    fn, base, scale = randn(24, 64, seed=1, scale=0.1), randn(24, seed=2), torch.ones(3)
    h, post, comb = Fn.hc_pre(x, fn, scale, base, rms_eps=EPS, hc_eps=EPS, sinkhorn_iters=20)
    assert h.dtype == torch.bfloat16 and post.dtype == torch.float32 and comb.dtype == torch.float32
    hf, _, _ = Fn.hc_pre(x.float(), fn, scale, base, rms_eps=EPS, hc_eps=EPS, sinkhorn_iters=20)
    torch.testing.assert_close(h.float(), hf, rtol=1e-2, atol=1e-2)
    assert Fn.hc_post(h, x, post, comb).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_topk(scoring):
    logits, bias = randn(6, 10), randn(10, seed=1)
    w, idx = Fn.route_topk(logits, bias, top_k=3, scoring=scoring, norm_topk_prob=True, routed_scaling_factor=1.5)
    s = {"sqrtsoftplus": F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid(logits),
         "softmax": logits.softmax(-1)}[scoring]
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(idx, (s + bias).topk(3).indices)  # distinct values: order = descending
    g = s.gather(1, idx)
    torch.testing.assert_close(w, g / (g.sum(-1, keepdim=True) + 1e-20) * 1.5)
    w2, _ = Fn.route_topk(logits, bias, top_k=3, scoring=scoring, norm_topk_prob=False, routed_scaling_factor=2.0)
    torch.testing.assert_close(w2, g * 2.0)


def test_route_topk_ties_lowest_index_first():
    # experts 1, 3, 4, 6 tie on s + bias; experts 3, 4 also tie on the unbiased score
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.5, 0.5, -1.0, 0.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    s = F.softplus(logits).sqrt()
    bias[3] = bias[4] = (s[0, 1] - s[0, 3]).item()
    bias[6] = (s[0, 1] - s[0, 6]).item()
    sel = s + bias
    assert sel[0, 1] == sel[0, 3] == sel[0, 4] == sel[0, 6]
    _, idx = Fn.route_topk(logits, bias, top_k=4, scoring="sqrtsoftplus", norm_topk_prob=True,
                           routed_scaling_factor=1.0)
    assert idx.tolist() == [[7, 1, 3, 4]]
    _, idx = Fn.route_topk(torch.zeros(2, 16), None, top_k=5, scoring="sigmoid", norm_topk_prob=True,
                           routed_scaling_factor=1.0)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 2


def test_route_hash_keeps_table_order():
    logits = randn(4, 8)
    table = torch.tensor([[7, 2], [0, 5], [3, 1], [6, 4]], dtype=torch.int32)
    ids = torch.tensor([2, 2, 0, 3])
    w, idx = Fn.route_hash(logits, ids, table, scoring="sqrtsoftplus", norm_topk_prob=True,
                           routed_scaling_factor=1.5)
    assert idx.dtype == torch.int64 and idx.tolist() == [[3, 1], [3, 1], [7, 2], [6, 4]]
    g = F.softplus(logits).sqrt().gather(1, idx)
    torch.testing.assert_close(w, g / (g.sum(-1, keepdim=True) + 1e-20) * 1.5)


# ---------------------------------------------------------------------------------------------- compressor


def run_compressor(kv, score, ape, norm_w, inv, chunks, start=None, capacity=None, garbage_state=False):
    B, T, W = kv.shape
    r, c = ape.shape[0], norm_w.shape[0]
    coff = W // c
    ks = torch.zeros(B, coff * r, W)
    ss = torch.full((B, coff * r, W), -math.inf)
    if garbage_state:  # a reused state must not leak into a fresh sequence
        ks, ss = randn(B, coff * r, W, seed=9), randn(B, coff * r, W, seed=10)
    ent = torch.zeros(B, capacity or (T // r + 1), c)
    sp = torch.zeros(B, dtype=torch.long) if start is None else start.clone()
    i = 0
    for n in chunks:
        ent, ks, ss = Fn.compressor_step(kv[:, i:i + n], score[:, i:i + n], ape, norm_w, inv, ks, ss, ent, sp,
                                         rms_eps=EPS)
        sp, i = sp + n, i + n
    return ent


@pytest.mark.parametrize("ratio,coff", [(4, 2), (16, 1), (3, 1), (128, 1)])
def test_compressor_matches_naive_and_is_chunk_invariant(ratio, coff):
    c, B = 16, 2
    T = 2 * ratio + 5 if ratio > 16 else 41
    W = coff * c
    kv, score = randn(B, T, W, seed=1), randn(B, T, W, seed=2)
    ape, norm_w, inv = randn(ratio, W, seed=3), 1 + randn(c, seed=4, scale=0.1), torch.rand(4, generator=gen(5))
    one = run_compressor(kv, score, ape, norm_w, inv, [T], garbage_state=True)
    n_ent = T // ratio
    for b in range(B):
        ref = naive_compressor(kv[b], score[b], ape, norm_w, inv, ratio)
        torch.testing.assert_close(one[b, :n_ent].double(), ref, rtol=1e-5, atol=1e-5)
    assert (one[:, n_ent:] == 0).all()
    for chunks in ([1] * T, [ratio - 1, 2, ratio + 3, T - 2 * ratio - 4], [5, T - 5]):
        assert torch.equal(run_compressor(kv, score, ape, norm_w, inv, chunks), one), chunks


def test_compressor_rows_at_different_positions():
    c, r, T = 8, 4, 23
    kv, score = randn(2, T, 2 * c, seed=1), randn(2, T, 2 * c, seed=2)
    ape, norm_w, inv = randn(r, 2 * c, seed=3), torch.ones(c), torch.rand(2, generator=gen(5))
    alone = [run_compressor(kv[b:b + 1], score[b:b + 1], ape, norm_w, inv, [T]) for b in range(2)]
    # row 0 has consumed 6 tokens, row 1 has consumed 11; then both advance by chunks of 3 and the rest
    ks, ss = torch.zeros(2, 8, 2 * c), torch.full((2, 8, 2 * c), -math.inf)
    ent = torch.zeros(2, T // r + 1, c)
    rows = []
    for b, n in ((0, 6), (1, 11)):
        e, k, s = Fn.compressor_step(kv[b:b + 1, :n], score[b:b + 1, :n], ape, norm_w, inv, ks[b:b + 1],
                                     ss[b:b + 1], ent[b:b + 1], torch.tensor([0]), rms_eps=EPS)
        rows.append((e, k, s))
    ent, ks, ss = (torch.cat(t) for t in zip(*rows))
    sp = torch.tensor([6, 11])
    for n in (3, 3, 4):
        take = torch.stack([kv[b, sp[b]:sp[b] + n] for b in range(2)])
        take_s = torch.stack([score[b, sp[b]:sp[b] + n] for b in range(2)])
        ent, ks, ss = Fn.compressor_step(take, take_s, ape, norm_w, inv, ks, ss, ent, sp, rms_eps=EPS)
        sp = sp + n
    for b in range(2):
        n_ent = int(sp[b]) // r
        torch.testing.assert_close(ent[b, :n_ent], alone[b][0, :n_ent], rtol=1e-6, atol=1e-6)


def test_compressor_capacity_error():
    kv = randn(1, 8, 4)
    with pytest.raises(ValueError, match="capacity"):
        run_compressor(kv, kv, randn(4, 4), torch.ones(4), torch.ones(1), [8], capacity=1)


# ---------------------------------------------------------------------------------------------- indexer


def test_indexer_matches_bruteforce():
    B, S, nI, cI, N, topk = 2, 9, 8, 16, 12, 5
    q, w, keys = randn(B, S, nI, cI, seed=1), randn(B, S, nI, seed=2), randn(B, N, cI, seed=3)
    start = torch.tensor([3, 40])
    idx = Fn.indexer_topk(q, w, keys, start, ratio=4, index_topk=topk)
    assert idx.shape == (B, S, topk) and idx.dtype == torch.int64
    for b in range(B):
        for s in range(S):
            p = int(start[b]) + s
            vis = min((p + 1) // 4, N)
            score = [sum(w[b, s, h].double() * nI**-0.5 * torch.relu(q[b, s, h].double() @ keys[b, j].double())
                         * cI**-0.5 for h in range(nI)) for j in range(vis)]
            want = sorted(range(vis), key=lambda j: (-float(score[j]), j))[:topk]
            assert idx[b, s].tolist() == want + [-1] * (topk - len(want)), (b, s)


def test_indexer_ties_lowest_index_first():
    N, cI = 10, 8
    keys = randn(1, N, cI, seed=1)
    keys[0, 7] = keys[0, 2]  # identical keys -> identical scores
    keys[0, 5] = keys[0, 2]
    keys[0, 9] = -keys[0, 2].abs() * 0  # all-zero key: score exactly 0, like every relu-dead entry
    keys[0, 8] = 0
    q = keys[0, 2].expand(1, 1, 2, cI).clone()  # largest score on 2, 5, 7
    idx = Fn.indexer_topk(q, torch.ones(1, 1, 2), keys, torch.tensor([100]), ratio=4, index_topk=N)
    row = idx[0, 0].tolist()
    assert row[:3] == [2, 5, 7]
    assert row.index(8) < row.index(9)
    # fewer visible entries than top-k: -1 padding, and capacity < index_topk pads too
    idx = Fn.indexer_topk(q, torch.ones(1, 1, 2), keys, torch.tensor([11]), ratio=4, index_topk=12)
    assert idx[0, 0, 3:].tolist() == [-1] * 9 and sorted(idx[0, 0, :3].tolist()) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- attention


def naive_attention(q, hist, start, entries, indices, sink, inv, n_win, ratio):
    """Per-query attention over an explicit history hist [B, P, D] of raw kv by absolute position."""
    B, S, H, D = q.shape
    out = torch.zeros(B, S, H, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            p = int(start[b]) + s
            sel = [hist[b, j] for j in range(max(0, p - n_win + 1), p + 1)]
            if ratio:
                vis = (p + 1) // ratio
                ids = range(vis) if indices is None else [int(i) for i in indices[b, s] if 0 <= i < vis]
                sel += [entries[b, i] for i in ids]
            K = torch.stack(sel).double()
            logit = q[b, s].double() @ K.T * D**-0.5
            m = torch.maximum(logit.amax(-1), sink.double())
            e = torch.exp(logit - m[:, None])
            o = (e / (e.sum(-1) + torch.exp(sink.double() - m))[:, None]) @ K
            out[b, s] = rope_complex(o, p, inv, inverse=True)
    return out


@pytest.mark.parametrize("ratio,use_idx,S", [(0, False, 5), (16, False, 7), (4, True, 6), (4, True, 19), (0, False, 1)])
def test_sparse_attention(ratio, use_idx, S):
    B, H, D, n_win, N = 2, 4, 32, 8, 9
    start = torch.tensor([0, 21]) if S > 1 else torch.tensor([5, 30])
    P = int(start.max()) + S
    hist = randn(B, P, D, seed=1)
    window = randn(B, n_win, D, seed=2) * 100  # slots not holding a past position must be ignored
    for b in range(B):
        for p in range(max(0, int(start[b]) - n_win), int(start[b])):
            window[b, p % n_win] = hist[b, p]
    kv = torch.stack([hist[b, int(start[b]):int(start[b]) + S] for b in range(B)])
    q, sink, inv = randn(B, S, H, D, seed=3), randn(H, seed=4), torch.rand(4, generator=gen(5))
    entries = randn(B, N, D, seed=6) if ratio else None
    indices = None
    if use_idx:
        indices = torch.rand(B, S, N, generator=gen(7)).argsort(-1)[..., :4]  # distinct, like the indexer's
        indices[..., 3] = -1
    o, new_win = Fn.sparse_attention(q, kv, window, entries, indices, sink, inv, start, ratio=ratio)
    ref = naive_attention(q, hist, start, entries, indices, sink, inv, n_win, ratio)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)
    for b in range(B):
        for p in range(max(0, int(start[b]) + S - n_win), int(start[b]) + S):
            assert torch.equal(new_win[b, p % n_win], hist[b, p])


def test_grouped_out_proj():
    B, S, H, D, G, dg, d = 2, 3, 8, 16, 4, 6, 10
    o, wa, wb = randn(B, S, H, D), randn(G * dg, H * D // G, seed=1), randn(d, G * dg, seed=2)
    y = Fn.grouped_out_proj(o, wa, wb, n_groups=G)
    og = o.reshape(B, S, G, -1).double()
    u = torch.cat([og[:, :, g] @ wa[g * dg:(g + 1) * dg].double().T for g in range(G)], -1)
    torch.testing.assert_close(y.double(), u @ wb.double().T, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- MoE


def test_swiglu_clamp():
    g = torch.tensor([-20.0, 5.0, 20.0, 20.0])
    u = torch.tensor([-20.0, 20.0, -3.0, 30.0])
    out = Fn.swiglu(g, u, 10.0)
    torch.testing.assert_close(out, F.silu(torch.tensor([-20.0, 5.0, 10.0, 10.0])) * torch.tensor([-10.0, 10, -3, 10]))


def test_moe_ffn_matches_loop():
    T, d, inter, E, k = 7, 16, 12, 5, 2
    x = randn(T, d)
    w1, w2, w3 = randn(E, inter, d, seed=1), randn(E, d, inter, seed=2), randn(E, inter, d, seed=3)
    sh = (randn(inter, d, seed=4), randn(d, inter, seed=5), randn(inter, d, seed=6))
    w, idx = Fn.route_topk(randn(T, E, seed=7), None, top_k=k, scoring="sqrtsoftplus", norm_topk_prob=True,
                           routed_scaling_factor=1.5)

    def expert(xt, a, b, c, wt=1.0):
        h = F.silu((xt.double() @ a.double().T).clamp(max=3.0)) * (xt.double() @ c.double().T).clamp(-3.0, 3.0)
        return (wt * h) @ b.double().T

    ref = torch.stack([sum(expert(x[t], w1[int(e)], w2[int(e)], w3[int(e)], float(w[t, j]))
                           for j, e in enumerate(idx[t])) + expert(x[t], *sh) for t in range(T)])
    y = Fn.moe_ffn(x, w, idx, w1, w2, w3, swiglu_limit=3.0, shared=sh)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    y_list = Fn.moe_ffn(x, w, idx, list(w1), list(w2), list(w3), swiglu_limit=3.0, shared=sh)
    assert torch.equal(y, y_list)
