"""DeepSeek-V4 reference model (PyTorch, exportable formulations only).

One class per block, parameter names equal to DeepSeek's released checkpoint keys (``embed.weight``,
``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``, ``mtp.0.e_proj.weight``, ...;
the FP8/FP4 ``.scale`` tensors are not parameters: weights are held dequantised). Every fused region
calls :mod:`.functional`, which documents the math and the state layouts.

Caching: ``state = model.new_state(batch_size, max_seq_len)`` allocates fixed-capacity per-layer state
(window ring, compressor states, compressed entries) and per-row positions; ``model(ids, state=state)``
processes ``S`` new tokens per row at the row's own position and advances it. Full prefill, chunked
prefill and token-by-token decode give the same logits. ``model(ids)`` is a stateless full prefill.

Numerics follow transformers' implementation (no QAT simulations, no indexer Hadamard); see
:mod:`.functional`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from . import functional as Fn
from .config import CSA_RATIO, DeepseekV4Config


class Linear(nn.Module):
    """Bias-free linear layer holding a dense weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with a float32 weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------------------------------------- state


@dataclass
class LayerState:
    """Per-layer cache of one block (see :func:`.functional.sparse_attention` / ``compressor_step``)."""

    window: torch.Tensor  # [B, n_win, D] raw kv ring, position p at slot p % n_win
    kv_state: torch.Tensor | None = None  # [B, coff*r, coff*D] float32 compressor state
    score_state: torch.Tensor | None = None  # [B, coff*r, coff*D] float32
    entries: torch.Tensor | None = None  # [B, max_seq_len // r, D] compressed kv, entry i at slot i
    idx_kv_state: torch.Tensor | None = None  # [B, 8, 2*cI] indexer compressor (ratio 4, overlap)
    idx_score_state: torch.Tensor | None = None
    idx_entries: torch.Tensor | None = None  # [B, max_seq_len // 4, cI]
    fp8: bool = False  # FP8 state: window / entries / index keys hold FP8-quantised values (functional.py)


@dataclass
class DeepseekV4State:
    """Decoding state of a batch: per-row next positions and one LayerState per main / MTP layer."""

    pos: torch.Tensor  # [B] int64, next position of each row (main model)
    max_seq_len: int
    layers: list[LayerState] = field(default_factory=list)
    mtp_pos: torch.Tensor | None = None  # [B] int64, next position of each row in the MTP block(s)
    mtp: list[LayerState] = field(default_factory=list)

    @staticmethod
    def concat(states: list["DeepseekV4State"]) -> "DeepseekV4State":
        """Stack the rows of several states (same model, same max_seq_len) into one batch."""

        def cat_layers(per_state):
            return [LayerState(*(ts[0] if not isinstance(ts[0], torch.Tensor) else torch.cat(ts) for ts in zip(
                *(dataclasses.astuple(ls) for ls in lss)))) for lss in zip(*per_state)]

        return DeepseekV4State(pos=torch.cat([s.pos for s in states]), max_seq_len=states[0].max_seq_len,
                               layers=cat_layers([s.layers for s in states]),
                               mtp_pos=torch.cat([s.mtp_pos for s in states]),
                               mtp=cat_layers([s.mtp for s in states]))


# ---------------------------------------------------------------------------------------------- attention


class Compressor(nn.Module):
    """Pools every ``ratio`` tokens' kv into one entry (overlapping windows when ratio == 4)."""

    def __init__(self, config: DeepseekV4Config, ratio: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.head_dim, self.eps = ratio, head_dim, config.rms_norm_eps
        self.coff = 2 if ratio == CSA_RATIO else 1
        width = self.coff * head_dim
        self.wkv = Linear(config.hidden_size, width, dtype)
        self.wgate = Linear(config.hidden_size, width, dtype)
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)

    def new_state(self, batch: int, max_seq_len: int, dtype: torch.dtype, device=None):
        shape = (batch, self.coff * self.ratio, self.coff * self.head_dim)
        return (torch.zeros(shape, device=device), torch.full(shape, float("-inf"), device=device),
                torch.zeros(batch, max_seq_len // self.ratio, self.head_dim, dtype=dtype, device=device))

    def forward(self, x, start_pos, inv_freq, kv_state, score_state, entries, fp8: str | None = None):
        # x: [B, S, d]; projections in float32; fp8: None or the FP8 entry layout ("attention" / "index")
        kv = Fn.linear(x.float(), self.wkv.weight)  # [B, S, coff*c]
        score = Fn.linear(x.float(), self.wgate.weight)
        return Fn.compressor_step(kv, score, self.ape, self.norm.weight, inv_freq, kv_state, score_state,
                                  entries, start_pos, rms_eps=self.eps, fp8=fp8)


class Indexer(nn.Module):
    """Lightning indexer of CSA layers: own compressor (ratio 4, width index_head_dim) + top-k scoring."""

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, dtype)
        self.compressor = Compressor(config, CSA_RATIO, self.head_dim, dtype)

    def forward(self, x, qr, start_pos, cos, sin, inv_freq, st: LayerState) -> torch.Tensor:
        st.idx_entries, st.idx_kv_state, st.idx_score_state = self.compressor(
            x, start_pos, inv_freq, st.idx_kv_state, st.idx_score_state, st.idx_entries,
            fp8="index" if st.fp8 else None)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [B, S, nI, cI]
        q = Fn.apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        w = self.weights_proj(x)  # [B, S, nI]
        return Fn.indexer_topk(q, w, st.idx_entries, start_pos, ratio=CSA_RATIO, index_topk=self.topk)


class Attention(nn.Module):
    """Shared-KV MQA with sliding window, optional compressed entries (CSA top-k / HCA all), sink,
    inverse RoPE on the output and grouped output projection."""

    def __init__(self, config: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.ratio, self.n_heads, self.head_dim = ratio, c.num_attention_heads, c.head_dim
        self.n_groups, self.eps, self.n_win = c.o_groups, c.rms_norm_eps, c.sliding_window
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, dtype)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, dtype)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, dtype)
        self.attn_sink = nn.Parameter(torch.empty(c.num_attention_heads, dtype=torch.float32))
        self.compressor = Compressor(c, ratio, c.head_dim, dtype) if ratio > 0 else None
        self.indexer = Indexer(c, dtype) if ratio == CSA_RATIO else None
        # plain theta for ratio-0 layers, compress_rope_theta + YaRN for compressed layers
        self.register_buffer("inv_freq", Fn.rope_freqs(c, compressed=ratio > 0), persistent=False)

    def new_state(self, batch: int, max_seq_len: int, dtype: torch.dtype, device=None) -> LayerState:
        st = LayerState(window=torch.zeros(batch, self.n_win, self.head_dim, dtype=dtype, device=device))
        if self.compressor is not None:
            st.kv_state, st.score_state, st.entries = self.compressor.new_state(batch, max_seq_len, dtype, device)
        if self.indexer is not None:
            st.idx_kv_state, st.idx_score_state, st.idx_entries = self.indexer.compressor.new_state(
                batch, max_seq_len, dtype, device)
        return st

    def forward(self, x: torch.Tensor, start_pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        # x: [B, S, d]; start_pos: [B]
        B, S, _ = x.shape
        pos = start_pos[:, None] + torch.arange(S, device=x.device)  # [B, S]
        cos, sin = Fn.rope_cos_sin(pos, self.inv_freq)  # [B, S, rd/2]
        qr = self.q_norm(self.wq_a(x))  # [B, S, d_c], shared with the indexer
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [B, S, H, D]
        q = Fn.q_norm_rope(q, cos, sin, rms_eps=self.eps)
        kv = Fn.kv_norm_rope(self.wkv(x), self.kv_norm.weight, cos, sin, rms_eps=self.eps)  # [B, S, D]
        indices = None
        if self.compressor is not None:
            st.entries, st.kv_state, st.score_state = self.compressor(
                x, start_pos, self.inv_freq, st.kv_state, st.score_state, st.entries,
                fp8="attention" if st.fp8 else None)
        if self.indexer is not None:
            indices = self.indexer(x, qr, start_pos, cos, sin, self.inv_freq, st)  # [B, S, index_topk]
        o, st.window = Fn.sparse_attention(q, kv, st.window, st.entries, indices, self.attn_sink, self.inv_freq,
                                           start_pos, ratio=self.ratio, fp8_window=st.fp8)  # [B, S, H, D]
        return Fn.grouped_out_proj(o, self.wo_a.weight, self.wo_b.weight, n_groups=self.n_groups)  # [B, S, d]


# ---------------------------------------------------------------------------------------------- MoE


class Expert(nn.Module):
    """SwiGLU expert with clamp: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, inter_dim: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype)
        self.w2 = Linear(inter_dim, dim, dtype)
        self.w3 = Linear(dim, inter_dim, dtype)


class Gate(nn.Module):
    """Router: learned logits; selection by a fixed token->experts table (hash layers) or by score + bias."""

    def __init__(self, config: DeepseekV4Config, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        c = config
        self.is_hash, self.top_k = is_hash, c.num_experts_per_tok
        self.kw = dict(scoring=c.scoring_func, norm_topk_prob=c.norm_topk_prob,
                       routed_scaling_factor=c.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, dtype=dtype))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, d]; input_ids: [T]
        logits = Fn.linear(x.float(), self.weight)  # [T, E] float32
        if self.is_hash:
            return Fn.route_hash(logits, input_ids, self.tid2eid, **self.kw)
        return Fn.route_topk(logits, self.bias, top_k=self.top_k, **self.kw)


class MoE(nn.Module):
    """Routed experts (top-k) plus one always-on shared expert."""

    def __init__(self, config: DeepseekV4Config, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        self.limit = config.swiglu_limit
        self.gate = Gate(config, is_hash, dtype)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size, dtype)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(config.hidden_size, config.moe_intermediate_size, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, d]
        weights, indices = self.gate(x, input_ids.reshape(-1))  # [T, k] each
        ws = [[getattr(e, n).weight for e in self.experts] for n in ("w1", "w2", "w3")]
        sh = self.shared_experts
        y = Fn.moe_ffn(x, weights, indices, *ws, swiglu_limit=self.limit,
                       shared=(sh.w1.weight, sh.w2.weight, sh.w3.weight))
        return y.view(shape)


# ---------------------------------------------------------------------------------------------- blocks


class Block(nn.Module):
    """Decoder block: mHC-pre -> RMSNorm -> attention -> mHC-post, then the same around the MoE."""

    def __init__(self, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.layer_id, self.ratio = layer_id, c.compress_ratios[layer_id]
        self.hc_kw = dict(rms_eps=c.rms_norm_eps, hc_eps=c.hc_eps, sinkhorn_iters=c.hc_sinkhorn_iters)
        self.attn = Attention(c, self.ratio, dtype)
        self.ffn = MoE(c, c.is_hash_layer(layer_id), dtype)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        for name in ("attn", "ffn"):
            setattr(self, f"hc_{name}_fn", nn.Parameter(torch.empty(mix, width, dtype=torch.float32)))
            setattr(self, f"hc_{name}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            setattr(self, f"hc_{name}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, start_pos: torch.Tensor,
                st: LayerState) -> torch.Tensor:
        # x: [B, S, hc, d]
        h, post, comb = Fn.hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, **self.hc_kw)
        x = Fn.hc_post(self.attn(self.attn_norm(h), start_pos, st), x, post, comb)
        h, post, comb = Fn.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, **self.hc_kw)
        return Fn.hc_post(self.ffn(self.ffn_norm(h), input_ids), x, post, comb)


class HCHead(nn.Module):
    """Mixin holding ``hc_head_fn / hc_head_base / hc_head_scale`` and the final norm."""

    def _init_head(self, config: DeepseekV4Config):
        c = config
        self.hc_eps, self.eps = c.hc_eps, c.rms_norm_eps
        self.hc_head_fn = nn.Parameter(torch.empty(c.hc_mult, c.hc_mult * c.hidden_size, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.empty(c.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def logits(self, x: torch.Tensor, head: Linear) -> torch.Tensor:
        # x: [B, S, hc, d] -> [B, S, V] float32
        y = Fn.hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, rms_eps=self.eps,
                       hc_eps=self.hc_eps)
        return Fn.linear(self.norm(y).float(), head.weight)


class MTPBlock(Block, HCHead):
    """Multi-token prediction block: combines the main model's streams at position t with the embedding
    of token t+1 and predicts token t+2. Shares ``embed`` and ``head`` with the main model."""

    def __init__(self, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype):
        super().__init__(config, layer_id, dtype)
        self.e_proj = Linear(config.hidden_size, config.hidden_size, dtype)
        self.h_proj = Linear(config.hidden_size, config.hidden_size, dtype)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._init_head(config)

    def forward(self, x, e, input_ids, start_pos, st):
        # x: [B, S, hc, d] main streams; e: [B, S, d] embeddings of the next tokens
        x = self.h_proj(self.hnorm(x)) + self.e_proj(self.enorm(e)).unsqueeze(2)  # [B, S, hc, d]
        return super().forward(x, input_ids, start_pos, st)


class DeepseekV4ForCausalLM(HCHead):
    """DeepSeek-V4 causal LM with its MTP block(s). ``state_dict()`` keys = released checkpoint names."""

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        c = self.config = config
        self.dtype = dtype
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(c, i, dtype) for i in range(c.num_hidden_layers))
        self.head = Linear(c.hidden_size, c.vocab_size, dtype)
        self._init_head(c)
        self.mtp = nn.ModuleList(MTPBlock(c, c.num_hidden_layers + k, dtype)
                                 for k in range(c.num_nextn_predict_layers))
        self.init_weights()

    # ------------------------------------------------------------------------------------------ state

    def new_state(self, batch_size: int, max_seq_len: int | None = None, *,
                  state: str = "default") -> DeepseekV4State:
        """Fresh state for ``batch_size`` rows at position 0 with room for ``max_seq_len`` positions.

        ``state="fp8"``: the window ring, compressed entries and indexer keys hold FP8-quantised values (the
        semantics of an export with ``state="fp8"``; see the FP8 state section of :mod:`.functional`).
        """
        if state not in ("default", "fp8"):
            raise ValueError(f"state must be 'default' or 'fp8', got {state!r}")
        n = max_seq_len or self.config.max_position_embeddings
        dev = self.embed.weight.device

        def make(blocks):
            out = [b.attn.new_state(batch_size, n, self.dtype, dev) for b in blocks]
            for st in out:
                st.fp8 = state == "fp8"
            return out

        zero = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        return DeepseekV4State(pos=zero, max_seq_len=n, layers=make(self.layers), mtp_pos=zero.clone(),
                               mtp=make(self.mtp))

    @staticmethod
    def _check(pos: torch.Tensor, S: int, state: DeepseekV4State):
        if Fn._eager() and int(pos.max()) + S > state.max_seq_len:
            raise ValueError(f"positions up to {int(pos.max()) + S - 1} exceed the state's max_seq_len "
                             f"{state.max_seq_len}")

    # ------------------------------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, state: DeepseekV4State | None = None, *,
                return_hidden: bool = False):
        """input_ids [B, S] -> logits [B, S, V] float32 (and the final streams [B, S, hc, d] if asked).

        With ``state`` the tokens of row b sit at positions state.pos[b] + 0..S-1 and the state advances;
        without, this is a full prefill from position 0.
        """
        B, S = input_ids.shape
        if state is None:
            state = self.new_state(B, S)
        start_pos = state.pos
        self._check(start_pos, S, state)
        h = self.embed(input_ids)  # [B, S, d]
        x = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()  # [B, S, hc, d]
        for layer, st in zip(self.layers, state.layers):
            x = layer(x, input_ids, start_pos, st)
        state.pos = start_pos + S
        logits = self.logits(x, self.head)
        return (logits, x) if return_hidden else logits

    def forward_mtp(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: DeepseekV4State | None = None,
                    *, depth: int = 0, return_hidden: bool = False):
        """MTP block ``depth``: hidden [B, S, hc, d] (streams of positions p, from ``forward(...,
        return_hidden=True)`` or the previous MTP depth) and next_ids [B, S] (tokens at p + 1 + depth)
        -> logits [B, S, V] predicting the tokens at p + 2 + depth.

        The MTP block keeps its own window cache in ``state.mtp[depth]`` and position ``state.mtp_pos``
        (advanced by the last depth).
        """
        B, S = next_ids.shape
        if state is None:
            state = self.new_state(B, S)
        start_pos = state.mtp_pos
        self._check(start_pos, S, state)
        blk = self.mtp[depth]
        x = blk(hidden, self.embed(next_ids), next_ids, start_pos, state.mtp[depth])
        if depth == len(self.mtp) - 1:
            state.mtp_pos = start_pos + S
        logits = blk.logits(x, self.head)
        return (logits, x) if return_hidden else logits

    # ------------------------------------------------------------------------------------------ init

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None):
        """Random weights for tests: N(0, initializer_range) matrices, unit norms, small random mHC /
        sink / ape / bias terms and a random token->experts table (distinct experts per token)."""
        if self.embed.weight.is_meta:
            return
        std, g = self.config.initializer_range, generator
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif leaf.endswith("_scale"):
                p.fill_(1.0)
            elif leaf == "ape":
                p.normal_(0.0, 0.5, generator=g)
            elif p.dim() == 2:
                p.normal_(0.0, std, generator=g)
            else:  # hc bases, attn_sink, ape, gate.bias
                p.normal_(0.0, 0.5, generator=g)
        E, K = self.config.n_routed_experts, self.config.num_experts_per_tok
        for name, b in self.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], E, generator=g).argsort(-1)[:, :K])


if __name__ == "__main__":  # smoke run: python -m dsv4_ort.models.model
    cfg = DeepseekV4Config.from_preset("tiny")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        full = model(ids)
        state = model.new_state(2, 40)
        steps = torch.cat([model(ids[:, i:i + 1], state=state) for i in range(40)], 1)
    print(f"logits {tuple(full.shape)}, prefill vs token-by-token max|diff| {(full - steps).abs().max().item():.2e}")
