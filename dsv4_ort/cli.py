"""The ``dsv4-ort`` command line.

Commands available in this release:
  info   library path, onnxruntime version, CPU features and the ISA level chosen per kernel family
  run    the main job; at this stage it runs the custom ops that exist (MoE routing and mHC) on random data at
         DeepSeek-V4-Flash shapes through ONNX Runtime and prints their timings (the full-model pipeline --
         export of a checkpoint and generation -- is added by the export and runtime modules)
Bad arguments exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import ISA_LEVELS, __version__


def _cmd_info(args) -> int:
    from ._library import library_info

    info = library_info(args.isa)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    feats = [k for k, v in info["features"].items() if v]
    print(f"dsv4-ort {__version__}")
    print(f"library:       {info['library_path']}")
    print(f"onnxruntime:   {info['onnxruntime_version']} (library needs API >= {info['ort_api_version']})")
    print(f"op domain:     {info['domain']} (op table v{info['op_table_version']}, {info['num_ops']} ops)")
    print(f"cpu features:  {' '.join(feats) or 'baseline x86-64 only'}")
    print(f"isa:           {info['isa']} (cpu maximum {info['isa_max']}; DSV4_ORT_ISA caps it)")
    for fam, level in info["families"].items():
        print(f"  {fam:<18} {level}")
    return 0


def _cmd_run(args) -> int:
    import numpy as np
    import onnxruntime as ort

    from . import _onnx_min, isa_cap, register
    from ._library import library_info
    from .export import schema

    info = library_info(args.isa)
    print(f"dsv4-ort run: ISA level {info['isa']} (cpu maximum {info['isa_max']}), onnxruntime {ort.__version__}")
    print("The full-model pipeline (export + generation) is not part of this release yet; running the custom ops")
    print("that exist on random data at DeepSeek-V4-Flash shapes: hidden 4096, 4 streams, 256 experts, top-6.")
    rng = np.random.default_rng(0)
    t, hc, d, experts = args.tokens, 4, 4096, 256
    f32, i64 = 1, 7
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.log_severity_level = 3

    def session(op, inputs, outputs, attrs=None):
        return ort.InferenceSession(_onnx_min.one_node_model(op, schema.DOMAIN, inputs, outputs, attrs), so,
                                    providers=["CPUExecutionProvider"])

    with isa_cap(args.isa):
        register(so)
        steps = [
            ("HcPre", session("HcPre", [("x", f32, 3), ("fn", f32, 2), ("scale", f32, 1), ("base", f32, 1)],
                              [("h", f32, 2), ("post", f32, 2), ("comb", f32, 3)]),
             {"x": rng.standard_normal((t, hc, d), dtype=np.float32),
              "fn": rng.standard_normal(((2 + hc) * hc, hc * d), dtype=np.float32) * 0.01,
              "scale": np.full(3, 0.5, np.float32), "base": rng.standard_normal((2 + hc) * hc, dtype=np.float32)}),
            ("MoeRouteTopK", session("MoeRouteTopK", [("logits", f32, 2), ("bias", f32, 1)],
                                     [("weights", f32, 2), ("indices", i64, 2)],
                                     {"top_k": 6, "routed_scaling_factor": 1.5}),
             {"logits": rng.standard_normal((t, experts), dtype=np.float32),
              "bias": rng.standard_normal(experts, dtype=np.float32) * 0.01}),
            ("HcPost", session("HcPost", [("f", f32, 2), ("residual", f32, 3), ("post", f32, 2), ("comb", f32, 3)],
                               [("out", f32, 3)]),
             {"f": rng.standard_normal((t, d), dtype=np.float32),
              "residual": rng.standard_normal((t, hc, d), dtype=np.float32),
              "post": rng.uniform(0, 2, (t, hc)).astype(np.float32),
              "comb": np.full((t, hc, hc), 1.0 / hc, np.float32)}),
        ]
    for name, sess, feeds in steps:
        sess.run(None, feeds)  # warm-up
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            outs = sess.run(None, feeds)
        ms = (time.perf_counter() - t0) / reps * 1e3
        shapes = " ".join(str(list(o.shape)) for o in outs)
        print(f"  {name:<13} {t} tokens: {ms:8.3f} ms/call  ({t / ms * 1e3:10.0f} tokens/s)  outputs {shapes}")
    w, idx = steps[1][1].run(None, steps[1][2])
    print(f"  token 0 routed to experts {idx[0].tolist()} with weights {[round(float(v), 3) for v in w[0]]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-ort", description="DeepSeek-V4 inference on CPUs through ONNX Runtime")
    p.add_argument("--version", action="version", version=f"dsv4-ort {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--isa", choices=ISA_LEVELS, default=None, help="cap the ISA level (like DSV4_ORT_ISA)")

    info = sub.add_parser("info", parents=[common], help="library, CPU features and chosen ISA levels")
    info.add_argument("--json", action="store_true", help="print the raw JSON")
    info.set_defaults(func=_cmd_info)

    run = sub.add_parser("run", parents=[common], help="run the available custom ops on random data")
    run.add_argument("--tokens", type=int, default=16, help="tokens per call (default 16)")
    run.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = onnxruntime default)")
    run.set_defaults(func=_cmd_run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    env_isa = os.environ.get("DSV4_ORT_ISA")
    if env_isa and env_isa not in ISA_LEVELS:
        print(f"dsv4-ort: error: DSV4_ORT_ISA='{env_isa}' is not a valid ISA level; valid values: "
              f"{', '.join(ISA_LEVELS)}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"dsv4-ort {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # onnxruntime errors and the like: one line, no traceback
        print(f"dsv4-ort {args.command}: error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
