"""The MTP block as a second ONNX graph (``mtp.onnx``) beside the main one, for speculative decoding.

DeepSeek-V4 checkpoints ship ``num_nextn_predict_layers`` multi-token-prediction blocks (``mtp.J.*``; one in Flash).
Block J combines the main model's residual streams at position t with the embedding of token t + 1 + J and predicts
token t + 2 + J (:class:`dsv4_ort.models.model.MTPBlock`). ``export_model(..., mtp=True)`` (``dsv4-ort export
--mtp``) exports block 0 as its own graph:

* ``mtp.onnx`` shares ``model.onnx.data``: its initializers are the ``mtp.0.*`` tensors (written into the same data
  file) plus the main model's ``embed.weight``, referenced at the same offsets, so the two sessions memory-map one
  copy of the embedding. It drafts with ``mtp.0.draft_head.weight``, an FP4 (default) or FP8 copy of the head
  requantised from the exact weights (``mtp_head``): a draft step on a CPU is bound by the bytes it reads, and the
  head is most of them (bf16 head of the bench preset: 529 MB; the MTP layer ~60 MB). Drafts only propose tokens,
  so this changes acceptance a little, never the output. ``mtp_head="shared"`` uses the main ``head.weight``;
* the main graph gains the output ``hidden`` (float32 ``[batch, seq, hc, d]``, the last block's streams before
  ``hc_head``: the MTP block's input) and, when exported with ``logits="last"``, the input ``num_logits`` (int64
  ``[1]``): logits of each row's last ``num_logits`` positions (1 for prefill and decode, k + 1 for a verify step
  of k drafts). A model exported without ``mtp`` is the plain single graph, unchanged.

MTP graph contract:

Inputs:
    ``hidden``      float32 ``[batch, seq, hc, d]``  streams at positions p .. p + seq - 1 (the main graph's
                    ``hidden``, or this graph's ``hidden_out`` when drafting further ahead);
    ``input_ids``   int64 ``[batch, seq]``           the tokens at p + 1 .. p + seq;
    ``start_pos``   int64 ``[batch]``                p of each row (the MTP block's own position);
    ``num_logits``  int64 ``[1]``                    logits of the last num_logits positions;
    ``past.L.<n>``  the block's in-place state, L = num_hidden_layers (+ J): a window ring for the MTP layer's
                    ratio 0 (and compressor state, entries and indexer keys as a main layer has for ratio > 0).
Outputs:
    ``logits``      float32 ``[batch, num_logits, vocab]`` predicting the tokens at p + 2 .. (last positions);
    ``hidden_out``  float32 ``[batch, seq, hc, d]`` the block's output streams (before its own ``hc_head``);
    ``present.L.<n>`` the updated state (bound to the same buffer as ``past.L.<n>``).

Only block 0 is exported: the runtime drafts k tokens by running it k times (on its own ``hidden_out`` after the
first), as engines do for DeepSeek's single MTP layer; deeper blocks of a checkpoint are recorded in the metadata
and not written.
"""

from __future__ import annotations

import numpy as np

from .graph import ACT, BATCH, I64, SEQ, DecoderGraph, GraphBuildError, _rope_table, layer_kind, state_tensors

MTP_FILE = "mtp.onnx"
MTP_HIDDEN, MTP_NUM_LOGITS = "hidden", "num_logits"  # main graph output / input (and MTP graph inputs)
MTP_HIDDEN_OUT = "hidden_out"
MTP_DEPTH = 0  # the one exported block
DRAFT_HEAD = "mtp.0.draft_head.weight"  # the MTP graph's requantised copy of head.weight (not a checkpoint tensor)


def mtp_layer(config, depth: int = MTP_DEPTH) -> int:
    """Layer id of MTP block ``depth`` (its state tensors are ``past.<id>.*``; its ratio is compress_ratios[id])."""
    return config.num_hidden_layers + depth


def mtp_state_tensors(config, max_seq_len: int, state: str = "default") -> list:
    """State of the exported MTP block, the same tensors a main layer of its ratio has, named by its layer id."""
    layer = mtp_layer(config)
    if config.num_nextn_predict_layers < 1:
        raise GraphBuildError("the config has no MTP block (num_nextn_predict_layers = 0)")
    ratio = config.compress_ratios[layer]
    return state_tensors(config, max_seq_len, state, layers=[(layer, ratio)])


class MainGraphWithMtp(DecoderGraph):
    """The main graph plus the I/O speculative decoding needs: output ``hidden``, input ``num_logits``."""

    def head(self, x: str) -> None:
        c, g = self.c, self.g
        d, hc = c.hidden_size, c.hc_mult
        g.node("Identity", [x], [(MTP_HIDDEN, ACT, [BATCH, SEQ, hc, d])], "hidden")
        if self.logits_mode == "last":  # the last num_logits positions of each row
            n = g.input(MTP_NUM_LOGITS, I64, [1])
            start = g.node("Neg", [n], [("num_logits.neg", I64, [1])], "num_logits.neg")[0]
            x = g.node("Slice", [x, start, self._i64("const.last.end", [np.iinfo(np.int64).max]),
                                 self._i64("const.axis1", [1])],
                       [("streams.last", ACT, [BATCH, MTP_NUM_LOGITS, hc, d])], "logits.last_positions")[0]
        _logits(self, x, "", "logits")
        for st in self.state:
            g.output(st.output_name)
        g.output(MTP_HIDDEN)


def _logits(dg: DecoderGraph, x: str, prefix: str, out: str, head: str = "head.weight") -> str:
    """hc_head (``<prefix>hc_head_*``), the norm ``<prefix>norm`` and the head ``head`` on streams x -> ``out``."""
    c, g = dg.c, dg.g
    fn, sc, base = (dg._w(f"{prefix}{n}").name for n in ("hc_head_fn", "hc_head_scale", "hc_head_base"))
    y = g.custom("HcHead", {"x": x, "fn": fn, "scale": sc, "base": base}, {"y": f"{prefix}hc_head.out"},
                 f"{prefix}hc_head", rms_eps=float(c.rms_norm_eps), hc_eps=float(c.hc_eps))[0]
    y = dg.rms_norm(y, f"{prefix}norm.weight", f"{prefix}norm")
    logits = dg.linear(y, head, out)
    g.output(logits)
    return logits


class MtpGraph(DecoderGraph):
    """MTP block 0 as a graph (see the module docstring); same weights dict and options as the main graph's."""

    def __init__(self, config, weights: dict, *, max_seq_len: int, state: str = "default", compute: str = "fp32",
                 draft_head: bool = False):
        super().__init__(config, weights, max_seq_len=max_seq_len, logits="last", state=state, compute=compute)
        self.state = mtp_state_tensors(config, max_seq_len, state)
        self.layer = mtp_layer(config)
        self.head_name = DRAFT_HEAD if draft_head else "head.weight"  # DRAFT_HEAD: a requantised copy of the head

    def build(self):
        c, g = self.c, self.g
        d, hc = c.hidden_size, c.hc_mult
        p = self.prefix(self.layer)
        hidden = g.input(MTP_HIDDEN, ACT, [BATCH, SEQ, hc, d])
        ids = g.input("input_ids", I64, [BATCH, SEQ])
        start_pos = g.input("start_pos", I64, [BATCH])
        n = g.input(MTP_NUM_LOGITS, I64, [1])
        for st in self.state:
            g.input(st.input_name, st.elem, list(st.shape))

        # e = e_proj(enorm(embed[next ids])), hs = h_proj(hnorm(streams)) per stream, x = hs + e on every stream
        emb_w = self._w("embed.weight")
        emb = g.node("Gather", [emb_w.name, ids], [("embed.out", emb_w.dtype, [BATCH, SEQ, d])], "embed", axis=0)[0]
        if emb_w.dtype != ACT:
            emb = g.node("Cast", [emb], [("embed.float", ACT, [BATCH, SEQ, d])], "embed.cast", to=ACT)[0]
        self.shape_bsd = g.node("Shape", [emb], [("embed.shape", I64, [3])], "embed.shape")[0]
        self.ids_flat = g.node("Reshape", [ids, self._i64("const.flat", [-1])], [("input_ids.flat", I64, ["tokens"])],
                               "input_ids.flat")[0]
        e = self.linear(self.rms_norm(emb, f"{p}.enorm.weight", f"{p}.enorm"), f"{p}.e_proj.weight", f"{p}.e_proj")
        e = g.node("Unsqueeze", [e, self._i64("const.axis2", [2])], [(f"{p}.e_proj.streams", ACT, [BATCH, SEQ, 1, d])],
                   f"{p}.e_proj.unsqueeze")[0]
        h = self.linear(self.rms_norm(hidden, f"{p}.hnorm.weight", f"{p}.hnorm"), f"{p}.h_proj.weight", f"{p}.h_proj")
        x = g.node("Add", [h, e], [(f"{p}.input", ACT, [BATCH, SEQ, hc, d])], f"{p}.input")[0]

        ratio = c.compress_ratios[self.layer]
        inv = g.const("rope.inv_freq_compressed", _rope_table(c, True)) if ratio > 0 else \
            g.const("rope.inv_freq", _rope_table(c, False))
        states = {st.name: st for st in self.state}
        x = self.block(self.layer, ratio, x, start_pos, inv, states)
        out = g.node("Identity", [x], [(MTP_HIDDEN_OUT, ACT, [BATCH, SEQ, hc, d])], "hidden_out")[0]

        start = g.node("Neg", [n], [("num_logits.neg", I64, [1])], "num_logits.neg")[0]
        x = g.node("Slice", [x, start, self._i64("const.last.end", [np.iinfo(np.int64).max]),
                             self._i64("const.axis1", [1])],
                   [("streams.last", ACT, [BATCH, MTP_NUM_LOGITS, hc, d])], "logits.last_positions")[0]
        _logits(self, x, f"{p}.", "logits", self.head_name)
        g.output(out)
        for st in self.state:
            g.output(st.output_name)
        return g


def check_mtp_source(config, origin: dict, stages) -> None:
    """An MTP export needs an MTP block in the config and its tensors in the checkpoint, and one graph (no stages)."""
    from .exporter import ExportError

    if stages is not None:
        raise ExportError("mtp=True exports one main graph: it cannot be combined with stages")
    if config.num_nextn_predict_layers < 1:
        raise ExportError("mtp=True: the model has no MTP block (num_nextn_predict_layers = 0)")
    if not origin.get("mtp_in_checkpoint", True):
        where = origin.get("checkpoint") or "the checkpoint"
        raise ExportError(f"mtp=True: {where} holds no mtp.* tensors (transformers writes none; export the "
                          "DeepSeek release checkpoint, or without mtp)")


def load_mtp_weights(config, mtp_weights) -> dict:
    """``mtp_weights`` (a dict or a .npz path) as name -> float32 array, checked against the config's MTP block 0."""
    from dsv4_ort.models.inventory import deepseek_tensor_specs

    from .exporter import ExportError

    if isinstance(mtp_weights, dict):
        arrays, where = dict(mtp_weights), "mtp_weights"
    else:
        where = str(mtp_weights)
        try:
            with np.load(where) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise ExportError(f"cannot read the MTP weights {where!r}: {e}") from None
    specs = {s.name: s for s in deepseek_tensor_specs(config) if s.name.startswith(f"mtp.{MTP_DEPTH}.")}
    for name, a in arrays.items():
        spec = specs.get(name)
        if spec is None:
            raise ExportError(f"{where}: {name!r} is not a tensor of this model's MTP block {MTP_DEPTH}")
        if tuple(np.shape(a)) != tuple(spec.shape):
            raise ExportError(f"{where}: {name!r} has shape {tuple(np.shape(a))}, the config needs {spec.shape}")
    return arrays


def override_mtp(config, source, mtp_weights):
    """The checkpoint's tensors with those of ``mtp_weights`` replaced, each stored in its release format (FP8 128 x
    128 blocks for linears, FP4 for experts, bf16 norms, float32 mHC / ape / bias), as a checkpoint would hold it."""
    from dsv4_ort.models import quant_np as QN
    from dsv4_ort.models.inventory import deepseek_tensor_specs, storage_kind
    from dsv4_ort.models.synthetic import ArrayTensor

    arrays = load_mtp_weights(config, mtp_weights)
    specs = {s.name: s for s in deepseek_tensor_specs(config)}
    for rt in source:
        a = arrays.get(rt.name)
        if a is None:
            yield rt
            continue
        x = np.ascontiguousarray(a, np.float32)
        kind = storage_kind(specs[rt.name], "native")
        if kind == "fp8":
            q, sc = QN.quant_fp8_block(x)
            yield ArrayTensor(rt.name, q, sc, "fp8", (QN.FP8_BLOCK, QN.FP8_BLOCK))
        elif kind == "fp4":
            q, sc = QN.quant_fp4(x)
            yield ArrayTensor(rt.name, q, sc, "fp4", (1, QN.FP4_BLOCK))
        elif kind == "bf16":
            yield ArrayTensor(rt.name, QN.float_to_bf16(x), None, "bf16")
        else:
            yield ArrayTensor(rt.name, x, None, "fp32")


def mtp_metadata(config, mg: MtpGraph, g, logits: str, io, type_name, in_checkpoint: bool) -> dict:
    """The ``mtp`` section of dsv4_ort.json for an export with the MTP graph ``g`` (built by ``mg``); ``logits`` is
    the main graph's mode, ``io`` / ``type_name`` format a value_info / an element type as the rest of the file."""
    ratio = config.compress_ratios[mg.layer]
    return {
        "exported": True, "graph": MTP_FILE, "layers": config.num_nextn_predict_layers, "exported_layers": 1,
        "in_checkpoint": in_checkpoint, "layer": mg.layer, "ratio": ratio, "kind": layer_kind(ratio),
        "main_outputs": [MTP_HIDDEN], "main_inputs": [MTP_NUM_LOGITS] if logits == "last" else [],
        "inputs": [io(v) for v in g.inputs], "outputs": [io(v) for v in g.outputs],
        "state": {"batch_dim": BATCH, "initial_value": 0.0, "format": mg.state_format,
                  "tensors": [{"layer": s.layer, "name": s.name, "input": s.input_name, "output": s.output_name,
                               "shape": list(s.shape), "dtype": type_name(s.elem)} for s in mg.state]},
    }


__all__ = ["MTP_FILE", "MTP_HIDDEN", "MTP_HIDDEN_OUT", "MTP_NUM_LOGITS", "MainGraphWithMtp", "MtpGraph", "mtp_layer",
           "mtp_metadata", "mtp_state_tensors", "check_mtp_source", "load_mtp_weights", "override_mtp"]
