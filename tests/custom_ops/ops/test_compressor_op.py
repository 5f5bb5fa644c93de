"""Compressor through onnxruntime vs models.functional.compressor_step, every ISA level: per-row positions, block
boundaries (CSA r=4 overlap, HCA r=128, non-overlapping r=16), one-shot == chunked == token-by-token through repeated
op calls, state updated in place through IOBinding, capacity errors."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, run_op, run_op_inplace, session_error

from testutil import tol
from dsv4_ort.models import functional as Fn

# name -> (ratio r, coff, entry width c, rope channels rd, capacity N)
CONFIGS = {
    "csa_r4_overlap": (4, 2, 16, 8, 12),
    "hca_r128": (128, 1, 8, 4, 3),
    "r16": (16, 1, 12, 4, 6),
}
# per config: tokens already processed by row 1 before the chunk, and the chunk length
CHUNKS = {"csa_r4_overlap": (6, 11), "hca_r128": (130, 140), "r16": (21, 27)}
EPS = 1e-6
ALIAS = {"present_entries": "past_entries", "present_kv_state": "past_kv_state",
         "present_score_state": "past_score_state"}


class Layer:
    def __init__(self, name, seed=0):
        self.r, self.coff, self.c, self.rd, self.N = CONFIGS[name]
        self.W = self.coff * self.c
        rng = np.random.default_rng(seed)
        self.ape = (rng.standard_normal((self.r, self.W)) * 0.5).astype(np.float32)
        self.norm_weight = rng.uniform(0.5, 1.5, self.c).astype(np.float32)
        self.inv_freq = (1.0 / 160000.0 ** (np.arange(0, self.rd, 2, dtype=np.float32) / self.rd)).astype(np.float32)
        self.rng = rng

    def tokens(self, B, S):
        kv = self.rng.standard_normal((B, S, self.W)).astype(np.float32)
        score = (self.rng.standard_normal((B, S, self.W)) * 2).astype(np.float32)
        return kv, score

    def fresh(self, B, entries_dtype="float32"):
        entries = np.zeros((B, self.N, self.c), np.float32)
        kv_state = np.zeros((B, self.coff * self.r, self.W), np.float32)
        score_state = np.full((B, self.coff * self.r, self.W), -np.inf, np.float32)
        return [bf16(entries) if entries_dtype == "bfloat16" else entries, kv_state, score_state]

    def junk(self, B, entries_dtype="float32"):
        """A state full of finite garbage: rows the compressor does not read or write must keep it."""
        entries = self.rng.standard_normal((B, self.N, self.c)).astype(np.float32)
        kv_state = self.rng.standard_normal((B, self.coff * self.r, self.W)).astype(np.float32)
        score_state = self.rng.standard_normal((B, self.coff * self.r, self.W)).astype(np.float32)
        return [bf16(entries) if entries_dtype == "bfloat16" else entries, kv_state, score_state]

    def feeds(self, kv, score, start_pos, state, weight_dtype="float32"):
        w = bf16(self.norm_weight) if weight_dtype == "bfloat16" else self.norm_weight
        return {"kv": kv, "score": score, "ape": self.ape, "norm_weight": w, "inv_freq": self.inv_freq,
                "start_pos": np.asarray(start_pos, np.int64), "past_entries": state[0], "past_kv_state": state[1],
                "past_score_state": state[2]}

    def op(self, kv, score, start_pos, state, isa, weight_dtype="float32"):
        return run_op("Compressor", self.feeds(kv, score, start_pos, state, weight_dtype), dict(rms_eps=EPS), isa)

    def op_inplace(self, kv, score, start_pos, state, isa):
        return run_op_inplace("Compressor", self.feeds(kv, score, start_pos, state), ALIAS, dict(rms_eps=EPS), isa)

    def spec(self, kv, score, start_pos, state, weight_dtype="float32"):
        """functional.compressor_step on float32 copies (bf16 entries widened exactly, rounded back by the caller)."""
        entries = f32(state[0])
        w = torch.from_numpy(self.norm_weight)
        if weight_dtype == "bfloat16":
            w = w.to(torch.bfloat16)
        out = Fn.compressor_step(torch.from_numpy(kv), torch.from_numpy(score), torch.from_numpy(self.ape), w,
                                torch.from_numpy(self.inv_freq), torch.from_numpy(state[1].copy()),
                                torch.from_numpy(state[2].copy()), torch.from_numpy(entries.copy()),
                                torch.as_tensor(np.asarray(start_pos, np.int64)), rms_eps=EPS)
        return [t.numpy() for t in out]

    def history(self, lengths, entries_dtype="float32"):
        """Per-row states after `lengths[b]` tokens from position 0 (spec, one row at a time): [entries, kv, score]."""
        rows = []
        for n in lengths:
            st = self.fresh(1)
            if n:
                kv, score = self.tokens(1, n)
                st = self.spec(kv, score, [0], st)
            rows.append(st)
        state = [np.concatenate([r[i] for r in rows]) for i in range(3)]
        if entries_dtype == "bfloat16":
            state[0] = bf16(state[0])
        return state

    def read_rows(self, P):
        """State rows the spec defines after processing up to next position P (others are never read)."""
        off = self.r if self.coff == 2 else 0
        rows = list(range(off, off + P % self.r))
        if self.coff == 2 and P // self.r >= 1:
            rows += list(range(self.r))
        return rows

    def written(self, start, S):
        """(state rows, entry slots) one call writes for a row starting at `start`."""
        off = self.r if self.coff == 2 else 0
        rows = {off + p % self.r for p in range(start, start + S)}
        slots = set(range(start // self.r, (start + S) // self.r))
        if slots and self.coff == 2:
            rows |= set(range(self.r))
        return rows, slots


def f32(a):
    return bf16_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, np.float32)


def assert_state_matches_spec(layer, got, ref, start_pos, S):
    for b, sp in enumerate(start_pos):
        rows = layer.read_rows(sp + S)
        np.testing.assert_array_equal(got[1][b, rows], ref[1][b, rows])
        np.testing.assert_array_equal(got[2][b, rows], ref[2][b, rows])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("entries_dtype,weight_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                        ("float32", "bfloat16")])
def test_compressor_matches_spec(isa, name, entries_dtype, weight_dtype):
    """Two rows at different positions (row 0 fresh, row 1 mid-block), a chunk crossing block boundaries."""
    layer = Layer(name)
    hist, S = CHUNKS[name]
    state = layer.history([0, hist], entries_dtype)
    kv, score = layer.tokens(2, S)
    start_pos = [0, hist]
    got = layer.op(kv, score, start_pos, state, isa, weight_dtype)
    ref = layer.spec(kv, score, start_pos, state, weight_dtype)
    kind = "bfloat16" if entries_dtype == "bfloat16" else "float32_reduction"
    np.testing.assert_allclose(got[0], ref[0], **tol(kind))
    assert_state_matches_spec(layer, got, ref, start_pos, S)
    # Entry slots not emitted by this call are the past ones.
    for b, sp in enumerate(start_pos):
        _, slots = layer.written(sp, S)
        keep = [i for i in range(layer.N) if i not in slots]
        np.testing.assert_array_equal(got[0][b, keep], f32(state[0])[b, keep])
    assert np.abs(got[0]).sum() > 0


@pytest.mark.parametrize("name", CONFIGS)
def test_compressor_boundaries(isa, name):
    """Calls starting and ending exactly on block boundaries, single tokens completing a block, and the last entry
    slot of the capacity; each step against the spec run on the same state."""
    layer = Layer(name, seed=1)
    r, N = layer.r, layer.N
    state = layer.fresh(2)
    pos = np.array([0, 0])
    # row positions after each step: block end, one token, complete the next block minus one, its last token, ...
    for S in [r, 1, r - 2, 1, (N - 2) * r]:
        kv, score = layer.tokens(2, S)
        got = layer.op(kv, score, pos, state, isa)
        ref = layer.spec(kv, score, pos, state)
        np.testing.assert_allclose(got[0], ref[0], **tol("float32_reduction"))
        assert_state_matches_spec(layer, got, ref, pos, S)
        state, pos = got, pos + S
    assert pos[0] == N * r  # the last slot was filled
    assert np.all(np.abs(state[0]).sum(-1) > 0)


@pytest.mark.parametrize("name", CONFIGS)
def test_compressor_chunking_is_invisible(isa, name):
    """One-shot == chunked == token-by-token (op calls feeding present_* back as past_*), bit for bit, for the
    entries and the whole state; the same through IOBinding with the state updated in place."""
    layer = Layer(name, seed=2)
    hist, S = CHUNKS[name]
    start = np.array([0, hist])
    base = layer.history([0, hist])
    kv, score = layer.tokens(2, S)
    one = layer.op(kv, score, start, base, isa)

    splits = {"chunked": [3, layer.r + 1, S - 4 - layer.r], "token": [1] * S}
    for mode, sizes in splits.items():
        assert sum(sizes) == S
        state, t = [a.copy() for a in base], 0
        for n in sizes:
            state = layer.op(kv[:, t:t + n], score[:, t:t + n], start + t, state, isa)
            t += n
        for a, b in zip(state, one):
            np.testing.assert_array_equal(a, b, err_msg=mode)

    state, t = [a.copy() for a in base], 0
    for n in [5, 2, S - 7]:
        layer.op_inplace(np.ascontiguousarray(kv[:, t:t + n]), np.ascontiguousarray(score[:, t:t + n]), start + t,
                         state, isa)
        t += n
    for a, b in zip(state, one):
        np.testing.assert_array_equal(a, b, err_msg="in place")


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("entries_dtype", ["float32", "bfloat16"])
def test_compressor_in_place(isa, name, entries_dtype):
    """The same OrtValue bound as past and present input/output: identical results to separate buffers, and every
    row and slot the call does not write keeps its previous bits."""
    layer = Layer(name, seed=3)
    hist, S = CHUNKS[name]
    start = [hist, 2 * layer.r + 1]
    # A consistent history in the rows the compressor reads, garbage everywhere else.
    state = layer.junk(2, entries_dtype)
    real = layer.history(start, entries_dtype)
    for b, sp in enumerate(start):
        rows = layer.read_rows(sp)
        state[1][b, rows], state[2][b, rows] = real[1][b, rows], real[2][b, rows]
    kv, score = layer.tokens(2, S)

    separate = layer.op(kv, score, start, state, isa)
    before = [a.copy() for a in state]
    aliased = [a.copy() for a in state]
    outs = layer.op_inplace(kv, score, start, aliased, isa)
    for a, b, c in zip(aliased, outs, separate):
        np.testing.assert_array_equal(f32(a), b)  # the bound buffers hold the outputs
        np.testing.assert_array_equal(b, c)
    for b, sp in enumerate(start):
        rows, slots = layer.written(sp, S)
        keep_rows = [i for i in range(layer.coff * layer.r) if i not in rows]
        keep_slots = [i for i in range(layer.N) if i not in slots]
        np.testing.assert_array_equal(aliased[0][b, keep_slots].view(np.uint8), before[0][b, keep_slots].view(np.uint8))
        for i in (1, 2):
            np.testing.assert_array_equal(aliased[i][b, keep_rows].view(np.uint8),
                                          before[i][b, keep_rows].view(np.uint8))
    ref = layer.spec(kv, score, start, before)
    kind = "bfloat16" if entries_dtype == "bfloat16" else "float32_reduction"
    np.testing.assert_allclose(outs[0], ref[0], **tol(kind))
    assert_state_matches_spec(layer, outs, ref, start, S)


@pytest.mark.parametrize("c,rd,ratio,coff", [(512, 64, 4, 2), (128, 64, 4, 2), (512, 64, 128, 1)])
@pytest.mark.parametrize("S", [1, 17])
def test_compressor_model_sizes(isa, c, rd, ratio, coff, S):
    """DeepSeek-V4 widths: CSA main (c 512, overlap), the indexer's compressor (c 128, overlap), HCA (r 128)."""
    rng = np.random.default_rng(c + ratio + S)
    W, N = coff * c, 8
    ape = (rng.standard_normal((ratio, W)) * 0.5).astype(np.float32)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    freqs = (1.0 / 160000.0 ** (np.arange(0, rd, 2, dtype=np.float32) / rd)).astype(np.float32)
    # both rows complete a block in this call, at different offsets; histories from the spec
    start = [ratio - 1, 2 * ratio - 1] if S == 1 else [max(ratio - 5, 0), 2 * ratio - 3]
    state = []
    for b, sp in enumerate(start):
        kvh = rng.standard_normal((1, sp, W)).astype(np.float32)
        sch = rng.standard_normal((1, sp, W)).astype(np.float32)
        fresh = [torch.zeros(1, N, c), torch.zeros(1, coff * ratio, W), torch.full((1, coff * ratio, W), -np.inf)]
        e, k, z = Fn.compressor_step(torch.from_numpy(kvh), torch.from_numpy(sch), torch.from_numpy(ape),
                                    torch.from_numpy(w), torch.from_numpy(freqs), fresh[1], fresh[2], fresh[0],
                                    torch.tensor([0]), rms_eps=EPS)
        state.append((e.numpy(), k.numpy(), z.numpy()))
    entries, kv_state, score_state = (np.concatenate([s[i] for s in state]) for i in range(3))
    kv = rng.standard_normal((2, S, W)).astype(np.float32)
    score = rng.standard_normal((2, S, W)).astype(np.float32)
    feeds = {"kv": kv, "score": score, "ape": ape, "norm_weight": w, "inv_freq": freqs,
             "start_pos": np.array(start, np.int64), "past_entries": entries, "past_kv_state": kv_state,
             "past_score_state": score_state}
    got = run_op("Compressor", feeds, dict(rms_eps=EPS), isa)
    ref = Fn.compressor_step(*(torch.from_numpy(a) for a in (kv, score, ape, w, freqs, kv_state, score_state, entries)),
                            torch.tensor(start), rms_eps=EPS)
    np.testing.assert_allclose(got[0], ref[0].numpy(), **tol("float32_reduction"))
    emitted = [(sp + S) // ratio > sp // ratio for sp in start]
    assert all(emitted)  # every row completes a block in this call


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_compressor_capacity_error_writes_nothing():
    layer = Layer("csa_r4_overlap", seed=4)
    state = layer.fresh(2)
    kv, score = layer.tokens(2, layer.r + 1)
    start = [layer.N * layer.r - 1, 5]  # row 0 completes entry N - 1 (the last slot), then entry N
    msg = session_error("Compressor", layer.feeds(kv, score, start, state))
    assert "Compressor" in msg and "past_entries" in msg and f"only {layer.N} entries" in msg and "row 0" in msg
    before = [a.copy() for a in state]
    with pytest.raises(Exception, match="capacity"):
        layer.op_inplace(kv, score, start, state, None)
    for a, b in zip(state, before):
        np.testing.assert_array_equal(a, b)
    # One token less stays within capacity (the spec agrees).
    S = layer.r
    ok = layer.op(kv[:, :S], score[:, :S], start, state, None)
    ref = layer.spec(kv[:, :S], score[:, :S], start, state)
    np.testing.assert_allclose(ok[0], ref[0], **tol("float32_reduction"))
    with pytest.raises(ValueError, match="capacity"):
        layer.spec(kv, score, start, state)


def test_compressor_bad_shapes():
    layer = Layer("csa_r4_overlap")
    state = layer.fresh(2)
    kv, score = layer.tokens(2, 3)
    ok = layer.feeds(kv, score, [0, 0], state)
    cases = [
        (dict(score=score[:, :2].copy()), "score"),
        (dict(ape=layer.ape[:, :-1].copy()), "ape"),
        (dict(norm_weight=np.ones(layer.c + 1, np.float32)), "norm_weight"),
        (dict(kv=np.zeros((2, 3, 3 * layer.c), np.float32), score=np.zeros((2, 3, 3 * layer.c), np.float32)), "kv"),
        (dict(inv_freq=np.ones(layer.c, np.float32)), "inv_freq"),
        (dict(start_pos=np.array([0, -4], np.int64)), "start_pos"),
        (dict(past_entries=np.zeros((2, 5, layer.c + 1), np.float32)), "past_entries"),
        (dict(past_kv_state=np.zeros((2, layer.r, layer.W), np.float32)), "past_kv_state"),
        (dict(past_score_state=np.zeros((1, 2 * layer.r, layer.W), np.float32)), "past_score_state"),
    ]
    for change, name in cases:
        msg = session_error("Compressor", {**ok, **change})
        assert "Compressor" in msg and name in msg, (name, msg)
