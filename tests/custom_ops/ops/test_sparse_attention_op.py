"""SparseAttention through onnxruntime vs models.functional.sparse_attention, every ISA level: window only (ratio 0),
all visible entries (HCA), selected entries with -1 / duplicate / not-yet-visible indices (CSA), empty, partial and
wrapped windows, rows at different positions, the ring updated in place through IOBinding, chunked == one-shot."""

import numpy as np
import pytest
import torch
from onnx_helpers import bf16, bf16_to_f32, run_op, run_op_inplace, session_error

from testutil import tol
from dsv4_ort.models import functional as Fn

H, D, RD, N_WIN = 3, 24, 8, 8
INV_FREQ = (1.0 / 160000.0 ** (np.arange(0, RD, 2, dtype=np.float32) / RD)).astype(np.float32)
ALIAS = {"present_window": "past_window"}


def to_torch(a):
    if a is None:
        return None
    return torch.from_numpy(bf16_to_f32(a)).to(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)


def feeds(q, kv, window, entries, indices, sink, start_pos, inv_freq=INV_FREQ):
    return {"q": q, "kv": kv, "past_window": window, "entries": entries, "indices": indices, "sink": sink,
            "inv_freq": inv_freq, "start_pos": np.asarray(start_pos, np.int64)}


def spec(f, ratio, softmax_scale=None):
    o, win = Fn.sparse_attention(to_torch(f["q"]), to_torch(f["kv"]), to_torch(f["past_window"]),
                                to_torch(f["entries"]), to_torch(f["indices"]), torch.from_numpy(f["sink"]),
                                torch.from_numpy(f["inv_freq"]), torch.from_numpy(f["start_pos"]), ratio=ratio,
                                softmax_scale=softmax_scale)
    return o.float().numpy(), win.float().numpy()


class Case:
    def __init__(self, B, S, N=0, seed=0, dtype="float32", k=0):
        rng = np.random.default_rng(seed)
        cast = bf16 if dtype == "bfloat16" else (lambda a: np.ascontiguousarray(a, np.float32))
        self.q = cast(rng.standard_normal((B, S, H, D)) * 1.5)
        self.kv = cast(rng.standard_normal((B, S, D)))
        self.window = cast(rng.standard_normal((B, N_WIN, D)))
        self.entries = cast(rng.standard_normal((B, N, D))) if N else None
        self.sink = (rng.standard_normal(H) * 0.5).astype(np.float32)
        self.rng = rng
        self.dtype = dtype

    def feeds(self, start_pos, indices=None, entries="default"):
        return feeds(self.q, self.kv, self.window, self.entries if entries == "default" else entries, indices,
                     self.sink, start_pos)


def check(got, ref, dtype):
    np.testing.assert_allclose(got[0], ref[0], **tol("bfloat16" if dtype == "bfloat16" else "float32_reduction"))
    np.testing.assert_array_equal(got[1], ref[1])  # the ring is a copy


@pytest.mark.parametrize("S", [1, 5, 11])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_only(isa, S, dtype):
    """ratio 0: row 0 starts a sequence (nothing valid in the ring), row 1 has a wrapped ring; S = 11 > n_win."""
    c = Case(2, S, seed=S, dtype=dtype)
    f = c.feeds([0, 13])
    got = run_op("SparseAttention", f, dict(ratio=0), isa)
    check(got, spec(f, 0), dtype)


@pytest.mark.parametrize("S,start", [(1, [2, 29]), (6, [0, 17]), (11, [3, 30])])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_visible_entries(isa, S, start, dtype):
    """HCA-style (no indices): every entry i < (p + 1) // ratio, ratio 4 and 16."""
    N = 12
    c = Case(2, S, N=N, seed=S + 1, dtype=dtype)
    for ratio in (4, 16):
        f = c.feeds(start)
        got = run_op("SparseAttention", f, dict(ratio=ratio), isa)
        check(got, spec(f, ratio), dtype)


@pytest.mark.parametrize("S", [1, 7])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_selected_entries(isa, S, dtype):
    """CSA-style indices: -1 slots, duplicates, entries not visible yet at the query's position, all-(-1) rows."""
    N, k = 10, 6
    c = Case(2, S, N=N, seed=S + 2, dtype=dtype)
    start = [1, 33]
    idx = c.rng.integers(-1, N, (2, S, k)).astype(np.int64)
    idx[0, 0] = -1  # a query with only its window
    idx[1, -1, :3] = idx[1, -1, 3]  # duplicates count once
    f = c.feeds(start, indices=idx)
    got = run_op("SparseAttention", f, dict(ratio=4), isa)
    check(got, spec(f, 4), dtype)


def test_empty_selection(isa):
    """indices of width 0 select nothing: window only, as the spec."""
    c = Case(2, 3, N=6, seed=10)
    f = c.feeds([5, 20], indices=np.zeros((2, 3, 0), np.int64))
    check(run_op("SparseAttention", f, dict(ratio=4), isa), spec(f, 4), "float32")


def test_entries_ignored_without_ratio(isa):
    c = Case(2, 4, N=6, seed=3)
    idx = np.zeros((2, 4, 2), np.int64)
    base = run_op("SparseAttention", c.feeds([5, 40], entries=None), dict(ratio=0), isa)
    for extra in (dict(), dict(indices=idx)):
        got = run_op("SparseAttention", c.feeds([5, 40], **extra), dict(ratio=0), isa)
        for a, b in zip(got, base):
            np.testing.assert_array_equal(a, b)


def test_softmax_scale_and_dominant_sink(isa):
    c = Case(2, 3, N=4, seed=4)
    f = c.feeds([4, 9])
    got = run_op("SparseAttention", f, dict(ratio=4, softmax_scale=0.3), isa)
    check(got, spec(f, 4, softmax_scale=0.3), "float32")
    f["sink"] = np.full(H, 1e4, np.float32)  # the sink takes all the mass: exactly zero output, as the spec
    got = run_op("SparseAttention", f, dict(ratio=4), isa)
    np.testing.assert_array_equal(got[0], np.zeros_like(got[0]))
    np.testing.assert_array_equal(spec(f, 4)[0], got[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("S", [3, 11])
def test_window_in_place(isa, dtype, S):
    """past_window and present_window bound to one OrtValue: the same o and ring as with separate buffers, the
    attention reads the ring before it is overwritten, and the slots the chunk does not write keep their bits."""
    c = Case(2, S, N=8, seed=5, dtype=dtype)
    start = [6, 21]
    f = c.feeds(start)
    separate = run_op("SparseAttention", f, dict(ratio=4), isa)
    before = c.window.copy()
    ring = c.window.copy()
    got = run_op_inplace("SparseAttention", {**f, "past_window": ring}, ALIAS, dict(ratio=4), isa)
    for a, b in zip(got, separate):
        np.testing.assert_array_equal(a, b)
    for b, sp in enumerate(start):
        written = {(sp + t) % N_WIN for t in range(max(0, S - N_WIN), S)}
        keep = [j for j in range(N_WIN) if j not in written]
        np.testing.assert_array_equal(ring[b, keep].view(np.uint8), before[b, keep].view(np.uint8))
    check(got, spec(f, 4), dtype)


def test_chunked_decode_matches_one_shot(isa):
    """A sequence fed as one chunk, as chunks and token by token through the in-place ring gives the same o."""
    T, ratio, N = 21, 4, 6
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((1, T, D)).astype(np.float32)
    entries = rng.standard_normal((1, N, D)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32)
    ring0 = rng.standard_normal((1, N_WIN, D)).astype(np.float32)  # stale garbage: never visible from position 0
    one = run_op("SparseAttention", feeds(q, kv, ring0, entries, None, sink, [0]), dict(ratio=ratio), isa)
    for sizes in ([5, 9, 7], [1] * T):
        ring, t, outs = ring0.copy(), 0, []
        for n in sizes:
            f = feeds(np.ascontiguousarray(q[:, t:t + n]), np.ascontiguousarray(kv[:, t:t + n]), ring, entries, None,
                      sink, [t])
            outs.append(run_op_inplace("SparseAttention", f, ALIAS, dict(ratio=ratio), isa)[0])
            t += n
        np.testing.assert_allclose(np.concatenate(outs, axis=1), one[0], **tol("float32_reduction"))
        np.testing.assert_array_equal(ring, one[1])


@pytest.mark.parametrize("heads", [1, 64])
@pytest.mark.parametrize("S", [1, 17])
@pytest.mark.parametrize("swa_only", [True, False])
def test_model_sizes(isa, heads, S, swa_only):
    """DeepSeek-V4 shapes: D 512, rope 64, n_win 128; window only or CSA-style top-k 16 over 80 entries."""
    Dm, rdm, n_win, N, k = 512, 64, 128, 80, 16
    rng = np.random.default_rng(heads + S)
    freqs = (1.0 / 160000.0 ** (np.arange(0, rdm, 2, dtype=np.float32) / rdm)).astype(np.float32)
    q = rng.standard_normal((1, S, heads, Dm)).astype(np.float32)
    kv = (rng.standard_normal((1, S, Dm)) * 0.1).astype(np.float32)
    window = (rng.standard_normal((1, n_win, Dm)) * 0.1).astype(np.float32)
    entries = None if swa_only else (rng.standard_normal((1, N, Dm)) * 0.1).astype(np.float32)
    start = [300]
    idx = None if swa_only else rng.integers(-1, (start[0] + 1) // 4, (1, S, k)).astype(np.int64)
    f = feeds(q, kv, window, entries, idx, (rng.standard_normal(heads)).astype(np.float32), start, freqs)
    ratio = 0 if swa_only else 4
    check(run_op("SparseAttention", f, dict(ratio=ratio), isa), spec(f, ratio), "float32")


# ---- compute="bf16": float inputs multiplied as bf16 ---------------------------------------------------------------

def _rounded(f):
    """The feeds with every float tensor except sink / inv_freq rounded to bf16 (fed as bfloat16)."""
    return {k: bf16(v) if v is not None and v.dtype == np.float32 and k not in ("sink", "inv_freq") else v
            for k, v in f.items()}


@pytest.mark.parametrize("shape", ["small", "model"])
@pytest.mark.parametrize("kind", ["window", "hca", "csa"])
def test_compute_bf16_is_the_bf16_op_on_rounded_inputs(isa, shape, kind):
    """compute="bf16" on float inputs: o equals, bit for bit, the bfloat16 op's output on q, kv, the window and the
    entries rounded to bf16 (widened back), and is within bf16 error of the spec run in bfloat16; the float ring is
    written exactly as with compute="fp32". D = 512 with 64 heads also takes the VDPBF16PS products where the CPU
    picks them (bf16_dot)."""
    rng = np.random.default_rng(10 * ["small", "model"].index(shape) + ["window", "hca", "csa"].index(kind))
    heads, Dm, rdm, n_win, N, S = (3, D, RD, N_WIN, 12, 5) if shape == "small" else (64, 512, 64, 128, 80, 3)
    freqs = (1.0 / 160000.0 ** (np.arange(0, rdm, 2, dtype=np.float32) / rdm)).astype(np.float32)
    q = rng.standard_normal((2, S, heads, Dm)).astype(np.float32)
    kv = (rng.standard_normal((2, S, Dm)) * 0.5).astype(np.float32)
    window = (rng.standard_normal((2, n_win, Dm)) * 0.5).astype(np.float32)
    entries = None if kind == "window" else (rng.standard_normal((2, N, Dm)) * 0.5).astype(np.float32)
    start = [7, 300] if shape == "model" else [2, 29]
    ratio = 0 if kind == "window" else (16 if shape == "model" and kind == "hca" else 4)
    idx = rng.integers(-1, N, (2, S, 6)).astype(np.int64) if kind == "csa" else None
    f = feeds(q, kv, window, entries, idx, rng.standard_normal(heads).astype(np.float32), start, freqs)
    got = run_op("SparseAttention", f, dict(ratio=ratio, compute="bf16"), isa)
    typed = run_op("SparseAttention", _rounded(f), dict(ratio=ratio), isa)
    np.testing.assert_array_equal(got[0], typed[0])
    assert got[0].dtype == np.float32
    np.testing.assert_array_equal(got[1], run_op("SparseAttention", f, dict(ratio=ratio), isa)[1])
    check([got[0], got[1]], [spec(_rounded(f), ratio)[0], got[1]], "bfloat16")
    # and it is not the fp32 result
    assert not np.array_equal(got[0], run_op("SparseAttention", f, dict(ratio=ratio), isa)[0])


def test_compute_bf16_on_bf16_inputs_changes_nothing():
    c = Case(2, 3, N=6, seed=21, dtype="bfloat16")
    f = c.feeds([4, 17])
    a, b = run_op("SparseAttention", f, dict(ratio=4, compute="bf16")), run_op("SparseAttention", f, dict(ratio=4))
    np.testing.assert_array_equal(a[0], b[0])


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_sparse_attention_bad_indices_write_nothing():
    c = Case(2, 2, N=5, seed=7)
    idx = np.zeros((2, 2, 3), np.int64)
    for bad in (5, -2):
        idx[1, 1, 2] = bad
        msg = session_error("SparseAttention", c.feeds([3, 9], indices=idx), dict(ratio=4))
        assert "SparseAttention" in msg and "indices" in msg and str(bad) in msg and "[0, 5)" in msg
        ring = c.window.copy()
        with pytest.raises(Exception, match="indices"):
            run_op_inplace("SparseAttention", {**c.feeds([3, 9], indices=idx), "past_window": ring}, ALIAS,
                           dict(ratio=4), None)
        np.testing.assert_array_equal(ring, c.window)


def test_sparse_attention_capacity_error():
    """Without indices every visible entry must exist: the query at position 15 sees 4 entries, N = 3."""
    c = Case(2, 2, N=3, seed=8)
    run_op("SparseAttention", c.feeds([0, 11]), dict(ratio=4))  # position 12 sees 3 entries: fine
    msg = session_error("SparseAttention", c.feeds([0, 14]), dict(ratio=4))
    assert "SparseAttention" in msg and "entries" in msg and "holds only 3" in msg and "row 1" in msg
    # With indices only the listed entries are read, so the same positions are fine.
    f = c.feeds([0, 14], indices=np.full((2, 2, 2), 2, np.int64))
    check(run_op("SparseAttention", f, dict(ratio=4)), spec(f, 4), "float32")


def test_sparse_attention_bad_shapes():
    c = Case(2, 2, N=3, seed=9)
    ok = c.feeds([0, 0])
    cases = [
        (dict(kv=np.zeros((2, 2, D + 1), np.float32)), "kv"),
        (dict(past_window=np.zeros((2, 0, D), np.float32)), "past_window"),
        (dict(past_window=np.zeros((1, N_WIN, D), np.float32)), "past_window"),
        (dict(entries=np.zeros((2, 3, D - 1), np.float32)), "entries"),
        (dict(indices=np.zeros((2, 3, 4), np.int64)), "indices"),
        (dict(sink=np.zeros(H + 1, np.float32)), "sink"),
        (dict(inv_freq=np.ones(D, np.float32)), "inv_freq"),
        (dict(start_pos=np.array([0, -1], np.int64)), "start_pos"),
    ]
    for change, name in cases:
        msg = session_error("SparseAttention", {**ok, **change}, dict(ratio=4))
        assert "SparseAttention" in msg and name in msg, (name, msg)
    msg = session_error("SparseAttention", ok, dict(ratio=-1))
    assert "ratio" in msg
    msg = session_error("SparseAttention", ok, dict(ratio=4, compute="fp16"))
    assert "compute" in msg and "fp16" in msg, msg
