"""DeepSeek-V4 fused regions as pure functions: the specification of the custom ops.

Every function here is one region that becomes a custom op (or a stock ORT op sequence). The C++
kernels (`custom_ops/kernels/*_ref.cc`), the ORT op tests and `model.py` all check against these.
Functions never modify their inputs; state tensors are passed in and returned updated.

Conventions
-----------
* ``B`` batch rows, ``S`` new tokens per row (any ``S >= 1``), ``start_pos [B] int64``: row ``b``'s new
  tokens sit at absolute positions ``start_pos[b] + 0 .. S-1``; rows may be at different positions.
* Activations are float32 or bfloat16; reductions, softmaxes, norms and RoPE are computed in float32
  and cast back to the activation dtype where noted.
* RoPE is interleaved ("GPT-J"): channels ``(2i, 2i+1)`` of the last ``rd`` channels form pair ``i``,
  rotated by ``angle = float32(position) * inv_freq[i]`` (the product is rounded to float32 before
  cos/sin). The inverse rotation negates the sine.

Numerics follow transformers' ``models/deepseek_v4`` (the test oracle). Differences from DeepSeek's own
``inference/model.py``: no FP8/FP4 quantisation-aware round trips of activations, kv or indexer q/k
(except the optional FP8 state, which quantises the stored window, entries and indexer keys; see "FP8 state"),
and no Hadamard rotation of the indexer q/k (orthonormal, so index scores agree in exact arithmetic);
index scores are float32 rather than bfloat16. Differences from transformers that change rounding
only: the compressor and router projections run in float32 for every activation dtype (as DeepSeek's
reference does); the routing weight multiplies the expert activation before w2 (transformers: after);
top-k ties are broken by the lowest index (torch.topk leaves them unspecified); with softmax scoring
the selected weights are renormalised only when ``norm_topk_prob`` (transformers always renormalises).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------- basics


def _eager() -> bool:
    """False while tracing / exporting: data-dependent argument checks are skipped there."""
    return not (torch.jit.is_tracing() or torch.compiler.is_compiling())


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``weight * x * rsqrt(mean(x^2) + eps)``, float32 math, x.dtype out.

    x: [..., n]; weight: [n] (any float dtype) or None for the weightless variant.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, *,
           fp8_block: int = 128) -> torch.Tensor:
    """``x @ W.T`` with W dense or in a checkpoint format (decoded by ``models/quant.py``).

    x: [..., in]; result [..., out] in x.dtype. ``weight``/``scale``:
      * dense [out, in] float tensor, scale None;
      * FP8: float8_e4m3fn [out, in] + block scales [ceil(out/128), ceil(in/128)] (E8M0 or float32);
      * FP4: packed e2m1 [out, in/2] (int8 / uint8 / float4_e2m1fn_x2, low nibble = even index)
        + E8M0 scales [out, in/32].
    The dequantised weight is cast to x.dtype before the product (DeepSeek's "bf16 gemm" path).
    """
    if scale is not None:
        from . import quant

        if weight.dtype == torch.float8_e4m3fn:
            weight = quant.dequant_fp8_block(weight, scale, fp8_block)
        else:
            weight = quant.dequant_fp4(weight, scale)
    return F.linear(x, weight.to(x.dtype))


# ---------------------------------------------------------------------------------------------- RoPE


def rope_freqs(config, compressed: bool) -> torch.Tensor:
    """Inverse frequencies [rd/2] float32 of one of the two RoPE tables.

    ``compressed=False``: ratio-0 layers and MTP, base ``rope_theta``, plain.
    ``compressed=True``: ratio > 0 layers (attention, compressors, indexer), base ``compress_rope_theta``
    with YaRN from ``config.rope_scaling`` (if set): ``f_i' = f_i/factor * ramp_i + f_i * (1 - ramp_i)``,
    ``ramp_i = clamp((i - low) / (high - low), 0, 1)``, low/high from beta_fast/beta_slow (floored /
    ceiled). No YaRN attention factor (mscale) is applied anywhere.

    The table is :func:`dsv4_ort.models.rope.inv_freq` (float64 arithmetic rounded once to float32, within
    2 ulps of transformers' all-float32 table); the exporter writes the same table into the graph.
    """
    from .rope import inv_freq

    return torch.from_numpy(inv_freq(config, compressed))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int64 -> (cos, sin), each [..., rd/2] float32."""
    angle = positions[..., None].float() * inv_freq.float()
    return angle.cos(), angle.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of x, interleaved pairs; other channels unchanged.

    x: [..., n]; cos/sin: broadcastable to ``x.shape[:-1] + (rd/2,)``. float32 math, x.dtype out.
    ``inverse`` rotates by the negative angle.
    """
    rd = 2 * cos.shape[-1]
    if inverse:
        sin = -sin
    pairs = x[..., x.shape[-1] - rd:].float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., : x.shape[-1] - rd], rot.to(x.dtype)], dim=-1)


# ---------------------------------------------------------------------------------------------- mHC


def _hc_mix(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """Weightless RMSNorm of the flattened streams, then the mixing projection: [..., hc, d] -> [..., m]."""
    v = x.flatten(-2).float()
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + rms_eps)
    return F.linear(v, fn.float())


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
           rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC "pre": collapse the hc residual streams into one block input and compute the mixing weights.

    Args:
        x: [..., hc, d] float32 or bfloat16 residual streams.
        fn: [(2+hc)*hc, hc*d] float32; rows [0, hc) pre, [hc, 2hc) post, [2hc, 2hc+hc*hc) comb (row-major k, j).
        scale: [3] float32 (pre, post, comb multipliers). base: [(2+hc)*hc] float32.
    Returns:
        h [..., d] (x.dtype) = sum_k pre[k] * x[k], with pre = sigmoid(mix*scale[0] + base) + hc_eps;
        post [..., hc] float32 = 2 * sigmoid(mix*scale[1] + base);
        comb [..., hc, hc] float32, comb[..., k, j] = weight of source stream k in output stream j:
        softmax over j of (mix*scale[2] + base) + hc_eps, then divide by column sums (+hc_eps), then
        ``sinkhorn_iters - 1`` times (rows, then columns) -- the last normalisation is over columns.
    mix = linear(x.flatten(-2) * rsqrt(mean(x^2) + rms_eps), fn), all float32.
    """
    hc = x.shape[-2]
    mix = _hc_mix(x, fn, rms_eps)
    base = base.float()
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    h = (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    return h, post, comb


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC "post": ``X_new[..., j, :] = post[..., j] * f + sum_k comb[..., k, j] * residual[..., k, :]``.

    f: [..., d]; residual: [..., hc, d] (same dtype as f); post [..., hc], comb [..., hc, hc] float32.
    float32 math, result [..., hc, d] in residual.dtype.
    """
    out = post.unsqueeze(-1) * f.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), residual.float())
    return out.to(residual.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
            rms_eps: float, hc_eps: float) -> torch.Tensor:
    """Final stream collapse (no Sinkhorn): ``y = sum_k (sigmoid(mix_k * scale[0] + base_k) + hc_eps) * x[k]``.

    x: [..., hc, d]; fn [hc, hc*d], scale [1], base [hc] float32; mix as in :func:`hc_pre`.
    Returns [..., d] in x.dtype.
    """
    pre = torch.sigmoid(_hc_mix(x, fn, rms_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------- routing


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = logits.float()
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "softmax":
        return logits.softmax(-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring function {scoring!r}")


def _route_weights(scores, indices, norm_topk_prob, routed_scaling_factor):
    w = scores.gather(-1, indices)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, scoring: str,
               norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Score-based routing ("noaux_tc"): select by ``s + bias``, weight by the unbiased ``s``.

    logits: [T, E] float32 router logits (``x @ gate.weight.T``); bias: [E] float32 or None.
    s = sqrt(softplus(logits)) | softmax(logits) | sigmoid(logits) for scoring in
    {"sqrtsoftplus", "softmax", "sigmoid"}.
    Returns (weights [T, k] float32, indices [T, k] int64). indices are the top_k experts by ``s + bias``
    in descending order, ties broken by the lowest expert index. weights = s[indices], divided by
    (their sum + 1e-20) when norm_topk_prob, times routed_scaling_factor.
    (transformers renormalises regardless of norm_topk_prob; all released configs set it true.)
    """
    s = _scores(logits, scoring)
    sel = s if bias is None else s + bias.float()
    indices = torch.sort(sel, dim=-1, descending=True, stable=True).indices[..., :top_k]
    return _route_weights(s, indices, norm_topk_prob, routed_scaling_factor), indices


def route_hash(logits: torch.Tensor, input_ids: torch.Tensor, tid2eid: torch.Tensor, *, scoring: str,
               norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: experts = ``tid2eid[input_ids]`` (table order kept), weights as in :func:`route_topk`.

    logits [T, E] float32; input_ids [T] int64; tid2eid [vocab, k] int32/int64.
    Returns (weights [T, k] float32, indices [T, k] int64).
    """
    indices = tid2eid[input_ids.reshape(-1)].long()
    return _route_weights(_scores(logits, scoring), indices, norm_topk_prob, routed_scaling_factor), indices


# ---------------------------------------------------------------------------------------------- FP8 state
#
# Optional FP8 attention state (exports with ``state="fp8"``; custom_ops/kernels/state_fp8.h is the C++ side).
# The window ring and the compressed entries store one row per entry of D channels (the last ``rope`` carry RoPE,
# D - rope a multiple of 64): (D - rope) E4M3FN codes, the rope channels as bf16, then one E8M0 scale byte per 64
# no-rope channels padded with zero bytes to a multiple of 8 (D = 512, rope = 64: 448 + 128 + 8 = 584 bytes, the
# released engines' per-token format, stored per entry rather than in their paged "data then scales" blocks).
# Indexer keys store cI E4M3FN codes and one float32 power-of-two scale (cI + 4 bytes).
# Quantiser per 64-channel block (or whole key): amax = max|x| (NaN if any is NaN), e = the smallest integer with
# 2^e >= max(amax, 1e-4) / 448 (float32, exact via frexp; e = 127 when amax is not finite), codes =
# E4M3FN(clamp(x / 2^e, -448, 448)) with round-to-nearest-even. Decoding (code * 2^e, bf16 widened) is exact, so the
# reference keeps dequantised values in ordinary tensors: the write points apply :func:`fp8_entry_qdq` /
# :func:`fp8_index_qdq` and the readers are unchanged.

FP8_BLOCK = 64
FP8_AMAX_FLOOR = 1e-4


def fp8_entry_bytes(dim: int, rope: int) -> int:
    """Bytes of one FP8 attention entry of ``dim`` channels with ``rope`` rope channels."""
    n = dim - rope
    if dim < 1 or not 0 <= rope <= dim or n % FP8_BLOCK:
        raise ValueError(f"FP8 state needs dim - rope ({dim} - {rope}) to be a non-negative multiple of {FP8_BLOCK}")
    return n + 2 * rope + (n // FP8_BLOCK + 7) // 8 * 8


def fp8_index_bytes(dim: int) -> int:
    """Bytes of one FP8 indexer key of ``dim`` channels."""
    return dim + 4


def _fp8_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax float32 [...] -> (exponent int32 [...], scale 2^exponent float32 [...])."""
    s = amax.clamp(min=FP8_AMAX_FLOOR) / 448.0
    m, e = torch.frexp(s)
    e = torch.where(torch.isfinite(s), e - (m == 0.5).to(e.dtype), 127).to(torch.int32)
    scale = ((e + 127) << 23).view(torch.float32)  # exact 2^e for e in [-126, 127]
    return e, scale


def _fp8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _fp8_entry_parts(x: torch.Tensor, rope: int):
    xf = x.float()
    n = x.shape[-1] - rope
    fp8_entry_bytes(x.shape[-1], rope)
    blocks = xf[..., :n].unflatten(-1, (n // FP8_BLOCK, FP8_BLOCK))
    e, scale = _fp8_scale(blocks.abs().amax(-1))
    return _fp8_codes(blocks, scale.unsqueeze(-1)), e, scale, xf[..., n:].to(torch.bfloat16)


def fp8_entry_qdq(x: torch.Tensor, rope: int) -> torch.Tensor:
    """x [..., D] -> the values an FP8 attention entry of x decodes to, in x.dtype (exact for float32 / bf16)."""
    codes, _, scale, r = _fp8_entry_parts(x, rope)
    deq = (codes.float() * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat([deq, r.float()], dim=-1).to(x.dtype)


def fp8_entry_encode(x: torch.Tensor, rope: int) -> torch.Tensor:
    """x [..., D] -> uint8 [..., fp8_entry_bytes(D, rope)] (layout above; bf16 little-endian)."""
    codes, e, _, r = _fp8_entry_parts(x, rope)
    nb = e.shape[-1]
    pad = (nb + 7) // 8 * 8 - nb
    parts = [codes.flatten(-2).view(torch.uint8), r.contiguous().view(torch.uint8), (e + 127).to(torch.uint8),
             torch.zeros(*x.shape[:-1], pad, dtype=torch.uint8)]
    return torch.cat(parts, dim=-1)


def fp8_entry_decode(data: torch.Tensor, dim: int, rope: int) -> torch.Tensor:
    """uint8 [..., fp8_entry_bytes(dim, rope)] -> float32 [..., dim] (exact; E8M0 0xFF gives NaN)."""
    n = dim - rope
    if data.shape[-1] != fp8_entry_bytes(dim, rope):
        raise ValueError(f"fp8_entry_decode: rows of {data.shape[-1]} bytes, expected {fp8_entry_bytes(dim, rope)}")
    codes = data[..., :n].contiguous().view(torch.float8_e4m3fn).float()
    r = data[..., n: n + 2 * rope].contiguous().view(torch.bfloat16).float()
    sb = data[..., n + 2 * rope: n + 2 * rope + n // FP8_BLOCK].to(torch.int32)
    scale = torch.where(sb == 255, torch.nan, ((sb.clamp(min=1) << 23).view(torch.float32)))
    scale = torch.where(sb == 0, 2.0 ** -127, scale)
    deq = (codes.unflatten(-1, (n // FP8_BLOCK, FP8_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat([deq, r], dim=-1)


def fp8_index_qdq(x: torch.Tensor) -> torch.Tensor:
    """x [..., cI] -> the values an FP8 indexer key of x decodes to, in x.dtype."""
    _, scale = _fp8_scale(x.float().abs().amax(-1, keepdim=True))
    return (_fp8_codes(x.float(), scale).float() * scale).to(x.dtype)


def fp8_index_encode(x: torch.Tensor) -> torch.Tensor:
    """x [..., cI] -> uint8 [..., cI + 4]: codes, then the float32 scale (little-endian)."""
    _, scale = _fp8_scale(x.float().abs().amax(-1, keepdim=True))
    codes = _fp8_codes(x.float(), scale).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


def fp8_index_decode(data: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 [..., dim + 4] -> float32 [..., dim] (exact)."""
    if data.shape[-1] != dim + 4:
        raise ValueError(f"fp8_index_decode: rows of {data.shape[-1]} bytes, expected {dim + 4}")
    scale = data[..., dim:].contiguous().view(torch.float32)
    return data[..., :dim].contiguous().view(torch.float8_e4m3fn).float() * scale


# ---------------------------------------------------------------------------------------------- attention


def q_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rms_eps: float) -> torch.Tensor:
    """Query preparation: per-head weightless RMSNorm, then RoPE on the last rd channels.

    q: [B, S, H, D] (= wq_b(q_norm(wq_a(x)))); cos/sin [B, S, rd/2] at the token positions.
    Returns [B, S, H, D] in q.dtype.
    """
    return apply_rope(rms_norm(q, None, rms_eps), cos.unsqueeze(-2), sin.unsqueeze(-2))


def kv_norm_rope(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 rms_eps: float) -> torch.Tensor:
    """Key/value preparation: RMSNorm(weight) then RoPE on the last rd channels.

    kv: [B, S, D] (= wkv(x)); weight [D]; cos/sin [B, S, rd/2]. Returns [B, S, D] in kv.dtype; this one
    vector is both key and value of the token.
    """
    return apply_rope(rms_norm(kv, weight, rms_eps), cos, sin)


def compressor_step(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                    inv_freq: torch.Tensor, kv_state: torch.Tensor, score_state: torch.Tensor,
                    entries: torch.Tensor, start_pos: torch.Tensor, *, rms_eps: float,
                    fp8: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV compressor: pool every ``r`` tokens into one entry (softmax-gated per channel), incrementally.

    Shapes (c = entry width, r = ratio = ape.shape[0], coff = 2 if overlapping else 1, coff = kv.shape[-1] / c):
        kv, score:  [B, S, coff*c]   ``x @ wkv.T`` and ``x @ wgate.T`` (computed in float32)
        ape:        [r, coff*c] float32 position bias, added to score of the token at ``p % r``
        norm_weight:[c]; inv_freq [rd/2] (the compressed-layer table)
        kv_state, score_state: [B, coff*r, coff*c] float32, a new sequence starts from 0 / -inf
        entries:    [B, N, c]; entry i (tokens [i*r, (i+1)*r)) lives at slot i
        start_pos:  [B] int64
    Returns (entries, kv_state, score_state), updated.

    Entry i is emitted when the token at p = (i+1)*r - 1 is processed. Non-overlapping (coff = 1):
    pooled_i = sum_j softmax_j(score_j + ape[j % r]) * kv_j over the r tokens j of block i, per channel.
    Overlapping (coff = 2, r = 4 in DeepSeek-V4): softmax over 2r rows jointly -- block i-1's tokens with
    channels [0, c), block i's tokens with channels [c, 2c) (ape likewise); for i = 0 the previous rows
    are empty (kv 0, score -inf). Then e_i = RMSNorm(pooled_i; norm_weight), RoPE at position i*r.

    State layout: rows ``[off, off + r)`` (off = r if overlapping else 0) hold kv / score+ape of the
    tokens of the block containing the next position P = start_pos + S (row off + p % r); with overlap,
    rows [0, r) hold the previous complete block. Only rows holding such tokens (positions < start_pos)
    are read, so the state of a batch row starting a new sequence (start_pos = 0) needs no reset.
    One-shot, chunked and token-by-token processing give identical entries.

    ``fp8`` (FP8 state): ``"attention"`` stores each emitted float32 entry as :func:`fp8_entry_qdq` with
    rope = 2 * len(inv_freq), ``"index"`` as :func:`fp8_index_qdq`; None stores it rounded to entries.dtype.
    """
    B, S, W = kv.shape
    r, c = ape.shape[0], norm_weight.shape[0]
    coff = W // c
    if coff * c != W or coff not in (1, 2) or ape.shape[1] != W:
        raise ValueError(f"compressor_step: kv width {W}, ape {tuple(ape.shape)} and norm width {c} disagree")
    overlap, off = coff == 2, (r if coff == 2 else 0)
    dev = kv.device
    n0 = start_pos // r  # block of the first new token
    nb = (r - 1 + S) // r + 1  # blocks n0 .. (start_pos + S) // r, at most
    ar = torch.arange(r, device=dev)

    # Block-aligned buffer: block k <-> absolute block n0 - 1 + k; k = 0 is the previous block.
    buf_kv = kv.new_zeros((B, (1 + nb) * r, W), dtype=torch.float32)
    buf_sc = torch.full_like(buf_kv, float("-inf"))
    if overlap:
        has_prev = (n0 >= 1)[:, None, None]
        buf_kv[:, :r] = torch.where(has_prev, kv_state[:, :r], 0.0)
        buf_sc[:, :r] = torch.where(has_prev, score_state[:, :r], float("-inf"))
    seen = (ar[None, :] < (start_pos % r)[:, None])[..., None]  # tokens of block n0 already in the state
    buf_kv[:, r: 2 * r] = torch.where(seen, kv_state[:, off: off + r], 0.0)
    buf_sc[:, r: 2 * r] = torch.where(seen, score_state[:, off: off + r], float("-inf"))
    pos = start_pos[:, None] + torch.arange(S, device=dev)  # [B, S]
    rows = (r + (start_pos % r)[:, None] + torch.arange(S, device=dev))[..., None].expand(B, S, W)
    buf_kv.scatter_(1, rows, kv.float())
    buf_sc.scatter_(1, rows, score.float() + ape.float()[pos % r])

    blk_kv, blk_sc = buf_kv.view(B, 1 + nb, r, W), buf_sc.view(B, 1 + nb, r, W)
    if overlap:
        K = torch.cat([blk_kv[:, :-1, :, :c], blk_kv[:, 1:, :, c:]], dim=2)  # [B, nb, 2r, c]
        Z = torch.cat([blk_sc[:, :-1, :, :c], blk_sc[:, 1:, :, c:]], dim=2)
    else:
        K, Z = blk_kv[:, 1:], blk_sc[:, 1:]  # [B, nb, r, c]
    idx = n0[:, None] + torch.arange(nb, device=dev)  # entry index of block k = 1..nb
    done = (idx + 1) * r <= (start_pos + S)[:, None]  # [B, nb] complete blocks
    Z = torch.where(done[:, :, None, None], Z, 0.0)  # keep unfinished blocks finite; they are dropped
    e = rms_norm((K * Z.softmax(dim=2)).sum(dim=2), norm_weight, rms_eps)  # [B, nb, c] float32
    cos, sin = rope_cos_sin(idx * r, inv_freq)
    e = apply_rope(e, cos, sin)

    N = entries.shape[1]
    if _eager() and bool((done & (idx >= N)).any()):
        raise ValueError(f"compressor_step: entry index beyond capacity {N} (increase max_seq_len)")
    out = torch.cat([entries, entries.new_zeros(B, 1, c)], dim=1)  # slot N catches unfinished blocks
    tgt = torch.where(done, idx, N)[..., None].expand(B, nb, c)
    if fp8 == "attention":
        e = fp8_entry_qdq(e, 2 * inv_freq.shape[0])
    elif fp8 == "index":
        e = fp8_index_qdq(e)
    elif fp8 is not None:
        raise ValueError(f"compressor_step: fp8 must be None, 'attention' or 'index', got {fp8!r}")
    out = out.scatter(1, tgt, e.to(entries.dtype))[:, :N]

    # New state: block of the next position P (k_p) and, with overlap, the block before it.
    k_p = ((start_pos + S) // r - n0 + 1)[:, None, None, None].expand(B, 1, r, W)
    new_kv, new_sc = kv_state.clone(), score_state.clone()
    new_kv[:, off: off + r] = blk_kv.gather(1, k_p)[:, 0]
    new_sc[:, off: off + r] = blk_sc.gather(1, k_p)[:, 0]
    if overlap:
        new_kv[:, :r] = blk_kv.gather(1, k_p - 1)[:, 0]
        new_sc[:, :r] = blk_sc.gather(1, k_p - 1)[:, 0]
    return out, new_kv, new_sc


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: torch.Tensor, *,
                 ratio: int, index_topk: int) -> torch.Tensor:
    """Lightning indexer: pick the top-k visible compressed entries per query.

    q: [B, S, nI, cI] indexer queries (``wq_b(qr)``, RoPE on the last rd channels);
    weights: [B, S, nI] (``x @ weights_proj.T``); keys: [B, N, cI] indexer-compressor entries;
    start_pos [B] int64.
    score[t, s] = sum_h (weights[t,h] * nI^-0.5) * (relu(q[t,h] . keys[s]) * cI^-0.5), float32;
    entry s is visible to the query at position p iff s < (p + 1) // ratio.
    Returns [B, S, index_topk] int64: the k = min(index_topk, visible) best visible entries in descending
    score order (ties: lowest entry index first), then -1 in the remaining slots.
    """
    B, S, nI, cI = q.shape
    N = keys.shape[1]
    s = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, S, nI, N]
    s = F.relu(s) * cI**-0.5
    score = (s * (weights.float() * nI**-0.5).unsqueeze(-1)).sum(dim=2)  # [B, S, N]
    pos = start_pos[:, None] + torch.arange(S, device=q.device)
    visible = (pos + 1) // ratio  # [B, S]
    score = score.masked_fill(torch.arange(N, device=q.device) >= visible[..., None], float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :index_topk]
    if order.shape[-1] < index_topk:
        order = F.pad(order, (0, index_topk - order.shape[-1]), value=-1)
    keep = torch.arange(index_topk, device=q.device) < visible.clamp(max=index_topk)[..., None]
    return torch.where(keep, order, -1)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, window: torch.Tensor, entries: torch.Tensor | None,
                     indices: torch.Tensor | None, sink: torch.Tensor, inv_freq: torch.Tensor,
                     start_pos: torch.Tensor, *, ratio: int, softmax_scale: float | None = None,
                     fp8_window: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-KV MQA over (sliding window) U (compressed entries), with attention sink and inverse RoPE.

    Args:
        q: [B, S, H, D] prepared queries; kv: [B, S, D] the chunk's own prepared kv (keys == values).
        window: [B, n_win, D] ring buffer of past raw kv, position p at slot p % n_win (slots holding
            positions < 0 or outside the window are masked, so a fresh buffer may hold anything finite).
        entries: [B, N, D] compressed entries (entry i at slot i) or None when ratio == 0.
        indices: [B, S, k] int64 selected entries (CSA; -1 = unused) or None: all visible entries (HCA).
        sink: [H] float32 per-head sink logit; inv_freq: [rd/2] table used for the inverse RoPE.
        start_pos: [B] int64; ratio: compress ratio of the layer (0 = window only).
    Returns:
        o [B, S, H, D] in q.dtype: softmax over the selected keys plus the sink (which has no value),
        ``logit = q . key * softmax_scale`` (default D^-0.5), float32; then the last rd channels are
        rotated by minus the query position.
        window [B, n_win, D]: the ring after writing the chunk's kv (the last min(S, n_win) tokens).
    The query at position p sees raw positions p - n_win < p' <= p and entries i < (p + 1) // ratio
    (restricted to ``indices`` when given). The chunk's kv is attended before the ring is overwritten.
    ``fp8_window`` (FP8 state): the ring stores :func:`fp8_entry_qdq` of the written kv rows (rope =
    2 * len(inv_freq)); the chunk's own kv is attended unquantised, so with FP8 state chunked prefill and
    token-by-token decoding differ by the quantisation of the keys a chunk reads from itself.
    """
    B, S, H, D = q.shape
    n_win = window.shape[1]
    dev = q.device
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    pos = start_pos[:, None] + torch.arange(S, device=dev)  # [B, S]
    slot = torch.arange(n_win, device=dev)
    ring_pos = start_pos[:, None] - 1 - torch.remainder(start_pos[:, None] - 1 - slot, n_win)  # [B, n_win]
    key_pos = torch.cat([ring_pos, pos], dim=1)  # [B, n_win + S]
    ok = (key_pos[:, None, :] <= pos[..., None]) & (key_pos[:, None, :] > pos[..., None] - n_win)
    ok &= key_pos[:, None, :] >= 0  # [B, S, n_win + S]
    keys = torch.cat([window.to(kv.dtype), kv], dim=1)
    if ratio > 0 and entries is not None and entries.shape[1] > 0:
        N = entries.shape[1]
        vis = torch.arange(N, device=dev) < ((pos + 1) // ratio)[..., None]  # [B, S, N]
        if indices is not None:
            sel = torch.zeros(B, S, N + 1, dtype=torch.bool, device=dev)
            sel.scatter_(-1, torch.where(indices >= 0, indices, N), True)
            vis &= sel[..., :N]
        ok = torch.cat([ok, vis], dim=-1)
        keys = torch.cat([keys, entries.to(kv.dtype)], dim=1)
    qh = q.transpose(1, 2)  # [B, H, S, D]
    logits = torch.matmul(qh.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale  # [B, H, S, K]
    logits = logits.masked_fill(~ok[:, None], float("-inf"))
    logits = torch.cat([logits, sink.float().view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    logits = logits - logits.amax(-1, keepdim=True)
    probs = logits.softmax(-1)[..., :-1]
    o = torch.matmul(probs.to(keys.dtype), keys.unsqueeze(1)).transpose(1, 2)  # [B, S, H, D]
    cos, sin = rope_cos_sin(pos, inv_freq)
    o = apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True).to(q.dtype)

    lo = max(0, S - n_win)
    tgt = ((pos[:, lo:]) % n_win)[..., None].expand(B, S - lo, D)
    written = fp8_entry_qdq(kv[:, lo:], 2 * inv_freq.shape[0]) if fp8_window else kv[:, lo:]
    new_window = window.scatter(1, tgt, written.to(window.dtype))
    return o, new_window


def grouped_out_proj(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, *, n_groups: int) -> torch.Tensor:
    """Grouped low-rank output projection.

    o: [B, S, H, D]; heads g*H/G .. (g+1)*H/G - 1 form group g. wo_a: [G*d_g, H*D/G] (group g = rows
    g*d_g .. (g+1)*d_g - 1); wo_b: [d, G*d_g]. u[g] = o_g @ wo_a_g.T; out = u.flatten() @ wo_b.T.
    Returns [B, S, d] in o.dtype.
    """
    B, S = o.shape[:2]
    x = o.reshape(B * S, n_groups, -1).transpose(0, 1)  # [G, T, H*D/G]
    w = wo_a.to(o.dtype).view(n_groups, -1, x.shape[-1]).transpose(1, 2)  # [G, H*D/G, d_g]
    u = torch.bmm(x, w).transpose(0, 1).reshape(B, S, -1)  # [B, S, G*d_g]
    return F.linear(u, wo_b.to(o.dtype))


# ---------------------------------------------------------------------------------------------- MoE


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in float32: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


def quantize_int8_blocks(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activation codes of the FP4 experts' compute="int8" (custom_ops/numerics/int8_blocks.h).

    v [..., n], n a multiple of 32, cut into blocks of 32: amax = max |v| (NaN if any value is), scale
    s = amax / 127 (NaN when amax is not finite), codes q = round_half_even(v * (127 / amax)) in float32 (0 when
    amax is 0 or not finite). Returns q [..., n] (integers in [-127, 127], as float32) and s [..., n / 32].
    """
    b = v.float().reshape(*v.shape[:-1], -1, 32)
    amax = b.abs().amax(-1)
    finite = torch.isfinite(amax)
    scale = torch.where(finite, amax / 127, torch.full_like(amax, float("nan")))
    inv = torch.where(finite & (amax > 0), 127 / amax, torch.zeros_like(amax))
    q = torch.nan_to_num(torch.round(b * inv.unsqueeze(-1)), nan=0.0)
    return q.reshape(v.shape), scale


def linear_int8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with x quantised by :func:`quantize_int8_blocks` (compute="int8"); w [N, K] the exact weights.

    Evaluated in float64 (every block product of the kernels is an exact integer sum); returns float32.
    """
    q, s = quantize_int8_blocks(x)
    xd = (q.double().reshape(*q.shape[:-1], -1, 32) * s.double().unsqueeze(-1)).reshape(q.shape)
    return F.linear(xd, w.double()).float()


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, *, swiglu_limit: float,
               weight: torch.Tensor | None = None, int8: bool = False) -> torch.Tensor:
    """One expert: ``w2(weight * swiglu(w1 x, w3 x))``; x [T, d], w1/w3 [I, d], w2 [d, I], weight [T] or None.

    The routing weight is applied to the float32 activation before w2. Returns [T, d] in x.dtype. int8: each
    matmul's input quantised per 32 columns (:func:`linear_int8`; MoeExpertsFp4 compute="int8", x in bfloat16).
    """
    def lin(v, w):
        return linear_int8(v, w).to(x.dtype) if int8 else F.linear(v, w.to(x.dtype))

    a = swiglu(lin(x, w1), lin(x, w3), swiglu_limit)
    if weight is not None:
        a = a * weight.float().unsqueeze(-1)
    return lin(a.to(x.dtype), w2)


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
            w1: torch.Tensor | Sequence[torch.Tensor], w2: torch.Tensor | Sequence[torch.Tensor],
            w3: torch.Tensor | Sequence[torch.Tensor], *, swiglu_limit: float,
            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, int8: bool = False
            ) -> torch.Tensor:
    """Routed experts plus the shared expert (int8: the routed experts as :func:`expert_ffn` with int8).

    x [T, d]; weights [T, k] float32, indices [T, k] int64 (from route_topk / route_hash);
    w1, w3: [E, I, d] and w2: [E, d, I] (stacked tensors or sequences of E matrices);
    shared: (w1 [I, d], w2 [d, I], w3 [I, d]) or None.
    y = sum_k expert_{indices[t,k]}(x_t, weights[t,k]) + shared(x_t), accumulated in float32 over
    experts in ascending index order; returned in x.dtype.
    """
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if not _eager():  # static graph: every expert on every token, non-routed pairs weighted 0
        dense = torch.zeros(x.shape[0], len(w1), device=x.device).scatter(1, indices, weights.float())
        for e in range(len(w1)):
            y += expert_ffn(x, w1[e], w2[e], w3[e], swiglu_limit=swiglu_limit, weight=dense[:, e], int8=int8).float()
        indices = indices[:0]
    for e in torch.unique(indices).tolist():
        tok, slot = torch.where(indices == e)
        y.index_add_(0, tok, expert_ffn(x[tok], w1[e], w2[e], w3[e], swiglu_limit=swiglu_limit,
                                        weight=weights[tok, slot], int8=int8).float())
    if shared is not None:
        y += expert_ffn(x, *shared, swiglu_limit=swiglu_limit).float()
    return y.to(x.dtype)
