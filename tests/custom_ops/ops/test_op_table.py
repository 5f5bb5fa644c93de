"""The built library implements exactly the op table (export/op_table.json): names, arity, types, attributes."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx_helpers import one_node_model

import dsv4_ort
from testutil import library_info
from dsv4_ort.export import schema


def test_library_reports_the_table():
    info = library_info()
    assert info["domain"] == schema.DOMAIN
    assert info["op_table_version"] == schema.TABLE_VERSION
    assert info["ort_api_version"] == schema.ORT_API_VERSION
    assert info["ops"] == [op["name"] for op in schema.load_table()["ops"]]
    # Every op has a kernel class and no kernel class exists outside the table.
    assert sorted(info["kernels"]) == sorted(schema.ops())


def _first_variant_inputs(spec):
    feeds = {}
    for io in spec.inputs:
        t = spec.type_constraints[io.type][0] if io.type in spec.type_constraints else io.type
        rank = io.rank if io.rank >= 0 else io.min_rank
        feeds[io.name] = (schema.ONNX_TYPES[t], rank)
    return feeds


def _model(spec, n_inputs, n_outputs, attrs):
    feeds = _first_variant_inputs(spec)
    names = [io.name for io in spec.inputs][:n_inputs] + [f"extra_in{i}" for i in range(n_inputs - len(spec.inputs))]
    outs = [o.name for o in spec.outputs][:n_outputs] + [f"extra_out{i}" for i in range(n_outputs - len(spec.outputs))]
    node = helper.make_node(spec.name, names, outs, domain=schema.DOMAIN, **attrs)
    ins = [helper.make_tensor_value_info(n, *(feeds.get(n, (TensorProto.FLOAT, 1))[0:1]), None) for n in names]
    outs_vi = [onnx.ValueInfoProto(name=n) for n in outs]  # types come from our shape inference
    graph = helper.make_graph([node], "g", ins, outs_vi)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                             ir_version=10).SerializeToString()


def _session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    dsv4_ort.register(so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _required_attrs(spec):
    return {a.name: (1 if a.type == "int" else 1.0 if a.type == "float" else a.choices[0]) for a in spec.attributes
            if a.required}


@pytest.mark.parametrize("name", sorted(schema.ops()))
def test_every_op_loads_with_table_arity(name):
    spec = schema.get(name)
    _session(_model(spec, len(spec.inputs), len(spec.outputs), _required_attrs(spec)))


@pytest.mark.parametrize("name", sorted(schema.ops()))
def test_wrong_arity_is_rejected(name):
    spec = schema.get(name)
    with pytest.raises(Exception):
        _session(_model(spec, len(spec.inputs) + 1, len(spec.outputs), _required_attrs(spec)))
    with pytest.raises(Exception):
        _session(_model(spec, len(spec.inputs), len(spec.outputs) + 1, _required_attrs(spec)))


@pytest.mark.parametrize("name", sorted(schema.ops()))
def test_every_type_variant_is_registered(name):
    spec = schema.get(name)
    for tv, types in spec.type_constraints.items():
        for t in types:
            ins = []
            for io in spec.inputs:
                tt = t if io.type == tv else (spec.type_constraints[io.type][0] if io.type in spec.type_constraints
                                              else io.type)
                ins.append(helper.make_tensor_value_info(io.name, schema.ONNX_TYPES[tt], None))
            node = helper.make_node(spec.name, [i.name for i in spec.inputs], [o.name for o in spec.outputs],
                                    domain=schema.DOMAIN, **_required_attrs(spec))
            outs = [onnx.ValueInfoProto(name=o.name) for o in spec.outputs]
            model = helper.make_model(helper.make_graph([node], "g", ins, outs),
                                      opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                                      ir_version=10)
            _session(model.SerializeToString())


def test_unknown_op_of_our_domain_is_rejected():
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain=schema.DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                              ir_version=10)
    with pytest.raises(Exception, match="NoSuchOp"):
        _session(model.SerializeToString())


def test_onnx_schemas_from_the_table_check_a_model():
    import onnx

    schema.register_onnx_schemas()
    model = onnx.load_from_string(one_node_model(
        "MoeRouteTopK", {"logits": np.zeros((2, 8), np.float32)}, [TensorProto.FLOAT, TensorProto.INT64], {"top_k": 2}))
    onnx.checker.check_model(model, full_check=True)


def test_make_node_validates_against_the_table():
    with pytest.raises(ValueError, match="top_k"):
        schema.make_node("MoeRouteTopK", ["l"], ["w", "i"])
    with pytest.raises(ValueError, match="inputs"):
        schema.make_node("HcPost", ["a"], ["b"])
    with pytest.raises(ValueError, match="unknown attribute"):
        schema.make_node("HcPost", ["a", "b", "c", "d"], ["o"], bogus=1)


def test_shape_rules():
    assert schema.infer_output_shapes("HcPre", [(2, 5, 4, 64), (24, 256), (3,), (24,)]) == [[2, 5, 64], [2, 5, 4],
                                                                                               [2, 5, 4, 4]]
    assert schema.infer_output_shapes("MoeRouteTopK", [(7, 64), None], {"top_k": 6}) == [[7, 6], [7, 6]]
    # symbolic dimensions (the graph builder's) pass through the same rules
    assert schema.infer_output_shapes("Linear", [("batch", "seq", 64), (32, 64)]) == [["batch", "seq", 32]]
    assert schema.infer_output_shapes("Indexer", [("batch", "seq", 4, 32), None, None, None], {"index_topk": 8}) == \
        [["batch", "seq", 8]]


def test_output_types_follow_the_table():
    f, bf, i64, u8 = (schema.ONNX_TYPES[t] for t in ("float", "bfloat16", "int64", "uint8"))
    assert schema.infer_output_types("HcPre", [bf, f, f, f]) == [bf, f, f]
    assert schema.infer_output_types("Compressor", [f, f, f, bf, f, i64, u8, f, f]) == [u8, f, f]
    with pytest.raises(ValueError, match="type constraint"):
        schema.infer_output_types("RmsNorm", [None, None])


def test_element_types_are_onnx_and_numpy_spellings():
    # one table (op_table.json "element_types"): ONNX names and codes, numpy storage dtypes
    for name, t in schema.ELEMENT_TYPES.items():
        assert TensorProto.DataType.Value(name.upper()) == t.code == schema.ONNX_TYPES[name]
        assert schema.element_type(t.code) is t and schema.element_type(name) is t
        assert t.bytes == (0 if name == "string" else np.dtype(t.numpy).itemsize)
    assert schema.element_type_of_numpy(np.dtype(np.float32)).name == "float"
    assert schema.element_type_of_numpy(np.dtype(np.uint16)).name == "uint16"
    assert schema.element_type_of_numpy(np.dtype(np.uint8)).name == "uint8"
    # every type the ops use is in the table
    for spec in schema.ops().values():
        for io in spec.inputs + spec.outputs:
            assert io.type in spec.type_constraints or io.type in schema.ELEMENT_TYPES, (spec.name, io.name)
        for types in spec.type_constraints.values():
            assert set(types) <= set(schema.ELEMENT_TYPES), spec.name
