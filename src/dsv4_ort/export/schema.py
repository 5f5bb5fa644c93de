"""The op-contract table of the ``ai.dsv4ort`` domain, as Python objects.

``op_table.json`` beside this file is the single source of truth: the C++ library compiles a generated view of it,
the exporter emits nodes from it and the tests check the built library against it. This module needs neither
torch nor onnx; :func:`make_node` and :func:`register_onnx_schemas` import onnx when called.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

TABLE_PATH = Path(__file__).with_name("op_table.json")

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
# Digest of the table file: names exports in caches, so a changed contract (a new attribute the exporter sets) exports
# again even where table_version stays.
TABLE_DIGEST: str = hashlib.sha256(TABLE_PATH.read_bytes()).hexdigest()[:8]
ORT_API_VERSION: int = load_table()["ort_api_version"]


@dataclasses.dataclass(frozen=True)
class ElementType:
    """One ONNX element type of the table's ``element_types`` (the only type table of the project)."""

    name: str   # ONNX spelling, as in tensor(float): "float", "bfloat16", "float8e4m3fn", ...
    code: int   # TensorProto.DataType (= ONNXTensorElementDataType)
    bytes: int  # per element; 0 = variable (string)
    numpy: str  # numpy dtype of the storage (bfloat16: uint16 bits, float8e4m3fn: uint8 codes)


# ONNX name -> element type, in code order.
ELEMENT_TYPES: dict = {name: ElementType(name, d["code"], d["bytes"], d["numpy"])
                       for name, d in sorted(load_table()["element_types"].items(), key=lambda kv: kv[1]["code"])}
# ONNX name -> TensorProto.DataType code (a view of ELEMENT_TYPES).
ONNX_TYPES: dict = {name: t.code for name, t in ELEMENT_TYPES.items()}


def element_type(key) -> ElementType:
    """The element type of an ONNX name ("float") or TensorProto.DataType code (1)."""
    for t in ELEMENT_TYPES.values():
        if key == t.name or key == t.code:
            return t
    raise KeyError(f"{key!r} is not an element type of the op table; known: {list(ELEMENT_TYPES)}")


def element_type_of_numpy(dtype) -> ElementType:
    """The element type a numpy dtype holds natively (uint16 is uint16, not bfloat16 bits)."""
    name = str(dtype) if not hasattr(dtype, "name") else dtype.name
    for t in ELEMENT_TYPES.values():
        if t.numpy == name:
            return t
    raise KeyError(f"numpy dtype {name!r} has no element type in the op table")


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


def infer_output_shapes(name: str, input_shapes: Sequence[Optional[Sequence]], attrs: dict | None = None) -> list:
    """Evaluates the table's output shape rules (None for absent optional inputs).

    Dimensions may be ints or symbolic names (str, as the graph builder's ``batch``): tokens that copy input
    dimensions carry them through, so the rule serves concrete shapes (tests) and symbolic ones (value_info) alike.
    The C++ glue evaluates the same rules (custom_op.cc, EvalShapeRule) for shape inference and output allocation.
    """
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
                dims.append(int(attrs[key]) if attrs.get(key) is not None else int(spec.attr(key).default))
            elif "[" in tok:
                src, inside = tok[:-1].split("[", 1)
                if by_name.get(src) is None:
                    raise ValueError(f"{name}: output {out.name!r} needs the shape of input {src!r}")
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


def infer_output_types(name: str, input_types: Sequence[Optional[int]]) -> list:
    """TensorProto.DataType codes of the outputs for the codes of the inputs (None for absent optional inputs): a
    concrete type, or the type of the first present input bound to the same type constraint (as the glue's
    InferOutputShape does)."""
    spec = get(name)
    result = []
    for out in spec.outputs:
        if out.type not in spec.type_constraints:
            result.append(ONNX_TYPES[out.type])
            continue
        bound = [t for io, t in zip(spec.inputs, input_types) if io.type == out.type and t is not None]
        if not bound:
            raise ValueError(f"{name}: no present input binds type constraint {out.type!r} of output {out.name!r}")
        result.append(bound[0])
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
