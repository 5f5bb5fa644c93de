"""Exporter: a DeepSeek-V4 checkpoint -> one ONNX graph (opset 21 + the ``ai.dsv4ort`` domain) for prefill and decode.

Use :func:`export_model` or ``dsv4-ort export CHECKPOINT_DIR OUT_DIR``. The graph is built directly with
``onnx.helper`` (:mod:`.graph`); weights are streamed from the checkpoint into one external-data file
(:mod:`.weights`).

Files written to ``OUT_DIR``
----------------------------
* ``model.onnx`` - the graph; every weight is an initializer stored in
* ``model.onnx.data`` - tensors at 4096-byte aligned offsets (onnxruntime memory-maps them);
* ``dsv4_ort.json`` - config, state geometry, I/O contract, weight formats, versions (also stored in the model's
  ``metadata_props`` under ``dsv4_ort.json``, next to a few flat ``dsv4_ort.*`` keys);
* the checkpoint's tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ...), copied when present.

Everything is first written under temporary names and renamed at the end (``model.onnx`` last), so a failed
export leaves no ``model.onnx``; an older export in the same directory is replaced as a whole.

Graph contract
--------------
Inputs:
    ``input_ids``   int64 ``[batch, seq]``    new tokens of every row;
    ``start_pos``   int64 ``[batch]``         absolute position of each row's first new token (rows may differ);
    ``past.L.<n>``  state of main layer L (table below).
Outputs:
    ``logits``      float32 ``[batch, 1, vocab]`` (``logits="last"``: each row's last position) or
                    ``[batch, seq, vocab]`` (``logits="all"``);
    ``present.L.<n>`` the updated state, same shape and type as ``past.L.<n>``.

One graph serves prefill (any ``seq``), chunked prefill and decode (``seq = 1``). Each row processes ``seq`` tokens
at positions ``start_pos[b] .. start_pos[b] + seq - 1``; the caller keeps the positions (the graph has no position
output) and must keep ``start_pos + seq <= max_seq_len``.

State per main layer (``batch`` is symbolic; ``N = max_seq_len``, ``D = head_dim``, ``cI = index_head_dim``,
``r`` = the layer's compress ratio, ``coff = 2`` for r = 4 else 1):

==========================  ===========================  ======  ============================================
name                        shape                        dtype   layers
==========================  ===========================  ======  ============================================
``window``                  ``[batch, sliding_window, D]``  float32 all (ring: position p at slot p % window)
``entries``                 ``[batch, N // r, D]``          float32 r > 0 (compressed entry i at slot i)
``kv_state``, ``score_state``  ``[batch, coff*r, coff*D]``  float32 r > 0 (compressor's partial block)
``index_keys``              ``[batch, N // 4, cI]``         float32 r = 4 (indexer-compressor entries)
``index_kv_state``, ``index_score_state`` ``[batch, 8, 2*cI]`` float32 r = 4
==========================  ===========================  ======  ============================================

The runtime allocates each state tensor once (zeros) and binds the same buffer as ``past.L.<n>`` and
``present.L.<n>`` (IOBinding); the ops update it in place. A row restarting at ``start_pos = 0`` needs no reset:
stale contents are never read. The batch dim is symbolic so one export serves any batch size; ``max_batch`` is
recorded for the runtime's allocation. ``max_seq_len`` must be a positive multiple of every compress ratio (128 for
DeepSeek-V4) and at most ``max_position_embeddings``.

With ``state="fp8"`` (``--state fp8``) ``window`` and ``entries`` are uint8 ``[batch, ..., E]`` rows of the FP8
attention-entry layout, E = (D - rd) + 2*rd + pad8((D - rd) / 64) bytes (584 for D = 512, rd = 64), and
``index_keys`` uint8 ``[batch, N // 4, cI + 4]`` (E4M3 codes + a float32 scale); the Compressor nodes carry
``fp8_layout`` and the metadata records ``state.format = "fp8"`` (see the FP8 state section of
:mod:`dsv4_ort.models.functional`). The compressor rows stay float32.

The MTP block is exported only on request (``mtp=True`` / ``--mtp``: a second graph ``mtp.onnx`` sharing the data
file, and the main graph's extra output ``hidden`` and input ``num_logits``; see :mod:`.mtp`); otherwise its checkpoint
tensors are skipped.
Activations are float32, and so is the state by default; bf16 / FP8 / FP4 weights are consumed directly by the
custom ops.
"""

# The exporter needs onnx, plus torch to read checkpoints (a preset export with random weights needs only numpy and
# onnx); ``dsv4_ort.export.schema`` must stay importable with onnxruntime + numpy alone, so the exporter's names
# are imported on first use.
_LAZY = {
    "export_model": "exporter", "ExportError": "exporter", "LOGITS_MODES": "exporter", "MODEL_FILE": "files",
    "DATA_FILE": "files", "META_FILE": "files", "FORMAT_VERSION": "files", "read_export_trailer": "files",
    "DEFAULT_MAX_SEQ_LEN": "exporter",
    "check_max_seq_len": "exporter", "ratio_multiple": "exporter", "GraphBuildError": "graph",
    "state_tensors": "graph", "WEIGHT_MODES": "weights", "WeightFormatError": "weights",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
