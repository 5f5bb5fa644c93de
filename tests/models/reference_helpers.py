"""Helpers of the reference-model tests: random models and the top-k selection margin."""

import torch

from dsv4_ort.models import DeepseekV4Config, DeepseekV4ForCausalLM


def make_model(config: DeepseekV4Config, seed: int = 0, dtype=torch.float32) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(config, dtype=dtype)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def selection_margin(model: DeepseekV4ForCausalLM, input_ids: torch.Tensor) -> float:
    """Smallest relative gap, over a full prefill, between the last selected and the first rejected score
    of every top-k choice (indexer entries, score-routed experts).

    Top-k selections are discontinuous: two scores closer than float32 rounding can be ordered
    differently by prefill, chunked and token-by-token runs (or by another implementation). Tests that
    demand equal logits first check that their random inputs keep this margin well above rounding.
    Exactly equal scores are ignored: they are ordered by the deterministic tie rule in every path.
    """
    from dsv4_ort.models import functional as Fn

    gaps = []
    real_indexer, real_route = Fn.indexer_topk, Fn.route_topk

    def boundary_gap(score, k):
        v = score.sort(dim=-1, descending=True).values
        if v.shape[-1] <= k:
            return
        a, b = v[..., k - 1], v[..., k]
        ok = torch.isfinite(b) & (a != b)
        if ok.any():
            gaps.append((((a - b) / v[..., :1].abs().clamp_min(1e-30).squeeze(-1))[ok]).min().item())

    def indexer_spy(q, weights, keys, start_pos, *, ratio, index_topk):
        nI, cI = q.shape[2], q.shape[3]
        s = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))) * cI**-0.5
        score = (s * (weights.float() * nI**-0.5).unsqueeze(-1)).sum(2)
        pos = start_pos[:, None] + torch.arange(q.shape[1])
        score = score.masked_fill(torch.arange(keys.shape[1]) >= ((pos + 1) // ratio)[..., None], float("-inf"))
        boundary_gap(score, index_topk)
        return real_indexer(q, weights, keys, start_pos, ratio=ratio, index_topk=index_topk)

    def route_spy(logits, bias, *, top_k, scoring, norm_topk_prob, routed_scaling_factor):
        s = Fn._scores(logits, scoring)
        boundary_gap(s if bias is None else s + bias.float(), top_k)
        return real_route(logits, bias, top_k=top_k, scoring=scoring, norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor)

    Fn.indexer_topk, Fn.route_topk = indexer_spy, route_spy
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        Fn.indexer_topk, Fn.route_topk = real_indexer, real_route
    return min(gaps) if gaps else float("inf")


def randomize_hf(model, seed):
    """Draws every parameter and buffer of a transformers DeepSeek-V4 model (norms near 1, hash tables of distinct
    experts) from one seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("position_bias") or p.dim() == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                table = torch.rand(b.shape[0], model.config.n_routed_experts, generator=g).argsort(-1)
                b.copy_(table[:, :b.shape[1]])


def hf_step(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits of transformers' model continuing ``cache`` with ``ids``.

    The cache keyword is ``cache`` from transformers 5.24 and ``past_key_values`` before; a keyword the model does
    not know is swallowed by its ``**kwargs``, so the wrong one silently runs without the cache.
    """
    import inspect

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(ids, use_cache=True, **{kw: cache}).logits
