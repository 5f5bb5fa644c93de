"""dsv4_ort.runtime.Session against the PyTorch reference: logits, greedy generation, batches at different
positions, chunked prefill, in-place state, sampling, errors."""

import numpy as np
import pytest
from model_fixtures import REL_TOL, random_ids, reference_logits, rel_err, require_library

from dsv4_ort.runtime import ModelError, Session, sample


@pytest.fixture(scope="module")
def tiny(cache):
    require_library()
    return cache.export(("tiny",), logits="all", max_seq_len=256)


@pytest.fixture(scope="module")
def tiny_last(cache):
    return cache.export(("tiny",), logits="last", max_seq_len=256)


@pytest.fixture(scope="module")
def session(tiny):
    return Session(tiny.parent, intra_op_threads=1)


def test_prefill_matches_reference(session, cache):
    ids = random_ids(session.vocab_size, (1, 140), seed=1)
    ref = reference_logits(cache.reference(("tiny",)), ids)
    out = session.forward(ids, session.new_state(1))
    assert out.shape == ref.shape
    assert rel_err(out, ref) < REL_TOL


def test_decode_and_chunked_prefill_match_one_shot(session, cache):
    ids = random_ids(session.vocab_size, (1, 70), seed=2)
    ref = reference_logits(cache.reference(("tiny",)), ids)
    st = session.new_state(1)
    steps = [session.forward(ids[:, i:i + 1], st) for i in range(ids.shape[1])]
    assert rel_err(np.concatenate(steps, axis=1), ref) < REL_TOL
    chunked = session.forward(ids, session.new_state(1), chunk_size=9)  # 9 straddles the 4- and 16-token blocks
    assert rel_err(chunked, ref) < REL_TOL


def test_batch_rows_at_different_positions(session, cache):
    """Row 0 has 20 tokens of history, row 1 has 3; then both advance together."""
    model = cache.reference(("tiny",))
    a, b = random_ids(session.vocab_size, (1, 30), seed=3), random_ids(session.vocab_size, (1, 13), seed=4)
    st = session.new_state(2)
    # One graph call advances every row by the same number of tokens, so the rows get their different histories in
    # single-row states first, which are then copied into the two rows of a batch state.
    s0, s1 = session.new_state(1), session.new_state(1)
    session.forward(a[:, :20], s0)
    session.forward(b[:, :3], s1)
    for (_, _, buf0, _), (_, _, buf1, _), (_, _, buf, _) in zip(s0.tensors, s1.tensors, st.tensors):
        buf[0], buf[1] = buf0[0], buf1[0]
    st.positions[:] = [20, 3]
    out = session.forward(np.concatenate([a[:, 20:30], b[:, 3:13]]), st)
    np.testing.assert_array_equal(st.positions, [30, 13])
    assert rel_err(out[0:1], reference_logits(model, a)[:, 20:30]) < REL_TOL
    assert rel_err(out[1:2], reference_logits(model, b)[:, 3:13]) < REL_TOL


def test_greedy_generation_matches_reference(tiny_last, cache):
    sess = Session(tiny_last.parent, intra_op_threads=1)
    model = cache.reference(("tiny",))
    prompt = random_ids(sess.vocab_size, (1, 12), seed=5)[0].tolist()
    ours = sess.generate(prompt, 32)
    seq = list(prompt)
    for _ in range(32):  # greedy with the reference, full recompute each step
        seq.append(int(reference_logits(model, np.array([seq]))[0, -1].argmax()))
    assert ours == seq[len(prompt):]
    assert len(ours) == 32 and list(sess.stream(prompt, 32)) == ours


def test_batch_generation_equals_single(tiny_last):
    sess = Session(tiny_last.parent, intra_op_threads=1)
    prompts = random_ids(sess.vocab_size, (2, 9), seed=6)
    both = sess.generate(prompts, 10)
    assert both == [sess.generate(p.tolist(), 10) for p in prompts]


def test_state_stays_in_place(session):
    """No state buffer is reallocated or copied between steps: the OrtValues keep pointing at the same numpy
    memory, the ops write into it, and slots beyond the written positions keep their bits."""
    st = session.new_state(1)
    ptrs = [(buf.ctypes.data, val.data_ptr()) for _, _, buf, val in st.tensors]
    assert all(a == b for a, b in ptrs)
    window = st.buffer("0.window")
    ids = random_ids(session.vocab_size, (1, 5), seed=7)
    session.forward(ids[:, :3], st)
    assert np.abs(window[0, :3]).sum() > 0 and not window[0, 3:].any()
    before = window.copy()
    session.forward(ids[:, 3:4], st)
    assert [(buf.ctypes.data, val.data_ptr()) for _, _, buf, val in st.tensors] == ptrs
    assert (window[0, :3] == before[0, :3]).all() and window[0, 3].any() and not window[0, 4:].any()


def test_two_states_interleaved(session):
    ids = random_ids(session.vocab_size, (2, 12), seed=8)
    alone = []
    for r in range(2):  # each sequence on its own, in the same chunks (kernels may pick paths by chunk length)
        st = session.new_state(1)
        alone.append(np.concatenate([session.forward(ids[r:r + 1, i:i + 4], st) for i in range(0, 12, 4)], axis=1))
    s0, s1 = session.new_state(1), session.new_state(1)
    parts = [[], []]
    for i in range(0, 12, 4):
        parts[0].append(session.forward(ids[0:1, i:i + 4], s0))
        parts[1].append(session.forward(ids[1:2, i:i + 4], s1))
    for r in range(2):
        np.testing.assert_array_equal(np.concatenate(parts[r], axis=1), alone[r])


def test_reset_starts_clean(session):
    ids = random_ids(session.vocab_size, (1, 10), seed=9)
    st = session.new_state(1)
    first = session.forward(ids, st)
    st.reset()
    np.testing.assert_array_equal(session.forward(ids, st), first)


def test_capacity_and_input_errors(session):
    st = session.new_state(1)
    with pytest.raises(ValueError, match="capacity"):
        session.forward(np.zeros((1, 257), np.int64), st)
    assert st.positions[0] == 0  # nothing ran
    with pytest.raises(ValueError, match=r"input_ids\[0, 1\]=512"):
        session.forward(np.array([[1, 512]]), st)
    with pytest.raises(ValueError, match="rows"):
        session.forward(np.zeros((2, 1), np.int64), st)
    with pytest.raises(ValueError, match="batch"):
        session.forward(np.zeros(3, np.int64), st)
    with pytest.raises(ValueError, match="batch_size"):
        session.new_state(0)


def test_model_dir_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        Session(tmp_path / "nope")
    with pytest.raises(ModelError, match="not an exported"):
        Session(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"garbage")
    (tmp_path / "dsv4_ort.json").write_text("{not json")
    with pytest.raises(ModelError, match="corrupt"):
        Session(tmp_path)


def test_newer_op_table_is_explained(tiny, tmp_path):
    import json
    import shutil

    for f in tiny.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    meta = json.loads((tmp_path / "dsv4_ort.json").read_text())
    meta["op_table_version"] = 99
    (tmp_path / "dsv4_ort.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="op table v99"):
        Session(tmp_path)


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_isa_levels_agree(tiny, isa):
    ids = random_ids(512, (1, 40), seed=10)
    best = Session(tiny.parent, intra_op_threads=1).forward(ids, Session(tiny.parent).new_state(1))
    capped = Session(tiny.parent, intra_op_threads=1, isa=isa)
    assert capped.isa == isa
    assert rel_err(capped.forward(ids, capped.new_state(1)), best) < REL_TOL


# ---- sampling ----------------------------------------------------------------------------------------------------

def numpy_rule(logits, temperature, top_k, top_p, rng):
    """An independent per-row statement of the documented rule."""
    out = []
    for row in logits.astype(np.float64):
        z = row / temperature
        if 0 < top_k < len(z):
            z = np.where(z >= np.sort(z)[len(z) - top_k], z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = np.zeros(len(p), bool)
            mass = 0.0
            for i in order:
                if mass >= top_p:
                    break
                keep[i] = True
                mass += p[i]
            p = np.where(keep, p, 0)
            p /= p.sum()
        out.append(p)
    probs = np.stack(out)
    return (probs / rng.exponential(1.0, size=probs.shape)).argmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5)])
def test_sampling_matches_numpy_rule(temperature, top_k, top_p):
    logits = np.random.default_rng(0).standard_normal((4, 100)).astype(np.float32) * 3
    ours = [sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, rng=np.random.default_rng(s))
            for s in range(20)]
    theirs = [numpy_rule(logits, temperature, top_k, top_p, np.random.default_rng(s)) for s in range(20)]
    np.testing.assert_array_equal(np.stack(ours), np.stack(theirs))
    if top_k:
        allowed = np.argsort(-logits, axis=-1)[:, :top_k]
        assert all(t in allowed[r] for o in ours for r, t in enumerate(o))


def test_sampling_reproducible_and_greedy(tiny_last):
    sess = Session(tiny_last.parent, intra_op_threads=1)
    prompt = [0, 5, 9, 11]
    a = sess.generate(prompt, 12, temperature=0.8, top_p=0.9, seed=123)
    assert a == sess.generate(prompt, 12, temperature=0.8, top_p=0.9, seed=123)
    assert a != sess.generate(prompt, 12, temperature=0.8, top_p=0.9, seed=124)
    logits = np.array([[0.0, 2.0, 2.0, 1.0]], np.float32)
    assert sample(logits)[0] == 1  # greedy ties -> lowest id


def test_stop_ids(tiny_last):
    sess = Session(tiny_last.parent, intra_op_threads=1)
    free = sess.generate([0, 1, 2], 10)
    stop = free[3]
    got = sess.generate([0, 1, 2], 10, stop_ids=[stop])
    assert got == free[:free.index(stop) + 1]


def test_embedding_is_read_ahead_at_load(tiny, monkeypatch):
    """The embedding (the one weight a step reads a few rows of) is advised into the page cache when a session
    loads, 2 MiB per advice, exactly its bytes of the data file."""
    import os

    import onnx

    from dsv4_ort.runtime import session as session_mod

    ranges = session_mod.sparse_weight_ranges(tiny)
    graph = onnx.load(str(tiny), load_external_data=False).graph
    embed = next(t for t in graph.initializer if t.name == "embed.weight")
    info = {e.key: e.value for e in embed.external_data}
    assert ranges == [(tiny.parent / info["location"], int(info.get("offset", 0)), int(info["length"]))]
    assert int(info["length"]) == np.prod(embed.dims) * 2  # bf16 rows

    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    Session(tiny.parent, intra_op_threads=1)
    (_, offset, length), = ranges
    assert calls and all(a == os.POSIX_FADV_WILLNEED and n <= 2 << 20 for _, n, a in calls)
    assert calls[0][0] == offset and sum(n for _, n, _ in calls) == length
    assert all(o2 == o1 + n1 for (o1, n1, _), (o2, _, _) in zip(calls, calls[1:]))
    assert session_mod.read_ahead([(tiny.parent / "missing.data", 0, 10)]) == 0
