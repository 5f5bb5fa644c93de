"""Shared pieces of the deployment tests: a bare onnxruntime driver that binds the state the way a C/C++
application does (one zeroed buffer per state tensor of dsv4_ort.json, bound in place as past.X and present.X),
for sessions the tests build with their own options (optimisation levels, ORT-format models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def session_options(**settings):
    """onnxruntime SessionOptions with the dsv4-ort library registered, one intra-op thread (the kernels are
    deterministic for a given thread count; one keeps the 2-core CI machine free) and ``settings`` applied as
    attributes (``graph_optimization_level=...``, ``optimized_model_filepath=...``)."""
    import onnxruntime as ort

    import dsv4_ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    for key, value in settings.items():
        setattr(so, key, value)
    dsv4_ort.register(so)
    return so


def run_in_place(sess, meta: dict, prompt: np.ndarray, decode_ids) -> list:
    """Prefill ``prompt`` [1, S] then one step per id of ``decode_ids`` (teacher-forced), with every state tensor
    bound once as both its past and present name. Returns the float32 logits of each run (prefill first)."""
    import onnxruntime as ort

    from dsv4_ort.export.schema import ELEMENT_TYPES

    io = sess.io_binding()
    keep = []  # OrtValues wrap these numpy buffers; they must outlive the runs
    for t in meta["state"]["tensors"]:
        elem = ELEMENT_TYPES[t["dtype"]]
        buf = np.zeros([1 if d == meta["state"]["batch_dim"] else int(d) for d in t["shape"]], np.dtype(elem.numpy))
        value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buf, elem.code)
        io.bind_ortvalue_input(t["input"], value)
        io.bind_ortvalue_output(t["output"], value)
        keep.append((buf, value))
    pos = 0
    outs = []
    for ids in [np.ascontiguousarray(prompt, np.int64)] + [np.array([[t]], np.int64) for t in decode_ids]:
        ids_value = ort.OrtValue.ortvalue_from_numpy(ids)
        start = ort.OrtValue.ortvalue_from_numpy(np.array([pos], np.int64))
        io.bind_ortvalue_input("input_ids", ids_value)
        io.bind_ortvalue_input("start_pos", start)
        rows = ids.shape[1] if meta["logits"] == "all" else 1
        logits = np.empty((1, rows, int(meta["config"]["vocab_size"])), np.float32)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        keep.append((ids, ids_value, start))  # bound by pointer: alive until the run is over
        sess.run_with_iobinding(io)
        outs.append(logits)
        pos += ids.shape[1]
    return outs


def read_meta(model_dir) -> dict:
    return json.loads((Path(model_dir) / "dsv4_ort.json").read_text())


def convert_to_ort_format(model_onnx, out_dir) -> None:
    """onnxruntime's converter (python -m onnxruntime.tools.convert_onnx_models_to_ort) with the library registered,
    'Fixed' style only: the optimisations are applied before saving (the guidance for the CPU provider); 'Runtime'
    style would also write temporary models into the source model's directory. Writes out_dir/model.ort and
    out_dir/model.required_operators.config (the op list for minimal onnxruntime builds)."""
    import dsv4_ort

    cmd = [sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", "--optimization_style", "Fixed",
           "--custom_op_library", dsv4_ort.get_library_path(), "--output_dir", str(out_dir), str(model_onnx)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
