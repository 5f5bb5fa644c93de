"""A minimal ONNX ModelProto writer for one-node models, so diagnostics work with onnxruntime + numpy alone.

It encodes just the protobuf fields it needs (ModelProto: ir_version, opset_import, graph; GraphProto: node, name,
input, output; NodeProto: input, output, name, op_type, domain, attribute; ValueInfoProto with a tensor type). The full
exporter uses the onnx package instead.
"""

from __future__ import annotations

import struct


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, payload: bytes | int | str) -> bytes:
    if isinstance(payload, int):
        return _varint(num << 3) + _varint(payload)
    if isinstance(payload, str):
        payload = payload.encode()
    return _varint((num << 3) | 2) + _varint(len(payload)) + payload


def _value_info(name: str, elem_type: int, rank: int) -> bytes:
    dims = b"".join(_field(1, _field(2, f"d{i}")) for i in range(rank))  # symbolic dims
    tensor_type = _field(1, elem_type) + _field(2, dims)
    return _field(1, name) + _field(2, _field(1, tensor_type))


def _attribute(name: str, value) -> bytes:
    # AttributeProto: name=1, f=2 (fixed32), i=3, s=4, type=20 (FLOAT=1, INT=2, STRING=3).
    if isinstance(value, bool) or isinstance(value, int):
        return _field(1, name) + _field(3, int(value)) + _field(20, 2)
    if isinstance(value, float):
        return _field(1, name) + _varint((2 << 3) | 5) + struct.pack("<f", value) + _field(20, 1)
    return _field(1, name) + _field(4, str(value)) + _field(20, 3)


def one_node_model(op_type: str, domain: str, inputs: list, outputs: list, attrs: dict | None = None,
                   opset: int = 1) -> bytes:
    """inputs/outputs: lists of (name, onnx elem type, rank); attrs: int, float or str values."""
    node = b"".join(_field(1, n) for n, _, _ in inputs) + b"".join(_field(2, n) for n, _, _ in outputs)
    node += _field(3, op_type.lower()) + _field(4, op_type) + _field(7, domain)
    node += b"".join(_field(5, _attribute(k, v)) for k, v in (attrs or {}).items())
    graph = _field(1, node) + _field(2, "g")
    graph += b"".join(_field(11, _value_info(*i)) for i in inputs)
    graph += b"".join(_field(12, _value_info(*o)) for o in outputs)
    opsets = _field(8, _field(1, "") + _field(2, 21)) + _field(8, _field(1, domain) + _field(2, opset))
    return _field(1, 10) + opsets + _field(7, graph)
