"""The DeepSeek-V4 decoder as an ONNX graph, built node by node with ``onnx.helper``.

The graph computes exactly what :class:`dsv4_ort.models.model.DeepseekV4ForCausalLM` computes (with float32
activations), one node of the ``ai.dsv4ort`` domain per fused region of :mod:`dsv4_ort.models.functional`:

==========================  =====================================================================================
region (functional.py)      node(s)
==========================  =====================================================================================
embedding                   ``Gather`` on the embedding table (+ ``Cast`` to float32 when it is bf16),
                            ``Unsqueeze`` + ``Expand`` into the ``hc`` residual streams
``hc_pre`` / ``hc_post``    ``HcPre`` / ``HcPost`` around each sublayer
RMSNorm                     ``RmsNorm`` (attn_norm, ffn_norm, q_norm, final norm)
``linear``                  ``Linear`` (float / bf16 weight), ``LinearFp8``, ``LinearFp4``; ``groups`` for wo_a
``q_norm_rope``             ``NormRope`` without weight on ``[B, S, H, D]``
``kv_norm_rope``            ``NormRope`` with kv_norm.weight on ``[B, S, D]``
``compressor_step``         ``Compressor`` (main one, and the indexer's), state in and out
``apply_rope`` (indexer q)  ``Rope``
``indexer_topk``            ``Indexer``
``sparse_attention``        ``SparseAttention`` (window ring in and out)
``grouped_out_proj``        ``Linear`` with ``groups = o_groups`` (wo_a) then a plain linear (wo_b)
``route_hash/route_topk``   gate linear, then ``MoeRouteHash`` / ``MoeRouteTopK``
``moe_ffn``                 ``MoeExperts*`` (routed, stacked ``[E, ...]``) + ``MoeExperts*`` in dense mode
                            (shared expert, ``[1, ...]``) + ``Add``
``hc_head`` + norm + head   ``HcHead``, ``RmsNorm``, head linear; ``Slice`` of the last position first when
                            ``logits="last"``
==========================  =====================================================================================

Standard ops only move data (Gather, Cast, Reshape, Shape, Unsqueeze, Expand, Slice) or add float32 tensors.

Every value is typed: the builder records element type and (symbolic) shape of everything it creates and emits
them as ``value_info``, because the ONNX schemas of our domain carry no shape-inference functions. Outputs of our
ops are typed and shaped by the op table's rules (:func:`schema.infer_output_types` / :func:`schema.infer_output_shapes`
on the inputs' symbolic shapes), the same rules the library evaluates. Symbolic dims:
``batch``, ``seq`` (new tokens per row), ``tokens`` (= batch * seq, the flattened MoE rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import helper, numpy_helper

from . import schema

FLOAT, BF16, I64, U8 = (schema.ONNX_TYPES[t] for t in ("float", "bfloat16", "int64", "uint8"))
STATE_FORMATS = ("default", "fp8")
# Products of the linears' and experts' fp32 activations (op attribute "compute"). int8: bf16 products, except the
# FP4 routed experts, whose matmul inputs are quantised to int8 per 32 columns (MoeExpertsFp4 compute="int8").
COMPUTE_MODES = ("fp32", "bf16", "int8")
ACT = FLOAT  # activation and state dtype of the exported graph
OPSET = 21
IR_VERSION = 10  # opset 21 needs IR 10; onnxruntime 1.21 reads IR <= 10

BATCH, SEQ, TOKENS = "batch", "seq", "tokens"


class GraphBuildError(ValueError):
    """The checkpoint's weights and the op table cannot express the model (names what is wrong)."""


# ----------------------------------------------------------------------------------------------------- builder


@dataclasses.dataclass(frozen=True)
class Weight:
    """A written initializer as the graph sees it: element type, dims, checkpoint format, FP8 block."""

    name: str
    dtype: int
    dims: tuple
    fmt: str
    scale: str | None = None  # initializer name of the block scales
    block: tuple | None = None


class GraphBuilder:
    """Collects nodes, typed values, inputs, outputs and initializers of one graph."""

    def __init__(self):
        self.nodes: list = []
        self.types: dict[str, tuple[int, list]] = {}
        self.inputs: list = []
        self.outputs: list = []
        self.initializers: list = []
        self.inline: list = []
        self._const_cache: dict = {}
        self._node_names: set = set()

    def _define(self, name: str, elem: int, shape) -> str:
        if name in self.types:
            raise GraphBuildError(f"value {name!r} defined twice")
        self.types[name] = (elem, list(shape))
        return name

    def shape(self, name: str) -> list:
        return list(self.types[name][1])

    def elem(self, name: str) -> int:
        return self.types[name][0]

    def input(self, name: str, elem: int, shape) -> str:
        self._define(name, elem, shape)
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def output(self, name: str) -> None:
        elem, shape = self.types[name]
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def weight(self, w: Weight) -> str:
        """Registers an (external) initializer's type; the TensorProto is added by the caller."""
        if w.name not in self.types:
            self._define(w.name, w.dtype, w.dims)
        return w.name

    def const(self, name: str, value: np.ndarray) -> str:
        """A small inline initializer (shape vectors, RoPE tables), deduplicated by content."""
        key = (value.dtype.str, value.shape, value.tobytes())
        if key in self._const_cache:
            return self._const_cache[key]
        t = numpy_helper.from_array(value, name)
        self._define(name, t.data_type, list(value.shape))
        self.inline.append(t)
        self._const_cache[key] = name
        return name

    def _node_name(self, name: str) -> str:
        if name in self._node_names:
            raise GraphBuildError(f"node name {name!r} used twice")
        self._node_names.add(name)
        return name

    def node(self, op_type: str, inputs: list, outputs: list, name: str, **attrs) -> list:
        """A standard-domain node; ``outputs`` are ``(value name, elem, shape)``."""
        for n, e, s in outputs:
            self._define(n, e, s)
        self.nodes.append(helper.make_node(op_type, list(inputs), [o[0] for o in outputs],
                                           name=self._node_name(name), **attrs))
        return [o[0] for o in outputs]

    def custom(self, op: str, inputs: dict, outputs: dict, name: str, **attrs) -> list:
        """A node of our domain. ``inputs`` maps the table's input names to values (None / absent = omitted
        optional input); ``outputs`` maps the table's output names to value names, typed and shaped by the op
        table's rules from the inputs' types and (symbolic) shapes. Inputs and outputs are ordered by the op
        table, so the call does not depend on positions."""
        spec = _spec(op)
        known = [i.name for i in spec.inputs]
        for k in inputs:
            if k not in known:
                raise GraphBuildError(f"{op}: the op table has no input {k!r} (inputs: {known})")
        ordered = []
        for i in spec.inputs:
            v = inputs.get(i.name)
            if v is None and not i.optional:
                raise GraphBuildError(f"{op} node {name!r}: required input {i.name!r} missing")
            ordered.append(v or "")
        while ordered and ordered[-1] == "":
            ordered.pop()
        out_known = [o.name for o in spec.outputs]
        if sorted(outputs) != sorted(out_known):
            raise GraphBuildError(f"{op}: outputs {sorted(outputs)} given, the op table has {out_known}")
        outs = [outputs[o] for o in out_known]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        present = [inputs.get(i.name) or None for i in spec.inputs]
        try:
            elems = schema.infer_output_types(op, [self.elem(v) if v else None for v in present])
            shapes = schema.infer_output_shapes(op, [self.shape(v) if v else None for v in present], attrs)
        except (KeyError, ValueError) as e:
            raise GraphBuildError(f"{op} node {name!r}: cannot type its outputs: {e}") from None
        for n, e, s in zip(outs, elems, shapes):
            self._define(n, e, s)
        self.nodes.append(schema.make_node(op, ordered, outs, name=self._node_name(name), **attrs))
        return outs

    def value_infos(self) -> list:
        """value_info for every value that is neither a graph input, output nor initializer."""
        skip = {v.name for v in self.inputs} | {v.name for v in self.outputs}
        skip |= {t.name for t in self.initializers} | {t.name for t in self.inline}
        out = []
        for n in self.nodes:
            for o in n.output:
                if o and o not in skip:
                    e, s = self.types[o]
                    out.append(helper.make_tensor_value_info(o, e, s))
        return out


def _spec(op: str):
    try:
        return schema.get(op)
    except KeyError:
        raise GraphBuildError(
            f"the op table (export/op_table.json, version {schema.TABLE_VERSION}) has no op {op!r}; this exporter "
            f"needs a library and op table that provide it") from None


def input_accepts(op: str, input_name: str, type_name: str) -> bool:
    """True if ``op``'s input may have element type ``type_name`` independently of the op's other inputs.

    An input typed by a constraint that another input shares (e.g. ``x`` and ``weight`` both ``T``) must follow
    the activation dtype, so it does not count as accepting a different type.
    """
    try:
        spec = schema.get(op)
    except KeyError:
        return False
    io = next((i for i in spec.inputs if i.name == input_name), None)
    if io is None:
        return False
    if io.type not in spec.type_constraints:
        return io.type == type_name
    if type_name not in spec.type_constraints[io.type]:
        return False
    shared = [i for i in list(spec.inputs) + list(spec.outputs) if i.type == io.type and i.name != input_name]
    return not shared


# ----------------------------------------------------------------------------------------------------- geometry


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One per-layer state tensor: graph input ``past.L.name`` and output ``present.L.name``, same shape."""

    layer: int
    name: str
    shape: tuple  # first dim is the symbolic batch
    elem: int

    @property
    def input_name(self) -> str:
        return f"past.{self.layer}.{self.name}"

    @property
    def output_name(self) -> str:
        return f"present.{self.layer}.{self.name}"


def layer_kind(ratio: int) -> str:
    return "swa" if ratio == 0 else ("csa" if ratio == 4 else "hca")


def state_tensors(config, max_seq_len: int, state: str = "default", layers=None) -> list[StateTensor]:
    """The state of every main layer, in graph order (see the module docstring of :mod:`dsv4_ort.export`).

    ``layers``: (layer id, compress ratio) pairs to describe instead of the main layers (the MTP block's state, layer
    id ``num_hidden_layers``, :mod:`.mtp`).

    ``state="fp8"``: window and entries are uint8 rows of the FP8 attention-entry layout and the indexer keys uint8
    rows of the FP8 index-key layout (:mod:`dsv4_ort.models.functional`, FP8 state); compressor rows stay float32.
    """
    c = config
    D, cI = c.head_dim, c.index_head_dim
    if state not in STATE_FORMATS:
        raise GraphBuildError(f"state must be one of {STATE_FORMATS}, got {state!r}")
    fp8 = state == "fp8"
    if fp8:
        rd = c.qk_rope_head_dim
        if not 0 <= rd <= D or (D - rd) % 64:
            raise GraphBuildError(f"state 'fp8' needs head_dim - qk_rope_head_dim ({D} - {rd}) to be a non-negative "
                                  f"multiple of 64")
        # = functional.fp8_entry_bytes / fp8_index_bytes (this module must not import torch)
        row, key_row, elem = (D - rd) + 2 * rd + ((D - rd) // 64 + 7) // 8 * 8, cI + 4, U8
    else:
        row, key_row, elem = D, cI, ACT
    out = []
    for layer, r in (enumerate(c.layer_ratios) if layers is None else layers):
        out.append(StateTensor(layer, "window", (BATCH, c.sliding_window, row), elem))
        if r > 0:
            coff = 2 if r == 4 else 1
            out.append(StateTensor(layer, "entries", (BATCH, max_seq_len // r, row), elem))
            out.append(StateTensor(layer, "kv_state", (BATCH, coff * r, coff * D), FLOAT))
            out.append(StateTensor(layer, "score_state", (BATCH, coff * r, coff * D), FLOAT))
        if r == 4:
            out.append(StateTensor(layer, "index_keys", (BATCH, max_seq_len // 4, key_row), elem))
            out.append(StateTensor(layer, "index_kv_state", (BATCH, 8, 2 * cI), FLOAT))
            out.append(StateTensor(layer, "index_score_state", (BATCH, 8, 2 * cI), FLOAT))
    return out


# ----------------------------------------------------------------------------------------------------- model


class DecoderGraph:
    """Builds the decoder graph from the config and the written weights (``weights``: name -> :class:`Weight`)."""

    def __init__(self, config, weights: dict, *, max_seq_len: int, logits: str = "last", state: str = "default",
                 compute: str = "fp32"):
        self.c = config
        self.w = weights
        self.max_seq_len = max_seq_len
        self.logits_mode = logits
        self.state_format = state
        self.compute = compute
        self.g = GraphBuilder()
        self.state = state_tensors(config, max_seq_len, state)

    # ------------------------------------------------------------------------------------------- helpers

    def prefix(self, layer: int) -> str:
        """Checkpoint prefix of a block: ``layers.L`` for a main layer, ``mtp.J`` for MTP depth J (layer id
        ``num_hidden_layers + J``, see :mod:`.mtp`)."""
        n = self.c.num_hidden_layers
        return f"layers.{layer}" if layer < n else f"mtp.{layer - n}"

    def _w(self, name: str) -> Weight:
        try:
            w = self.w[name]
        except KeyError:
            raise GraphBuildError(f"weight {name!r} was not written") from None
        self.g.weight(w)
        if w.scale is not None:
            self.g.weight(self.w[w.scale])
        return w

    def _i64(self, name: str, values) -> str:
        return self.g.const(name, np.asarray(values, dtype=np.int64))

    def _compute_attr(self, op: str) -> str | None:
        """The op's ``compute`` attribute for this export's mode (None: the default, fp32). ``int8`` is a mode of
        the FP4 routed experts only; every other linear / expert / attention op takes bf16 products then."""
        if self.compute == "int8":
            return "int8" if op == "MoeExpertsFp4" else "bf16"
        return None if self.compute == "fp32" else self.compute

    def linear(self, x: str, weight: str, out: str, *, groups: int = 1) -> str:
        """``x @ W.T`` (W dense, FP8 or FP4) -> float32 ``[..., out_features]``."""
        w = self._w(weight)
        outputs = {"y": out}
        grp = groups if groups != 1 else None
        compute = self._compute_attr("Linear")
        if w.fmt == "fp8":
            if w.block[0] != w.block[1]:
                raise GraphBuildError(f"{weight}: FP8 blocks {w.block} are not square; export with --weights bf16")
            return self.g.custom("LinearFp8", {"x": x, "weight": w.name, "scale": w.scale}, outputs, out,
                                 groups=grp, block_size=int(w.block[0]), compute=compute)[0]
        if w.fmt == "fp4":
            return self.g.custom("LinearFp4", {"x": x, "weight": w.name, "scale": w.scale}, outputs, out,
                                 groups=grp, compute=compute)[0]
        return self.g.custom("Linear", {"x": x, "weight": w.name}, outputs, out, groups=grp, compute=compute)[0]

    def rms_norm(self, x: str, weight: str | None, out: str) -> str:
        ins = {"x": x, "weight": self._w(weight).name if weight else None}
        return self.g.custom("RmsNorm", ins, {"y": out}, out, eps=float(self.c.rms_norm_eps))[0]

    def experts(self, x: str, weights: str | None, indices: str | None, prefix: str, out: str) -> str:
        """Routed experts (weights/indices given, stacked ``[E, ...]``) or the shared expert (dense mode)."""
        ws = [self._w(f"{prefix}.{k}.weight") for k in ("w1", "w2", "w3")]
        fmts = {w.fmt for w in ws}
        if len(fmts) != 1:
            raise GraphBuildError(f"{prefix}: w1/w2/w3 have different formats {sorted(fmts)}; "
                                  "export with --weights bf16")
        fmt = fmts.pop()
        ins = {"x": x, "weights": weights, "indices": indices}
        for k, w in zip(("w1", "w2", "w3"), ws):
            ins[k] = w.name
            if fmt in ("fp8", "fp4"):
                ins["s" + k[1]] = w.scale
        op = {"fp8": "MoeExpertsFp8", "fp4": "MoeExpertsFp4"}.get(fmt, "MoeExperts")
        attrs = {"swiglu_limit": float(self.c.swiglu_limit)}
        if fmt == "fp8":
            blocks = {w.block for w in ws}
            if len(blocks) != 1 or ws[0].block[0] != ws[0].block[1]:
                raise GraphBuildError(f"{prefix}: FP8 blocks {sorted(blocks)} must be square and equal")
            if "block_size" in {a.name for a in _spec(op).attributes}:
                attrs["block_size"] = int(ws[0].block[0])
        if self._compute_attr(op) is not None:
            attrs["compute"] = self._compute_attr(op)
        return self.g.custom(op, ins, {"y": out}, out, **attrs)[0]

    # ------------------------------------------------------------------------------------------- graph

    def build(self):
        ids, start_pos = self.inputs()
        x = self.embed(ids)
        x = self.layers(range(self.c.num_hidden_layers), x, start_pos)
        self.head(x)
        return self.g

    # The pieces of build(), in graph order; a pipeline stage (:mod:`.stages`) builds its own graph from them.

    def inputs(self, streams: str | None = None) -> tuple[str, str]:
        """Graph inputs ``input_ids``, ``start_pos`` (and the residual streams ``streams`` [batch, seq, hc, d] when
        named: a stage after the first) and every state tensor of ``self.state``, in that order."""
        c, g = self.c, self.g
        ids = g.input("input_ids", I64, [BATCH, SEQ])
        start_pos = g.input("start_pos", I64, [BATCH])
        if streams is not None:
            g.input(streams, ACT, [BATCH, SEQ, c.hc_mult, c.hidden_size])
        for st in self.state:
            g.input(st.input_name, st.elem, list(st.shape))
        return ids, start_pos

    def embed(self, ids: str) -> str:
        """Embedding rows expanded into the ``hc`` residual streams; also defines ``shape_bsd`` and ``ids_flat``
        (the MoE's ``[batch, seq, d]`` shape and the hash routers' token ids)."""
        c, g = self.c, self.g
        d, hc = c.hidden_size, c.hc_mult
        emb_w = self._w("embed.weight")
        emb = g.node("Gather", [emb_w.name, ids], [("embed.out", emb_w.dtype, [BATCH, SEQ, d])], "embed", axis=0)[0]
        if emb_w.dtype != ACT:
            emb = g.node("Cast", [emb], [("embed.float", ACT, [BATCH, SEQ, d])], "embed.cast", to=ACT)[0]
        self.shape_bsd = g.node("Shape", [emb], [("embed.shape", I64, [3])], "embed.shape")[0]
        self.ids_flat = g.node("Reshape", [ids, self._i64("const.flat", [-1])], [("input_ids.flat", I64, [TOKENS])],
                               "input_ids.flat")[0]
        x = g.node("Unsqueeze", [emb, self._i64("const.axis2", [2])], [("embed.unsqueeze", ACT, [BATCH, SEQ, 1, d])],
                   "streams.unsqueeze")[0]
        return g.node("Expand", [x, self._i64("const.streams", [1, 1, hc, 1])], [("streams", ACT, [BATCH, SEQ, hc, d])],
                      "streams.expand")[0]

    def layers(self, layers, x: str, start_pos: str) -> str:
        """Blocks ``layers`` (consecutive layer indices) on the streams ``x``; their state is in ``self.state``."""
        c, g = self.c, self.g
        states = {}
        for st in self.state:
            states.setdefault(st.layer, {})[st.name] = st
        for layer in layers:
            ratio = c.layer_ratios[layer]
            # the two RoPE tables: plain for ratio-0 layers, compress_rope_theta + YaRN for compressed ones
            inv = g.const("rope.inv_freq_compressed", _rope_table(c, True)) if ratio > 0 else \
                g.const("rope.inv_freq", _rope_table(c, False))
            x = self.block(layer, ratio, x, start_pos, inv, states[layer])
        return x

    def head(self, x: str) -> None:
        """hc_head, the final norm and the LM head on the streams ``x``; outputs ``logits`` then every state tensor."""
        c, g = self.c, self.g
        d, hc = c.hidden_size, c.hc_mult
        if self.logits_mode == "last":
            x = g.node("Slice", [x, self._i64("const.last.start", [-1]),
                                 self._i64("const.last.end", [np.iinfo(np.int64).max]), self._i64("const.axis1", [1])],
                       [("streams.last", ACT, [BATCH, 1, hc, d])], "logits.last_position")[0]
        fn, sc, base = (self._w(n).name for n in ("hc_head_fn", "hc_head_scale", "hc_head_base"))
        y = g.custom("HcHead", {"x": x, "fn": fn, "scale": sc, "base": base}, {"y": "hc_head.out"}, "hc_head",
                     rms_eps=float(c.rms_norm_eps), hc_eps=float(c.hc_eps))[0]
        y = self.rms_norm(y, "norm.weight", "norm")
        logits = self.linear(y, "head.weight", "logits")
        g.output(logits)
        for st in self.state:
            g.output(st.output_name)

    def block(self, layer: int, ratio: int, x: str, start_pos: str, inv: str, st: dict) -> str:
        c, g = self.c, self.g
        p = self.prefix(layer)
        hc_kw = dict(rms_eps=float(c.rms_norm_eps), hc_eps=float(c.hc_eps), sinkhorn_iters=int(c.hc_sinkhorn_iters))

        def hc_pre(x, which):
            ins = {"x": x, "fn": self._w(f"{p}.hc_{which}_fn").name, "scale": self._w(f"{p}.hc_{which}_scale").name,
                   "base": self._w(f"{p}.hc_{which}_base").name}
            q = f"{p}.hc_{which}"
            return g.custom("HcPre", ins, {"h": f"{q}.h", "post": f"{q}.post", "comb": f"{q}.comb"}, f"{q}_pre",
                            **hc_kw)

        def hc_post(f, residual, post, comb, which):
            return g.custom("HcPost", {"f": f, "residual": residual, "post": post, "comb": comb},
                            {"out": f"{p}.hc_{which}.out"}, f"{p}.hc_{which}_post")[0]

        h, post, comb = hc_pre(x, "attn")
        a = self.attention(layer, ratio, self.rms_norm(h, f"{p}.attn_norm.weight", f"{p}.attn_norm"),
                           start_pos, inv, st)
        x = hc_post(a, x, post, comb, "attn")
        h, post, comb = hc_pre(x, "ffn")
        f = self.moe(layer, self.rms_norm(h, f"{p}.ffn_norm.weight", f"{p}.ffn_norm"))
        return hc_post(f, x, post, comb, "ffn")

    def compressor(self, x: str, prefix: str, start_pos: str, inv: str, entries: StateTensor,
                   kv_state: StateTensor, score_state: StateTensor, layout: str = "attention") -> str:
        """One Compressor node (projections in float32), returns the present entries (``layout``: the FP8 row
        layout, "attention" or "index", used when the entries are uint8)."""
        kv = self.linear(x, f"{prefix}.wkv.weight", f"{prefix}.wkv")
        score = self.linear(x, f"{prefix}.wgate.weight", f"{prefix}.wgate")
        ins = {"kv": kv, "score": score, "ape": self._w(f"{prefix}.ape").name,
               "norm_weight": self._w(f"{prefix}.norm.weight").name, "inv_freq": inv, "start_pos": start_pos,
               "past_entries": entries.input_name, "past_kv_state": kv_state.input_name,
               "past_score_state": score_state.input_name}
        outs = {"present_entries": entries.output_name, "present_kv_state": kv_state.output_name,
                "present_score_state": score_state.output_name}
        attrs = {"fp8_layout": layout} if entries.elem == U8 else {}
        return self.g.custom("Compressor", ins, outs, prefix, rms_eps=float(self.c.rms_norm_eps), **attrs)[0]

    def attention(self, layer: int, ratio: int, x: str, start_pos: str, inv: str, st: dict) -> str:
        c, g = self.c, self.g
        p = f"{self.prefix(layer)}.attn"
        H, D, G = c.num_attention_heads, c.head_dim, c.o_groups
        eps = float(c.rms_norm_eps)
        qr = self.rms_norm(self.linear(x, f"{p}.wq_a.weight", f"{p}.wq_a"), f"{p}.q_norm.weight", f"{p}.q_norm")
        q = self.linear(qr, f"{p}.wq_b.weight", f"{p}.wq_b")
        q = g.node("Reshape", [q, self._i64("const.heads", [0, 0, H, D])], [(f"{p}.q_heads", ACT, [BATCH, SEQ, H, D])],
                   f"{p}.q_heads")[0]
        q = g.custom("NormRope", {"x": q, "start_pos": start_pos, "inv_freq": inv},
                     {"y": f"{p}.q"}, f"{p}.q_norm_rope", eps=eps)[0]
        kv = self.linear(x, f"{p}.wkv.weight", f"{p}.wkv")
        kv = g.custom("NormRope", {"x": kv, "weight": self._w(f"{p}.kv_norm.weight").name, "start_pos": start_pos,
                                   "inv_freq": inv},
                      {"y": f"{p}.kv"}, f"{p}.kv_norm_rope", eps=eps)[0]
        entries = indices = None
        if ratio > 0:
            entries = self.compressor(x, f"{p}.compressor", start_pos, inv, st["entries"], st["kv_state"],
                                      st["score_state"])
        if ratio == 4:
            nI, cI = c.index_n_heads, c.index_head_dim
            keys = self.compressor(x, f"{p}.indexer.compressor", start_pos, inv, st["index_keys"],
                                   st["index_kv_state"], st["index_score_state"], layout="index")
            iq = self.linear(qr, f"{p}.indexer.wq_b.weight", f"{p}.indexer.wq_b")
            iq = g.node("Reshape", [iq, self._i64("const.index_heads", [0, 0, nI, cI])],
                        [(f"{p}.indexer.q_heads", ACT, [BATCH, SEQ, nI, cI])], f"{p}.indexer.q_heads")[0]
            iq = g.custom("Rope", {"x": iq, "start_pos": start_pos, "inv_freq": inv},
                          {"y": f"{p}.indexer.q"}, f"{p}.indexer.q_rope")[0]
            iw = self.linear(x, f"{p}.indexer.weights_proj.weight", f"{p}.indexer.weights_proj")
            indices = g.custom("Indexer", {"q": iq, "weights": iw, "keys": keys, "start_pos": start_pos},
                               {"indices": f"{p}.indexer.indices"},
                               f"{p}.indexer", ratio=4, index_topk=int(c.index_topk))[0]
        win = st["window"]
        o, _ = g.custom("SparseAttention",
                        {"q": q, "kv": kv, "past_window": win.input_name, "entries": entries, "indices": indices,
                         "sink": self._w(f"{p}.attn_sink").name, "inv_freq": inv, "start_pos": start_pos},
                        {"o": f"{p}.o", "present_window": win.output_name},
                        f"{p}.sparse_attention", ratio=int(ratio), softmax_scale=float(D ** -0.5),
                        compute=self._compute_attr("SparseAttention"))
        o = g.node("Reshape", [o, self._i64("const.merge_heads", [0, 0, H * D])],
                   [(f"{p}.o_flat", ACT, [BATCH, SEQ, H * D])], f"{p}.o_flat")[0]
        u = self.linear(o, f"{p}.wo_a.weight", f"{p}.wo_a", groups=G)
        return self.linear(u, f"{p}.wo_b.weight", f"{p}.wo_b")

    def moe(self, layer: int, x: str) -> str:
        c, g = self.c, self.g
        p = f"{self.prefix(layer)}.ffn"
        d = c.hidden_size
        xt = g.node("Reshape", [x, self._i64("const.rows", [-1, d])], [(f"{p}.x", ACT, [TOKENS, d])], f"{p}.rows")[0]
        logits = self.linear(xt, f"{p}.gate.weight", f"{p}.gate")
        k = c.num_experts_per_tok
        rk = dict(scoring=c.scoring_func, norm_topk_prob=int(bool(c.norm_topk_prob)),
                  routed_scaling_factor=float(c.routed_scaling_factor))
        outs = {"weights": f"{p}.route.weights", "indices": f"{p}.route.indices"}
        if c.is_hash_layer(layer):
            w, idx = g.custom("MoeRouteHash", {"logits": logits, "input_ids": self.ids_flat,
                                               "tid2eid": self._w(f"{p}.gate.tid2eid").name}, outs, f"{p}.route", **rk)
        else:
            w, idx = g.custom("MoeRouteTopK", {"logits": logits, "bias": self._w(f"{p}.gate.bias").name}, outs,
                              f"{p}.route", top_k=int(k), **rk)
        routed = self.experts(xt, w, idx, f"{p}.experts", f"{p}.experts")
        shared = self.experts(xt, None, None, f"{p}.shared_experts", f"{p}.shared_experts")
        y = g.node("Add", [routed, shared], [(f"{p}.sum", ACT, [TOKENS, d])], f"{p}.sum")[0]
        return g.node("Reshape", [y, self.shape_bsd], [(f"{p}.out", ACT, [BATCH, SEQ, d])], f"{p}.out")[0]


def _rope_table(config, compressed: bool) -> np.ndarray:
    """The reference model's table (:func:`dsv4_ort.models.functional.rope_freqs` returns the same values)."""
    from dsv4_ort.models.rope import inv_freq

    return inv_freq(config, compressed=compressed)


def make_model(g: GraphBuilder, metadata: dict, doc: str = "") -> "object":
    """The ModelProto of a built graph (initializers already attached to ``g``)."""
    graph = helper.make_graph(g.nodes, "dsv4", g.inputs, g.outputs, initializer=g.inline + g.initializers,
                              value_info=g.value_infos(), doc_string=doc)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(schema.DOMAIN, 1)],
                              ir_version=IR_VERSION, producer_name="dsv4-ort", doc_string=doc)
    helper.set_model_props(model, {k: str(v) for k, v in metadata.items()})
    return model


__all__ = ["DecoderGraph", "GraphBuilder", "GraphBuildError", "StateTensor", "Weight", "state_tensors",
           "input_accepts", "layer_kind", "make_model"]
