"""The exported graph at every onnxruntime graph optimisation level, and saved after optimisation.

The graph is almost all custom ops of the ai.dsv4ort domain, which onnxruntime's optimisers leave as they are; the
standard ops around them (Reshape, Shape, Gather, Slice, ...) may be fused or folded. Every level must give the
same logits as ORT_DISABLE_ALL bit for bit: the custom kernels are deterministic for a given thread count and no
optimisation may reorder their float arithmetic (they are opaque to onnxruntime).
"""

from __future__ import annotations

import numpy as np
import pytest
from deploy_helpers import read_meta, run_in_place, session_options
from model_fixtures import random_ids, require_library

LEVELS = ["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_LAYOUT", "ORT_ENABLE_ALL"]


def _levels():
    import onnxruntime as ort

    # ORT_ENABLE_LAYOUT exists from onnxruntime 1.22 on
    return [lv for lv in LEVELS if hasattr(ort.GraphOptimizationLevel, lv)]


@pytest.fixture(scope="module")
def tiny(cache):
    require_library()
    return cache.export(("tiny",), logits="all", max_seq_len=256).parent


@pytest.fixture(scope="module")
def inputs(tiny):
    vocab = read_meta(tiny)["config"]["vocab_size"]
    # 21 prompt tokens cross the window (16) and several compress boundaries (r = 4); then 6 decode steps
    return random_ids(vocab, (1, 21), seed=11), random_ids(vocab, (6,), seed=12).tolist()


@pytest.fixture(scope="module")
def baseline(tiny, inputs):
    import onnxruntime as ort

    so = session_options(graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    sess = ort.InferenceSession(str(tiny / "model.onnx"), so, providers=["CPUExecutionProvider"])
    return run_in_place(sess, read_meta(tiny), *inputs)


@pytest.mark.parametrize("level", _levels())
def test_every_level_gives_identical_logits(level, tiny, inputs, baseline, tmp_path):
    import onnxruntime as ort

    saved = tmp_path / "model.onnx"
    so = session_options(graph_optimization_level=getattr(ort.GraphOptimizationLevel, level),
                         optimized_model_filepath=str(saved))
    # The optimised model gets its own external-data file beside it (initializers of >= 1 KiB, onnxruntime's
    # default threshold); without this entry it would refer to model.onnx.data relative to ITS directory. A threshold
    # of 0 would move the small int64 shape constants out too, and onnxruntime's Reshape shape inference cannot
    # read external data when it loads such a model back.
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx.data")
    sess = ort.InferenceSession(str(tiny / "model.onnx"), so, providers=["CPUExecutionProvider"])
    meta = read_meta(tiny)
    outs = run_in_place(sess, meta, *inputs)
    assert len(outs) == len(baseline)
    for i, (a, b) in enumerate(zip(outs, baseline)):
        assert a.shape == b.shape and np.isfinite(a).all()
        np.testing.assert_array_equal(a, b, err_msg=f"{level}: run {i} (0 = prefill) differs from ORT_DISABLE_ALL")

    # The saved model is self-contained, keeps the export's metadata and gives the same logits when loaded back
    # without further optimisation (what onnxruntime recommends for offline-optimised models).
    assert saved.is_file() and (tmp_path / "model.onnx.data").is_file()
    back = ort.InferenceSession(
        str(saved), session_options(graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        providers=["CPUExecutionProvider"])
    recorded = back.get_modelmeta().custom_metadata_map
    assert recorded["dsv4_ort.export_id"] == meta["export_id"]
    for i, (a, b) in enumerate(zip(run_in_place(back, meta, *inputs), baseline)):
        np.testing.assert_array_equal(a, b, err_msg=f"{level}, saved and reloaded: run {i} differs")


def test_optimised_graph_keeps_every_custom_op(tiny, tmp_path):
    """No optimiser drops, duplicates or replaces a node of the ai.dsv4ort domain."""
    import onnx
    import onnxruntime as ort

    saved = tmp_path / "model.onnx"
    so = session_options(graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                         optimized_model_filepath=str(saved))
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx.data")
    ort.InferenceSession(str(tiny / "model.onnx"), so, providers=["CPUExecutionProvider"])

    def ours(path):
        graph = onnx.load(str(path), load_external_data=False).graph
        return sorted((n.op_type, n.name) for n in graph.node if n.domain == "ai.dsv4ort")

    assert ours(saved) == ours(tiny / "model.onnx")
