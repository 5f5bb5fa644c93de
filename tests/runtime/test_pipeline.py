"""dsv4_ort.runtime.pipeline with every stage in this process: 2- and 3-stage exports of the tiny preset give the
single graph's float32 logits bit for bit (prefill, chunked prefill, decode, rows at different positions, greedy
generation), and drive the serving engine; a dsv4_ort.json whose stages do not cover the layers is refused. The Ray
backend (one actor per stage) is tested in test_pipeline_ray.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from model_fixtures import random_ids, require_library

from dsv4_ort.export import export_model
from dsv4_ort.runtime import Session
from dsv4_ort.runtime.engine import Engine, SamplingParams
from dsv4_ort.runtime.pipeline import PipelineSession, read_pipeline_metadata
from dsv4_ort.runtime.session import ModelError


@pytest.fixture(scope="module")
def exports(cache, tmp_path_factory):
    require_library()
    ck = cache.checkpoint("tiny")
    root = tmp_path_factory.mktemp("stages")
    out = {1: export_model(ck, root / "one", logits="all", max_seq_len=256, progress=False).parent}
    for spec in (2, "0:1,1:4"):
        out[spec] = export_model(ck, root / f"staged-{spec}".replace(":", "_").replace(",", "-"), logits="all",
                                 max_seq_len=256, progress=False, stages=spec).parent
    return out


@pytest.mark.parametrize("spec", [2, "0:1,1:4"])
def test_stages_give_the_single_graph_bitwise(exports, spec):
    one = Session(exports[1], intra_op_threads=1)
    staged = PipelineSession(exports[spec], intra_op_threads=1)
    assert staged.n_stages == 2
    ids = random_ids(one.vocab_size, (3, 37), seed=11)
    sa, sb = one.new_state(3), staged.new_state(3)
    np.testing.assert_array_equal(one.forward(ids[:, :20], sa), staged.forward(ids[:, :20], sb))
    # chunked prefill of the rest, then decode with the rows at different positions
    np.testing.assert_array_equal(one.forward(ids[:, 20:], sa, chunk_size=8),
                                  staged.forward(ids[:, 20:], sb, chunk_size=8))
    sa.positions[1] -= 5
    sb.positions[1] -= 5
    tok = np.array([[5], [6], [7]], np.int64)
    for _ in range(4):
        la, lb = one.forward(tok, sa), staged.forward(tok, sb)
        np.testing.assert_array_equal(la, lb)
        tok = la[:, -1].argmax(-1)[:, None]
    assert one.generate([1, 2, 3], 24) == staged.generate([1, 2, 3], 24)


def test_three_stages_and_the_engine(exports, tmp_path, cache):
    staged3 = export_model(cache.checkpoint("tiny"), tmp_path / "three", logits="last", max_seq_len=256,
                           progress=False, stages=3).parent
    one = Session(cache.export(("tiny",), logits="last", max_seq_len=256).parent, intra_op_threads=1,
                  batch_invariant=4)
    staged = PipelineSession(staged3, intra_op_threads=1, batch_invariant=4, micro_batches=2)
    assert staged.n_stages == 3
    prompts = [random_ids(one.vocab_size, (n,), seed=n).tolist() for n in (3, 17, 9, 30)]
    results = []
    for sess in (one, staged):
        eng = Engine(sess, max_batch=4, prefill_chunk=8)
        reqs = [eng.submit(p, SamplingParams(max_tokens=10)) for p in prompts]
        eng.run_until_idle()
        results.append([r.result(timeout=0)["tokens"] for r in reqs])
    assert results[0] == results[1]


@pytest.mark.parametrize("layers, why", [([[0, 1], [2, 4]], "should start at layer 1"),
                                         ([[0, 2], [2, 3]], "end at layer 3, the model has 4"),
                                         ([[0, 2], [2, 2]], "holds no layer")])
def test_stages_that_do_not_cover_the_layers_are_refused(exports, tmp_path, layers, why):
    d = shutil.copytree(exports[2], tmp_path / "bad")
    meta = json.loads((d / "dsv4_ort.json").read_text())
    for s, r in zip(meta["pipeline"]["stages"], layers):
        s["layers"] = r
    (d / "dsv4_ort.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match=f"corrupt: stages .*{why}"):
        read_pipeline_metadata(d)


def test_only_the_first_stage_reads_the_embedding_ahead(exports):
    """The embedding lives in the first stage's data file; that range, and nothing of a later stage, is advised."""
    from dsv4_ort.runtime.session import sparse_weight_ranges

    meta = read_pipeline_metadata(exports[2])
    stages = meta["pipeline"]["stages"]
    ranges = [sparse_weight_ranges(exports[2] / s["model_file"]) for s in stages]
    assert [len(r) for r in ranges] == [1, 0]
    (path, offset, length), = ranges[0]
    assert path == exports[2] / stages[0]["data_file"] and offset + length <= path.stat().st_size
    assert sparse_weight_ranges(exports[1] / "model.onnx")[0][2] == length  # the single graph's embedding


def test_stage_sessions_stop_spinning_when_a_run_returns(exports):
    # the stages of a process run one after another: a pool spinning on after its run takes the cores from the next
    from dsv4_ort.runtime.session import SPIN_STOP_KEY

    staged = PipelineSession(exports[2], intra_op_threads=1)
    for runner in staged._stages.runners:
        assert runner.session.get_session_options().get_session_config_entry(SPIN_STOP_KEY) == "1"
