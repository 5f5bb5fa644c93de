"""Reference model: checkpoint naming, and equivalence of prefill / token-by-token / chunked / batched runs."""

import dataclasses

import pytest
import torch
from reference_helpers import make_model, selection_margin

from dsv4_ort.models import DeepseekV4ForCausalLM, DeepseekV4State, LayerState

TOL = dict(rtol=1e-5, atol=1e-5)
MARGIN = 1e-5  # top-k choices of the test inputs must be this far from a tie (relative), see selection_margin


def check_margin(model, ids):
    m = selection_margin(model, ids)
    assert m > MARGIN, f"test inputs within {m:.1e} of a top-k tie: choose another seed"


def ids_for(config, B, T, seed=0):
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def run_chunks(model, ids, chunks, max_seq_len=None):
    state = model.new_state(ids.shape[0], max_seq_len or ids.shape[1])
    out, i = [], 0
    for n in chunks:
        out.append(model(ids[:, i:i + n], state=state))
        i += n
    assert i == ids.shape[1] and state.pos.tolist() == [i] * ids.shape[0]
    return torch.cat(out, 1)


def test_state_dict_uses_checkpoint_names(tiny_config):
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(tiny_config)
    sd = model.state_dict()
    c = tiny_config
    d, D, H, G = c.hidden_size, c.head_dim, c.num_attention_heads, c.o_groups
    expect = {
        "embed.weight": (c.vocab_size, d), "head.weight": (c.vocab_size, d), "norm.weight": (d,),
        "hc_head_fn": (c.hc_mult, c.hc_mult * d), "hc_head_base": (c.hc_mult,), "hc_head_scale": (1,),
        "layers.0.hc_attn_fn": ((2 + c.hc_mult) * c.hc_mult, c.hc_mult * d), "layers.0.hc_ffn_scale": (3,),
        "layers.0.attn_norm.weight": (d,), "layers.0.ffn_norm.weight": (d,),
        "layers.0.attn.wq_a.weight": (c.q_lora_rank, d), "layers.0.attn.q_norm.weight": (c.q_lora_rank,),
        "layers.0.attn.wq_b.weight": (H * D, c.q_lora_rank), "layers.0.attn.wkv.weight": (D, d),
        "layers.0.attn.kv_norm.weight": (D,), "layers.0.attn.attn_sink": (H,),
        "layers.0.attn.wo_a.weight": (G * c.o_lora_rank, H * D // G),
        "layers.0.attn.wo_b.weight": (d, G * c.o_lora_rank),
        "layers.1.attn.compressor.ape": (4, 2 * D), "layers.1.attn.compressor.wkv.weight": (2 * D, d),
        "layers.1.attn.compressor.wgate.weight": (2 * D, d), "layers.1.attn.compressor.norm.weight": (D,),
        "layers.1.attn.indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        "layers.1.attn.indexer.weights_proj.weight": (c.index_n_heads, d),
        "layers.1.attn.indexer.compressor.ape": (4, 2 * c.index_head_dim),
        "layers.1.attn.indexer.compressor.norm.weight": (c.index_head_dim,),
        "layers.2.attn.compressor.ape": (128, D), "layers.2.attn.compressor.wkv.weight": (D, d),
        "layers.0.ffn.gate.weight": (c.n_routed_experts, d), "layers.0.ffn.gate.tid2eid": (c.vocab_size, 2),
        "layers.2.ffn.gate.bias": (c.n_routed_experts,),
        "layers.0.ffn.experts.7.w1.weight": (c.moe_intermediate_size, d),
        "layers.0.ffn.experts.7.w2.weight": (d, c.moe_intermediate_size),
        "layers.3.ffn.shared_experts.w3.weight": (c.moe_intermediate_size, d),
        "mtp.0.e_proj.weight": (d, d), "mtp.0.h_proj.weight": (d, d), "mtp.0.enorm.weight": (d,),
        "mtp.0.hnorm.weight": (d,), "mtp.0.norm.weight": (d,), "mtp.0.hc_head_fn": (c.hc_mult, c.hc_mult * d),
        "mtp.0.attn.wq_a.weight": (c.q_lora_rank, d), "mtp.0.ffn.gate.bias": (c.n_routed_experts,),
    }
    for k, shape in expect.items():
        assert tuple(sd[k].shape) == shape, k
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    for k in ("hc_head_fn", "layers.0.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.2.ffn.gate.bias"):
        assert sd[k].dtype == torch.float32
    # no compressor in SWA layers / MTP, no indexer in HCA layers, no bias in hash layers, no tid2eid elsewhere
    for k in sd:
        assert not k.endswith((".scale", "inv_freq")), k
        assert not k.startswith(("layers.0.attn.compressor", "layers.0.attn.indexer", "mtp.0.attn.compressor",
                                 "layers.2.attn.indexer", "layers.1.ffn.gate.bias", "layers.2.ffn.gate.tid2eid"))
    n_experts = sum(k.endswith("w1.weight") and ".experts." in k for k in sd)
    assert n_experts == (c.num_hidden_layers + 1) * c.n_routed_experts
    assert sd.keys() >= expect.keys()


@torch.no_grad()
def test_prefill_decode_chunked_real_ratio_128(tiny_model, tiny_config):
    T = 270  # 2 HCA entries (boundary 256), 67 CSA entries >> top-k 8, window 16 full
    ids = ids_for(tiny_config, 2, T, seed=2)
    check_margin(tiny_model, ids)
    full = tiny_model(ids)
    assert full.shape == (2, T, tiny_config.vocab_size) and full.dtype == torch.float32
    torch.testing.assert_close(run_chunks(tiny_model, ids, [1] * T), full, **TOL)
    # chunks straddling 4-, 16- (window) and 128-boundaries, longer than the window, and single tokens
    torch.testing.assert_close(run_chunks(tiny_model, ids, [3, 2, 130, 1, 17, 117]), full, **TOL)
    # a larger state capacity changes nothing
    torch.testing.assert_close(run_chunks(tiny_model, ids, [T], max_seq_len=512), full, **TOL)


@torch.no_grad()
def test_prefill_decode_chunked_generic_ratio(fast_model, fast_config):
    T = 75
    ids = ids_for(fast_config, 2, T, seed=1)
    check_margin(fast_model, ids)
    full = fast_model(ids)
    torch.testing.assert_close(run_chunks(fast_model, ids, [1] * T), full, **TOL)
    for chunks in ([7, 9, 31, 1, 27], [16, 16, 17, 26], [40, 35]):
        torch.testing.assert_close(run_chunks(fast_model, ids, chunks), full, **TOL)


@torch.no_grad()
def test_rows_at_different_positions(fast_model, fast_config):
    T = 70
    ids = ids_for(fast_config, 2, T, seed=2)
    check_margin(fast_model, ids)
    alone = [fast_model(ids[b:b + 1]) for b in range(2)]
    states = []
    for b, n in ((0, 13), (1, 34)):  # row 0 has consumed 13 tokens, row 1 34
        st = fast_model.new_state(1, T)
        fast_model(ids[b:b + 1, :n], state=st)
        states.append(st)
    state = DeepseekV4State.concat(states)
    got = [[], []]
    for n in (1, 6, 17):
        pos = state.pos.tolist()
        chunk = torch.stack([ids[b, pos[b]:pos[b] + n] for b in range(2)])
        out = fast_model(chunk, state=state)
        for b in range(2):
            got[b].append(out[b])
    assert state.pos.tolist() == [13 + 24, 34 + 24]
    for b, n in ((0, 13), (1, 34)):
        torch.testing.assert_close(torch.cat(got[b]), alone[b][0, n:n + 24], **TOL)


@torch.no_grad()
def test_mtp_consistency(fast_model, fast_config):
    T = 40
    ids = ids_for(fast_config, 2, T + 1, seed=3)
    logits, hidden = fast_model(ids[:, :T], return_hidden=True)
    assert hidden.shape == (2, T, fast_config.hc_mult, fast_config.hidden_size)
    mtp = fast_model.forward_mtp(hidden, ids[:, 1:T + 1])
    assert mtp.shape == (2, T, fast_config.vocab_size) and torch.isfinite(mtp).all()
    assert not torch.allclose(mtp, logits)
    # incremental: main model and MTP block advance together, one token or a chunk at a time
    state = fast_model.new_state(2, T)
    outs, i = [], 0
    for n in (1, 1, 9, 20, 9):
        _, h = fast_model(ids[:, i:i + n], state=state, return_hidden=True)
        outs.append(fast_model.forward_mtp(h, ids[:, i + 1:i + n + 1], state=state))
        i += n
    torch.testing.assert_close(torch.cat(outs, 1), mtp, **TOL)
    assert state.mtp_pos.tolist() == [T, T]


def test_capacity_and_determinism(fast_config, fast_model):
    ids = ids_for(fast_config, 1, 10)
    state = fast_model.new_state(1, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        fast_model(ids, state=state)
    a, b = make_model(fast_config, seed=5), make_model(fast_config, seed=5)
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(v, w), k


@torch.no_grad()
def test_bfloat16_close_to_float32(fast_config, fast_model):
    ids = ids_for(fast_config, 1, 40, seed=4)
    ref = fast_model(ids)
    m16 = DeepseekV4ForCausalLM(fast_config, dtype=torch.bfloat16)
    m16.load_state_dict(fast_model.state_dict())
    got = m16.eval()(ids)
    assert got.dtype == torch.float32
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.1
    torch.testing.assert_close(run_chunks(m16, ids, [1] * 40), got, rtol=0.05, atol=0.05)


class _Step(torch.nn.Module):
    """One call of the model on explicit, flat state tensors (how an exporter sees it)."""

    def __init__(self, model, layout, max_seq_len):
        super().__init__()
        self.model, self.layout, self.max_seq_len = model, layout, max_seq_len

    def forward(self, ids, pos, *flat):
        it = iter(flat)
        layers = [LayerState(**{n: next(it) for n in names}) for names in self.layout]
        st = DeepseekV4State(pos=pos, max_seq_len=self.max_seq_len, layers=layers, mtp_pos=pos, mtp=[])
        logits = self.model(ids, state=st)
        return (logits, st.pos) + tuple(getattr(ls, n) for ls, names in zip(st.layers, self.layout) for n in names)


@torch.no_grad()
def test_decode_step_exports(fast_model, fast_config):
    state = fast_model.new_state(2, 64)
    fast_model(ids_for(fast_config, 2, 21), state=state)  # realistic state contents, then rows at 21 and 30
    layout = [[f.name for f in dataclasses.fields(LayerState) if getattr(ls, f.name) is not None]
              for ls in state.layers]
    flat = [getattr(ls, n) for ls, names in zip(state.layers, layout) for n in names]
    pos = torch.tensor([21, 30])
    step = _Step(fast_model, layout, 64)
    ids = ids_for(fast_config, 2, 1, seed=9)
    exported = torch.export.export(step, (ids, pos, *flat), strict=False).module()
    for got, want in zip(exported(ids, pos, *flat), step(ids, pos, *flat)):
        torch.testing.assert_close(got, want, **TOL)
