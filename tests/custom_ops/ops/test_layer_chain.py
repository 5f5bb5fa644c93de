"""One decoder layer built from the custom ops (plus embedding/head glue) equals the reference layer.

For each layer kind -- SWA (ratio 0), CSA (ratio 4: overlapping compressor + indexer) and HCA (a non-overlapping
ratio) -- a one-layer model is exported (every DeepSeek-specific step is a node of our domain) and compared with
the PyTorch reference for a full prefill and for token-by-token decode through in-place state.
"""

import numpy as np
import pytest
from model_fixtures import REL_TOL, OrtModel, one_torch_thread, random_ids, reference_logits, rel_err, require_library


@pytest.fixture(scope="module", params=[("swa", 0), ("csa", 4), ("hca", 16), ("hca128", 128)], ids=lambda p: p[0])
def layer(request, tmp_path_factory):
    require_library()
    from dsv4_ort.export import export_model
    from dsv4_ort.models import load_model, write_random_checkpoint
    from dsv4_ort.models.config import DeepseekV4Config

    kind, ratio = request.param
    cfg = DeepseekV4Config.from_preset("tiny").replace(num_hidden_layers=1, compress_ratios=[ratio, 0],
                                                       num_hash_layers=0 if kind == "csa" else 1)
    root = tmp_path_factory.mktemp(kind)
    with one_torch_thread():
        write_random_checkpoint(root / "ck", cfg, weights="native", seed=11)
        ref = load_model(root / "ck")
    path = export_model(root / "ck", root / "onnx", logits="all", max_seq_len=256, progress=False)
    return kind, ratio, ref, OrtModel(path)


def test_layer_prefill_and_decode(layer):
    import onnx

    kind, ratio, ref, model = layer
    graph = onnx.load(str(model.path), load_external_data=False).graph
    ours = {n.op_type for n in graph.node if n.domain == "ai.dsv4ort"}
    expected = {"HcPre", "HcPost", "HcHead", "RmsNorm", "NormRope", "SparseAttention", "MoeExpertsFp4"}
    if ratio:
        expected |= {"Compressor"}
    if ratio == 4:
        expected |= {"Indexer", "Rope"}
    assert expected <= ours, sorted(expected - ours)
    assert {n.op_type for n in graph.node if n.domain in ("", "ai.onnx")} <= {
        "Gather", "Cast", "Shape", "Reshape", "Unsqueeze", "Expand", "Slice", "Add", "Concat", "Squeeze"}

    T = 140 if ratio == 128 else 70  # past the first entry of every ratio, the window (16) and index_topk (8)
    ids = random_ids(512, (1, T), seed=ratio + 1)
    want = reference_logits(ref, ids)
    state = model.new_state(1)
    got = model.run(ids, np.zeros(1, np.int64), state)
    assert rel_err(got, want) < REL_TOL, kind
    state = model.new_state(1)
    steps = [model.run(ids[:, t:t + 1], np.array([t]), state) for t in range(T)]
    assert rel_err(np.concatenate(steps, axis=1), want) < REL_TOL, kind
