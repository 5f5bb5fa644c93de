"""``Session``: an exported DeepSeek-V4 model in an onnxruntime InferenceSession with the dsv4-ort library.

The session registers the custom-op library itself, checks that the model's op-table version is one the library
implements, binds every state buffer in place (see :mod:`.state`) and runs prefill (any number of tokens, optionally
in chunks) and decode (one token per row) through the same graph.
"""

from __future__ import annotations

import json
import numbers
import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..export.files import DATA_FILE, FORMAT_VERSION, META_FILE, MODEL_FILE, read_export_trailer
from .sampling import check_count, check_logits, check_sampling, check_seed, sample
from .speculative import check_speculative
from .state import State


class ModelError(ValueError):
    """The model directory is missing, incomplete or not usable with this library."""


def physical_cores() -> int:
    """Cores available to this process, counting SMT siblings once."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list"
        try:
            with open(path) as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def load_metadata_file(meta_path: Path) -> dict:
    """The JSON of an existing dsv4_ort.json, checked as a dsv4-ort export of this format version (single graph or
    pipeline stages)."""
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise ModelError(f"{meta_path} is corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != "dsv4-ort":
        raise ModelError(f"{meta_path} does not describe a dsv4-ort model")
    if meta.get("format_version") != FORMAT_VERSION or not isinstance(meta.get("export_id"), str):
        raise ModelError(f"{meta_path}: export format {meta.get('format_version')!r}, this dsv4-ort reads "
                         f"{FORMAT_VERSION}; re-export the model with `dsv4-ort export`")
    _check_metadata(meta, meta_path)
    return meta


def read_metadata(model_dir: str | os.PathLike, model_file: str = MODEL_FILE) -> dict:
    """dsv4_ort.json of ``model_dir``, checked; ``model_file`` is the graph that must sit beside it (``model.onnx``,
    or an ORT-format conversion such as ``model.ort``)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelError(f"model directory {str(d)!r} does not exist")
    meta_path, model_path = d / META_FILE, d / model_file
    if not model_path.is_file() and meta_path.is_file() and '"pipeline"' in meta_path.read_text(errors="replace"):
        raise ModelError(f"{str(d)!r} is an export in pipeline stages (model.stage<i>.onnx): open it with "
                         "dsv4_ort.runtime.pipeline.PipelineSession")
    if not model_path.is_file() or not meta_path.is_file():
        raise ModelError(f"{str(d)!r} is not an exported dsv4-ort model (needs {model_file} and {META_FILE}; "
                         "create one with `dsv4-ort export`)")
    meta = load_metadata_file(meta_path)
    data_path = d / DATA_FILE
    if data_path.is_file():
        found = read_export_trailer(data_path)
        if found is None:
            raise ModelError(f"{data_path} ends without its export id: truncated, or not written by this dsv4-ort; "
                             "re-export the model")
        if found != meta["export_id"]:
            raise ModelError(f"{data_path} is not the data of {model_path} ({meta_path} names export "
                             f"{meta['export_id']}, the data file {found or 'no export'}): the directory mixes "
                             "files of different exports; re-export it")
    return meta


def _check_metadata(meta: dict, meta_path: Path) -> None:
    """The fields a Session reads, with the types it needs (a damaged or hand-edited file fails here, by name)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ModelError(f"{meta_path} is corrupt: {what}")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    need(isinstance(meta.get("config"), dict) and count(meta["config"].get("vocab_size")),
         "'config' with a positive 'vocab_size' is missing")
    need(count(meta.get("max_seq_len")), "'max_seq_len' must be a positive integer")
    need(meta.get("logits") in ("last", "all"), "'logits' must be 'last' or 'all'")
    need(isinstance(meta.get("op_table_version"), int), "'op_table_version' is missing")
    state = meta.get("state")
    need(isinstance(state, dict) and isinstance(state.get("tensors"), list) and "batch_dim" in state,
         "'state' must hold 'batch_dim' and a list of 'tensors'")
    for t in state["tensors"]:
        need(isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("input", "output", "dtype"))
             and isinstance(t.get("shape"), list) and all(d == state["batch_dim"] or count(d) for d in t["shape"]),
             f"malformed state tensor entry {t!r}")


def _check_against_graph(meta: dict, session, model_path: Path) -> None:
    """dsv4_ort.json must describe the graph it sits next to: the op table version and capacity recorded inside
    model.onnx, every state tensor (name, element type, fixed dimensions) and the vocabulary of the logits."""
    from .state import STATE_TYPES

    def mismatch(what: str) -> ModelError:
        return ModelError(f"{model_path.parent / META_FILE} does not match {model_path}: {what}")

    recorded = session.get_modelmeta().custom_metadata_map
    for key in ("export_id", "op_table_version", "max_seq_len", "logits"):
        if str(recorded.get(f"dsv4_ort.{key}")) != str(meta.get(key)):
            raise mismatch(f"{key} {meta.get(key)} in the JSON, {recorded.get(f'dsv4_ort.{key}')} in the graph")
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    listed_in = {t["input"] for t in meta["state"]["tensors"]}
    listed_out = {t["output"] for t in meta["state"]["tensors"]}
    for t in meta["state"]["tensors"]:
        # a state tensor is one buffer bound as past.X and present.X: a pair of other names would bind one
        # layer's output to another's input
        if not t["input"].startswith("past.") or t["output"] != "present." + t["input"][len("past."):]:
            raise mismatch(f"state pair {t['input']!r} / {t['output']!r} is not past.X / present.X")
        for name, table in ((t["input"], inputs), (t["output"], outputs)):
            arg = table.get(name)
            if arg is None:
                raise mismatch(f"the graph has no state tensor {name!r}")
            if t["dtype"] not in STATE_TYPES or arg.type != f"tensor({t['dtype']})":
                raise mismatch(f"state tensor {name!r} is {arg.type} in the graph, {t['dtype']} in the JSON")
            fixed = [(a, b) for a, b in zip(arg.shape, t["shape"]) if isinstance(a, int)]
            if len(arg.shape) != len(t["shape"]) or any(a != b for a, b in fixed):
                raise mismatch(f"state tensor {name!r} has shape {arg.shape} in the graph, {t['shape']} in the JSON")
    # an export with its MTP block (export/mtp.py) adds the output "hidden" and, for last-position logits, the input
    # "num_logits"; the JSON's "mtp" section lists them
    mtp = meta.get("mtp") if isinstance(meta.get("mtp"), dict) and meta["mtp"].get("exported") else {}
    mtp_in, mtp_out = set(mtp.get("main_inputs", ())), set(mtp.get("main_outputs", ()))
    for name in sorted(set(inputs) - listed_in - {"input_ids", "start_pos"} - mtp_in):
        raise mismatch(f"graph input {name!r} is not in the JSON's state tensors")
    for name in sorted(set(outputs) - listed_out - {"logits"} - mtp_out):
        raise mismatch(f"graph output {name!r} is not in the JSON's state tensors")
    logits = outputs.get("logits")
    vocab = meta["config"]["vocab_size"]
    if logits is None or (logits.shape and isinstance(logits.shape[-1], int) and logits.shape[-1] != vocab):
        raise mismatch(f"the logits output is {None if logits is None else logits.shape}, the vocabulary {vocab}")
    last = logits.shape[1] == 1 or ("num_logits" in mtp_in and logits.shape[1] == "num_logits")
    if len(logits.shape) != 3 or (meta["logits"] == "last") != last:
        raise mismatch(f"logits {meta['logits']!r} in the JSON, an output of shape {logits.shape} in the graph")


def _ort_format_nodes(model_path: Path) -> list:
    """The top-level nodes of an ORT-format model (a flatbuffer, what onnxruntime's convert_onnx_models_to_ort
    writes) as objects with the fields of onnx's NodeProto that :func:`_check_node_attributes` reads (domain,
    op_type, name, attribute[].name / .type; the flatbuffer's attribute type codes are onnx's). Read through the
    flatbuffer classes onnxruntime ships in onnxruntime.tools, on a memory map: the file holds every weight."""
    import mmap
    from types import SimpleNamespace

    import onnxruntime.tools.ort_format_model  # noqa: F401 - puts onnxruntime's ort_flatbuffers_py on sys.path
    from ort_flatbuffers_py.fbs.InferenceSession import InferenceSession

    def text(b) -> str:
        return b.decode("utf-8", "replace") if b is not None else ""

    with open(model_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if len(buf) < 8 or not InferenceSession.InferenceSessionBufferHasIdentifier(buf, 0):
            raise ValueError("no ORTM file identifier")
        graph = InferenceSession.GetRootAs(buf, 0).Model().Graph()
        nodes = []
        for i in range(graph.NodesLength()):
            n = graph.Nodes(i)
            if n is None:
                continue
            attrs = [SimpleNamespace(name=text(a.Name()), type=a.Type())
                     for a in (n.Attributes(j) for j in range(n.AttributesLength())) if a is not None]
            nodes.append(SimpleNamespace(domain=text(n.Domain()), op_type=text(n.OpType()), name=text(n.Name()),
                                         attribute=attrs))
    return nodes


def sparse_weight_ranges(model_path: Path) -> list:
    """[(data file, offset, length)] of the external weights a step reads only a few rows of: the data input of
    every Gather (the token embedding). onnxruntime maps external data files, so a row is read from the page cache,
    or from disk on its first touch once the cache has let it go; every other weight is streamed whole each step
    and stays resident by use. ORT-format models hold their weights in the model file: none listed."""
    import onnx

    if model_path.suffix != ".onnx":
        return []
    graph = onnx.load(str(model_path), load_external_data=False).graph
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.domain in ("", "ai.onnx") and n.input}
    out = []
    for t in graph.initializer:
        if t.name not in gathered or t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if "location" in info and "length" in info:
            out.append((model_path.parent / info["location"], int(info.get("offset", 0)), int(info["length"])))
    return out


_READ_AHEAD_STEP = 2 << 20


def read_ahead(ranges) -> int:
    """Ask the kernel to bring ``ranges`` into the page cache now (POSIX_FADV_WILLNEED, asynchronous) so that the
    first decode steps do not wait on disk for each new embedding row (measured: 0.4-0.6 ms per row on a cold
    cache, 13 ms of a 111 ms 8-row step). Returns the bytes advised; 0 where the platform has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    done = 0
    for path, offset, length in ranges:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # onnxruntime has already loaded the model, so this is a race with a deleted file
            continue
        try:
            # one advice per 2 MiB: Linux reads at most its read-ahead window (a few MiB) per call
            for at in range(offset, offset + length, _READ_AHEAD_STEP):
                os.posix_fadvise(fd, at, min(_READ_AHEAD_STEP, offset + length - at), os.POSIX_FADV_WILLNEED)
            done += length
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


def _check_node_attributes(model_path: Path, domain: str) -> None:
    """Every node of the op domain has only the attributes its op declares, each of the declared type (an int where
    a float is declared is taken at its value). The library checks types and ranges itself, but onnxruntime's C API
    reads attributes by name and cannot list a node's attributes, so a misspelled one would be ignored there."""
    import onnx

    from dsv4_ort.export import schema

    if model_path.suffix == ".ort":
        try:
            nodes = _ort_format_nodes(model_path)
        except Exception as e:  # noqa: BLE001 - a damaged flatbuffer fails in struct/index errors
            raise ModelError(f"cannot load {model_path}: not a readable ORT-format model ({_last_line(e)})") from None
    else:
        try:
            nodes = onnx.load(str(model_path), load_external_data=False).graph.node
        except Exception as e:  # noqa: BLE001 - reported as a model error
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ModelError(f"cannot load {model_path}: Protobuf parsing failed ({detail})") from None
    kinds = {"int": {onnx.AttributeProto.INT}, "float": {onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT},
             "string": {onnx.AttributeProto.STRING}}
    table = schema.ops()
    for node in nodes:
        if node.domain != domain:
            continue
        spec = table.get(node.op_type)
        if spec is None:
            raise ModelError(f"{model_path}: node {node.name!r} is op {node.op_type!r}, which the {domain} domain "
                             "does not define")
        declared = {a.name: a for a in spec.attributes}
        for attr in node.attribute:
            a = declared.get(attr.name)
            if a is None:
                raise ModelError(f"{model_path}: {node.op_type} node {node.name!r} has attribute {attr.name!r}, "
                                 f"which {node.op_type} does not have (it has: {', '.join(declared) or 'none'})")
            if attr.type not in kinds[a.type]:
                raise ModelError(f"{model_path}: {node.op_type} node {node.name!r}: attribute {attr.name!r} must be "
                                 f"{a.type}, the node has {onnx.AttributeProto.AttributeType.Name(attr.type).lower()}")


def _token_ids(value, name: str, vocab: int) -> np.ndarray:
    """``value`` (nested sequences or an array of integers) as an int64 array, every id in [0, vocab).

    Integer dtypes and Python ints only: a float array is a TypeError even when its values are whole, so an id is
    never rounded or truncated (1.5 is not token 1); bools and strings are TypeErrors; an id outside the
    vocabulary (also one too large for int64) is a ValueError naming its position."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be token ids (integers), got a {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be a rectangular array of token ids ({str(e).split('. ')[0]})") from None
    if arr.size == 0:
        return arr.astype(np.int64).reshape(arr.shape)
    if arr.dtype.kind == "O":
        for idx, v in np.ndenumerate(arr):
            if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{name}{list(idx)} = {v!r} is not an integer token id")
    elif arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype} (ids are not rounded: "
                        "convert whole-valued floats with .astype(numpy.int64))")
    bad = np.asarray((arr < 0) | (arr >= vocab), dtype=bool)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        where = ", ".join(map(str, idx))
        raise ValueError(f"{name}[{where}]={int(arr[idx])} is outside the vocabulary [0, {vocab})")
    return np.ascontiguousarray(arr.astype(np.int64))


_NOT_LOADED = object()

# onnxruntime session config key: "1" makes the intra-op pool's threads stop spinning as soon as a run returns (a key
# a release does not know is stored and ignored, never an error).
SPIN_STOP_KEY = "session.force_spinning_stop"


def session_options(threads: int):
    """The ``onnxruntime.SessionOptions`` of every model session we open (main graph, MTP graph, pipeline stages).

    ``threads`` intra-op threads. Fatal log lines only: every error reaches the caller as an exception with the same
    text, so onnxruntime's own log lines would only repeat it (and break the one-line error of the command line).
    The pool's threads spin between the nodes of a run (a node's work reaches them without a wake-up) and stop when
    the run returns: spinning on after it, they took the cores from whatever the process ran next, such as another
    session's run (a draft step of the MTP graph right after a main step: 17.2 against 9.2 ms on the bench preset,
    2 cores), sampling or the server's threads. Plain back-to-back decode steps measured the same either way."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 4
    so.add_session_config_entry(SPIN_STOP_KEY, "1")
    return so


def _forward_ids(input_ids, state, vocab: int, max_seq_len: int) -> np.ndarray:
    """The ``input_ids`` of a forward call as int64 [B, S] (S >= 1), checked against the ``state`` it advances
    (B rows, ``state.positions`` + S within ``max_seq_len``). Shared by Session and PipelineSession."""
    ids = _token_ids(input_ids, "input_ids", vocab)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got shape {ids.shape}")
    if ids.shape[0] != state.batch_size:
        raise ValueError(f"input_ids has {ids.shape[0]} rows but the state holds {state.batch_size}")
    end = int(state.positions.max()) + ids.shape[1]
    if end > max_seq_len:
        raise ValueError(f"sequence would reach position {end} but the model's capacity is {max_seq_len} "
                         "tokens (re-export with a larger --max-seq-len)")
    return ids


def _last_line(e: BaseException) -> str:
    """The last non-empty line of an exception's message (onnxruntime and tokenizers put the cause there), or the
    exception's type name when the message is empty."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


class Session:
    """An exported model ready to run.

    Args:
        model_dir: directory written by ``dsv4-ort export`` (model.onnx, model.onnx.data, dsv4_ort.json).
        intra_op_threads: onnxruntime intra-op threads (default: physical cores).
        isa: cap the kernels' ISA level ("scalar", "avx2", "avx512", "amx"); default: the best the CPU has.
        kernels: force kernel families to levels, like DSV4_ORT_KERNELS ("linear=avx2,indexer=scalar"; capped by
            ``isa``); default: the library's plan for this CPU (see ``families`` / ``family_source``).
        prefill_chunk: split prompts longer than this into chunks (default: no split).
        batch_invariant: a row bound N (0 = off; default: DSV4_ORT_BATCH_INVARIANT, else off). Every call of at most
            N rows (in particular a decode step of up to N sequences) then gives each row, bit for bit, what it gets
            run alone: the linears and MoE experts keep such calls on their one-row summation order instead of the
            panels / AMX tiles, which costs batched-decode speed at large N. The serving engine
            (:class:`~.engine.Engine`) needs N >= its ``max_batch`` for outputs that do not depend on the other
            requests; ``dsv4-ort serve`` sets it. Calls of more rows (prompt chunks longer than N tokens) run as
            usual.
        model_file: the graph file in ``model_dir``: ``model.onnx`` (default), or an ORT-format conversion of it
            (``model.ort``, from ``python -m onnxruntime.tools.convert_onnx_models_to_ort``; weights inside the file,
            so the directory needs only it and dsv4_ort.json).

    ``tokenizer.json`` (when the model directory has one and the ``tokenizers`` package is installed) is read on
    first use (:attr:`tokenizer`, :meth:`encode`, :meth:`decode`); an unreadable one is a :class:`ModelError`
    naming the file then, so a model with a damaged tokenizer still runs on token ids.
    """

    MAX_THREADS = 1024

    def __init__(self, model_dir: str | os.PathLike, *, intra_op_threads: int | None = None, isa: str | None = None,
                 prefill_chunk: int | None = None, kernels: str | None = None, model_file: str = MODEL_FILE,
                 batch_invariant: int | None = None):
        import onnxruntime as ort

        import dsv4_ort
        from dsv4_ort.export import schema

        self.model_dir = Path(model_dir)
        if not isinstance(model_file, str):
            raise TypeError(f"model_file must be a str, got {type(model_file).__name__}")
        if Path(model_file).name != model_file or Path(model_file).suffix not in (".onnx", ".ort"):
            raise ValueError(f"model_file must be a file name in the model directory ending in .onnx or .ort, got "
                             f"{model_file!r}")
        self.model_path = self.model_dir / model_file
        self.meta = read_metadata(model_dir, model_file)
        if kernels is not None and not isinstance(kernels, str):
            raise TypeError(f"kernels must be a str like 'linear=avx2,indexer=scalar', got {type(kernels).__name__}")
        if batch_invariant is not None:
            batch_invariant = check_count("batch_invariant", batch_invariant, minimum=0)
        info = dsv4_ort.library_info(isa, kernels, batch_invariant)
        if self.meta.get("domain") != info["domain"]:
            raise ModelError(f"model uses op domain {self.meta.get('domain')!r}; this library implements "
                             f"{info['domain']!r}")
        need, have = int(self.meta.get("op_table_version", -1)), int(info["op_table_version"])
        if need > have:
            raise ModelError(f"model was exported for op table v{need} but this dsv4-ort library implements v{have}; "
                             "upgrade dsv4-ort (or re-export the model with this version)")
        if have != schema.TABLE_VERSION:
            raise ModelError(f"the installed library (op table v{have}) does not match the Python package "
                             f"(v{schema.TABLE_VERSION}); reinstall dsv4-ort")
        _check_node_attributes(self.model_path, info["domain"])
        self.isa = info["isa"]
        self.families = dict(info["families"])  # family -> ISA level its kernels run at in this session
        self.batch_invariant = int(info["batch_invariant_rows"])  # row bound of batch invariance (0: off)
        self.config = self.meta["config"]
        self.vocab_size = int(self.config["vocab_size"])
        self.max_seq_len = int(self.meta["max_seq_len"])
        self.logits_mode = self.meta.get("logits", "all")
        if prefill_chunk is not None:
            prefill_chunk = check_count("prefill_chunk", prefill_chunk, minimum=1)
        self.prefill_chunk = prefill_chunk
        if intra_op_threads is not None:
            intra_op_threads = check_count("intra_op_threads", intra_op_threads, minimum=1)
            if intra_op_threads > self.MAX_THREADS:
                raise ValueError(f"intra_op_threads must be <= {self.MAX_THREADS}, got {intra_op_threads}")
        so = session_options(intra_op_threads or physical_cores())
        with dsv4_ort.isa_cap(isa, kernels, batch_invariant):
            dsv4_ort.register(so)
            try:
                self.session = ort.InferenceSession(str(self.model_path), so,
                                                    providers=["CPUExecutionProvider"])
            except Exception as e:
                raise ModelError(f"cannot load {self.model_path}: {_last_line(e)}") from None
        _check_against_graph(self.meta, self.session, self.model_path)
        read_ahead(sparse_weight_ranges(self.model_path))
        self.threads = so.intra_op_num_threads
        self._tokenizer = _NOT_LOADED

    @property
    def tokenizer(self):
        """The model's ``tokenizers.Tokenizer``, or None (no tokenizer.json, or the tokenizers package is not
        installed). Read on first access; an unreadable file is a ModelError naming it (raised at each access)."""
        if self._tokenizer is _NOT_LOADED:
            tok = self.model_dir / "tokenizer.json"
            if not tok.is_file():
                self._tokenizer = None
                return None
            try:
                from tokenizers import Tokenizer
            except ImportError:  # text I/O is optional; ids always work
                self._tokenizer = None
                return None
            try:
                self._tokenizer = Tokenizer.from_file(str(tok))
            except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions
                raise ModelError(f"{tok} is not a readable tokenizer: {_last_line(e)}") from None
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        """Replace the tokenizer (None: ids only)."""
        self._tokenizer = value

    # ---- state and forward ---------------------------------------------------------------------------------------

    def new_state(self, batch_size: int = 1) -> State:
        """Fresh, zeroed state for ``batch_size`` sequences; reuse it across calls to continue them."""
        return State(self.meta, batch_size, self.session)

    def _run(self, ids: np.ndarray, state: State) -> np.ndarray:
        import onnxruntime as ort

        B, S = ids.shape
        if state.owner is not self.session:  # a state of another session of the same model moves here once
            if state.layout != [(t["input"], t["output"], t["dtype"], list(t["shape"]))
                                for t in self.meta["state"]["tensors"]]:
                raise ValueError("the state belongs to a model with other state tensors (use Session.new_state)")
            state.bind(self.session)
        io = state.binding  # state tensors and start_pos are bound once (State)
        ids_value = ort.OrtValue.ortvalue_from_numpy(ids)
        logits = np.empty((B, S if self.logits_mode == "all" else 1, self.vocab_size), np.float32)
        state._run_buffers = (ids, ids_value, logits)  # alive for the run on every onnxruntime
        io.bind_ortvalue_input("input_ids", ids_value)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(io)
        state.positions += S
        return logits

    def forward(self, input_ids, state: State, *, chunk_size: int | None = None) -> np.ndarray:
        """Runs ``input_ids`` [B, S] from each row's current position; returns float32 logits [B, S, V] (or
        [B, 1, V] for a model exported with last-position logits) and advances the state.

        ``input_ids``: integers (any numpy integer dtype or Python ints); float and bool arrays are a TypeError
        even when every value is whole (ids are never rounded: convert with ``.astype(np.int64)``), an id outside
        the vocabulary a ValueError. ``chunk_size``: None (the session's ``prefill_chunk``, else one chunk) or an
        integer >= 1."""
        if chunk_size is not None:
            chunk_size = check_count("chunk_size", chunk_size, minimum=1)
        if self.prefill_chunk is not None:
            check_count("prefill_chunk", self.prefill_chunk, minimum=1)
        if not isinstance(state, State):
            raise TypeError(f"state must be a State (Session.new_state), got {type(state).__name__}")
        ids = _forward_ids(input_ids, state, self.vocab_size, self.max_seq_len)
        chunk = chunk_size or self.prefill_chunk or ids.shape[1]
        outs = [self._run(np.ascontiguousarray(ids[:, i:i + chunk]), state) for i in range(0, ids.shape[1], chunk)]
        if self.logits_mode == "all":
            return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)
        return outs[-1]

    # ---- generation ----------------------------------------------------------------------------------------------

    def _check_generation(self, prompt_len: int, max_new_tokens, temperature, top_p, top_k, seed, stop_ids,
                          start: int = 0) -> tuple:
        """Validated generation arguments (see :mod:`.sampling` for the sampling parameters)."""
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
        seed = check_seed(seed)
        if stop_ids is None:
            stops = set()
        else:
            if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
                raise TypeError(f"stop_ids must be a sequence of token ids, got {type(stop_ids).__name__}")
            stops = {check_count("stop_ids item", t) for t in stop_ids}
        if start + prompt_len + max_new_tokens > self.max_seq_len:
            at = f" from position {start}" if start else ""
            raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}){at} exceeds the model's "
                             f"capacity of {self.max_seq_len} tokens")
        return max_new_tokens, temperature, top_k, top_p, seed, stops

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop_ids: Sequence[int] | None = None,
               state: State | None = None, stats: dict | None = None, speculative: str | None = None,
               num_draft: int = 1) -> Iterator[int]:
        """Yields up to ``max_new_tokens`` new token ids for one prompt (stops after a stop id, which is yielded).

        Every argument is checked when ``stream`` is called, before anything runs (see :mod:`.sampling` for the
        sampling parameters; ``max_new_tokens`` is an integer >= 0, ``seed`` None or an integer >= 0). Logits
        that are not finite are a ValueError naming the step (step 0 samples from the prompt's logits).

        ``speculative="mtp"``: draft ``num_draft`` (1 to 3) tokens per step with the export's MTP block and verify
        them in one forward (an export with ``--mtp``; see :mod:`.speculative`): greedy tokens are those of plain
        decoding, sampled ones follow the same distribution."""
        prompt = _token_ids(prompt_ids, "prompt_ids", self.vocab_size)
        if prompt.ndim == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.ndim != 1:
            raise ValueError(f"prompt_ids must be one sequence of token ids, got shape {prompt.shape} (use "
                             "generate for a batch)")
        if prompt.shape[0] == 0:
            raise ValueError("the prompt is empty")
        if state is not None and not isinstance(state, State):
            raise TypeError(f"state must be a State (Session.new_state), got {type(state).__name__}")
        if state is not None and state.batch_size != 1:
            raise ValueError(f"stream runs one sequence but the state holds {state.batch_size}")
        start = 0 if state is None else int(state.positions.max())
        args = self._check_generation(prompt.shape[0], max_new_tokens, temperature, top_p, top_k, seed, stop_ids,
                                      start)
        speculative, num_draft = check_speculative(speculative, num_draft)
        if speculative is not None:
            from .speculative import stream_tokens

            return stream_tokens(self.speculator(), prompt.reshape(1, -1), state, stats, num_draft, *args)
        return self._stream(prompt.reshape(1, -1), state, stats, *args)

    def speculator(self):
        """The :class:`~.speculative.MtpSpeculator` of this session (its MTP graph loaded on first use)."""
        spec = getattr(self, "_speculator", None)
        if spec is None:
            from .speculative import MtpSpeculator

            spec = self._speculator = MtpSpeculator(self)
        return spec

    def _stream(self, prompt, state, stats, max_new_tokens, temperature, top_k, top_p, seed, stops):
        state = state or self.new_state(1)
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        logits = self.forward(prompt, state)[:, -1]
        t1 = time.perf_counter()
        if stats is not None:
            stats.update(prefill_tokens=prompt.shape[1], prefill_s=t1 - t0, decode_tokens=0, decode_s=0.0)
        for i in range(max_new_tokens):
            check_logits(logits, step=i)
            tok = int(sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)[0])
            yield tok
            if tok in stops or i == max_new_tokens - 1:
                return
            t = time.perf_counter()
            logits = self.forward(np.array([[tok]], np.int64), state)[:, -1]
            if stats is not None:
                stats["decode_tokens"] += 1
                stats["decode_s"] += time.perf_counter() - t

    def generate(self, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop_ids: Sequence[int] | None = None,
                 speculative: str | None = None, num_draft: int = 1) -> list:
        """New token ids for one prompt (list of ints) or a batch of equal-length prompts (list of lists).
        Arguments are checked as by :meth:`stream` (``speculative`` / ``num_draft`` too: with a batch the rows
        accept different numbers of drafts and run on at their own positions)."""
        arr = _token_ids(prompt_ids, "prompt_ids", self.vocab_size)
        if arr.ndim == 1:
            return list(self.stream(arr, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed, stop_ids=stop_ids, speculative=speculative, num_draft=num_draft))
        if arr.ndim != 2:
            raise ValueError(f"prompt_ids must be 1-D or 2-D, got shape {arr.shape}")
        if arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"the prompt batch is empty (shape {arr.shape})")
        max_new_tokens, temperature, top_k, top_p, seed, stops = self._check_generation(
            arr.shape[1], max_new_tokens, temperature, top_p, top_k, seed, stop_ids)
        speculative, num_draft = check_speculative(speculative, num_draft)
        B = arr.shape[0]
        out = [[] for _ in range(B)]
        if max_new_tokens == 0:
            return out
        if speculative is not None:
            for step in self.speculator().generate(arr, max_new_tokens, num_draft=num_draft, temperature=temperature,
                                                   top_k=top_k, top_p=top_p, rng=np.random.default_rng(seed),
                                                   stops=stops):
                for b, toks in enumerate(step):
                    out[b].extend(toks)
            return out
        state = self.new_state(B)
        rng = np.random.default_rng(seed)
        done = np.zeros(B, bool)
        logits = self.forward(arr, state)[:, -1]
        for step in range(max_new_tokens):
            check_logits(logits, step=step)
            toks = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)
            for b in range(B):
                if not done[b]:
                    out[b].append(int(toks[b]))
                    done[b] = int(toks[b]) in stops
            if done.all() or step == max_new_tokens - 1:
                break
            logits = self.forward(toks.reshape(B, 1), state)[:, -1]
        return out

    # ---- text ----------------------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self.tokenizer is None:
            raise ModelError(f"{self.model_dir} has no tokenizer.json (or the tokenizers package is missing); "
                             "pass token ids instead")
        ids = self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens)).ids
        bad = [i for i in ids if i >= self.vocab_size]
        if bad:
            raise ModelError(f"the tokenizer produced id {bad[0]} outside the model's vocabulary ({self.vocab_size})")
        return ids

    def chat(self, messages, max_new_tokens: int, *, thinking: bool = False, **sampling) -> str:
        """Answers a conversation ([{"role", "content"}, ...]) in DeepSeek-V4's chat format; returns the text."""
        from .chat import format_chat

        unknown = sorted(set(sampling) - {"temperature", "top_p", "top_k", "seed"})
        if unknown:
            raise TypeError(f"chat: unknown sampling argument(s) {', '.join(unknown)} (temperature, top_p, top_k, "
                            "seed)")
        check_count("max_new_tokens", max_new_tokens)
        ids = self.encode(format_chat(messages, thinking=thinking), add_special_tokens=False)
        eos = int(self.config.get("eos_token_id", 1))
        out = self.generate(ids, max_new_tokens, stop_ids=[eos], **sampling)
        return self.decode([t for t in out if t != eos])

    def decode(self, ids: Sequence[int]) -> str:
        arr = _token_ids(ids, "ids", self.vocab_size)
        if arr.ndim != 1:
            raise ValueError(f"decode takes one sequence of token ids, got shape {arr.shape}")
        if self.tokenizer is None:
            return " ".join(str(i) for i in arr.tolist())
        return self.tokenizer.decode(arr.tolist())
