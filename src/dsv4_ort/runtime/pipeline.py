"""``PipelineSession``: a staged export (``dsv4-ort export ... --stages N``) run stage after stage, in this process
or as one Ray actor per stage, with the API of :class:`~.session.Session`.

A staged export cuts the decoder between blocks (:mod:`dsv4_ort.export.stages`): stage i runs layers ``[a, b)``
and hands the hyper-connection residual streams (float32 ``[rows, seq, hc_mult, hidden]``) to stage i + 1; the
first stage embeds, the last ends with hc_head, the final norm and the LM head. Every stage keeps its own layers'
state; the positions are kept here, by the caller's :class:`PipelineState`, and sent with every call, so the
stages never disagree about where a row is.

Backends (``backend``):

* ``"local"``: every stage in an onnxruntime session of this process, run one after the other;
* ``"ray"``: one Ray actor per stage (``pip install 'dsv4-ort[cluster]'``), placed by Ray resources
  (``num_cpus`` per actor, ``ray_options`` for per-stage resources such as a custom ``{"stage0": 1}`` a node was
  started with, or ``placement`` for a placement group strategy such as ``"STRICT_SPREAD"``: one stage per node).
  Ray moves the streams: stage i's output is an object reference handed to stage i + 1, never fetched here. Each
  node needs ``dsv4_ort.json`` and its stage's two files at the same path as ``model_dir`` (a node maps only its
  share); this process needs ``dsv4_ort.json`` (and ``tokenizer.json`` for text). On one machine,
  :func:`start_local_ray` starts a Ray instance that listens on loopback only.

Micro-batches. The rows of a decode call (one token per row) are split into ``micro_batches`` consecutive groups
that enter the stages one behind the other: with Ray, stage 0 works on group 2 while stage 1 works on group 1, so
a batched decode step keeps every stage busy instead of one at a time. The chunks of a chunked prefill flow the
same way (chunk c + 1 enters stage 0 while chunk c is in stage 1); a prefill call's rows stay together. Default:
one group per stage with Ray, one group locally (no overlap in one process).

Results. Each stage's nodes are the single graph's nodes and the streams cross as exact float32 copies, so a
call gives bitwise the logits of the single-graph export's call over the same rows. Micro-batching changes how
many rows each kernel call of a decode step sees: with ``batch_invariant`` at least the batch (on the pipeline and
on the single graph it is compared with), or at the scalar ISA level, every row is computed as it is alone and
micro-batched logits equal the whole batch's bit for bit; without it the Linear / MoE kernels at the vector levels
pick their inner loop by the number of rows (see :class:`~.session.Session`), so logits equal those of the single
graph run on the same groups, and differ from the whole batch's in the last bits.

Failures. An exception in a stage, a stage actor that died (killed, its node lost) or no answer within
``timeout`` seconds is a :class:`StageError` from the call that needed the stage, naming it. A lost actor is not
restarted (``max_restarts=0``: its layers' state is gone); every later call raises the same error at once.
Recovery: :meth:`PipelineSession.close` and open a new pipeline; the state of the sequences in flight is lost
(their requests end with an error in the serving engine; clients resubmit).
"""

from __future__ import annotations

import json
import os
import socket
import weakref
from pathlib import Path

import numpy as np

from ..export.files import META_FILE, read_export_trailer
from .sampling import check_count
from .session import (_NOT_LOADED, ModelError, Session, _check_node_attributes, _forward_ids, _last_line,
                      load_metadata_file, physical_cores, read_ahead, session_options, sparse_weight_ranges)
from .state import STATE_TYPES, State

BACKENDS = ("local", "ray")
RECOVERY = ("restart the pipeline (close this PipelineSession and open a new one); the state of the sequences in "
            "flight is lost")


class StageError(RuntimeError):
    """A pipeline stage failed, died or did not answer; the message names the stage (and how to recover)."""

    def __init__(self, message: str, stage: int | None = None):
        super().__init__(message)
        self.stage = stage


def read_pipeline_metadata(model_dir: str | os.PathLike) -> dict:
    """dsv4_ort.json of a staged export, checked (the stage files themselves are checked by each stage, on its
    node)."""
    d = Path(model_dir)
    meta_path = d / META_FILE
    if not d.is_dir():
        raise ModelError(f"model directory {str(d)!r} does not exist")
    if not meta_path.is_file():
        raise ModelError(f"{str(d)!r} is not an exported dsv4-ort model (needs {META_FILE}; create one with "
                         "`dsv4-ort export --stages N`)")
    meta = load_metadata_file(meta_path)
    pipe = meta.get("pipeline")
    if pipe is None:
        raise ModelError(f"{str(d)!r} is a single-graph export (model.onnx): open it with Session, or export it "
                         "again with --stages N")
    stages = pipe.get("stages") if isinstance(pipe, dict) else None
    if not isinstance(stages, list) or not stages:
        raise ModelError(f"{meta_path} is corrupt: 'pipeline' must hold a list of 'stages'")
    from ..export.stages import StageSpecError, check_stage_ranges

    names = {t["input"] for t in meta["state"]["tensors"]}
    for i, s in enumerate(stages):
        ok = isinstance(s, dict) and s.get("index") == i and isinstance(s.get("layers"), list) \
            and len(s["layers"]) == 2 and all(type(x) is int for x in s["layers"]) \
            and all(isinstance(s.get(k), str) and Path(s[k]).name == s[k] for k in ("model_file", "data_file")) \
            and isinstance(s.get("state"), list) and set(s["state"]) <= names
        if not ok:
            raise ModelError(f"{meta_path} is corrupt: malformed pipeline stage {i} {s!r}")
    try:  # the same rule as the exporter's --stages: consecutive layer ranges from 0 to the last layer
        check_stage_ranges([tuple(s["layers"]) for s in stages], meta["config"].get("num_hidden_layers"))
    except StageSpecError as e:
        raise ModelError(f"{meta_path} is corrupt: {e}") from None
    return meta


# ---- one stage -----------------------------------------------------------------------------------------------------

class StageRunner:
    """Stage ``index`` of the staged export in ``model_dir`` in an onnxruntime session with the dsv4-ort library,
    holding the state of that stage's layers for every :class:`PipelineState` (by key). Runs in the caller's
    process (backend ``local``) or as the body of a Ray actor (backend ``ray``); every method takes and returns
    plain values (numpy arrays, ints, dicts) so Ray can carry them."""

    def __init__(self, model_dir: str, index: int, *, intra_op_threads: int | None = None, isa: str | None = None,
                 kernels: str | None = None, batch_invariant: int | None = None):
        import onnxruntime as ort

        import dsv4_ort
        from dsv4_ort.export import schema

        d = Path(model_dir)
        meta = read_pipeline_metadata(d)
        stages = meta["pipeline"]["stages"]
        if not 0 <= index < len(stages):
            raise ModelError(f"{d / META_FILE} has {len(stages)} stages, no stage {index}")
        spec = stages[index]
        self.index, self.n_stages = index, len(stages)
        self.layers = tuple(spec["layers"])
        self.first, self.last = index == 0, index == len(stages) - 1
        self.where = f"pipeline stage {index} (layers {self.layers[0]}:{self.layers[1]})"
        self.model_path, data_path = d / spec["model_file"], d / spec["data_file"]
        for p in (self.model_path, data_path):
            if not p.is_file():
                raise ModelError(f"{self.where}: {p} is missing on host {socket.gethostname()} (every stage's node "
                                 f"needs {META_FILE} and its stage's two files at the same path)")
        found = read_export_trailer(data_path)
        if found != meta["export_id"]:
            raise ModelError(f"{data_path} is not the data of {d / META_FILE} (export {meta['export_id']} there, "
                             f"{found or 'no export id'} in the data file): re-export the model")
        info = dsv4_ort.library_info(isa, kernels, batch_invariant)
        if meta.get("domain") != info["domain"]:
            raise ModelError(f"model uses op domain {meta.get('domain')!r}; this library implements "
                             f"{info['domain']!r}")
        need, have = int(meta.get("op_table_version", -1)), int(info["op_table_version"])
        if need > have:
            raise ModelError(f"model was exported for op table v{need} but this dsv4-ort library implements v{have}; "
                             "upgrade dsv4-ort (or re-export the model with this version)")
        if have != schema.TABLE_VERSION:
            raise ModelError(f"the installed library (op table v{have}) does not match the Python package "
                             f"(v{schema.TABLE_VERSION}); reinstall dsv4-ort")
        _check_node_attributes(self.model_path, info["domain"])
        self.isa, self.families = info["isa"], dict(info["families"])
        self.batch_invariant = int(info.get("batch_invariant_rows", 0))
        by_input = {t["input"]: t for t in meta["state"]["tensors"]}
        # the State of this stage: its layers' tensors only, at the model's capacity
        self.state_meta = {"max_seq_len": meta["max_seq_len"],
                           "state": {"batch_dim": meta["state"]["batch_dim"],
                                     "tensors": [by_input[n] for n in spec["state"]]}}
        cfg = meta["config"]
        self.streams_shape = (int(cfg["hc_mult"]), int(cfg["hidden_size"]))
        self.vocab_size = int(cfg["vocab_size"])
        self.logits_all = meta["logits"] == "all"
        threads = check_count("intra_op_threads", intra_op_threads, minimum=1) if intra_op_threads is not None \
            else physical_cores()
        so = session_options(threads)  # the stages of a process run one after another: no spinning between runs
        with dsv4_ort.isa_cap(isa, kernels, batch_invariant):
            dsv4_ort.register(so)
            try:
                self.session = ort.InferenceSession(str(self.model_path), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - reported as a model error naming the file
                raise ModelError(f"cannot load {self.model_path}: {_last_line(e)}") from None
        self._check_graph(meta)
        read_ahead(sparse_weight_ranges(self.model_path))  # the first stage's embedding
        self.threads = threads
        self.states: dict = {}  # key -> State of this stage's layers
        self.views: dict = {}  # (key, start, stop) -> row view of that State, bound once

    def _check_graph(self, meta: dict) -> None:
        """The stage graph must be the one dsv4_ort.json describes: export id, stage, inputs, outputs, state."""
        recorded = self.session.get_modelmeta().custom_metadata_map

        def mismatch(what: str) -> ModelError:
            return ModelError(f"{self.model_path} does not match {self.model_path.parent / META_FILE}: {what}")

        for key, want in (("export_id", meta["export_id"]), ("max_seq_len", meta["max_seq_len"]),
                          ("logits", meta["logits"]), ("stage", f"{self.index}/{self.n_stages}"),
                          ("stage_layers", f"{self.layers[0]}:{self.layers[1]}")):
            if str(recorded.get(f"dsv4_ort.{key}")) != str(want):
                raise mismatch(f"{key} {want} in the JSON, {recorded.get(f'dsv4_ort.{key}')} in the graph")
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        want_in = {"input_ids", "start_pos"} | (set() if self.first else {"streams_in"})
        want_out = {"logits" if self.last else "streams_out"}
        for t in self.state_meta["state"]["tensors"]:
            for name, table in ((t["input"], inputs), (t["output"], outputs)):
                arg = table.get(name)
                if arg is None or t["dtype"] not in STATE_TYPES or arg.type != f"tensor({t['dtype']})":
                    raise mismatch(f"state tensor {name!r} is {arg.type if arg else 'missing'} in the graph, "
                                   f"{t['dtype']} in the JSON")
            want_in.add(t["input"])
            want_out.add(t["output"])
        if set(inputs) != want_in or set(outputs) != want_out:
            raise mismatch(f"graph inputs {sorted(inputs)} / outputs {sorted(outputs)}, expected {sorted(want_in)} / "
                           f"{sorted(want_out)}")

    # ---- state ---------------------------------------------------------------------------------------------------

    def info(self) -> dict:
        return {"index": self.index, "layers": list(self.layers), "host": socket.gethostname(), "pid": os.getpid(),
                "isa": self.isa, "families": self.families, "threads": self.threads,
                "batch_invariant": self.batch_invariant}

    def new_state(self, key: int, batch_size: int) -> int:
        self.drop_state(key)
        self.states[key] = State(self.state_meta, batch_size, self.session)
        return self.states[key].nbytes

    def drop_state(self, key: int) -> None:
        self.states.pop(key, None)
        for k in [k for k in self.views if k[0] == key]:
            del self.views[k]

    def _state(self, key: int) -> State:
        try:
            return self.states[key]
        except KeyError:
            raise StageError(f"{self.where}: no state {key} here (created by another pipeline, or released)",
                             self.index) from None

    def _view(self, key: int, start: int, stop: int) -> State:
        st = self._state(key)
        if (start, stop) == (0, st.batch_size):
            return st
        k = (key, start, stop)
        if k not in self.views:
            self.views[k] = st.rows(start, stop)
        return self.views[k]

    def copy_row(self, key: int, src: int, dst: int) -> None:
        self._state(key).copy_row(src, dst)

    def swap_rows(self, key: int, a: int, b: int) -> None:
        self._state(key).swap_rows(a, b)

    def buffer(self, key: int, name: str) -> np.ndarray:
        return self._state(key).buffer(name).copy()

    # ---- run -----------------------------------------------------------------------------------------------------

    def run(self, key: int, start: int, stop: int, positions: np.ndarray, ids: np.ndarray,
            streams: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of state ``key`` from ``positions`` (int64 [rows]) on ``ids`` [rows, seq] (and
        the previous stage's ``streams`` [rows, seq, hc, d]); returns this stage's streams, or the logits [rows,
        seq or 1, vocab] for the last stage."""
        import onnxruntime as ort

        try:
            view = self._view(key, start, stop)
            B, S = ids.shape
            view.positions[:] = positions  # the caller's positions are the truth; the stages only follow them
            io = view.binding
            ids = np.ascontiguousarray(ids, np.int64)
            keep = [ids, ort.OrtValue.ortvalue_from_numpy(ids)]
            io.bind_ortvalue_input("input_ids", keep[-1])
            if not self.first:
                if streams is None or streams.shape != (B, S, *self.streams_shape):
                    raise ValueError(f"streams of shape {None if streams is None else streams.shape} for ids "
                                     f"{ids.shape}, expected {(B, S, *self.streams_shape)}")
                # arrays from Ray's object store are read-only views of shared memory: onnxruntime only reads them
                streams = np.ascontiguousarray(streams, np.float32)
                keep += [streams, ort.OrtValue.ortvalue_from_numpy(streams)]
                io.bind_ortvalue_input("streams_in", keep[-1])
            if self.last:
                out = np.empty((B, S if self.logits_all else 1, self.vocab_size), np.float32)
                name = "logits"
            else:
                out = np.empty((B, S, *self.streams_shape), np.float32)
                name = "streams_out"
            io.bind_output(name, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
            view._run_buffers = (*keep, out)  # alive for the run on every onnxruntime
            self.session.run_with_iobinding(io)
            view.positions += S
            return out
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - reported with the stage it happened in
            raise StageError(f"{self.where} failed: {' '.join(str(e).split()) or type(e).__name__}",
                             self.index) from None


# ---- backends ------------------------------------------------------------------------------------------------------

class _LocalStages:
    """Every stage in this process; a call runs at once and its result is the value."""

    remote = False

    def __init__(self, runners: list):
        self.runners = runners

    def call(self, stage: int, method: str, *args):
        return getattr(self.runners[stage], method)(*args)

    def get(self, values: list) -> list:
        return values

    def infos(self) -> list:
        return [r.info() for r in self.runners]

    def release(self, key: int) -> None:
        for r in self.runners:
            r.drop_state(key)

    def close(self) -> None:
        self.runners = []


class _RayStages:
    """One Ray actor per stage; a call returns an object reference (arguments may be references of other stages'
    results: Ray hands them over between the actors)."""

    remote = True

    def __init__(self, model_dir: str, n: int, *, threads, isa, kernels, batch_invariant, num_cpus,
                 ray_options, placement, timeout):
        try:
            import ray
        except ImportError as e:
            raise ImportError(f"backend 'ray' needs the cluster extra ({e}); pip install 'dsv4-ort[cluster]'") from e
        self.ray = ray
        self.timeout = timeout
        self.broken: str | None = None
        if not ray.is_initialized():
            raise StageError("backend 'ray': connect to a Ray cluster first (ray.init(address=...), or ray.init() "
                             "for one on this machine)")
        if isinstance(ray_options, dict) or ray_options is None:
            ray_options = [dict(ray_options or {}) for _ in range(n)]
        if len(ray_options) != n:
            raise ValueError(f"ray_options: {len(ray_options)} entries for {n} stages")
        self.pg = None
        if placement is not None:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            self.pg = placement_group([{"CPU": num_cpus}] * n, strategy=placement)
            self._wait(self.pg.ready(), f"a placement group of {n} bundles of {num_cpus} CPUs ({placement})")
        actor = ray.remote(StageRunner)
        self.actors = []
        for i in range(n):
            opts = {"num_cpus": num_cpus, "max_restarts": 0, "max_task_retries": 0, **ray_options[i]}
            if self.pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i)
            self.actors.append(actor.options(**opts).remote(model_dir, i, intra_op_threads=threads, isa=isa,
                                                            kernels=kernels, batch_invariant=batch_invariant))
        self.ids = {a._actor_id.hex(): i for i, a in enumerate(self.actors)}

    def _wait(self, ref, what: str):
        try:
            return self.ray.get(ref, timeout=self.timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise StageError(f"pipeline: no {what} within {self.timeout} s") from None

    def call(self, stage: int, method: str, *args):
        if self.broken is not None:
            raise StageError(self.broken)
        return getattr(self.actors[stage], method).remote(*args)

    def get(self, refs: list) -> list:
        ray = self.ray
        if self.broken is not None:
            raise StageError(self.broken)
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise StageError(f"pipeline: no answer from the stages within {self.timeout} s (a stage is stuck or "
                             f"its node unreachable); {RECOVERY}") from None
        except ray.exceptions.RayActorError as e:  # the actor (process or node) is gone: its layers' state too
            i = self.ids.get(getattr(e, "actor_id", None))
            where = f"pipeline stage {i}" if i is not None else "a pipeline stage"
            init = " while starting" if getattr(e, "actor_init_failed", False) else ""
            self.broken = (f"{where} died{init} ({_ray_reason(e)}); {RECOVERY}")
            raise StageError(self.broken, i) from None
        except ray.exceptions.RayTaskError as e:  # an exception inside a stage: its own message
            cause = getattr(e, "cause", None)
            if isinstance(cause, (StageError, ModelError)):
                raise type(cause)(str(cause)) from None
            i = self.ids.get(getattr(e, "actor_id", None))
            raise StageError(f"pipeline stage {i} failed: {_last_line(cause or e)}", i) from None

    def infos(self) -> list:
        return self.get([a.info.remote() for a in self.actors])

    def release(self, key: int) -> None:
        if self.broken is None:
            for a in self.actors:
                try:
                    a.drop_state.remote(key)
                except Exception:  # noqa: BLE001 - a dying cluster: nothing left to release
                    pass

    def close(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.pg is not None:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
        self.broken = "the pipeline was closed"


def _ray_reason(e) -> str:
    """One line of why Ray says an actor is gone."""
    text = " ".join(str(getattr(e, "error_msg", None) or e).split())
    for marker in ("The actor is dead because ", "The actor died because "):
        if marker in text:
            text = text[text.index(marker) + len(marker):]
    return text[:240] or type(e).__name__


# ---- the driver's state --------------------------------------------------------------------------------------------

class PipelineState(State):
    """The state of ``batch_size`` sequences of a :class:`PipelineSession`: positions here, buffers in the
    stages (each stage holds its layers' tensors under this state's key). The API of :class:`~.state.State`
    (``rows``, ``copy_row``, ``swap_rows``, ``reset``, ``positions``, ``batch_size``, ``nbytes``, ``buffer``) except
    the local buffers (``tensors``, ``bind``). Released in the stages when the whole state is garbage collected."""

    def __init__(self, owner: "PipelineSession", key: int, batch_size: int, nbytes: int):
        # State.__init__ is not run: there are no local buffers to allocate
        self.owner, self.key, self.offset = owner, key, 0
        self.batch_size = batch_size
        self.max_seq_len = owner.max_seq_len
        self.positions = np.zeros(batch_size, np.int64)
        self.parent = None
        self._nbytes = nbytes

    @property
    def tensors(self):
        raise AttributeError("a PipelineState's buffers live in the pipeline's stages (use buffer(name))")

    @property
    def binding(self):
        return None

    def bind(self, session) -> None:
        raise TypeError("a PipelineState runs only in the PipelineSession that made it")

    def rows(self, start: int, stop: int) -> "PipelineState":
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= self.batch_size):
            raise ValueError(f"rows [{start}, {stop}) are not a non-empty range of the {self.batch_size} rows")
        view = PipelineState.__new__(PipelineState)
        view.owner, view.key, view.offset = self.owner, self.key, self.offset + start
        view.batch_size, view.max_seq_len = stop - start, self.max_seq_len
        view.positions = self.positions[start:stop]
        view.parent = self  # keeps the whole state (and its stage buffers) alive
        view._nbytes = self._nbytes * (stop - start) // self.batch_size
        return view

    def _rows_call(self, method: str, a: int, b: int) -> None:
        for i in (a, b):
            if not (isinstance(i, int) and 0 <= i < self.batch_size):
                raise ValueError(f"row {i!r} is outside the {self.batch_size} rows")
        st = self.owner._stages
        st.get([st.call(s, method, self.key, self.offset + a, self.offset + b) for s in range(self.owner.n_stages)])

    def copy_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        self._rows_call("copy_row", src, dst)
        self.positions[dst] = self.positions[src]

    def swap_rows(self, a: int, b: int) -> None:
        if a == b:
            return
        self._rows_call("swap_rows", a, b)
        self.positions[[a, b]] = self.positions[[b, a]]

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def buffer(self, name: str) -> np.ndarray:
        """A copy of a state tensor's rows (by its past/present name or ``L.name``), from the stage holding it."""
        layer = name.removeprefix("past.").removeprefix("present.").split(".", 1)[0]
        if not layer.isdigit():
            raise KeyError(name)
        stage = self.owner._stage_of_layer.get(int(layer))
        if stage is None:
            raise KeyError(name)
        st = self.owner._stages
        (buf,) = st.get([st.call(stage, "buffer", self.key, name)])
        return buf[self.offset:self.offset + self.batch_size]


# ---- the session ---------------------------------------------------------------------------------------------------

class PipelineSession:
    """A staged export ready to run, with the API of :class:`~.session.Session` (``new_state``, ``forward``,
    ``generate``, ``stream``, ``chat``, ``encode``, ``decode``; the serving :class:`~.engine.Engine` drives it).

    Args:
        model_dir: directory written by ``dsv4-ort export ... --stages N``.
        backend: ``"local"`` (every stage in this process) or ``"ray"`` (one actor per stage, on the Ray cluster
            this process is connected to: call ``ray.init(...)`` first).
        intra_op_threads: onnxruntime threads of each stage (default: the physical cores of its node).
        isa, kernels, batch_invariant: as for :class:`~.session.Session`, for every stage.
        prefill_chunk: split prompts longer than this into chunks (default: no split).
        micro_batches: groups a call's rows are split into (see the module docstring); default: one per stage with
            Ray, 1 locally.
        num_cpus: Ray CPUs each stage actor reserves (default: ``intra_op_threads``, else 1).
        ray_options: extra ``.options()`` of the stage actors: one dict for all, or a list with one per stage (e.g.
            ``[{"resources": {"stage0": 1}}, {"resources": {"stage1": 1}}]`` for nodes started with those custom
            resources).
        placement: a Ray placement group strategy (``"STRICT_SPREAD"``: one stage per node; ``"PACK"``,
            ``"SPREAD"``) with one bundle of ``num_cpus`` CPUs per stage; default: none (Ray places the actors).
        timeout: seconds a call waits for the stages before a :class:`StageError` (default: no limit; a dead actor
            is reported at once either way). Opening the pipeline waits for every stage to load under the same
            limit; a Ray worker process that dies while starting is replaced only after Ray's worker registration
            timeout (60 s by default), so leave loading more than that.
    """

    def __init__(self, model_dir: str | os.PathLike, *, backend: str = "local", intra_op_threads: int | None = None,
                 isa: str | None = None, kernels: str | None = None, batch_invariant: int | None = None,
                 prefill_chunk: int | None = None, micro_batches: int | None = None, num_cpus: float | None = None,
                 ray_options=None, placement: str | None = None, timeout: float | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.model_dir = Path(model_dir)
        self.meta = read_pipeline_metadata(self.model_dir)
        self.config = self.meta["config"]
        self.vocab_size = int(self.config["vocab_size"])
        self.max_seq_len = int(self.meta["max_seq_len"])
        self.logits_mode = self.meta["logits"]
        stages = self.meta["pipeline"]["stages"]
        self.n_stages = len(stages)
        self.layers = [tuple(s["layers"]) for s in stages]
        self._stage_of_layer = {layer: i for i, (a, b) in enumerate(self.layers) for layer in range(a, b)}
        self.backend = backend
        if intra_op_threads is not None:
            intra_op_threads = check_count("intra_op_threads", intra_op_threads, minimum=1)
        if prefill_chunk is not None:
            prefill_chunk = check_count("prefill_chunk", prefill_chunk, minimum=1)
        self.prefill_chunk = prefill_chunk
        if micro_batches is None:
            micro_batches = self.n_stages if backend == "ray" else 1
        self.micro_batches = check_count("micro_batches", micro_batches, minimum=1)
        _check_timeout(timeout)
        if backend == "local":
            self._stages = _LocalStages([StageRunner(str(self.model_dir), i, intra_op_threads=intra_op_threads,
                                                     isa=isa, kernels=kernels, batch_invariant=batch_invariant)
                                         for i in range(self.n_stages)])
        else:
            cpus = num_cpus if num_cpus is not None else (intra_op_threads or 1)
            self._stages = _RayStages(str(self.model_dir.resolve()), self.n_stages, threads=intra_op_threads,
                                      isa=isa, kernels=kernels, batch_invariant=batch_invariant, num_cpus=cpus,
                                      ray_options=ray_options, placement=placement, timeout=timeout)
        try:
            self.stages = self._stages.infos()  # waits for every stage to load (errors name the stage)
        except BaseException:
            self._stages.close()
            raise
        self.isa = self.stages[0]["isa"]
        self.families = self.stages[0]["families"]
        self.threads = self.stages[0]["threads"]
        self.batch_invariant = min(s["batch_invariant"] for s in self.stages)
        self._keys = iter(range(1, 1 << 62))
        self._tokenizer = _NOT_LOADED

    tokenizer = Session.tokenizer

    @property
    def timeout(self) -> float | None:
        """Seconds a call waits for the Ray stages before a :class:`StageError` (None: no limit); settable, e.g. a
        long one while the stages load and a short one for decode steps. No effect on the local backend."""
        return getattr(self._stages, "timeout", None)

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        _check_timeout(value)
        self._stages.timeout = value

    def close(self) -> None:
        """Stops the stages (Ray: kills the actors); the session and its states are unusable afterwards."""
        self._stages.close()

    def __enter__(self) -> "PipelineSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- state and forward ---------------------------------------------------------------------------------------

    def new_state(self, batch_size: int = 1) -> PipelineState:
        """Fresh, zeroed state for ``batch_size`` sequences, allocated in every stage."""
        batch_size = check_count("batch_size", batch_size, minimum=1)
        key = next(self._keys)
        st = self._stages
        sizes = st.get([st.call(s, "new_state", key, batch_size) for s in range(self.n_stages)])
        state = PipelineState(self, key, batch_size, int(sum(sizes)))
        weakref.finalize(state, _release, weakref.ref(self._stages), key)
        return state

    def _groups(self, rows: int) -> list:
        """Consecutive row groups of a decode call: ``micro_batches`` of them (at most one per row), sizes within
        one. Prefill calls stay whole (their chunks flow through the stages one behind the other instead): a
        kernel's summation order depends on the rows of a call, and splitting a prompt's rows would change it."""
        from ..export.stages import even_ranges

        return even_ranges(rows, min(self.micro_batches, rows))

    def forward(self, input_ids, state: PipelineState, *, chunk_size: int | None = None) -> np.ndarray:
        """Runs ``input_ids`` [B, S] from each row's current position through every stage; returns float32 logits
        [B, S, V] (or [B, 1, V] for last-position logits) and advances the state. Arguments as for
        :meth:`Session.forward`; a stage's failure is a :class:`StageError`."""
        if chunk_size is not None:
            chunk_size = check_count("chunk_size", chunk_size, minimum=1)
        if not isinstance(state, PipelineState) or state.owner is not self:
            raise TypeError(f"state must be a PipelineState of this PipelineSession (new_state), got "
                            f"{type(state).__name__}")
        ids = _forward_ids(input_ids, state, self.vocab_size, self.max_seq_len)
        B, S = ids.shape
        chunk = chunk_size or self.prefill_chunk or S
        st, pos0 = self._stages, state.positions.copy()
        pending = []  # (chunk start, rows a, rows b, the last stage's result)
        # everything is submitted before anything is awaited: with Ray, group g + 1 (or chunk c + 1) enters stage 0
        # while group g is in stage 1; each stage takes its calls in submission order
        for c in range(0, S, chunk):
            part = ids[:, c:c + chunk]
            for a, b in (self._groups(B) if S == 1 else [(0, B)]):
                x = None
                for s in range(self.n_stages):
                    args = (state.key, state.offset + a, state.offset + b, pos0[a:b] + c, part[a:b])
                    x = st.call(s, "run", *args, *(() if s == 0 else (x,)))
                pending.append((c, a, b, x))
        results = st.get([p[3] for p in pending])
        state.positions += S
        chunks = []
        for c in range(0, S, chunk):
            parts = [r for (cc, _, _, _), r in zip(pending, results) if cc == c]
            chunks.append(np.concatenate(parts, axis=0) if len(parts) > 1 else np.array(parts[0]))
        if self.logits_mode == "all":
            return chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=1)
        return chunks[-1]

    # ---- generation and text: Session's, on this forward / new_state -------------------------------------------

    _check_generation = Session._check_generation
    stream = Session.stream
    _stream = Session._stream
    generate = Session.generate
    encode = Session.encode
    chat = Session.chat
    decode = Session.decode



def _check_timeout(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {value!r}")


def _release(stages_ref, key: int) -> None:
    """Frees a garbage-collected state's buffers in the stages (nothing when the pipeline is gone)."""
    stages = stages_ref()
    if stages is not None:
        try:
            stages.release(key)
        except Exception:  # noqa: BLE001 - at interpreter exit the backend may be half torn down
            pass


def open_pipeline(model_dir, **kw) -> PipelineSession:
    """``PipelineSession(model_dir, **kw)``; with ``backend="ray"`` and no Ray connection yet, first
    ``ray.init(address=kw.pop("ray_address"))`` (None: a Ray instance on this machine)."""
    address = kw.pop("ray_address", None)
    if kw.get("backend") == "ray":
        import ray

        if not ray.is_initialized():
            if address is None:  # a Ray instance of this machine alone
                start_local_ray()
            else:
                ray.init(address=address, log_to_driver=False)
    return PipelineSession(model_dir, **kw)


def start_local_ray(num_cpus: float | None = None, *, object_store_memory: int | None = None, **kw):
    """Starts a Ray instance of this machine alone, reachable on loopback only (every Ray server listens on
    127.0.0.1), without dashboard, usage reporting or workers started ahead of the actors; returns the ``ray``
    module. ``num_cpus``: logical CPUs it offers (default: the machine's); ``kw``: more ``ray.init`` arguments.

    Trap: on Linux Ray replaces a 127.0.0.1 node address by the host's outside address (and binds there) unless
    its single-machine mode is on; that mode is read from the environment when ``ray`` is imported, so it is set
    both in the environment (for Ray's own processes) and in the imported module."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    opts = {"address": "local", "include_dashboard": False, "_node_ip_address": "127.0.0.1", "log_to_driver": False,
            "configure_logging": False, "_system_config": {"enable_worker_prestart": False}}
    if num_cpus is not None:
        opts["num_cpus"] = num_cpus
    if object_store_memory is not None:
        opts["object_store_memory"] = object_store_memory
    ray.init(**{**opts, **kw})
    return ray


def is_pipeline_export(model_dir) -> bool:
    """Whether ``model_dir``'s dsv4_ort.json describes a staged export (cheap: reads only that file)."""
    try:
        meta = json.loads((Path(model_dir) / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("pipeline"), dict)


__all__ = ["BACKENDS", "PipelineSession", "PipelineState", "StageError", "StageRunner", "is_pipeline_export",
           "open_pipeline", "read_pipeline_metadata", "start_local_ray"]

