"""One-node ONNX models of the ai.dsv4ort domain, run through onnxruntime with the custom-op library."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import dsv4_ort
from dsv4_ort.export import schema

class BF16(np.ndarray):
    """Marks a uint16 array as bfloat16 storage."""


def bf16(a) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), stored as uint16 and marked as bfloat16."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).view(BF16)


class FP8E4M3(np.ndarray):
    """Marks a uint8 array as float8e4m3fn storage."""


def fp8_e4m3(codes) -> np.ndarray:
    """E4M3FN codes (a torch float8_e4m3fn / uint8 tensor or a uint8 array), marked as float8e4m3fn."""
    import torch

    if isinstance(codes, torch.Tensor):
        codes = codes.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(codes, dtype=np.uint8).view(FP8E4M3)


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a).astype(np.uint32) << 16).view(np.float32)


def onnx_type(a) -> int:
    if isinstance(a, BF16):
        return TensorProto.BFLOAT16
    if isinstance(a, FP8E4M3):
        return TensorProto.FLOAT8E4M3FN
    return schema.element_type_of_numpy(np.asarray(a).dtype).code


def _output_types(op: str, inputs: dict) -> list:
    """Output element types: concrete, or bound through a type constraint to the first matching input."""
    spec = schema.get(op)
    return schema.infer_output_types(op, [onnx_type(inputs[i.name]) if inputs.get(i.name) is not None else None
                                          for i in spec.inputs])


def _output_shapes(op: str, inputs: dict, attrs: dict) -> list:
    """Output shapes by the op table's rules."""
    spec = schema.get(op)
    return schema.infer_output_shapes(op, [np.shape(inputs[i.name]) if inputs.get(i.name) is not None else None
                                           for i in spec.inputs], attrs)


def _output_buffer(shape, t: int) -> np.ndarray:
    """An output buffer of element type t (bfloat16 as uint16 bits)."""
    return np.empty(shape, np.dtype(schema.element_type(t).numpy))


def one_node_model(op: str, inputs: dict, out_types: list, attrs: dict) -> bytes:
    """A model holding one node of our domain; graph outputs typed and shaped from the op table's rules."""
    spec = schema.get(op)
    out_shapes = _output_shapes(op, inputs, attrs)
    names = [io.name for io in spec.inputs]
    node_inputs = [n if inputs.get(n) is not None else "" for n in names]
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()
    node = schema.make_node(op, node_inputs, [o.name for o in spec.outputs], name=op.lower(), **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, onnx_type(a), list(np.shape(a)))
                    for n, a in inputs.items() if a is not None]
    graph_outputs = [helper.make_tensor_value_info(o.name, t, shape)
                     for o, t, shape in zip(spec.outputs, out_types, out_shapes)]
    graph = helper.make_graph([node], op, graph_inputs, graph_outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                     helper.make_opsetid(schema.DOMAIN, 1)], ir_version=10)
    return model.SerializeToString()


@functools.lru_cache(maxsize=64)
def _session(model: bytes, isa: str | None, threads: int):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    with dsv4_ort.isa_cap(isa):
        dsv4_ort.register(so)
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def run_op(op: str, inputs: dict, attrs: dict | None = None, isa: str | None = None, threads: int = 2) -> list:
    """Runs op on numpy inputs (BF16-marked arrays are fed as bfloat16). Outputs come back as numpy arrays;
    bfloat16 outputs as float32. Output shapes are taken from the op table's shape rules."""
    attrs = attrs or {}
    spec = schema.get(op)
    out_types = _output_types(op, inputs)
    sess = _session(one_node_model(op, inputs, out_types, attrs), isa, threads)
    shapes = _output_shapes(op, inputs, attrs)
    io = sess.io_binding()
    for name, a in inputs.items():
        if a is None:
            continue
        arr = np.ascontiguousarray(a)
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            arr.view(np.uint16) if isinstance(a, BF16) else arr, onnx_type(a)))
    outs = []
    for o, t, shape in zip(spec.outputs, out_types, shapes):
        buf = _output_buffer(shape, t)
        io.bind_output(o.name, "cpu", 0, t, list(shape), buf.ctypes.data)
        outs.append(buf)
    sess.run_with_iobinding(io)
    return [bf16_to_f32(b) if t == TensorProto.BFLOAT16 else b for b, t in zip(outs, out_types)]


def run_op_inplace(op: str, inputs: dict, alias: dict, attrs: dict | None = None, isa: str | None = None,
                   threads: int = 2) -> list:
    """Runs op with every output named in ``alias`` (output name -> input name) bound to the SAME OrtValue as that
    input, as a runtime that keeps its state in place does (IOBinding of one buffer as past input and present output).

    The aliased input arrays must be C-contiguous and writable; they are updated in place by the op (BF16-marked
    arrays too). Returns all outputs like :func:`run_op` (aliased ones as float32 copies of the updated arrays)."""
    attrs = attrs or {}
    spec = schema.get(op)
    out_types = _output_types(op, inputs)
    sess = _session(one_node_model(op, inputs, out_types, attrs), isa, threads)
    shapes = _output_shapes(op, inputs, attrs)
    io = sess.io_binding()
    values = {}
    for name, a in inputs.items():
        if a is None:
            continue
        if name in alias.values():
            if not (a.flags.c_contiguous and a.flags.writeable):
                raise ValueError(f"aliased input {name!r} must be a C-contiguous writable array")
            arr = a
        else:
            arr = np.ascontiguousarray(a)
        values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            arr.view(np.uint16) if isinstance(a, BF16) else arr, onnx_type(a))
        io.bind_ortvalue_input(name, values[name])
    outs = []
    for o, t, shape in zip(spec.outputs, out_types, shapes):
        if o.name in alias:
            io.bind_ortvalue_output(o.name, values[alias[o.name]])
            outs.append(inputs[alias[o.name]])
            continue
        buf = _output_buffer(shape, t)
        io.bind_output(o.name, "cpu", 0, t, list(shape), buf.ctypes.data)
        outs.append(buf)
    sess.run_with_iobinding(io)
    return [bf16_to_f32(b) if t == TensorProto.BFLOAT16 else np.array(b) for b, t in zip(outs, out_types)]


def run_op_const(op: str, inputs: dict, constants: tuple, attrs: dict | None = None, isa: str | None = None,
                 threads: int = 2) -> list:
    """Like :func:`run_op`, but the inputs named in ``constants`` are constant initializers of the model (as exported
    weights are) instead of graph inputs, so kernels see them at creation. Errors at session creation propagate."""
    from onnx import numpy_helper

    attrs = attrs or {}
    spec = schema.get(op)
    out_types = _output_types(op, inputs)
    model = onnx.ModelProto()
    model.ParseFromString(one_node_model(op, inputs, out_types, attrs))
    kept = [i for i in model.graph.input if i.name not in constants]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for name in constants:
        a = inputs[name]
        t = numpy_helper.from_array(np.ascontiguousarray(np.asarray(a).view(np.uint16) if isinstance(a, BF16)
                                                         else np.asarray(a)), name)
        t.data_type = onnx_type(a)
        model.graph.initializer.append(t)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    with dsv4_ort.isa_cap(isa):
        dsv4_ort.register(so)
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    shapes = _output_shapes(op, inputs, attrs)
    io = sess.io_binding()
    for name, a in inputs.items():
        if a is None or name in constants:
            continue
        arr = np.ascontiguousarray(a)
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            arr.view(np.uint16) if isinstance(a, BF16) else arr, onnx_type(a)))
    outs = []
    for o, t, shape in zip(spec.outputs, out_types, shapes):
        buf = _output_buffer(shape, t)
        io.bind_output(o.name, "cpu", 0, t, list(shape), buf.ctypes.data)
        outs.append(buf)
    sess.run_with_iobinding(io)
    return [bf16_to_f32(b) if t == TensorProto.BFLOAT16 else b for b, t in zip(outs, out_types)]


def session_error(op: str, inputs: dict, attrs: dict | None = None, isa: str | None = None) -> str:
    """Runs op expecting a failure (at session creation or run); returns the error text."""
    try:
        run_op(op, inputs, attrs, isa)
    except Exception as e:  # onnxruntime raises Fail / InvalidArgument / RuntimeException
        return str(e)
    raise AssertionError(f"{op} accepted invalid input")


__all__ = ["bf16", "bf16_to_f32", "fp8_e4m3", "run_op", "run_op_const", "run_op_inplace", "session_error",
           "one_node_model", "onnx"]
