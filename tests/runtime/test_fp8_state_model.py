"""Exports with FP8 attention state (state="fp8") at every ISA level the CPU has: the runtime (in-place IOBinding
state of uint8 rows) against the PyTorch reference with FP8 state, for prefill, token-by-token decode and chunked
prefill; the state layout recorded in the metadata; generation; the command-line flag.

Tolerance: FP8_REL_TOL relative to the largest reference logit. It is looser than the default state's REL_TOL
because a float32 kv or entry value that differs from torch's by an ulp can round to the neighbouring E4M3 code
(1/8 relative of that element); observed ~1.3e-5 on the scalar level and ~3e-3 on the vector levels (tiny preset).
The reference with FP8 state differs from the default-state reference by far more than the tolerance, so the test
checks the FP8 semantics and not merely closeness to the default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_fixtures import one_torch_thread, random_ids, rel_err, require_library
from testutil import available_isa_levels

from dsv4_ort.runtime import Session

FP8_REL_TOL = 1e-2
MAX_SEQ = 256


@pytest.fixture(scope="module")
def tiny_fp8(cache):
    require_library()
    return cache.export(("tiny",), logits="all", max_seq_len=MAX_SEQ, state="fp8")


def reference(model, ids, chunks, state: str) -> np.ndarray:
    """Logits of the reference run chunk by chunk ([a, b) column ranges) on one state."""
    with torch.no_grad(), one_torch_thread():
        st = model.new_state(ids.shape[0], MAX_SEQ, state=state)
        return torch.cat([model(torch.as_tensor(ids[:, a:b]), state=st) for a, b in chunks], dim=1).numpy()


def test_fp8_state_layout(tiny_fp8):
    sess = Session(tiny_fp8.parent, intra_op_threads=1)
    meta = sess.meta
    assert meta["state"]["format"] == "fp8"
    cfg = meta["config"]
    D, rd, cI = cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]
    row = (D - rd) + 2 * rd + ((D - rd) // 64 + 7) // 8 * 8
    by_name = {}
    for t in meta["state"]["tensors"]:
        by_name.setdefault(t["name"], set()).add((t["dtype"], t["shape"][-1]))
    assert by_name["window"] == {("uint8", row)} and by_name["entries"] == {("uint8", row)}
    assert by_name["index_keys"] == {("uint8", cI + 4)}
    assert {dt for dt, _ in by_name["kv_state"] | by_name["score_state"] | by_name["index_kv_state"]} == {"float"}
    st = sess.new_state(2)
    assert all(buf.dtype == np.uint8 for name, buf in ((i, b) for i, _, b, _ in st.tensors)
               if name.endswith((".window", ".entries", ".index_keys")))


@pytest.mark.parametrize("level", available_isa_levels())
def test_fp8_state_matches_reference(tiny_fp8, cache, level):
    sess = Session(tiny_fp8.parent, intra_op_threads=2, isa=level)
    assert sess.isa == level
    model = cache.reference(("tiny",))
    ids = random_ids(sess.vocab_size, (2, 48), seed=61)
    steps = [(0, 32)] + [(i, i + 1) for i in range(32, 48)]
    ref = reference(model, ids, steps, "fp8")
    st = sess.new_state(2)
    got = np.concatenate([sess.forward(ids[:, a:b], st) for a, b in steps], axis=1)
    assert rel_err(got, ref) < FP8_REL_TOL
    assert rel_err(reference(model, ids, steps, "default"), ref) > 3 * FP8_REL_TOL  # FP8 semantics matter
    chunks = [(a, min(a + 7, 48)) for a in range(0, 48, 7)]
    got = sess.forward(ids, sess.new_state(2), chunk_size=7)
    assert rel_err(got, reference(model, ids, chunks, "fp8")) < FP8_REL_TOL


def test_fp8_state_rows_at_different_positions(tiny_fp8, cache):
    """Row 1 restarts at position 0 over stale FP8 rows while row 0 decodes on at 24+: each row equals its own
    single-row reference."""
    sess = Session(tiny_fp8.parent, intra_op_threads=2)
    model = cache.reference(("tiny",))
    ids = random_ids(sess.vocab_size, (2, 40), seed=62)
    new = random_ids(sess.vocab_size, (1, 16), seed=63)
    st = sess.new_state(2)
    sess.forward(ids[:, :24], st)
    st.positions[1] = 0
    got = np.concatenate([sess.forward(np.array([[ids[0, i]], [new[0, i - 24]]]), st) for i in range(24, 40)], axis=1)
    ref0 = reference(model, ids[:1], [(0, 24)] + [(i, i + 1) for i in range(24, 40)], "fp8")[:, 24:]
    ref1 = reference(model, new, [(i, i + 1) for i in range(16)], "fp8")
    assert rel_err(got[:1], ref0) < FP8_REL_TOL
    assert rel_err(got[1:], ref1) < FP8_REL_TOL


def test_fp8_state_generate_and_cli(tiny_fp8, tmp_path):
    sess = Session(tiny_fp8.parent, intra_op_threads=1)
    toks = sess.generate([3, 14, 15, 92, 65], 12)
    assert len(toks) == 12 and toks == sess.generate([3, 14, 15, 92, 65], 12)
    from dsv4_ort.cli import main

    out = tmp_path / "cli-fp8"
    assert main(["export", "--preset", "tiny", str(out), "--state", "fp8", "--max-seq-len", "128", "--quiet"]) == 0
    s2 = Session(out, intra_op_threads=1)
    assert s2.meta["state"]["format"] == "fp8" and len(s2.generate([1, 2, 3], 4)) == 4
    with pytest.raises(SystemExit) as e:
        main(["export", "--preset", "tiny", str(tmp_path / "bad"), "--state", "fp16", "--quiet"])
    assert e.value.code == 2
