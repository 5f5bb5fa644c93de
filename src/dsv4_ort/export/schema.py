"""The op-contract table of the ``ai.dsv4ort`` domain, as Python objects.

``op_table.json`` beside this file is the single source of truth: the C++ library compiles a generated view of it,
the exporter emits nodes from it and the tests check the built library against it. This module needs neither
torch nor onnx; :func:`make_node` and :func:`register_onnx_schemas` import onnx when called.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

TABLE_PATH = Path(__file__).with_name("op_table.json")

# ONNX TensorProto.DataType codes of the type names used in the table.
ONNX_TYPES = {
    "float": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7, "string": 8, "bool": 9,
    "float16": 10, "double": 11, "uint32": 12, "uint64": 13, "bfloat16": 16, "float8e4m3fn": 17,
}


@dataclasses.dataclass(frozen=True)
class IoSpec:
    name: str
    type: str  # ONNX type name, or the name of a type constraint
    optional: bool = False
    rank: int = -1
    min_rank: int = 0
    shape: Optional[tuple] = None  # output shape rule
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class AttrSpec:
    name: str
    type: str  # "int" | "float" | "string"
    default: Any = None
    required: bool = False
    min: Optional[float] = None
    max: Optional[float] = None
    choices: Optional[tuple] = None
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    since_version: int
    inputs: tuple
    outputs: tuple
    attributes: tuple
    type_constraints: dict
    doc: str = ""

    def attr(self, name: str) -> AttrSpec:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no attribute {name!r}")


@lru_cache(maxsize=None)
def load_table() -> dict:
    with open(TABLE_PATH) as f:
        return json.load(f)


DOMAIN: str = load_table()["domain"]
TABLE_VERSION: int = load_table()["table_version"]
ORT_API_VERSION: int = load_table()["ort_api_version"]


def _io(d: dict) -> IoSpec:
    rank = d.get("rank", -1)
    return IoSpec(d["name"], d["type"], bool(d.get("optional", False)), rank, d.get("min_rank", max(rank, 0)),
                  tuple(d["shape"]) if "shape" in d else None, d.get("doc", ""))


def _attr(d: dict) -> AttrSpec:
    return AttrSpec(d["name"], d["type"], d.get("default"), "default" not in d, d.get("min"), d.get("max"),
                    tuple(d["choices"]) if "choices" in d else None, d.get("doc", ""))


@lru_cache(maxsize=None)
def ops() -> dict:
    """All ops of the table, by name."""
    out = {}
    for d in load_table()["ops"]:
        out[d["name"]] = OpSpec(d["name"], d["since_version"], tuple(_io(i) for i in d["inputs"]),
                                tuple(_io(o) for o in d["outputs"]), tuple(_attr(a) for a in d.get("attributes", [])),
                                dict(d.get("type_constraints", {})), d.get("doc", ""))
    return out


def get(name: str) -> OpSpec:
    try:
        return ops()[name]
    except KeyError:
        raise KeyError(f"{name!r} is not an op of the {DOMAIN} domain; known: {sorted(ops())}") from None


def infer_output_shapes(name: str, input_shapes: Sequence[Optional[Sequence[int]]], attrs: dict | None = None) -> list:
    """Evaluates the table's output shape rules for concrete input shapes (None for absent optional inputs)."""
    spec = get(name)
    attrs = attrs or {}
    by_name = {io.name: shape for io, shape in zip(spec.inputs, input_shapes)}
    result = []
    for out in spec.outputs:
        dims: list = []
        for tok in out.shape or ():
            tok = str(tok)
            if tok.startswith("@"):
                key = tok[1:]
                dims.append(int(attrs[key]) if key in attrs else int(spec.attr(key).default))
            elif "[" in tok:
                src, inside = tok[:-1].split("[", 1)
                shape = list(by_name[src])
                if ":" in inside:
                    a, b = inside.split(":")
                    dims.extend(shape[int(a) if a else None:int(b) if b else None])
                else:
                    dims.append(shape[int(inside)])
            else:
                dims.append(int(tok))
        result.append(dims)
    return result


def make_node(op_name: str, inputs: Sequence[str], outputs: Sequence[str], name: str | None = None, **attrs):
    """An onnx NodeProto of our domain, checked against the table (arity, attribute names and ranges)."""
    from onnx import helper

    spec = get(op_name)
    required_in = sum(1 for i in spec.inputs if not i.optional)
    if not required_in <= len(inputs) <= len(spec.inputs):
        raise ValueError(f"{op_name}: expected {required_in}..{len(spec.inputs)} inputs, got {len(inputs)}")
    if len(outputs) != len(spec.outputs):
        raise ValueError(f"{op_name}: expected {len(spec.outputs)} outputs, got {len(outputs)}")
    known = {a.name: a for a in spec.attributes}
    for key, value in attrs.items():
        if key not in known:
            raise ValueError(f"{op_name}: unknown attribute {key!r}; known: {sorted(known)}")
        a = known[key]
        if a.choices is not None and value not in a.choices:
            raise ValueError(f"{op_name}: attribute {key!r} must be one of {a.choices}, got {value!r}")
        if a.min is not None and value < a.min or a.max is not None and value > a.max:
            raise ValueError(f"{op_name}: attribute {key!r}={value} outside [{a.min}, {a.max}]")
    for a in spec.attributes:
        if a.required and a.name not in attrs:
            raise ValueError(f"{op_name}: required attribute {a.name!r} missing")
    return helper.make_node(op_name, list(inputs), list(outputs), name=name, domain=DOMAIN, **attrs)


def onnx_schemas() -> list:
    """onnx.defs.OpSchema objects for every op (types and attributes; shapes are typed by the exporter)."""
    from onnx import defs

    attr_types = {"int": defs.OpSchema.AttrType.INT, "float": defs.OpSchema.AttrType.FLOAT,
                  "string": defs.OpSchema.AttrType.STRING}
    schemas = []
    for spec in ops().values():
        def param(io: IoSpec):
            t = io.type if io.type in spec.type_constraints else f"tensor({io.type})"
            option = defs.OpSchema.FormalParameterOption.Optional if io.optional else \
                defs.OpSchema.FormalParameterOption.Single
            return defs.OpSchema.FormalParameter(io.name, t, io.doc, param_option=option)

        attributes = []
        for a in spec.attributes:
            if a.required:
                attributes.append(defs.OpSchema.Attribute(a.name, attr_types[a.type], a.doc, required=True))
            else:
                from onnx import helper
                attributes.append(defs.OpSchema.Attribute(a.name, helper.make_attribute(a.name, a.default), a.doc))
        constraints = [(tv, [f"tensor({t})" for t in types], "") for tv, types in spec.type_constraints.items()]
        schemas.append(defs.OpSchema(spec.name, DOMAIN, spec.since_version, doc=spec.doc,
                                     inputs=[param(i) for i in spec.inputs], outputs=[param(o) for o in spec.outputs],
                                     type_constraints=constraints, attributes=attributes))
    return schemas


def register_onnx_schemas() -> None:
    """Registers the table's schemas with onnx (idempotent), so checker and shape inference know our ops."""
    from onnx import defs

    for schema in onnx_schemas():
        if not defs.has(schema.name, schema.domain):
            defs.register_schema(schema)
