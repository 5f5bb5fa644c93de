"""Parity with the transformers implementation of DeepSeek-V4 (the executable oracle).

Random weights are drawn for transformers' ``DeepseekV4ForCausalLM`` (eager, float32, CPU), converted
to DeepSeek names with ``models.checkpoint.hf_state_dict_to_deepseek`` and loaded into our model. We
compare logits for full prefill, token-by-token decode and chunked prefill, and greedy continuations.
Metric: max|ours - hf| / max|hf|. Run with ``-s`` to see the measured figures.
"""

import time

import pytest
import torch
import transformers
from reference_helpers import hf_step, randomize_hf, selection_margin
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as H

from dsv4_ort.models import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4_ort.models import functional as Fn
from dsv4_ort.models import hf_state_dict_to_deepseek

transformers.logging.set_verbosity_error()

PARITY = 1e-4  # max|diff| / max|logit|

TINY = DeepseekV4Config.from_preset("tiny")
CONFIGS = {
    # SWA, CSA, HCA(128), CSA; hash MoE in layers 0-1; window 16, top-k 8
    "tiny": (TINY, 300),
    # hc 2, window 8, top-k 4, generic HCA ratio 16, CSA first, sigmoid scores, k=3 of 6 experts.
    # 16 indexer heads: with 8, one query of this draw has a top-k boundary on two entries scoring exactly 0
    # (every head's relu dead), which transformers' torch.topk breaks differently.
    "hc2_r16": (TINY.replace(num_hidden_layers=5, compress_ratios=[4, 16, 0, 16, 4, 0], hc_mult=2, hidden_size=128,
                             head_dim=64, qk_rope_head_dim=32, index_head_dim=64, o_groups=2, sliding_window=8,
                             index_topk=4, index_n_heads=16, n_routed_experts=6, num_experts_per_tok=3,
                             scoring_func="sigmoid", num_hash_layers=1), 160),
    # hc 3, HCA-first like Pro, no hash layers, plain compressed RoPE, 16 indexer heads, all experts active
    "hc3_pro_like": (TINY.replace(num_hidden_layers=3, compress_ratios=[16, 16, 4, 0], hc_mult=3, hidden_size=128,
                                  sliding_window=32, index_topk=16, index_n_heads=16, n_routed_experts=4,
                                  num_experts_per_tok=4, num_hash_layers=0, rope_scaling=None,
                                  routed_scaling_factor=2.5, hc_sinkhorn_iters=5), 200),
    # one stream, two CSA layers, window 4, top-2 entries, a single routed expert per token, all hash-routed
    "hc1_k1": (TINY.replace(num_hidden_layers=3, compress_ratios=[0, 4, 4, 0], hc_mult=1, hidden_size=64,
                            num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, index_head_dim=32, o_groups=1,
                            sliding_window=4, index_topk=2, num_experts_per_tok=1, num_hash_layers=3), 120),
}


def build_pair(config, seed=0):
    hc = transformers.DeepseekV4Config(**config.to_hf_dict())
    hc._attn_implementation = "eager"
    hf = transformers.DeepseekV4ForCausalLM(hc).eval()
    randomize_hf(hf, seed)
    ours = DeepseekV4ForCausalLM(config).eval()
    missing, unexpected = ours.load_state_dict(hf_state_dict_to_deepseek(hf.state_dict()), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing), (missing, unexpected)
    return ours, hf


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_run(hf, ids, chunks):
    cache = transformers.DynamicCache(config=hf.config)
    out, i = [], 0
    for n in chunks:
        out.append(hf_step(hf, ids[:, i:i + n], cache))
        i += n
    return torch.cat(out, 1)


def our_run(model, ids, chunks):
    state = model.new_state(ids.shape[0], ids.shape[1] + 64)
    out, i = [], 0
    for n in chunks:
        out.append(model(ids[:, i:i + n], state=state))
        i += n
    return torch.cat(out, 1)


def greedy(step, first_logits, n):
    toks = [first_logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        toks.append(step(toks[-1])[:, -1].argmax(-1, keepdim=True))
    return torch.cat(toks, 1)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_logits_match_transformers(name):
    config, T = CONFIGS[name]
    ours, hf = build_pair(config)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    margin = selection_margin(ours, ids)
    assert margin > 1e-5, f"test inputs within {margin:.1e} of a top-k tie: choose another seed"
    t0 = time.time()
    ref = hf(ids).logits
    figs = {"prefill": rel(ours(ids), ref)}
    figs["token_by_token"] = rel(our_run(ours, ids[:1], [1] * T), ref[:1])
    figs["hf_token_by_token_vs_hf_prefill"] = rel(hf_run(hf, ids[:1], [1] * T), ref[:1])
    chunks = [3, 37, 1, 60, 5, T - 106]  # straddles every compress-block boundary kind
    figs["chunked"] = rel(our_run(ours, ids, chunks), ref)
    figs["chunked_hf_vs_hf_prefill"] = rel(hf_run(hf, ids, chunks), ref)

    # greedy continuation of a prompt long enough to fill the window and exceed index_topk
    prompt = ids[:1, : T - 64]
    state, cache = ours.new_state(1, T), transformers.DynamicCache(config=hf.config)
    ours_toks = greedy(lambda t: ours(t, state=state), ours(prompt, state=state), 64)
    hf_toks = greedy(lambda t: hf_step(hf, t, cache), hf_step(hf, prompt, cache), 64)
    print(f"\n[hf parity] {name}: T={T} " + " ".join(f"{k}={v:.2e}" for k, v in figs.items())
          + f" selection_margin={margin:.1e} greedy64_identical={torch.equal(ours_toks, hf_toks)} ({time.time() - t0:.1f}s)")
    for k in ("prefill", "token_by_token", "chunked"):
        assert figs[k] <= PARITY, (k, figs[k])
    assert torch.equal(ours_toks, hf_toks)


# ---------------------------------------------------------------------------------------------- unit parity


def _hf_config(config):
    hc = transformers.DeepseekV4Config(**config.to_hf_dict())
    hc._attn_implementation = "eager"
    return hc


@torch.no_grad()
def test_hc_functions_match_transformers():
    hc_cfg = _hf_config(TINY)
    g = torch.Generator().manual_seed(0)
    mod = H.DeepseekV4HyperConnection(hc_cfg)
    mod.fn.copy_(0.05 * torch.randn(mod.fn.shape, generator=g))
    mod.base.copy_(torch.randn(mod.base.shape, generator=g))
    mod.scale.copy_(1 + 0.1 * torch.randn(3, generator=g))
    x = torch.randn(2, 5, TINY.hc_mult, TINY.hidden_size, generator=g)
    post, comb, collapsed = mod(x)
    h, p2, c2 = Fn.hc_pre(x, mod.fn, mod.scale, mod.base, rms_eps=TINY.rms_norm_eps, hc_eps=TINY.hc_eps,
                          sinkhorn_iters=TINY.hc_sinkhorn_iters)
    torch.testing.assert_close(h, collapsed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p2, post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c2, comb, rtol=1e-5, atol=1e-6)
    f = torch.randn(2, 5, TINY.hidden_size, generator=g)
    hf_post = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)  # decoder layer
    torch.testing.assert_close(Fn.hc_post(f, x, p2, c2), hf_post, rtol=1e-5, atol=1e-6)

    head = H.DeepseekV4HyperHead(hc_cfg)
    head.hc_fn.copy_(0.05 * torch.randn(head.hc_fn.shape, generator=g))
    head.hc_base.copy_(torch.randn(head.hc_base.shape, generator=g))
    head.hc_scale.fill_(1.3)
    torch.testing.assert_close(Fn.hc_head(x, head.hc_fn, head.hc_scale, head.hc_base, rms_eps=TINY.rms_norm_eps,
                                          hc_eps=TINY.hc_eps), head(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@torch.no_grad()
def test_routers_match_transformers(scoring):
    cfg = TINY.replace(scoring_func=scoring)
    hc_cfg = _hf_config(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, cfg.hidden_size, generator=g)
    kw = dict(scoring=scoring, norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor)
    router = H.DeepseekV4TopKRouter(hc_cfg)
    router.weight.copy_(0.1 * torch.randn(router.weight.shape, generator=g))
    router.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts, generator=g))
    _, hw, hi = router(x)
    w, i = Fn.route_topk(x @ router.weight.T, router.e_score_correction_bias, top_k=cfg.num_experts_per_tok, **kw)
    order = hi.argsort(-1)  # transformers returns an unsorted top-k set
    srt = i.argsort(-1)
    assert torch.equal(hi.gather(1, order), i.gather(1, srt))
    torch.testing.assert_close(hw.gather(1, order), w.gather(1, srt), rtol=1e-5, atol=1e-7)

    hrouter = H.DeepseekV4HashRouter(hc_cfg)
    hrouter.weight.copy_(router.weight)
    hrouter.tid2eid.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, :2])
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=g)
    _, hw, hi = hrouter(x, ids)
    w, i = Fn.route_hash(x @ router.weight.T, ids, hrouter.tid2eid, **kw)
    assert torch.equal(hi, i)
    torch.testing.assert_close(hw, w, rtol=1e-5, atol=1e-7)


def test_rope_tables_match_transformers():
    for cfg in (TINY, DeepseekV4Config.from_preset("flash")):
        rot = H.DeepseekV4RotaryEmbedding(_hf_config(cfg))
        torch.testing.assert_close(Fn.rope_freqs(cfg, compressed=False), rot.main_inv_freq, rtol=1e-6, atol=0)
        torch.testing.assert_close(Fn.rope_freqs(cfg, compressed=True), rot.compress_inv_freq, rtol=1e-6, atol=0)
        assert rot.compress_attention_scaling == 1.0
