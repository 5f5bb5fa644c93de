"""The end-to-end parity tests at every ISA level the CPU has (scalar, avx2, avx512, amx), capped both through the
Session argument and through DSV4_ORT_ISA in a fresh process: prefill, token-by-token decode and chunked prefill
against the PyTorch reference, and greedy generation from the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from model_fixtures import REL_TOL, random_ids, reference_logits, rel_err, require_library
from testutil import available_isa_levels

from dsv4_ort.runtime import Session


@pytest.fixture(scope="module")
def tiny(cache):
    require_library()
    return cache.export(("tiny",), logits="all", max_seq_len=256)


@pytest.mark.parametrize("level", available_isa_levels())
def test_prefill_decode_and_chunks_match_reference(tiny, cache, level):
    sess = Session(tiny.parent, intra_op_threads=2, isa=level)
    assert sess.isa == level
    ids = random_ids(sess.vocab_size, (1, 48), seed=60)
    ref = reference_logits(cache.reference(("tiny",)), ids)
    assert rel_err(sess.forward(ids, sess.new_state(1)), ref) < REL_TOL
    st = sess.new_state(1)
    sess.forward(ids[:, :32], st)
    steps = [sess.forward(ids[:, i:i + 1], st) for i in range(32, 48)]
    assert rel_err(np.concatenate(steps, axis=1), ref[:, 32:]) < REL_TOL
    assert rel_err(sess.forward(ids, sess.new_state(1), chunk_size=7), ref) < REL_TOL


@pytest.mark.parametrize("kernels", ["linear=scalar,moe_experts=avx2", "indexer=scalar,sparse_attention=avx2,"
                                     "compressor=scalar"])
def test_mixed_family_levels_match_reference(tiny, cache, kernels):
    """Families at different levels in one session (DSV4_ORT_KERNELS / Session(kernels=)) still match."""
    sess = Session(tiny.parent, intra_op_threads=2, kernels=kernels)
    for entry in kernels.split(","):
        fam, level = entry.split("=")
        order = ["scalar", "avx2", "avx512", "amx"]
        assert sess.families[fam] == order[min(order.index(level), order.index(sess.isa))]
    ids = random_ids(sess.vocab_size, (1, 40), seed=61)
    assert rel_err(sess.forward(ids, sess.new_state(1)), reference_logits(cache.reference(("tiny",)), ids)) < REL_TOL


GENERATE = """
import sys
from dsv4_ort.runtime import Session
sess = Session(sys.argv[1], intra_op_threads=1)
print(sess.isa, *sess.generate([3, 14, 15, 92, 65], 12))
"""


@pytest.fixture(scope="module")
def best_ids(tiny):
    return Session(tiny.parent, intra_op_threads=1).generate([3, 14, 15, 92, 65], 12)


@pytest.mark.parametrize("level", [lv for lv in ("scalar", "avx2") if lv in available_isa_levels()])
def test_environment_cap_generates_the_same_tokens(tiny, best_ids, level):
    """DSV4_ORT_ISA set for the whole process, as a user would: the library reports the capped level and greedy
    generation gives the tokens of the best level."""
    env = dict(os.environ, DSV4_ORT_ISA=level)
    # -P: the checkout's dsv4_ort/ folder (the cwd) must not shadow the installed package.
    r = subprocess.run([sys.executable, "-P", "-c", GENERATE, str(tiny.parent)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    isa, *ids = r.stdout.split()
    assert isa == level
    assert [int(t) for t in ids] == best_ids
