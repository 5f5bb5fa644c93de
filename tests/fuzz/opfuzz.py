"""Malformed-input fuzzing of every op of the ai.dsv4ort domain through onnxruntime.

A case is one node of the op table in a one-node model whose graph inputs carry no shapes (so onnxruntime hands
the kernel whatever tensors are fed), plus the tensors to feed and the node's attributes. Cases start from a valid
configuration of the op (small, consistent dimensions) and get up to a few mutations: wrong ranks, zero and huge
dimensions (huge ones always with a zero elsewhere so the tensor is empty), dimensions that disagree between inputs,
negative / out-of-range indices, positions and token ids, NaN / Inf / extreme values, state tensors of the wrong
capacity, absent or extra optional inputs, wrong element types, attribute values out of range, of the wrong type,
missing or unknown, in-place (same buffer) and partially overlapping past / present bindings.

The contract checked: a case either runs or fails with an onnxruntime error whose message names the op; it never
crashes, hangs, trips a sanitizer or makes the library allocate absurd memory (workers run under an address-space
limit, or ASan's allocation-size limit, so an allocation sized from a huge dimension shows up).

Case i of a run is a pure function of (seed, i), so a crashing case is regenerated from its index and saved as a
JSON file (the regression corpus in tests/fuzz/corpus/ holds such files; see ``replay``).

    python tests/fuzz/opfuzz.py --cases 100000 --jobs 2 [--seed S] [--ops Linear,Indexer] [--save-crashes DIR]
    python tests/fuzz/opfuzz.py --replay tests/fuzz/corpus        # run saved cases, print the outcomes
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import math
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CORPUS_DIR = HERE / "corpus"

# Element storage and codes of the ONNX types, from the op table (bfloat16 as uint16 bits, float8e4m3fn as uint8).
_ELEMENT_TYPES = json.loads((Path(__file__).resolve().parents[2] / "src/dsv4_ort/export/op_table.json")
                            .read_text())["element_types"]
STORAGE = {name: np.dtype(t["numpy"]) for name, t in _ELEMENT_TYPES.items() if name != "string"}
ONNX_CODE = {name: t["code"] for name, t in _ELEMENT_TYPES.items()}

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
HUGE_DIMS = (2 ** 31, 2 ** 32 + 1, 2 ** 40, 2 ** 48, 2 ** 62, INT64_MAX)
MAX_ELEMENTS = 1 << 16  # no fed tensor holds more elements than this

# Outcome classes.
OK, REJECTED, UNNAMED, OOM, SKIPPED = "ok", "rejected", "unnamed-error", "out-of-memory", "skipped"
ORT_ALLOC = "ort-alloc-abort"  # ASan only: onnxruntime's allocation of a huge output failed (see ort_allocation_abort)


def table():
    from dsv4_ort.export import schema

    return schema


# ---------------------------------------------------------------------------------------------------- tensors


class Tensor:
    """An input to feed: ONNX type name, shape, and the storage array (None when the tensor has no elements)."""

    __slots__ = ("type", "shape", "data")

    def __init__(self, type_name: str, shape, data=None):
        self.type = type_name
        self.shape = [int(d) for d in shape]
        self.data = data

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if all(d >= 0 for d in self.shape) else 0

    def to_json(self) -> dict:
        out = {"type": self.type, "shape": self.shape}
        if self.data is not None and self.data.size:
            raw = np.ascontiguousarray(self.data).tobytes()
            out["data"] = base64.b64encode(zlib.compress(raw, 9)).decode()
        return out

    @staticmethod
    def from_json(d: dict) -> "Tensor":
        data = None
        if "data" in d:
            raw = zlib.decompress(base64.b64decode(d["data"]))
            data = np.frombuffer(raw, STORAGE[d["type"]]).reshape(d["shape"]).copy()
        return Tensor(d["type"], d["shape"], data)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0
    return out


def random_values(rng, type_name: str, shape, kind: str = "normal", lo: int = 0, hi: int = 1) -> np.ndarray:
    """Storage array of `shape` for an input of `type_name`."""
    n = math.prod(shape)
    if type_name in ("int64", "int32", "int8"):
        v = rng.integers(lo, max(hi, lo + 1), size=n, dtype=np.int64)
        return v.astype(STORAGE[type_name]).reshape(shape)
    if type_name == "uint8":  # E8M0 scales or packed FP4 codes
        if kind == "scale":
            return rng.integers(118, 134, size=n, dtype=np.uint8).reshape(shape)
        return rng.integers(0, 256, size=n, dtype=np.uint8).reshape(shape)
    if type_name == "float8e4m3fn":  # finite codes (0x7F / 0xFF are the NaN codes)
        v = rng.integers(0, 0x7F, size=n, dtype=np.uint8) | (rng.integers(0, 2, size=n, dtype=np.uint8) << 7)
        return v.reshape(shape)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "positive":
        x = np.abs(x) + np.float32(0.25)
    elif kind == "freq":
        x = (np.float32(1.0) / (np.float32(10000.0) ** (np.arange(n, dtype=np.float32) / max(n, 1)))).astype(np.float32)
    x = x.reshape(shape)
    if type_name == "bfloat16":
        return f32_to_bf16(x)
    return x.astype(STORAGE.get(type_name, np.float32))


# ---------------------------------------------------------------------------------------------------- cases


class Case:
    """One fuzz case (see the module docstring); JSON-serialisable."""

    def __init__(self, op: str, inputs: dict, attrs: dict, *, isa: str = "scalar", threads: int = 1,
                 alias: dict | None = None, overlap: dict | None = None, opset: int = 1, constants=(), tags=()):
        self.op = op
        self.inputs = inputs          # input name -> Tensor, or None (absent)
        self.attrs = attrs            # attribute name -> int / float / str (absent = default)
        self.isa = isa
        self.threads = threads
        self.alias = alias or {}      # output name -> input name bound to the same OrtValue
        self.overlap = overlap or {}  # output name -> [input name, byte offset]: a buffer overlapping the input
        self.opset = opset
        self.constants = list(constants)  # inputs stored in the model as initializers instead of being fed
        self.tags = list(tags)

    def to_json(self) -> dict:
        attrs = {k: (v if not isinstance(v, float) or math.isfinite(v) else {"float": repr(v)})
                 for k, v in self.attrs.items()}
        return {"op": self.op, "isa": self.isa, "threads": self.threads, "opset": self.opset,
                "constants": self.constants,
                "attrs": attrs, "alias": self.alias, "overlap": self.overlap, "tags": self.tags,
                "inputs": {k: (None if t is None else t.to_json()) for k, t in self.inputs.items()}}

    @staticmethod
    def from_json(d: dict) -> "Case":
        attrs = {k: (float(v["float"]) if isinstance(v, dict) else v) for k, v in d["attrs"].items()}
        inputs = {k: (None if t is None else Tensor.from_json(t)) for k, t in d["inputs"].items()}
        return Case(d["op"], inputs, attrs, isa=d.get("isa", "scalar"), threads=d.get("threads", 1),
                    alias=d.get("alias"), overlap=d.get("overlap"), opset=d.get("opset", 1),
                    constants=d.get("constants", ()), tags=d.get("tags", ()))


class Builder:
    """Helper for the valid-case generators: typed tensors of the op's inputs.

    Two random streams: ``g*`` draws come from the case group's stream and decide everything that shapes the model
    (attribute values, which optional inputs are present), so the cases of a group share one session; the other
    draws come from the case's own stream (dimensions, values). A generator must draw from the group stream
    unconditionally (never depending on a per-case draw), or cases of one group would get different models.
    """

    def __init__(self, op: str, rng, grng, types: dict):
        self.spec = table().get(op)
        self.rng = rng
        self.grng = grng
        self.types = types
        self.inputs = {io.name: None for io in self.spec.inputs}

    def type_of(self, name: str) -> str:
        io = next(i for i in self.spec.inputs if i.name == name)
        return self.types.get(io.type, io.type)

    def put(self, name: str, shape, kind: str = "normal", lo: int = 0, hi: int = 1, data=None):
        t = self.type_of(name)
        if data is None:
            data = random_values(self.rng, t, list(shape), kind, lo, hi)
        data = np.ascontiguousarray(data).reshape(shape)
        self.inputs[name] = Tensor(t, shape, data if data.size else None)

    def small(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def choice(self, seq):
        return seq[int(self.rng.integers(0, len(seq)))]

    def g(self, lo: int, hi: int) -> int:
        return int(self.grng.integers(lo, hi + 1))

    def gchoice(self, seq):
        return seq[int(self.grng.integers(0, len(seq)))]

    def gflag(self, p: float) -> bool:
        return bool(self.grng.random() < p)


def _lead(b: Builder, max_dims: int = 2, lo: int = 0):
    return [b.small(lo, 3) for _ in range(b.small(0, max_dims))]


def gen_library_info(b):
    b.put("unused", [b.small(0, 3) for _ in range(b.small(0, 2))], lo=-5, hi=5)
    return {}


def _routing_attrs(b, attrs):
    if b.gflag(0.5):
        attrs["scoring"] = b.gchoice(["sqrtsoftplus", "softmax", "sigmoid"])
    if b.gflag(0.3):
        attrs["norm_topk_prob"] = b.g(0, 1)
    if b.gflag(0.3):
        attrs["routed_scaling_factor"] = b.gchoice([1.0, 2.5])
    return attrs


def gen_moe_route_topk(b):
    top_k, with_bias = b.g(1, 4), b.gflag(0.5)
    attrs = _routing_attrs(b, {"top_k": top_k})
    t, e = b.small(0, 6), b.small(top_k, 10)
    b.put("logits", [t, e])
    if with_bias:
        b.put("bias", [e])
    return attrs


def gen_moe_route_hash(b):
    attrs = _routing_attrs(b, {})
    t, e, v = b.small(0, 6), b.small(1, 8), b.small(1, 9)
    k = b.small(1, min(e, 3))
    b.put("logits", [t, e])
    b.put("input_ids", [t], lo=0, hi=v)
    b.put("tid2eid", [v, k], lo=0, hi=e)
    return attrs


def gen_hc_pre(b):
    attrs = {"sinkhorn_iters": b.gchoice([1, 3, 20])} if b.gflag(0.5) else {}
    hc, d = b.choice([1, 2, 4]), b.small(1, 12)
    lead = _lead(b, 2, 0) or [b.small(0, 3)]
    b.put("x", lead + [hc, d])
    b.put("fn", [(2 + hc) * hc, hc * d])
    b.put("scale", [3])
    b.put("base", [(2 + hc) * hc])
    return attrs


def gen_hc_post(b):
    hc, d = b.choice([1, 2, 4]), b.small(1, 12)
    lead = _lead(b, 2, 0) or [b.small(0, 3)]
    b.put("f", lead + [d])
    b.put("residual", lead + [hc, d])
    b.put("post", lead + [hc])
    b.put("comb", lead + [hc, hc])
    return {}


def gen_hc_head(b):
    hc, d = b.choice([1, 2, 4]), b.small(1, 12)
    lead = _lead(b, 2, 0) or [b.small(0, 3)]
    b.put("x", lead + [hc, d])
    b.put("fn", [hc, hc * d])
    b.put("scale", [1])
    b.put("base", [hc])
    return {}


def _linear_x(b, k):
    b.put("x", _lead(b, 2, 0) + [k])


def gen_linear(b):
    g = b.gchoice([1, 1, 2, 3])
    attrs = {"groups": g} if g != 1 or b.gflag(0.3) else {}
    kw, n = b.small(1, 12), b.small(1, 5)
    _linear_x(b, g * kw)
    b.put("weight", [g * n, kw])
    return attrs


def gen_linear_fp8(b):
    g, blk = b.gchoice([1, 1, 2]), b.gchoice([1, 4, 128])
    attrs = {"block_size": blk} if blk != 128 or b.gflag(0.3) else {}
    if g != 1:
        attrs["groups"] = g
    kw, n = b.small(1, 12), b.small(1, 5)
    _linear_x(b, g * kw)
    b.put("weight", [g * n, kw])
    b.put("scale", [-(-g * n // blk), -(-kw // blk)], kind="scale" if b.type_of("scale") == "uint8" else "positive")
    return attrs


def gen_linear_fp4(b):
    g = b.gchoice([1, 1, 2])
    kw, n = b.choice([32, 64]), b.small(1, 4)
    _linear_x(b, g * kw)
    b.put("weight", [g * n, kw // 2])
    b.put("scale", [g * n, kw // 32], kind="scale")
    return {"groups": g} if g != 1 else {}


def _experts_common(b, d, dense):
    t = b.small(0, 5)
    e = 1 if dense else b.small(1, 4)
    b.put("x", [t, d])
    if not dense:
        k = b.small(1, e)
        b.put("weights", [t, k], kind="positive")
        b.put("indices", [t, k], lo=0, hi=e)
    return e


def gen_moe_experts(b):
    dense = b.gflag(0.25)
    attrs = {"swiglu_limit": b.gchoice([10.0, 0.0])} if b.gflag(0.3) else {}
    d, inter = b.small(1, 10), b.small(1, 10)
    e = _experts_common(b, d, dense)
    b.put("w1", [e, inter, d])
    b.put("w2", [e, d, inter])
    b.put("w3", [e, inter, d])
    return attrs


def gen_moe_experts_fp8(b):
    dense, blk = b.gflag(0.25), b.gchoice([4, 128])
    d, inter = b.small(1, 10), b.small(1, 10)
    e = _experts_common(b, d, dense)
    kind = "scale" if b.type_of("s1") == "uint8" else "positive"
    b.put("w1", [e, inter, d])
    b.put("w2", [e, d, inter])
    b.put("w3", [e, inter, d])
    b.put("s1", [e, -(-inter // blk), -(-d // blk)], kind=kind)
    b.put("s2", [e, -(-d // blk), -(-inter // blk)], kind=kind)
    b.put("s3", [e, -(-inter // blk), -(-d // blk)], kind=kind)
    return {"block_size": blk} if blk != 128 else {}


def gen_moe_experts_fp4(b):
    dense = b.gflag(0.25)
    d, inter = b.choice([32, 64]), b.choice([32, 64])
    e = _experts_common(b, d, dense)
    b.put("w1", [e, inter, d // 2])
    b.put("w2", [e, d, inter // 2])
    b.put("w3", [e, inter, d // 2])
    b.put("s1", [e, inter, d // 32], kind="scale")
    b.put("s2", [e, d, inter // 32], kind="scale")
    b.put("s3", [e, inter, d // 32], kind="scale")
    return {}


def gen_rms_norm(b):
    with_weight, attrs = b.gflag(0.6), ({"eps": 1e-6} if b.gflag(0.2) else {})
    n = b.small(1, 16)
    b.put("x", _lead(b, 2, 0) + [n])
    if with_weight:
        b.put("weight", [n])
    return attrs


def _rope_inputs(b, with_heads: bool):
    bs, s, dim = b.small(1, 3), b.small(1, 4), 2 * b.small(1, 8)
    shape = [bs, s] + ([b.small(1, 3)] if with_heads else []) + [dim]
    b.put("x", shape)
    b.put("start_pos", [bs], lo=0, hi=100)
    b.put("inv_freq", [b.small(0, dim // 2)], kind="freq")
    return dim


def gen_norm_rope(b):
    with_weight = b.gflag(0.5)
    dim = _rope_inputs(b, b.rng.random() < 0.5)
    if with_weight:
        b.put("weight", [dim])
    return {}


def gen_rope(b):
    attrs = {"inverse": b.g(0, 1)} if b.gflag(0.5) else {}
    _rope_inputs(b, b.rng.random() < 0.7)
    return attrs


def fp8_entry_bytes(dim: int, rope: int) -> int:
    """Row bytes of an FP8 attention-state entry (custom_ops/kernels/state_fp8.h)."""
    return (dim - rope) + 2 * rope + ((dim - rope) // 64 + 7) // 8 * 8


def gen_compressor(b):
    layout = b.gchoice(["attention", "index"])
    fp8 = b.type_of("past_entries") == "uint8"  # FP8 state rows: widths that fit the layout
    bs, s, c, coff, r = b.small(1, 2), b.small(1, 6), b.choice([2, 4, 8]), b.small(1, 2), b.choice([1, 2, 4])
    half = b.small(0, c // 2)
    if fp8 and layout == "attention":
        c = 64 + 2 * half
    start = b.rng.integers(0, 24, size=bs)
    cap = int(((start + s) // r).max()) + b.small(0, 2)
    w = coff * c
    b.put("kv", [bs, s, w])
    b.put("score", [bs, s, w])
    b.put("ape", [r, w])
    b.put("norm_weight", [c])
    b.put("inv_freq", [half], kind="freq")
    b.put("start_pos", [bs], data=start.astype(np.int64))
    row = (fp8_entry_bytes(c, 2 * half) if layout == "attention" else c + 4) if fp8 else c
    b.put("past_entries", [bs, cap, row])
    b.put("past_kv_state", [bs, coff * r, w])
    b.put("past_score_state", [bs, coff * r, w])
    return {"fp8_layout": layout} if fp8 else {}


def gen_indexer(b):
    ratio, topk = b.gchoice([1, 4]), b.gchoice([1, 4])
    bs, s, heads, cd = b.small(1, 2), b.small(1, 4), b.small(1, 3), b.small(1, 8)
    start = b.rng.integers(0, 20, size=bs)
    cap = int(((start + s) // ratio).max()) + b.small(0, 2)
    b.put("q", [bs, s, heads, cd])
    b.put("weights", [bs, s, heads])
    b.put("keys", [bs, cap, cd + 4 if b.type_of("keys") == "uint8" else cd])  # uint8: FP8 keys + float32 scale
    b.put("start_pos", [bs], data=start.astype(np.int64))
    return {"ratio": ratio, "index_topk": topk}


def gen_sparse_attention(b):
    ratio, with_entries, with_indices, explicit = b.gchoice([0, 4]), b.gflag(0.8), b.gflag(0.6), b.gflag(0.3)
    bs, s, heads, dim, win = b.small(1, 2), b.small(1, 4), b.small(1, 3), 2 * b.small(1, 4), b.small(1, 6)
    half = b.small(0, dim // 2)
    fp8 = b.type_of("past_window") == "uint8"  # FP8 state rows: D - rd must be a multiple of 64
    if fp8:
        dim = 64 + 2 * half
    row = fp8_entry_bytes(dim, 2 * half) if fp8 else dim
    start = b.rng.integers(0, 20, size=bs)
    b.put("q", [bs, s, heads, dim])
    b.put("kv", [bs, s, dim])
    b.put("past_window", [bs, win, row])
    b.put("sink", [heads])
    b.put("inv_freq", [half], kind="freq")
    b.put("start_pos", [bs], data=start.astype(np.int64))
    if ratio and with_entries:
        cap = int(((start + s) // ratio).max()) + b.small(0, 2)
        b.put("entries", [bs, cap, row])
        if with_indices:
            b.put("indices", [bs, s, b.small(0, 4)], lo=-1, hi=max(cap, 0))
    return {"ratio": ratio} if ratio or explicit else {}


GENERATORS = {
    "LibraryInfo": gen_library_info, "MoeRouteTopK": gen_moe_route_topk, "MoeRouteHash": gen_moe_route_hash,
    "HcPre": gen_hc_pre, "HcPost": gen_hc_post, "HcHead": gen_hc_head, "Linear": gen_linear,
    "LinearFp8": gen_linear_fp8, "LinearFp4": gen_linear_fp4, "MoeExperts": gen_moe_experts,
    "MoeExpertsFp8": gen_moe_experts_fp8, "MoeExpertsFp4": gen_moe_experts_fp4, "RmsNorm": gen_rms_norm,
    "NormRope": gen_norm_rope, "Rope": gen_rope, "Compressor": gen_compressor, "Indexer": gen_indexer,
    "SparseAttention": gen_sparse_attention,
}

# past -> present pairs of the ops that keep state in place.
STATE_PAIRS = {
    "Compressor": {"present_entries": "past_entries", "present_kv_state": "past_kv_state",
                   "present_score_state": "past_score_state"},
    "SparseAttention": {"present_window": "past_window"},
}

SPECIAL_FLOATS = (float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, -0.0, 1e30)
SPECIAL_BF16 = (0x7FC0, 0x7F80, 0xFF80, 0x7F7F, 0xFF7F, 0x0001, 0x8000, 0xFFFF)
SPECIAL_FP8 = (0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80, 0x01)
SPECIAL_U8 = (0xFF, 0x00, 0xFE, 0x01, 0x7F, 0x80)
SPECIAL_INTS = (INT64_MIN, -(2 ** 31), -2, -1, 0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 48 - 1, 2 ** 48, 2 ** 62,
                INT64_MAX)
SPECIAL_ATTR_INTS = (INT64_MIN, -(2 ** 31), -1, 0, 1, 2, 3, 5, 7, 16, 33, 64, 128, 10001, 2 ** 31 - 1, 2 ** 31,
                     2 ** 40, 2 ** 62, INT64_MAX)
SPECIAL_ATTR_FLOATS = (float("nan"), float("inf"), float("-inf"), -1.0, 0.0, -0.0, 1e-45, 1e-30, 1e30, 3.4e38, 1.0)
SPECIAL_ATTR_STRINGS = ("", "softmax", "SOFTMAX", "sigmoid ", "x" * 300, "sqrtsoftplus|softmax", "\u00e9")


def _alloc(rng, t: Tensor) -> Tensor:
    """Re-creates t's data for its (new) shape: empty tensors carry no data, oversized ones are shrunk."""
    if any(d < 0 for d in t.shape):
        t.shape = [abs(d) for d in t.shape]
    t.shape = [min(d, INT64_MAX) for d in t.shape]
    if t.numel > MAX_ELEMENTS:
        big = max(range(len(t.shape)), key=lambda i: t.shape[i])
        t.shape[big] = 0
    prefix = 1
    for d in t.shape:  # onnxruntime multiplies dims in order (overflow-checked) until it meets a zero
        prefix *= d
        if prefix == 0:
            break
        if prefix > INT64_MAX:
            t.shape[0] = 0
            break
    if t.numel == 0:
        t.data = None
        return t
    old = t.data
    new = random_values(rng, t.type, t.shape, "scale" if t.type == "uint8" else "normal")
    if old is not None and old.size and t.type in ("int64", "int32"):
        # keep index-like inputs mostly in the range they had
        flat_old = old.reshape(-1)
        new = flat_old[rng.integers(0, flat_old.size, size=new.size)].reshape(t.shape).astype(old.dtype)
    t.data = new
    return t


def _present(case):
    return [n for n, t in case.inputs.items() if t is not None]


DATA_MUTATIONS = ("rank", "dim_zero", "dim_huge", "dim_huge_consistent", "dim_perturb", "dim_consistent", "values",
                  "ints", "ints", "all_empty", "extreme_scale")
MODEL_MUTATIONS = ("optional", "drop_required", "attr_value", "attr_value", "attr_type", "attr_missing",
                   "attr_unknown", "dtype", "dtype", "opset", "constants")


def _pick(rng, seq):
    return seq[int(rng.integers(0, len(seq)))]


def mutate_data(rng, case: Case, spec) -> str:
    """One random change of shapes or values (the model stays the same); returns its name."""
    names = _present(case)
    m = _pick(rng, DATA_MUTATIONS)
    pick = lambda seq: _pick(rng, seq)  # noqa: E731
    if m == "rank" and names:
        t = case.inputs[pick(names)]
        if t.shape and rng.random() < 0.5:
            del t.shape[int(rng.integers(0, len(t.shape)))]
        else:
            t.shape.insert(int(rng.integers(0, len(t.shape) + 1)), int(rng.integers(0, 4)))
        _alloc(rng, t)
    elif m == "dim_zero" and names:
        t = case.inputs[pick(names)]
        if t.shape:
            t.shape[int(rng.integers(0, len(t.shape)))] = 0
            _alloc(rng, t)
    elif m == "dim_huge" and names:
        t = case.inputs[pick(names)]
        if len(t.shape) >= 2:
            i, j = rng.choice(len(t.shape), size=2, replace=False)
            t.shape[i], t.shape[j] = pick(HUGE_DIMS), 0
        elif t.shape:
            t.shape[0] = 0
        _alloc(rng, t)
    elif m in ("dim_huge_consistent", "dim_consistent", "all_empty"):
        dims = sorted({d for n in names for d in case.inputs[n].shape if d > 0})
        if dims:
            v = pick(dims)
            if m == "dim_huge_consistent":
                repl = pick(HUGE_DIMS)
            elif m == "all_empty":
                repl = 0
            else:
                repl = min(max(0, v + pick([-2, -1, 1, 2, 5, 31, 32, 33, 127, 128, 129])), INT64_MAX)
            zero = pick([d for d in dims if d != v] or [v]) if m == "dim_huge_consistent" else None
            for n in names:
                t = case.inputs[n]
                t.shape = [repl if d == v else (0 if d == zero else d) for d in t.shape]
                _alloc(rng, t)
    elif m == "dim_perturb" and names:
        t = case.inputs[pick(names)]
        if t.shape:
            i = int(rng.integers(0, len(t.shape)))
            t.shape[i] = min(max(0, t.shape[i] + pick([-1, 1, 2, -2, 7])), INT64_MAX)
            _alloc(rng, t)
    elif m == "values":
        floats = [n for n in names if case.inputs[n].type in ("float", "bfloat16", "float8e4m3fn", "uint8")
                  and case.inputs[n].data is not None]
        if floats:
            t = case.inputs[pick(floats)]
            flat = t.data.reshape(-1)
            special = {"float": SPECIAL_FLOATS, "bfloat16": SPECIAL_BF16, "float8e4m3fn": SPECIAL_FP8,
                       "uint8": SPECIAL_U8}[t.type]
            count = flat.size if rng.random() < 0.3 else int(rng.integers(1, flat.size + 1))
            where = rng.choice(flat.size, size=count, replace=False)
            flat[where] = np.array([pick(special) for _ in where]).astype(flat.dtype)
    elif m == "ints":
        ints = [n for n in names if case.inputs[n].type in ("int64", "int32") and case.inputs[n].data is not None]
        if ints:
            t = case.inputs[pick(ints)]
            flat = t.data.reshape(-1)
            dims = [d for n in names for d in case.inputs[n].shape if 0 < d < 2 ** 20]
            vals = list(SPECIAL_INTS) + [d + o for d in dims for o in (-1, 0, 1)]
            info = np.iinfo(flat.dtype)
            for i in rng.choice(flat.size, size=int(rng.integers(1, flat.size + 1)), replace=False):
                flat[i] = min(max(pick(vals), info.min), info.max)
    elif m == "extreme_scale":
        floats = [n for n in names if case.inputs[n].type == "float" and case.inputs[n].data is not None]
        if floats:
            t = case.inputs[pick(floats)]
            with np.errstate(all="ignore"):
                scaled = np.asarray(t.data * np.float32(pick([1e30, 1e-30, -1e20, 1e38])), np.float32)
                t.data = scaled.reshape(t.shape)
    return m


def mutate_model(grng, rng, case: Case, spec) -> str:
    """One random change of the model (attributes, input presence, element types, opset) or of the past / present
    binding. Every choice comes from the group stream `grng`, so all cases of a group get the same change; the
    case stream `rng` only fills new tensors."""
    m = _pick(grng, MODEL_MUTATIONS + (("overlap",) if case.op in STATE_PAIRS else ()))
    pick = lambda seq: _pick(grng, seq)  # noqa: E731
    if m == "optional":
        opt = [io for io in spec.inputs if io.optional]
        if opt:
            io = pick(opt)
            rank_extra = int(grng.integers(0, 3))
            if case.inputs.get(io.name) is not None:
                case.inputs[io.name] = None
            else:
                names = _present(case)
                dims = [d for n in names for d in case.inputs[n].shape if 0 < d < 64] or [1]
                rank = io.rank if io.rank >= 0 else io.min_rank + rank_extra
                t = Tensor(_type_for(spec, io, case), [_pick(rng, dims) for _ in range(rank)])
                case.inputs[io.name] = _alloc(rng, t)
                if t.type in ("int64", "int32") and t.data is not None:
                    t.data[...] = rng.integers(-1, max(dims) + 1, size=t.data.shape)
    elif m == "drop_required":
        case.inputs[pick([io.name for io in spec.inputs if not io.optional])] = None
    elif m == "attr_value" and spec.attributes:
        a = pick(spec.attributes)
        case.attrs[a.name] = pick({"int": SPECIAL_ATTR_INTS, "float": SPECIAL_ATTR_FLOATS,
                                   "string": SPECIAL_ATTR_STRINGS}[a.type])
    elif m == "attr_type" and spec.attributes:
        a = pick(spec.attributes)
        case.attrs[a.name] = pick({"int": [1.5, "3"], "float": [1, "x"], "string": [1, 2.0]}[a.type])
    elif m == "attr_missing":
        if case.attrs:
            del case.attrs[pick(sorted(case.attrs))]
    elif m == "attr_unknown":
        case.attrs["bogus"] = pick([1, 2.0, "x"])
    elif m == "dtype":
        name = pick([io.name for io in spec.inputs])
        new_type = pick(["float", "bfloat16", "int64", "int32", "uint8", "float8e4m3fn", "float16"])
        t = case.inputs.get(name)
        if t is not None and new_type != t.type:
            t.type = new_type
            t.data = None
            _alloc(rng, t)
    elif m == "overlap":
        out, inp = pick(sorted(STATE_PAIRS[case.op].items()))
        offset = int(pick([1, 2, 4, 8, 64]))
        case.alias.pop(out, None)
        if case.inputs.get(inp) is not None and case.inputs[inp].data is not None and inp not in case.constants:
            case.overlap[out] = [inp, offset]
    elif m == "opset":
        case.opset = pick([0, 2, 99])
    elif m == "constants":  # weights, scales, tables... as initializers (what an exported model holds)
        names = [io.name for io in spec.inputs]
        chosen = [n for n in names if grng.random() < 0.4] or [pick(names)]
        bound = set(case.alias.values()) | {src for src, _ in case.overlap.values()}
        case.constants = [n for n in chosen if n not in bound]
    return m


def _type_for(spec, io, case: Case) -> str:
    if io.type not in spec.type_constraints:
        return io.type
    for other in spec.inputs:  # the type already bound to this constraint
        if other.type == io.type and case.inputs.get(other.name) is not None:
            return case.inputs[other.name].type
    return spec.type_constraints[io.type][0]


GROUP = 32  # consecutive cases sharing op, element types, attributes, ISA level and threads (one session)


def op_of(index: int, ops: list) -> str:
    return ops[(index // GROUP) % len(ops)]


def make_case(seed: int, index: int, ops: list, isa_levels: list) -> Case:
    """Case `index` of the run with `seed` (deterministic)."""
    group = index // GROUP
    rng = np.random.default_rng([seed, index])
    grng = np.random.default_rng([seed, group, 1])
    op = op_of(index, ops)
    spec = table().get(op)
    types = {tv: allowed[int(grng.integers(0, len(allowed)))] for tv, allowed in spec.type_constraints.items()}
    isa = isa_levels[int(grng.integers(0, len(isa_levels)))]
    threads = int(grng.integers(1, 3))
    in_place = bool(grng.random() < 0.5)
    n_model = int(grng.choice([0, 0, 0, 1, 1, 2]))
    b = Builder(op, rng, grng, types)
    attrs = GENERATORS[op](b)
    case = Case(op, b.inputs, attrs, isa=isa, threads=threads)
    if op in STATE_PAIRS and in_place:
        case.alias = dict(STATE_PAIRS[op])
    mrng = np.random.default_rng([seed, group, 2])
    for _ in range(n_model):
        case.tags.append(mutate_model(mrng, rng, case, spec))
    for _ in range(int(rng.choice([0, 1, 1, 2, 2, 3]))):
        case.tags.append(mutate_data(rng, case, spec))
    return case


# ---------------------------------------------------------------------------------------------------- running


def _output_types(case: Case, spec) -> list:
    out = []
    for o in spec.outputs:
        if o.type in spec.type_constraints:
            src = next((i for i in spec.inputs if i.type == o.type and case.inputs.get(i.name) is not None), None)
            out.append(case.inputs[src.name].type if src is not None else spec.type_constraints[o.type][0])
        else:
            out.append(o.type)
    return out


def build_model(case: Case) -> bytes:
    from onnx import TensorProto, helper

    spec = table().get(case.op)
    node_inputs = [io.name if case.inputs.get(io.name) is not None else "" for io in spec.inputs]
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()
    node = helper.make_node(case.op, node_inputs, [o.name for o in spec.outputs], name="n0",
                            domain=table().DOMAIN)
    for k, v in case.attrs.items():
        node.attribute.append(helper.make_attribute(k, v))
    graph_inputs = [helper.make_tensor_value_info(n, ONNX_CODE[t.type], None)
                    for n, t in case.inputs.items() if t is not None and n not in case.constants]
    initializers = []
    for n in case.constants:
        t = case.inputs.get(n)
        if t is not None:
            raw = b"" if t.data is None else np.ascontiguousarray(t.data).tobytes()
            initializers.append(helper.make_tensor(n, ONNX_CODE[t.type], t.shape, raw, raw=True))
    out_types = _output_types(case, spec)
    graph_outputs = [helper.make_tensor_value_info(o.name, ONNX_CODE.get(t, TensorProto.FLOAT), None)
                     for o, t in zip(spec.outputs, out_types)]
    graph = helper.make_graph([node], "fuzz", graph_inputs, graph_outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                     helper.make_opsetid(table().DOMAIN, case.opset)],
                              ir_version=10)
    return model.SerializeToString()


class Runner:
    """Runs cases with a cache of sessions (one per model bytes, ISA level and thread count)."""

    def __init__(self, max_sessions: int = 256):
        import onnxruntime as ort

        import dsv4_ort

        self.ort = ort
        self.dsv4_ort = dsv4_ort
        self.sessions = collections.OrderedDict()
        self.max_sessions = max_sessions

    def session(self, case: Case):
        model = build_model(case)
        key = (model, case.isa, case.threads)
        sess = self.sessions.get(key)
        if sess is not None:
            self.sessions.move_to_end(key)
            return sess
        so = self.ort.SessionOptions()
        so.intra_op_num_threads = case.threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 4
        so.enable_cpu_mem_arena = False  # a session's arena would keep its largest output allocated
        with self.dsv4_ort.isa_cap(case.isa):
            self.dsv4_ort.register(so)
            sess = self.ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        self.sessions[key] = sess
        if len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return sess

    def value(self, t: Tensor):
        ort = self.ort
        if t.data is None:
            return ort.OrtValue.ortvalue_from_shape_and_type(t.shape, ONNX_CODE[t.type])
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.data, ONNX_CODE[t.type])

    def run(self, case: Case) -> tuple:
        """(outcome, message) for one case."""
        try:
            feeds = {n: self.value(t) for n, t in case.inputs.items() if t is not None and n not in case.constants}
        except Exception as e:  # a shape onnxruntime cannot even represent (its size overflows int64)
            return SKIPPED, str(e)
        try:
            sess = self.session(case)
            if not case.alias and not case.overlap:
                sess.run_with_ort_values(None, feeds)
            else:
                keep = []
                io = sess.io_binding()
                for n, v in feeds.items():
                    io.bind_ortvalue_input(n, v)
                spec = table().get(case.op)
                for o, otype in zip(spec.outputs, _output_types(case, spec)):
                    if o.name in case.alias and case.alias[o.name] in feeds:
                        io.bind_ortvalue_output(o.name, feeds[case.alias[o.name]])
                    elif o.name in case.overlap and case.inputs.get(case.overlap[o.name][0]) is not None \
                            and case.inputs[case.overlap[o.name][0]].data is not None:
                        src, offset = case.overlap[o.name]
                        t = case.inputs[src]
                        # One backing buffer: the input at its start, the output `offset` bytes later; both fit.
                        backing = np.zeros(t.data.nbytes + offset, np.uint8)
                        backing[:t.data.nbytes] = t.data.reshape(-1).view(np.uint8)
                        keep.append(backing)
                        in_view = backing[:t.data.nbytes].view(t.data.dtype).reshape(t.shape)
                        v = self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(in_view, ONNX_CODE[t.type])
                        keep.append(v)
                        io.bind_ortvalue_input(src, v)
                        io.bind_output(o.name, "cpu", 0, ONNX_CODE[otype], t.shape, backing.ctypes.data + offset)
                    else:
                        io.bind_output(o.name, "cpu")
                sess.run_with_iobinding(io)
            return OK, ""
        except Exception as e:  # onnxruntime's Fail / InvalidArgument / InvalidGraph / RuntimeException ...
            msg = str(e)
            if re.search(r": out of memory|std::length_error", msg):
                return OOM, msg  # the library's own allocation failed (the glue's wording for std::bad_alloc)
            return (REJECTED if case.op in msg else UNNAMED), msg


def message_template(msg: str) -> str:
    """An error message with numbers and shapes blanked, for grouping."""
    msg = msg.split("Status Message:")[-1]
    msg = re.sub(r"\[[-0-9, ]*\]", "[..]", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", msg)
    return " ".join(msg.split())[:160]


# ---------------------------------------------------------------------------------------------------- worker


def _limit_memory(limit_bytes: int) -> None:
    if os.environ.get("LD_PRELOAD", "").find("asan") >= 0:
        return  # ASan reserves terabytes of shadow address space; its allocation-size limit applies instead
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def worker_main(args) -> int:
    """Runs cases [start, stop) and keeps the index of the running case in the progress file."""
    _limit_memory(args.mem_limit_mb << 20)
    ops = args.ops.split(",")
    levels = args.isa.split(",")
    runner = Runner()
    runner.ort.set_default_logger_severity(4)
    with open(args.progress, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 16)
    counts = collections.defaultdict(collections.Counter)
    samples = {}
    last_dump = time.monotonic()

    def dump():
        with open(args.stats + ".tmp", "w") as out:
            json.dump({"counts": counts, "samples": samples}, out)
        os.replace(args.stats + ".tmp", args.stats)

    for i in range(args.start, args.stop):
        mm[0:8] = struct.pack("<q", i)
        case = make_case(args.seed, i, ops, levels)
        outcome, msg = runner.run(case)
        counts[case.op][outcome] += 1
        if outcome not in (OK, SKIPPED):
            key = f"{case.op}|{outcome}|{message_template(msg)}"
            if key not in samples:
                samples[key] = {"index": i, "message": msg[-600:]}
        if time.monotonic() - last_dump > 0.5:
            dump()
            last_dump = time.monotonic()
    mm[0:8] = struct.pack("<q", args.stop)
    mm[8:16] = struct.pack("<q", 1)
    dump()
    return 0


# ---------------------------------------------------------------------------------------------------- driver


def available_isa_levels() -> list:
    import dsv4_ort

    info = dsv4_ort.library_info()
    return list(dsv4_ort.ISA_LEVELS[: dsv4_ort.ISA_LEVELS.index(info["isa"]) + 1])


def sanitizer_env(library: str, log_dir: str) -> dict:
    """Environment running python with an ASan+UBSan build of the library (libstdc++ preloaded too, so ASan's
    __cxa_throw interceptor resolves in a python that does not link it)."""
    def gcc_file(name):
        return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                              check=True).stdout.strip()

    return {"LD_PRELOAD": f"{gcc_file('libasan.so')} {gcc_file('libstdc++.so')}",
            "DSV4_ORT_LIBRARY": library,
            "ASAN_OPTIONS": f"detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=2048:"
                            f"log_path={log_dir}/asan",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=0"}  # (halts anyway unless built recoverable)


class Failure(dict):
    pass


def report_excerpt(report: str, size: int = 4000) -> str:
    """The part of a crash's output worth reading: from the fatal sanitizer report (an ASan error, else the last
    UBSan report: earlier ones were recoverable) or fatal-error line on, without the python interpreter's frames."""
    m = re.search(r"ERROR: AddressSanitizer|Fatal Python error|Segmentation fault|terminate called", report)
    if m is None:
        m = list(re.finditer(r"runtime error:", report))[-1] if "runtime error:" in report else None
    text = report[m.start():] if m else report[-size:]
    keep = [line for line in text.splitlines() if not re.search(r" (Python|Objects|Modules|Include)/|site-packages|"
                                                                 r"libc_start|_start \(", line)]
    return "\n".join(keep)[:size]


def ort_allocation_abort(report: str) -> bool:
    """True for an ASan out-of-memory / allocation-size abort whose allocating caller is onnxruntime, not the
    library (frame #1, the caller of operator new / malloc)."""
    error = re.search(r"ERROR: AddressSanitizer: (allocator is out of memory|requested allocation size)", report)
    if error is None:
        return False
    m = re.compile(r"\n\s*#1 0x[0-9a-f]+ (.*)").search(report, error.end())
    return bool(m) and "onnxruntime" in m.group(1) and "libdsv4_ort" not in m.group(1)


def fuzz(cases: int, *, seed: int = 0, jobs: int = 2, ops: list | None = None, isa_levels: list | None = None,
         env: dict | None = None, start: int = 0, hang_timeout: float = 60.0, mem_limit_mb: int = 3072,
         save_dir: str | None = None, log=print) -> dict:
    """Runs cases [start, start + cases) in `jobs` worker processes. Returns figures and failures."""
    ops = ops or sorted(GENERATORS)
    isa_levels = isa_levels or available_isa_levels()
    env = dict(os.environ, **(env or {}))
    log_dir = None
    if "ASAN_OPTIONS" in env:
        m = re.search(r"log_path=([^:]+)/asan", env["ASAN_OPTIONS"])
        log_dir = m.group(1) if m else None
    work = tempfile.mkdtemp(prefix="dsv4-fuzz-")
    chunk = max(1, min(20000, cases // max(jobs, 1) + 1))
    pending = [(s, min(s + chunk, start + cases)) for s in range(start, start + cases, chunk)]
    running = []
    counts = collections.defaultdict(collections.Counter)
    samples, failures = {}, []
    t0 = time.monotonic()

    def launch(lo, hi):
        tag = f"{lo}-{hi}"
        progress, stats = os.path.join(work, f"p{tag}"), os.path.join(work, f"s{tag}.json")
        with open(progress, "wb") as f:
            f.write(struct.pack("<qq", lo, 0))
        cmd = [sys.executable, __file__, "--worker", "--seed", str(seed), "--start", str(lo), "--stop", str(hi),
               "--ops", ",".join(ops), "--isa", ",".join(isa_levels), "--progress", progress, "--stats", stats,
               "--mem-limit-mb", str(mem_limit_mb)]
        errlog = os.path.join(work, f"e{tag}.log")
        with open(errlog, "wb") as err:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        running.append({"proc": p, "lo": lo, "hi": hi, "progress": progress, "stats": stats, "stderr": errlog,
                        "last": lo, "since": time.monotonic()})

    def read_progress(w):
        with open(w["progress"], "rb") as f:
            return struct.unpack("<qq", f.read(16))

    def merge_stats(w):
        try:
            with open(w["stats"]) as f:
                s = json.load(f)
        except (OSError, ValueError):
            return
        for op, c in s["counts"].items():
            counts[op].update(c)
        for k, v in s["samples"].items():
            samples.setdefault(k, v)
        os.remove(w["stats"])

    def sanitizer_report(pid):
        if not log_dir:
            return ""
        texts = []
        for name in os.listdir(log_dir):
            if name.endswith(f".{pid}"):
                with open(os.path.join(log_dir, name), errors="replace") as f:
                    texts.append(f.read())
        return "\n".join(texts)

    try:
        _drive(pending, running, jobs, launch, read_progress, merge_stats, sanitizer_report, hang_timeout, seed, ops,
               isa_levels, counts, failures, save_dir, log)
    finally:
        for w in running:
            w["proc"].kill()
            w["proc"].wait()
    elapsed = time.monotonic() - t0
    # Reports of sanitizer checks built as recoverable (-fsanitize-recover=...) do not stop a worker: collect them.
    recovered = collections.Counter()
    logs = [os.path.join(work, n) for n in os.listdir(work) if n.startswith("e") and n.endswith(".log")]
    if log_dir and os.path.isdir(log_dir):
        logs += [os.path.join(log_dir, n) for n in os.listdir(log_dir)]
    for path in logs:
        with open(path, errors="replace") as f:
            for line in f:
                if "runtime error:" in line:
                    recovered[re.sub(r"0x[0-9a-f]+", "0x..", line.strip())] += 1
    for f in failures:  # a failure's own (fatal) report is not a recovered one
        fatal = re.sub(r"0x[0-9a-f]+", "0x..", next((ln.strip() for ln in f["report"].splitlines()
                                                     if "runtime error:" in ln), ""))
        if recovered.get(fatal):
            recovered[fatal] -= 1
    recovered = +recovered
    shutil.rmtree(work, ignore_errors=True)
    attempted = collections.Counter(op_of(i, ops) for i in range(start, start + cases))
    return {"cases": cases, "seed": seed, "start": start, "seconds": round(elapsed, 1),
            "attempted": dict(sorted(attempted.items())),
            "counts": {op: dict(c) for op, c in sorted(counts.items())}, "samples": samples, "failures": failures,
            "recovered_reports": dict(recovered)}


def _drive(pending, running, jobs, launch, read_progress, merge_stats, sanitizer_report, hang_timeout, seed, ops,
           isa_levels, counts, failures, save_dir, log):
    while pending or running:
        while pending and len(running) < jobs:
            launch(*pending.pop(0))
        time.sleep(0.2)
        for w in list(running):
            idx, done = read_progress(w)
            rc = w["proc"].poll()
            if rc is None:
                if idx != w["last"]:
                    w["last"], w["since"] = idx, time.monotonic()
                    continue
                if time.monotonic() - w["since"] <= hang_timeout:
                    continue
                w["proc"].kill()
                w["proc"].wait()
                rc = "hang"
            running.remove(w)
            merge_stats(w)
            if rc == 0 and done:
                continue
            with open(w["stderr"], errors="replace") as f:
                stderr = f.read()
            os.remove(w["stderr"])  # (its reports belong to this failure, not to the recovered ones)
            case = make_case(seed, idx, ops, isa_levels)
            kind = "hang" if rc == "hang" else (f"signal {-rc}" if isinstance(rc, int) and rc < 0 else f"exit {rc}")
            report = sanitizer_report(w["proc"].pid) + "\n" + stderr
            if ort_allocation_abort(report):
                # ASan aborts on any failed `operator new`, onnxruntime's too: an output buffer a huge (but
                # consistent) shape asks for. Not the library's allocation; the run goes on after the case.
                counts[case.op][ORT_ALLOC] += 1
                if idx + 1 < w["hi"]:
                    pending.insert(0, (idx + 1, w["hi"]))
                continue
            failure = Failure(index=idx, op=case.op, kind=kind, tags=case.tags, report=report_excerpt(report))
            failures.append(failure)
            counts[case.op]["crash"] += 1
            log(f"FAILURE case {idx} ({case.op}, {kind}, mutations {case.tags})")
            if save_dir:
                os.makedirs(save_dir, exist_ok=True)
                path = os.path.join(save_dir, f"crash-{case.op}-{seed}-{idx}.json")
                with open(path, "w") as f:
                    json.dump(dict(case.to_json(), failure={"kind": kind, "seed": seed, "index": idx}), f)
                failure["saved"] = path
            if idx + 1 < w["hi"]:
                pending.insert(0, (idx + 1, w["hi"]))


# ---------------------------------------------------------------------------------------------------- replay


def load_corpus(path=CORPUS_DIR) -> list:
    files = sorted(Path(path).glob("*.json")) if Path(path).is_dir() else [Path(path)]
    return [(f.name, json.loads(f.read_text())) for f in files]


def replay_main(args) -> int:
    """Runs saved cases and prints one JSON line before and one after each run (so a crash names its case). Each
    case runs at its own ISA level (capped at what this CPU has), or with --all-isa at every level the CPU has."""
    _limit_memory(args.mem_limit_mb << 20)
    levels = available_isa_levels()
    runner = Runner()
    runner.ort.set_default_logger_severity(4)
    for name, d in load_corpus(args.replay):
        case = Case.from_json(d)
        for isa in (levels if args.all_isa else [case.isa if case.isa in levels else levels[-1]]):
            case.isa = isa
            print(json.dumps({"file": name, "op": case.op, "isa": isa, "phase": "start"}), flush=True)
            outcome, msg = runner.run(case)
            print(json.dumps({"file": name, "op": case.op, "isa": isa, "outcome": outcome, "message": msg[-400:]}),
                  flush=True)
    return 0


def huge_sweep_cases(seed: int = 0, huge=(2 ** 40, INT64_MAX)):
    """Systematic huge-dimension cases: for each op, a valid case, then for every pair of distinct dimension values
    (v, u) of it: every v replaced by a huge value and every u by 0 (so the tensors stay empty but agree with each
    other, as a crafted model's would). Yields (name, Case)."""
    levels = available_isa_levels()
    for op in sorted(GENERATORS):
        for variant in range(2):
            rng = np.random.default_rng([seed, variant, len(op)])
            spec = table().get(op)
            types = {tv: allowed[variant % len(allowed)] for tv, allowed in spec.type_constraints.items()}
            b = Builder(op, rng, np.random.default_rng([seed, variant]), types)
            attrs = GENERATORS[op](b)
            dims = sorted({d for t in b.inputs.values() if t is not None for d in t.shape if d > 0})
            for v in dims:
                for u in [d for d in dims if d != v][:3] or [v]:
                    for h in huge:
                        inputs = {}
                        for n, t in b.inputs.items():
                            if t is None:
                                inputs[n] = None
                                continue
                            c = Tensor(t.type, [h if d == v else (0 if d == u else d) for d in t.shape], t.data)
                            inputs[n] = _alloc(rng, c) if c.shape != t.shape else c
                        case = Case(op, inputs, dict(attrs), isa=levels[variant * (len(levels) - 1)], threads=2)
                        yield f"{op}/{variant}/{v}->{h}/{u}->0", case


def sweep_main(args) -> int:
    """Runs huge_sweep_cases like replay_main (one JSON line before and after each case)."""
    _limit_memory(args.mem_limit_mb << 20)
    runner = Runner()
    runner.ort.set_default_logger_severity(4)
    for name, case in huge_sweep_cases(args.seed):
        print(json.dumps({"file": name, "op": case.op, "phase": "start"}), flush=True)
        outcome, msg = runner.run(case)
        print(json.dumps({"file": name, "op": case.op, "outcome": outcome, "message": msg[-300:]}), flush=True)
    print(json.dumps({"peak_rss_kb": _peak_rss_kb()}), flush=True)
    return 0


def _peak_rss_kb() -> int:
    """This process's own peak RSS. Linux's ru_maxrss keeps the high-water mark of the image replaced by exec, i.e.
    of the (possibly large) parent that forked this worker; VmHWM belongs to the current address space only."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def make_corpus(out_dir: str, cases: int, seed: int, per_op: int, max_bytes: int = 4096, log=print) -> int:
    """Runs cases in this process and saves, per op, the first case of each distinct outcome / error message
    (numbers blanked), up to `per_op` files per op, with the outcome recorded as "expect"."""
    levels = available_isa_levels()
    ops = sorted(GENERATORS)
    runner = Runner()
    runner.ort.set_default_logger_severity(4)
    kept = collections.defaultdict(dict)
    for i in range(cases):
        case = make_case(seed, i, ops, levels)
        outcome, msg = runner.run(case)
        if outcome == SKIPPED:
            continue
        key = (outcome, message_template(msg) if outcome != OK else "+".join(sorted(set(case.tags))))
        if outcome not in (OK, REJECTED):
            log(f"case {i} ({case.op}) is a finding, not corpus material: {outcome} {msg[-200:]}")
            continue
        size = sum(t.data.nbytes for t in case.inputs.values() if t is not None and t.data is not None)
        if size > max_bytes or (key not in kept[case.op] and len(kept[case.op]) >= per_op):
            continue
        if key not in kept[case.op] or size < kept[case.op][key][0]:  # keep the smallest case of each kind
            kept[case.op][key] = (size, i, case, outcome, message_template(msg))
    os.makedirs(out_dir, exist_ok=True)
    n = 0
    for op, entries in sorted(kept.items()):
        for k, (_, i, case, outcome, template) in enumerate(entries.values()):
            d = dict(case.to_json(), expect=outcome, origin=f"seed {seed} case {i}")
            if outcome == REJECTED:
                d["message"] = template
            with open(os.path.join(out_dir, f"{op}-{k:02d}.json"), "w") as f:
                json.dump(d, f, indent=None, separators=(",", ":"))
                f.write("\n")
            n += 1
    return n


SUMMARY_COLUMNS = (OK, REJECTED, SKIPPED, ORT_ALLOC, UNNAMED, OOM, "crash")


def summary_table(result: dict) -> str:
    """Cases per op (attempted) and their outcomes (a crashed worker loses up to 0.5 s of outcome counts)."""
    lines = [f"{'op':16} {'cases':>8}" + "".join(f" {c:>15}" for c in SUMMARY_COLUMNS)]
    total = collections.Counter()
    for op, n in result["attempted"].items():
        c = result["counts"].get(op, {})
        total.update(c)
        total["cases"] += n
        lines.append(f"{op:16} {n:8}" + "".join(f" {c.get(k, 0):15}" for k in SUMMARY_COLUMNS))
    lines.append(f"{'total':16} {total['cases']:8}" + "".join(f" {total[k]:15}" for k in SUMMARY_COLUMNS)
                 + f"   ({result['seconds']} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--stop", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--ops", default="")
    p.add_argument("--isa", default="")
    p.add_argument("--sanitize", metavar="LIBRARY", help="run the workers with this ASan+UBSan build of the library")
    p.add_argument("--save-crashes", metavar="DIR")
    p.add_argument("--hang-timeout", type=float, default=60.0)
    p.add_argument("--mem-limit-mb", type=int, default=3072)
    p.add_argument("--json", metavar="FILE", help="write the figures and failures as JSON")
    p.add_argument("--replay", metavar="PATH")
    p.add_argument("--all-isa", action="store_true", help="replay every case at every ISA level of this CPU")
    p.add_argument("--make-corpus", metavar="DIR", help="save one case per distinct outcome and message, per op")
    p.add_argument("--per-op", type=int, default=10)
    p.add_argument("--huge-sweep", action="store_true", help="run the systematic huge-dimension cases")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.replay:
        return replay_main(args)
    if args.huge_sweep:
        return sweep_main(args)
    if args.make_corpus:
        _limit_memory(args.mem_limit_mb << 20)
        print(f"wrote {make_corpus(args.make_corpus, args.cases, args.seed, args.per_op)} cases")
        return 0
    env = {}
    if args.sanitize:
        log_dir = tempfile.mkdtemp(prefix="dsv4-fuzz-asan-")
        env = sanitizer_env(os.path.abspath(args.sanitize), log_dir)
    result = fuzz(args.cases, seed=args.seed, jobs=args.jobs, ops=[o for o in args.ops.split(",") if o] or None,
                  isa_levels=[x for x in args.isa.split(",") if x] or None, env=env, start=args.start,
                  hang_timeout=args.hang_timeout, mem_limit_mb=args.mem_limit_mb, save_dir=args.save_crashes)
    print(summary_table(result))
    for line, n in result.get("recovered_reports", {}).items():
        print(f"\nRECOVERED SANITIZER REPORT x{n}: {line}")
    for f in result["failures"]:
        first = next((line for line in f["report"].splitlines() if line.strip()), "")
        print(f"\nFAILURE {f['op']} case {f['index']} ({f['kind']}, {f['tags']}): {first[:300]}")
    interesting = {k: v for k, v in result["samples"].items() if f"|{REJECTED}|" not in k}
    for k, v in interesting.items():
        print(f"\n{k}\n  case {v['index']}: {v['message'][-300:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["failures"] or result.get("recovered_reports") else 0


if __name__ == "__main__":
    sys.exit(main())
