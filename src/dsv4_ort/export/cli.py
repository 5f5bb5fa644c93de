"""``dsv4-ort export``: the exporter's command-line subcommand.

``add_parser(subparsers)`` adds it to the ``dsv4-ort`` parser; the handler returns the exit status (0 on success,
2 with a one-line message on bad input: arguments, checkpoint, output directory).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

USAGE = """\
dsv4-ort export CHECKPOINT_DIR OUT_DIR [options]
       dsv4-ort export --preset NAME OUT_DIR [options]   (random weights, for tests and benchmarks)"""


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


class CheckpointPathError(ValueError):
    """A checkpoint path that cannot be read as one: missing, or holding a FIFO, device or directory where a file
    belongs."""


# The files of a checkpoint directory the exporter (and ``dsv4-ort run``'s cache key) opens.
_CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja")


def check_checkpoint_path(path) -> None:
    """Checks, without opening anything, that ``path`` is a checkpoint directory (or file) whose files are regular
    files: a FIFO in place of a shard would block the first read forever, a device would be read without end.
    Raises :class:`CheckpointPathError` (a ValueError) naming the path."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointPathError(f"checkpoint directory not found: {path!r} does not exist") from None
    except OSError as e:
        raise CheckpointPathError(f"checkpoint {path!r} cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise CheckpointPathError(f"checkpoint directory {path!r} cannot be listed ({e.strerror or e})") \
                from None
        files = [os.path.join(path, n) for n in names if n.endswith(_CHECKPOINT_SUFFIXES)]
    elif stat.S_ISREG(st.st_mode):
        files = []
    else:
        raise CheckpointPathError(f"checkpoint {path!r} is not a directory or a regular file")
    for f in files:
        try:
            mode = os.stat(f).st_mode  # follows symlinks: a link to a regular file is fine
        except OSError as e:
            raise CheckpointPathError(f"checkpoint file {f!r} cannot be read ({e.strerror or e})") from None
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
                else "not a regular file"
            raise CheckpointPathError(f"checkpoint file {f!r} is {kind}, not a regular file")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``export`` subcommand to an ``argparse`` subparsers object (imports nothing heavy)."""
    p = subparsers.add_parser(
        "export", usage=USAGE, help="export a DeepSeek-V4 checkpoint to ONNX",
        description="Export a DeepSeek-V4 checkpoint (DeepSeek or transformers naming, FP8/FP4/bf16/fp32 weights) to "
                    "model.onnx + model.onnx.data + dsv4_ort.json in OUT_DIR. The graph takes input_ids [batch, seq], "
                    "start_pos [batch] and per-layer state past.L.* -> present.L.* and returns logits.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="CHECKPOINT_DIR OUT_DIR, or OUT_DIR with --preset")
    p.add_argument("--weights", choices=("native", "bf16", "fp32"), default="native",
                   help="weight formats: native (as stored: FP8/FP4 + E8M0 scales, bf16, fp32; default), bf16 "
                        "(dequantise every matrix to bf16) or fp32")
    p.add_argument("--head", choices=("native", "fp8", "fp4"), default="native",
                   help="LM head format: native (default), fp8 (E4M3 + E8M0 128x128 block scales) or fp4 (E2M1 + E8M0 "
                        "scales per 32 inputs), quantised from the exact weights: fewer bytes per decoded token")
    p.add_argument("--dense", choices=("native", "fp8", "fp4"), default="native",
                   help="the same for the dense projections (attention, compressor, indexer, shared experts; not the "
                        "routers, embedding or routed experts)")
    p.add_argument("--compute", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="products of the linears', MoE experts' and attention's float32 activations: fp32 (exact; "
                        "default), bf16 (activations and weights rounded to bf16, fp32 sums; the experts and the "
                        "attention as for bf16 activations: "
                        "AVX512-BF16 / AMX-BF16 speed for prefill and batches) or int8 (bf16, and the FP4 routed "
                        "experts' inputs quantised to int8 per 32 columns for VNNI integer products; see the "
                        "README for where it pays and its quality cost)")
    p.add_argument("--max-seq-len", type=_positive_int, default=None, metavar="N",
                   help="state capacity in positions per row; a multiple of every compress ratio (default: "
                        "min(4096, max_position_embeddings))")
    p.add_argument("--max-batch", type=_positive_int, default=1, metavar="N",
                   help="rows the runtime allocates state for (recorded in the metadata; default 1)")
    p.add_argument("--logits", choices=("last", "all"), default="last",
                   help="logits of each row's last position only (default) or of every position")
    p.add_argument("--state", choices=("default", "fp8"), default="default",
                   help="attention state format: default (activation dtype) or fp8 (window and compressed entries as "
                        "FP8 E4M3 + E8M0 block scales with bf16 rope channels, indexer keys as E4M3 + a float32 "
                        "scale; about 3.5x smaller at D = 512)")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="export a preset configuration (tiny, bench, flash, pro) with deterministic random weights "
                        "instead of a checkpoint")
    p.add_argument("--seed", type=_nonnegative_int, default=0,
                   help="seed of the random weights with --preset (default 0)")
    p.add_argument("--stages", default=None, metavar="N|A:B,...",
                   help="export in pipeline stages: N graphs of consecutive layers (as even as possible) or the "
                        "given layer ranges (e.g. 0:2,2:4), model.stage<i>.onnx each with its own weights file "
                        "(run with PipelineSession or dsv4-ort serve; see the README's Pipeline stages)")
    p.add_argument("--mtp", action="store_true",
                   help="also export the checkpoint's MTP block as mtp.onnx (sharing model.onnx.data) for "
                        "speculative decoding (Session.generate(..., speculative='mtp'); see dsv4_ort.export.mtp)")
    p.add_argument("--mtp-weights", default=None, metavar="NPZ",
                   help="with --mtp: fitted mtp.0.* tensors replacing the checkpoint's (python -m "
                        "dsv4_ort.models.mtp_fit)")
    p.add_argument("--mtp-head", choices=("fp4", "fp8", "shared"), default="fp4",
                   help="with --mtp: the head the MTP block drafts with: an fp4 (default) or fp8 copy of the head "
                        "(a draft step reads the head; drafts only propose, outputs do not change) or the main "
                        "model's head (shared)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Handler of ``dsv4-ort export``; returns the exit status."""
    import time

    paths = list(args.paths)
    if args.preset is None and len(paths) != 2:
        return _fail(f"expected CHECKPOINT_DIR OUT_DIR, got {len(paths)} path(s)")
    if args.preset is not None and len(paths) != 1:
        return _fail(f"with --preset give only OUT_DIR, got {len(paths)} paths")
    checkpoint, out_dir = (None, paths[0]) if args.preset is not None else (paths[0], paths[1])
    # The paths first: a missing checkpoint or a FIFO among its files is reported as such, before the exporter's
    # imports (which may fail for want of torch, or take seconds)
    try:
        if checkpoint is not None:
            check_checkpoint_path(checkpoint)
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            return _fail(f"output directory {out_dir!r} exists and is not a directory")
    except CheckpointPathError as e:
        return _fail(str(e))
    # Imported before the try: a Ctrl-C during the exporter's imports below must reach the caller as a
    # KeyboardInterrupt (an except clause naming a class imported inside the try would fail to evaluate).
    from dsv4_ort.models.errors import CheckpointError

    try:
        from dsv4_ort.export import export_model

        t0 = time.perf_counter()
        path = export_model(checkpoint, out_dir, preset=args.preset, weights=args.weights, head=args.head,
                            dense=args.dense, compute=args.compute, max_seq_len=args.max_seq_len,
                            max_batch=args.max_batch, stages=args.stages, mtp=args.mtp,
                            mtp_weights=args.mtp_weights, mtp_head=args.mtp_head, logits=args.logits, progress=not args.quiet,
                            seed=args.seed, state=args.state)
    except ImportError as e:
        return _fail(f"the exporter needs the 'export' extra (pip install 'dsv4-ort[export]'): {e}")
    except (CheckpointError, ValueError, OSError) as e:
        return _fail(str(e) or type(e).__name__)
    if not args.quiet:
        if args.stages is not None:
            import json

            stages = json.loads(path.read_text())["pipeline"]["stages"]
            for s in stages:
                print(f"stage {s['index']}: layers {s['layers'][0]}:{s['layers'][1]}, {s['model_file']} "
                      f"(+ {s['data_bytes'] / 2**30:.2f} GiB of weights)")
            print(f"wrote {len(stages)} stages into {os.path.dirname(path)} in {time.perf_counter() - t0:.1f} s")
            return 0
        data = os.path.join(os.path.dirname(path), "model.onnx.data")
        print(f"wrote {path} (+ {os.path.getsize(data) / 2**30:.2f} GiB of weights) in "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


def _fail(message: str) -> int:
    line = " ".join(str(message).split()) or "failed"
    print(f"dsv4-ort export: error: {line}", file=sys.stderr)
    return 2
