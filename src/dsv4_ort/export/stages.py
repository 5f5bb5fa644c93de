"""Pipeline stages: one export cut into N graphs of consecutive layers, each with its own weights and state.

Between two DeepSeek-V4 blocks only the hyper-connection residual streams cross (``[batch, seq, hc_mult, hidden]``
float32), so a cut there is cheap and changes nothing in the arithmetic: every node of a stage graph is the node of
the single graph (same op, same attributes, same inputs), the streams cross the boundary as exact float32 copies,
and the logits of the last stage are bitwise those of ``model.onnx``.

Files written to ``OUT_DIR`` (``dsv4-ort export ... --stages N`` or ``--stages 0:2,2:4``; Python:
``export_model(..., stages=...)``) instead of ``model.onnx`` / ``model.onnx.data``:

* ``model.stage<i>.onnx`` for i = 0 .. N-1, and ``model.stage<i>.onnx.data`` with only that stage's weights (the
  embedding in stage 0; layers ``[a, b)``; hc_head, the final norm and the LM head in the last stage), each ending
  with the export id like a single data file, so a node memory-maps only its share;
* ``dsv4_ort.json`` as for a single graph (config, the whole model's state tensors, ...) plus ``pipeline``: the
  stages (layer range, files, inputs, outputs, state tensors, data bytes) and the boundary (names, shape, bytes per
  token).

Stage contract (every stage takes the same ``input_ids`` and ``start_pos`` as the single graph: the hash-routed
MoE layers read the token ids, every attention reads the positions):

====================  ===========================================================================================
stage                 inputs -> outputs
====================  ===========================================================================================
first (0)             ``input_ids``, ``start_pos``, its ``past.L.*`` -> ``streams_out`` + its ``present.L.*``
middle                ``input_ids``, ``start_pos``, ``streams_in``, its ``past.L.*`` -> ``streams_out`` + state
last (N-1)            ``input_ids``, ``start_pos``, ``streams_in``, its ``past.L.*`` -> ``logits`` + state
====================  ===========================================================================================

``streams_in`` / ``streams_out`` are float32 ``[batch, seq, hc_mult, hidden_size]``: all positions of the call
cross a boundary (the last stage takes the last position itself when ``logits="last"``). A one-stage pipeline is
the whole model in one stage graph. The runtime is :class:`dsv4_ort.runtime.pipeline.PipelineSession`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from . import schema
from .files import FORMAT_VERSION, META_FILE, export_trailer
from .graph import ACT, BATCH, I64, DecoderGraph, GraphBuildError

STREAMS_IN, STREAMS_OUT = "streams_in", "streams_out"
_STAGE_FILE_RE = re.compile(r"^model\.stage(\d+)\.onnx(\.data)?$")


def stage_model_file(index: int) -> str:
    return f"model.stage{index}.onnx"


def stage_data_file(index: int) -> str:
    return f"model.stage{index}.onnx.data"


def is_stage_file(name: str) -> bool:
    """Whether ``name`` is one of the files a staged export writes (for the publisher's foreign-file check)."""
    return _STAGE_FILE_RE.match(name) is not None


class StageSpecError(ValueError):
    """A ``stages`` argument that does not describe consecutive layer ranges covering the model."""


def parse_stages(spec, n_layers: int) -> list[tuple[int, int]]:
    """``stages`` as a list of layer ranges ``[(a, b), ...]`` (b exclusive) covering ``0 .. n_layers`` in order.

    ``spec``: a stage count N (int or digits: consecutive ranges as even as possible, the first ``n_layers % N``
    stages one layer longer, since the last stage also holds the LM head), a string of ranges ``"0:2,2:4"`` or a
    sequence of ``(a, b)`` pairs. Raises :class:`StageSpecError` naming what is wrong."""
    if isinstance(spec, str) and spec.strip().isdigit():
        spec = int(spec.strip())
    if isinstance(spec, bool):
        raise StageSpecError(f"stages must be a count or layer ranges, got {spec!r}")
    if isinstance(spec, int):
        if not 1 <= spec <= n_layers:
            raise StageSpecError(f"stages={spec}: the model has {n_layers} layers, so 1 .. {n_layers} stages")
        return even_ranges(n_layers, spec)
    if isinstance(spec, str):
        pairs = []
        for part in spec.replace(" ", "").split(","):
            m = re.fullmatch(r"(\d+):(\d+)", part)
            if m is None:
                raise StageSpecError(f"stages {spec!r}: {part!r} is not a layer range A:B (e.g. 0:2,2:4)")
            pairs.append((int(m[1]), int(m[2])))
    else:
        try:
            pairs = [(int(a), int(b)) for a, b in spec]
        except (TypeError, ValueError):
            raise StageSpecError(f"stages must be a count, 'A:B,C:D,...' or (a, b) pairs, got {spec!r}") from None
    check_stage_ranges(pairs, n_layers)
    return pairs


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``0 .. n`` cut into ``parts`` consecutive ranges (1 <= parts <= n) whose lengths differ by at most one, the
    longer ones first: the layers of N stages, the rows of the micro-batches of a decode call."""
    base, extra = divmod(n, parts)
    ranges, a = [], 0
    for i in range(parts):
        b = a + base + (1 if i < extra else 0)
        ranges.append((a, b))
        a = b
    return ranges


def check_stage_ranges(pairs, n_layers: int) -> None:
    """Raises :class:`StageSpecError` unless ``pairs`` (``(a, b)`` ints, b exclusive) are non-empty layer ranges,
    consecutive from layer 0, ending at ``n_layers``. The exporter checks a ``stages`` argument with it, the runtime
    the stages of a dsv4_ort.json."""
    if not pairs:
        raise StageSpecError("stages: no layer range given")
    expect = 0
    for a, b in pairs:
        if a != expect:
            raise StageSpecError(f"stages {_fmt(pairs)}: range {a}:{b} should start at layer {expect} (ranges are "
                                 "consecutive from layer 0)")
        if b <= a:
            raise StageSpecError(f"stages {_fmt(pairs)}: range {a}:{b} holds no layer")
        expect = b
    if expect != n_layers:
        raise StageSpecError(f"stages {_fmt(pairs)} end at layer {expect}, the model has {n_layers} layers")


def _fmt(pairs) -> str:
    return ",".join(f"{a}:{b}" for a, b in pairs)


# ----------------------------------------------------------------------------------------------------- graphs


class StageGraph(DecoderGraph):
    """The graph of one stage: layers ``[a, b)``, the embedding when first, the head when last."""

    def __init__(self, config, weights: dict, layers: tuple[int, int], *, first: bool, last: bool, **kw):
        super().__init__(config, weights, **kw)
        self.range = (int(layers[0]), int(layers[1]))
        self.first, self.last = first, last
        self.state = [s for s in self.state if self.range[0] <= s.layer < self.range[1]]

    def build(self):
        c, g = self.c, self.g
        a, b = self.range
        ids, start_pos = self.inputs(None if self.first else STREAMS_IN)
        if self.first:
            x = self.embed(ids)
        else:
            # what embed() defines for the MoE blocks: [batch, seq, d] from the streams, and the flat token ids
            # when a hash-routed layer is here (other stages leave input_ids unread)
            x = STREAMS_IN
            bs = g.node("Shape", [x], [("streams_in.shape", I64, [2])], "streams_in.shape", start=0, end=2)[0]
            self.shape_bsd = g.node("Concat", [bs, self._i64("const.hidden", [c.hidden_size])],
                                    [("streams_in.shape_bsd", I64, [3])], "streams_in.shape_bsd", axis=0)[0]
            if any(c.is_hash_layer(layer) for layer in range(a, b)):
                self.ids_flat = g.node("Reshape", [ids, self._i64("const.flat", [-1])],
                                       [("input_ids.flat", I64, ["tokens"])], "input_ids.flat")[0]
        x = self.layers(range(a, b), x, start_pos)
        if self.last:
            self.head(x)
        else:
            g.node("Identity", [x], [(STREAMS_OUT, ACT, [BATCH, "seq", c.hc_mult, c.hidden_size])], STREAMS_OUT)
            g.output(STREAMS_OUT)
            for st in self.state:
                g.output(st.output_name)
        return g


# ----------------------------------------------------------------------------------------------------- weights


class RoutingWriter:
    """The interface of :class:`~.weights.ExternalDataWriter` that the exporter's weight streaming uses, over one
    writer per stage: every tensor goes to the stage whose graph reads it (``embed.weight`` to the first,
    ``layers.L.*`` to the stage holding layer L, the head's tensors to the last). ``entries`` is the union."""

    def __init__(self, writers: list, ranges: list[tuple[int, int]]):
        self.writers = writers
        self.stage_of = {layer: i for i, (a, b) in enumerate(ranges) for layer in range(a, b)}
        self._entries: dict = {}

    def route(self, name: str) -> int:
        if name.startswith("embed."):
            return 0
        if name.startswith("layers."):
            return self.stage_of[int(name.split(".", 2)[1])]
        return len(self.writers) - 1  # hc_head_*, norm.weight, head.weight (+ head.scale)

    def add(self, piece, source: str = ""):
        e = self.writers[self.route(piece.name)].add(piece, source=source)
        self._entries[e.name] = e
        return e

    def add_part(self, piece, index: int, parts: int, source: str = ""):
        e = self.writers[self.route(piece.name)].add_part(piece, index, parts, source=source)
        self._entries[e.name] = e
        return e

    def entries(self) -> dict:
        return self._entries

    def incomplete(self) -> list:
        return [x for w in self.writers for x in w.incomplete()]

    @property
    def bytes_written(self) -> int:
        return sum(w.bytes_written for w in self.writers)


# ----------------------------------------------------------------------------------------------------- export


def export_stages(config, source, origin: dict, ck_dir, out_dir: Path, ranges: list[tuple[int, int]], *,
                  weights: str, max_seq_len: int, max_batch: int, logits: str, progress: bool, check: bool,
                  state: str, head: str, dense: str, compute: str, t0: float) -> Path:
    """The staged counterpart of :func:`~.exporter.export_model` (which validates the arguments and calls this);
    staged and published the same way (a staging directory swapped in whole). Returns the path of dsv4_ort.json."""
    from . import exporter as X
    from .weights import ExternalDataWriter, external_initializer

    export_id = uuid.uuid4().hex
    n = len(ranges)
    stage = X._staging_dir(out_dir)
    writers: list = []
    try:
        try:
            stage.mkdir()
            for i in range(n):
                writers.append(ExternalDataWriter(stage / stage_data_file(i)))
        except OSError as e:
            raise X.ExportError(f"cannot write next to the output directory {str(out_dir)!r} "
                                f"({e.strerror or e})") from None
        requant = {"head": head, "dense": dense}
        router = RoutingWriter(writers, ranges)
        written, formats = X._stream_weights(config, source, router, weights, progress, ck_dir, requant)
        for w in writers:
            w.append_trailer(export_trailer(export_id))
            w.close()
        t_weights = time.perf_counter() - t0

        graphs = []
        for i, (a, b) in enumerate(ranges):
            sg = StageGraph(config, written, (a, b), first=i == 0, last=i == n - 1, max_seq_len=max_seq_len,
                            logits=logits, state=state, compute=compute)
            g = sg.build()
            mine = writers[i].entries()
            for name in sorted(set(g.types) & set(mine)):
                g.initializers.append(external_initializer(mine[name], stage_data_file(i)))
            unused = sorted(set(mine) - {t.name for t in g.initializers})
            if unused:
                raise GraphBuildError(f"stage {i} (layers {a}:{b}): tensors of its data file not used by its graph: "
                                      f"{unused[:5]}")
            graphs.append((sg, g))

        tok_dir = ck_dir if ck_dir is not None else X._released_tokenizer_dir(config)
        tok_files = [f for f in X.TOKENIZER_FILES if tok_dir is not None and os.path.isfile(os.path.join(tok_dir, f))]
        meta = _pipeline_metadata(config, graphs, ranges, writers, origin, weights, formats, max_seq_len, max_batch,
                                  logits, tok_files, state)
        meta["weights"]["requantized"] = requant
        meta["compute"] = compute
        meta["export_id"] = export_id
        meta["export"] = {"seconds": round(time.perf_counter() - t0, 3), "weights_seconds": round(t_weights, 3),
                          "data_bytes": sum(w.end for w in writers)}
        text = json.dumps(meta, sort_keys=True)
        for i, ((sg, g), (a, b)) in enumerate(zip(graphs, ranges)):
            props = {"dsv4_ort.json": text, "dsv4_ort.format_version": FORMAT_VERSION,
                     "dsv4_ort.max_seq_len": max_seq_len, "dsv4_ort.max_batch": max_batch, "dsv4_ort.logits": logits,
                     "dsv4_ort.weights": weights, "dsv4_ort.requantized": f"head={head},dense={dense}",
                     "dsv4_ort.op_table_version": schema.TABLE_VERSION,
                     "dsv4_ort.ort_api_version": schema.ORT_API_VERSION, "dsv4_ort.export_id": export_id,
                     "dsv4_ort.stage": f"{i}/{n}", "dsv4_ort.stage_layers": f"{a}:{b}"}
            model = X.make_model(g, props, doc=f"DeepSeek-V4 pipeline stage {i} of {n} (layers {a}:{b}) exported by "
                                               "dsv4-ort; see dsv4_ort.json")
            X._write(stage / stage_model_file(i), model.SerializeToString())
            del model
            if check:
                import onnx

                schema.register_onnx_schemas()
                onnx.checker.check_model(str(stage / stage_model_file(i)), full_check=True)
        X._write(stage / META_FILE, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
        for name in tok_files:
            shutil.copyfile(os.path.join(tok_dir, name), stage / name)
            X._fsync_file(stage / name)
        X._fsync_dir(stage)
        X._publish(stage, out_dir)
        return out_dir / META_FILE
    except BaseException:
        for w in writers:
            w.close(sync=False)
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _pipeline_metadata(config, graphs, ranges, writers, origin, mode, formats, max_seq_len, max_batch, logits,
                       tok_files, state_format) -> dict:
    """dsv4_ort.json of a staged export: the single graph's fields for the whole pipeline (inputs ``input_ids``,
    ``start_pos`` and every state tensor; outputs ``logits`` and every state tensor) plus ``pipeline``."""
    from .exporter import _metadata

    every_state = [s for sg, _ in graphs for s in sg.state]
    ins = {v.name: v for _, g in graphs for v in g.inputs}
    outs = {v.name: v for _, g in graphs for v in g.outputs}
    whole_io = SimpleNamespace(
        inputs=[ins["input_ids"], ins["start_pos"]] + [ins[s.input_name] for s in every_state],
        outputs=[outs["logits"]] + [outs[s.output_name] for s in every_state])
    whole = SimpleNamespace(state=every_state, state_format=state_format)
    meta = _metadata(config, whole, whole_io, origin, mode, formats, max_seq_len, max_batch, logits, tok_files)
    meta["weights"]["data_file"] = None  # one per stage, below

    def io(vi):
        t = vi.type.tensor_type
        return {"name": vi.name, "dtype": schema.element_type(t.elem_type).name,
                "shape": [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]}

    stages = []
    for i, ((sg, g), (a, b), w) in enumerate(zip(graphs, ranges, writers)):
        stages.append({"index": i, "layers": [a, b], "model_file": stage_model_file(i),
                       "data_file": stage_data_file(i), "data_bytes": w.end, "embed": i == 0,
                       "head": i == len(graphs) - 1, "inputs": [io(v) for v in g.inputs if not v.name.startswith(
                           "past.")], "outputs": [io(v) for v in g.outputs if not v.name.startswith("present.")],
                       "state": [s.input_name for s in sg.state]})
    hc, d = int(config.hc_mult), int(config.hidden_size)
    meta["pipeline"] = {
        "stages": stages,
        "boundary": {"input": STREAMS_IN, "output": STREAMS_OUT, "dtype": schema.element_type(ACT).name,
                     "shape": [BATCH, "seq", hc, d], "bytes_per_token": hc * d * schema.element_type(ACT).bytes,
                     "note": "the hyper-connection residual streams of every position of the call cross each "
                             "boundary; input_ids and start_pos go to every stage"},
        "note": "run with dsv4_ort.runtime.pipeline.PipelineSession (in one process or one Ray actor per stage)",
    }
    return meta


__all__ = ["RoutingWriter", "STREAMS_IN", "STREAMS_OUT", "StageGraph", "StageSpecError", "check_stage_ranges",
           "even_ranges", "export_stages", "is_stage_file", "parse_stages", "stage_data_file", "stage_model_file"]
