"""Resident weights (custom_ops/platform/resident_weights.cc): large constant inputs copied into huge-page memory
when a session is created. The copy must change no output, be shared by the nodes that read one initializer, skip
small inputs, be freed with the session, and follow DSV4_ORT_RESIDENT_WEIGHTS."""
import gc

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import dsv4_ort
from dsv4_ort.export import schema

K, N_BIG, N_SMALL = 1024, 1024, 64  # bf16 weights: 2 MiB (copied) and 128 KiB (below the 1 MiB minimum)


def _weights():
    rng = np.random.default_rng(7)
    big = (rng.standard_normal((N_BIG, K), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    small = (rng.standard_normal((N_SMALL, K), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return big, small


def _model() -> bytes:
    big, small = _weights()
    inits = []
    for name, a in (("w_big", big), ("w_small", small)):
        t = numpy_helper.from_array(a, name)
        t.data_type = TensorProto.BFLOAT16
        inits.append(t)
    nodes = [schema.make_node("Linear", ["x", "w_big"], ["y1"], name="a", groups=1),
             schema.make_node("Linear", ["x", "w_big"], ["y2"], name="b", groups=1),  # the same initializer again
             schema.make_node("Linear", ["x", "w_small"], ["y3"], name="c", groups=1)]
    graph = helper.make_graph(
        nodes, "resident", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [3, N_BIG]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, [3, N_BIG]),
         helper.make_tensor_value_info("y3", TensorProto.FLOAT, [3, N_SMALL])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                              ir_version=10)
    return model.SerializeToString()


def _session(model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    dsv4_ort.register(so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _bytes_now() -> int:
    return dsv4_ort.library_info()["resident_weights"]["bytes_now"]


def test_copies_change_nothing_are_shared_and_freed(monkeypatch):
    model = _model()
    x = np.random.default_rng(3).standard_normal((3, K), dtype=np.float32)
    gc.collect()
    base = _bytes_now()
    outs = {}
    for policy in ("0", "1"):
        monkeypatch.setenv("DSV4_ORT_RESIDENT_WEIGHTS", policy)
        sess = _session(model)
        held = _bytes_now() - base
        # "1": one copy of the 2 MiB weight for both nodes that read it, none of the small one; "0": none
        assert held == (N_BIG * K * 2 if policy == "1" else 0), (policy, held)
        outs[policy] = sess.run(None, {"x": x})
        del sess
        gc.collect()
        assert _bytes_now() == base, policy  # freed with the session
    for a, b in zip(outs["0"], outs["1"]):
        assert a.tobytes() == b.tobytes()
    assert outs["1"][0].tobytes() == outs["1"][1].tobytes()
    # and the outputs are the products (bf16 weights widened exactly)
    w = _weights()[0].astype(np.uint32) << 16
    want = x.astype(np.float64) @ w.view(np.float32).astype(np.float64).T
    np.testing.assert_allclose(outs["1"][0], want, rtol=1e-4, atol=1e-3)


def test_auto_copies_where_huge_pages_are_offered(monkeypatch):
    monkeypatch.delenv("DSV4_ORT_RESIDENT_WEIGHTS", raising=False)
    info = dsv4_ort.library_info()["resident_weights"]
    assert info["policy"] == "auto" and info["min_bytes"] == 1 << 20
    gc.collect()
    base = _bytes_now()
    sess = _session(_model())
    held = _bytes_now() - base
    with open("/proc/meminfo") as f:
        mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    if info["huge_pages_offered"] and mem["MemAvailable"] - N_BIG * K * 2 > mem["MemTotal"] // 4:
        assert held == N_BIG * K * 2
    else:
        assert held == 0
    del sess


@pytest.mark.parametrize("value", ["yes", "2", " 1"])
def test_invalid_policy_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("DSV4_ORT_RESIDENT_WEIGHTS", value)
    with pytest.raises(Exception, match="DSV4_ORT_RESIDENT_WEIGHTS must be auto, 0 or 1"):
        _session(_model())
