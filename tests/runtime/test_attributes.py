"""Attributes of the op domain's nodes are checked by name and type: an int where a float is declared takes the
int's value (what onnx.helper.make_attribute writes for a Python int), another type (a list or a tensor too) or an
unknown name is an error naming the op and the attribute, from the library (through onnxruntime alone) or from
Session."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from model_fixtures import require_library
from onnx import TensorProto, helper, numpy_helper

import dsv4_ort
from dsv4_ort.export import schema
from dsv4_ort.runtime import ModelError, Session

OP, ATTR = "MoeRouteTopK", "routed_scaling_factor"


@pytest.fixture(scope="module")
def tiny(cache):
    require_library()
    return cache.export(("tiny",), logits="all", max_seq_len=128).parent


def _edited(src, dst, change):
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == OP)
    change(node)
    onnx.save(model, str(dst / "model.onnx"))
    return dst


def _set(node, name, value):
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute(name, value)])


def _logits(d):
    sess = Session(d, intra_op_threads=1)
    return sess.forward(np.array([[3, 1, 4, 1, 5]]), sess.new_state(1))


def test_int_for_a_float_attribute_takes_its_value(tiny, tmp_path):
    as_float = _edited(tiny, tmp_path / "f", lambda n: _set(n, ATTR, 3.0))
    as_int = _edited(tiny, tmp_path / "i", lambda n: _set(n, ATTR, 3))
    default = _logits(tiny)
    got = _logits(as_int)
    assert np.array_equal(got, _logits(as_float)) and not np.array_equal(got, default)


def test_misspelled_attribute_is_a_model_error(tiny, tmp_path):
    d = _edited(tiny, tmp_path / "m", lambda n: _set(n, "routed_scaling_facter", 3.0))
    with pytest.raises(ModelError, match=f"{OP} node .* has attribute 'routed_scaling_facter', which {OP} does not"):
        Session(d, intra_op_threads=1)


@pytest.mark.parametrize("value,kind", [("3", "a string"), (3.0, "a float")])
def test_wrong_type_is_an_error_from_the_library_itself(tiny, tmp_path, value, kind):
    import onnxruntime as ort

    name = ATTR if isinstance(value, str) else "top_k"  # a string for a float, a float for an int
    d = _edited(tiny, tmp_path / "t", lambda n: _set(n, name, value))
    with pytest.raises(ModelError, match=f"attribute '{name}' must be"):
        Session(d, intra_op_threads=1)
    so = ort.SessionOptions()
    dsv4_ort.register(so)
    so.log_severity_level = 4
    with pytest.raises(Exception, match=f"{OP}.*attribute '{name}' must be .*the node has {kind}"):
        ort.InferenceSession(str(d / "model.onnx"), so, providers=["CPUExecutionProvider"])


def _rms_norm_model(eps) -> bytes:
    """One RmsNorm node (x [2, 8] fp32, no weight) with attribute eps made by onnx.helper from ``eps``."""
    node = helper.make_node("RmsNorm", ["x"], ["y"], domain=schema.DOMAIN, name="rms")
    node.attribute.append(helper.make_attribute("eps", eps))
    graph = helper.make_graph([node], "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                             ir_version=10).SerializeToString()


@pytest.mark.parametrize("eps,kind", [([1e-6, 1e-6], "a list of floats"), ([1, 2], "a list of ints"),
                                      (numpy_helper.from_array(np.array([1e-6], np.float32)), "a tensor")],
                         ids=["floats", "ints", "tensor"])
def test_list_or_tensor_for_a_scalar_attribute_is_an_error(eps, kind):
    """onnxruntime reads attributes by name and kind, so a list or a tensor under a declared name would read as
    absent and take the default: the library reports it, naming the op and the attribute."""
    import onnxruntime as ort

    require_library()
    so = ort.SessionOptions()
    dsv4_ort.register(so)
    so.log_severity_level = 4
    with pytest.raises(Exception, match=f"RmsNorm.*attribute 'eps' must be a float .*the node has {kind}"):
        ort.InferenceSession(_rms_norm_model(eps), so, providers=["CPUExecutionProvider"])
