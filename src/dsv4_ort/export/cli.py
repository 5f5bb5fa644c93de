"""``dsv4-ort export``: the exporter's command-line subcommand.

``add_parser(subparsers)`` adds it to the ``dsv4-ort`` parser; the handler returns the exit status (0 on success,
2 with a one-line message on bad input: arguments, checkpoint, output directory).
"""

from __future__ import annotations

import argparse
import sys

USAGE = """\
dsv4-ort export CHECKPOINT_DIR OUT_DIR [options]
       dsv4-ort export --preset NAME OUT_DIR [options]   (random weights, for tests and benchmarks)"""


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
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights with --preset (default 0)")
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
    try:
        from dsv4_ort.export import export_model
        from dsv4_ort.models.errors import CheckpointError

        t0 = time.perf_counter()
        path = export_model(checkpoint, out_dir, preset=args.preset, weights=args.weights,
                            max_seq_len=args.max_seq_len, max_batch=args.max_batch, logits=args.logits,
                            progress=not args.quiet, seed=args.seed, state=args.state)
    except ImportError as e:
        return _fail(f"the exporter needs the 'export' extra (pip install 'dsv4-ort[export]'): {e}")
    except (CheckpointError, ValueError, OSError) as e:
        return _fail(str(e))
    if not args.quiet:
        import os

        data = os.path.join(os.path.dirname(path), "model.onnx.data")
        print(f"wrote {path} (+ {os.path.getsize(data) / 2**30:.2f} GiB of weights) in "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


def _fail(message: str) -> int:
    line = " ".join(str(message).split())
    print(f"dsv4-ort export: error: {line}", file=sys.stderr)
    return 2
