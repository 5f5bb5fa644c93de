"""The ``dsv4-ort`` command line.

Commands:
  run       the main job: export the built-in tiny model (or --checkpoint DIR) once into a cache, load it and
            generate, printing the tokens, prefill/decode tokens per second and the ISA level used
  generate  stream tokens from an exported model (--prompt TEXT or --ids 1,2,3)
  export    checkpoint (or --preset) -> model.onnx + model.onnx.data + dsv4_ort.json
  bench     machine limits, kernel and end-to-end speed against baselines (JSON + markdown, --plot charts)
  info      library path, onnxruntime version, CPU features and the ISA level chosen per kernel family
  serve     an OpenAI-compatible HTTP server with continuous batching (needs the serve extra)
Bad arguments, a missing or corrupt model and out-of-range ids exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
    cpu = info["cpu"]
    print(f"cpu:           {cpu['vendor'] or 'unknown'} family {cpu['family']:#x} model {cpu['model']:#x}")
    print(f"isa:           {info['isa']} (cpu maximum {info['isa_max']}; DSV4_ORT_ISA caps it, DSV4_ORT_KERNELS "
          "forces families)")
    why = {"cap": "", "cpu": "  (faster on this CPU)", "forced": "  (DSV4_ORT_KERNELS)"}
    for fam, level in info["families"].items():
        print(f"  {fam:<18} {level}{why[info['family_source'][fam]]}")
    why_pf = {"cap": "", "cpu": "  (the hardware prefetchers stream faster alone on this CPU)",
              "forced": "  (DSV4_ORT_KERNELS)"}
    print(f"weight prefetch: {'on' if info['weight_prefetch'] else 'off'}{why_pf[info['weight_prefetch_source']]}")
    why_dot = {"cap": "", "cpu": "  (VDPBF16PS outruns fp32 FMAs on this CPU)", "forced": "  (DSV4_ORT_KERNELS)"}
    print(f"bf16 attention products: {'VDPBF16PS' if info['bf16_dot'] else 'widened to fp32'} at avx512"
          f"{why_dot[info['bf16_dot_source']]}")
    rw = info["resident_weights"]
    print(f"resident weights: {rw['policy']} (DSV4_ORT_RESIDENT_WEIGHTS; transparent huge pages "
          f"{'offered' if rw['huge_pages_offered'] else 'not offered'}: constant inputs of {rw['min_bytes'] >> 20} MiB "
          f"or more are copied into huge pages when a session is created"
          f"{'' if rw['policy'] != 'auto' else ' and a quarter of the memory stays available'})")
    return 0


def _cmd_serve(args) -> int:
    try:
        from .serve import run
    except ImportError as e:
        print(f"dsv4-ort serve: error: {one_line(e)}", file=sys.stderr)
        return 2
    return run(args)


def _add_serve_parser(sub, common) -> None:
    from .runtime.cli import nonnegative_int, thread_count

    def positive(text: str) -> int:
        v = nonnegative_int(text)
        if v < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
        return v

    def window_ms(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if not 0 <= v <= 10000:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be 0 .. 10000 milliseconds, got {text}")
        return v

    def port(text: str) -> int:
        v = nonnegative_int(text)
        if v > 65535:
            raise argparse.ArgumentTypeError(f"must be 0 (any free port) .. 65535, got {v}")
        return v

    serve = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("model_dir", metavar="MODEL_DIR", help="a directory written by `dsv4-ort export`")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="port (default 8000; 0: any free port)")
    serve.add_argument("--max-batch", type=positive, default=8, help="state rows: requests decoded together "
                                                                      "(default 8)")
    serve.add_argument("--max-queue", type=nonnegative_int, default=64,
                       help="requests that may wait while every row is taken; more are answered 429 (default 64)")
    serve.add_argument("--prefill-chunk", type=positive, default=64,
                       help="prompt tokens prefilled per engine step beside decoding requests; a step with none "
                            "decoding prefills one such chunk of every new prompt (default 64)")
    serve.add_argument("--admission-window", type=window_ms, default=10.0, metavar="MS",
                       help="an idle engine, woken by a request, waits until none has arrived for MS milliseconds "
                            "(at most 4 x MS) so that requests sent together start together; 0: at once "
                            "(default 10)")
    serve.add_argument("--threads", type=thread_count, default=0, help="intra-op threads (default: physical cores)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    serve.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                       help="let the kernels pick their inner loop by the number of decoding rows (faster batched "
                            "decode; a request's output may then differ in float32 rounding with what runs beside it)")
    serve.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS", dest="ray_address",
                       help="for an export in pipeline stages (export --stages): one Ray actor per stage on the Ray "
                            "cluster at ADDRESS (default 'auto': the one this machine belongs to; needs the cluster "
                            "extra); without it every stage runs in this process")
    serve.add_argument("--micro-batches", type=positive, default=None, metavar="N",
                       help="pipeline stages: decode rows split into N groups that follow each other through the "
                            "stages (default: one per stage with --ray, 1 without)")
    serve.add_argument("--speculative", choices=("mtp",), default=None,
                       help="speculative decoding with the export's MTP block (an export with --mtp): drafts "
                            "verified in one step per request; greedy outputs are those of plain decoding")
    serve.add_argument("--num-draft", type=positive, default=2, metavar="K",
                       help="with --speculative: tokens drafted per step, 1 to 3 (default 2)")
    serve.set_defaults(func=_cmd_serve)


class OneLineErrors(argparse.ArgumentParser):
    """argparse with its usage errors on one line (status 2, as before); ``--help`` still shows the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="dsv4-ort", description="DeepSeek-V4 inference on CPUs through ONNX Runtime")
    p.add_argument("--version", action="version", version=f"dsv4-ort {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    common = OneLineErrors(add_help=False)
    common.add_argument("--isa", choices=ISA_LEVELS, default=None, help="cap the ISA level (like DSV4_ORT_ISA)")

    info = sub.add_parser("info", parents=[common], help="library, CPU features and chosen ISA levels")
    info.add_argument("--json", action="store_true", help="print the raw JSON")
    info.set_defaults(func=_cmd_info)

    from .bench import cli as bench_cli
    from .export import cli as export_cli
    from .runtime import cli as runtime_cli

    runtime_cli.add_parsers(sub, common)
    export_cli.add_parser(sub)
    bench_cli.add_parser(sub)  # takes its own --isa list
    _add_serve_parser(sub, common)
    return p


def one_line(e: BaseException) -> str:
    """An exception as one line: its last non-empty line, or its type's name when it has no message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        if argv[:1] == ["bench"]:
            from .bench.cli import quiet_numpy_blas

            quiet_numpy_blas()  # before numpy loads: building the parser imports the runtime, which imports it
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        command = args.command
        env_isa = os.environ.get("DSV4_ORT_ISA")
        if env_isa and env_isa not in ISA_LEVELS:
            print(f"dsv4-ort: error: DSV4_ORT_ISA='{env_isa}' is not a valid ISA level; valid values: "
                  f"{', '.join(ISA_LEVELS)}", file=sys.stderr)
            return 2
        try:
            return args.func(args)
        except (FileNotFoundError, ValueError) as e:  # bad input: arguments, model, checkpoint, paths
            print(f"dsv4-ort {args.command}: error: {' '.join(str(e).split()) or type(e).__name__}",
                  file=sys.stderr)
            return 2
        except Exception as e:  # onnxruntime errors and the like: one line, no traceback
            print(f"dsv4-ort {args.command}: error: {one_line(e)}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:  # Ctrl-C, also during the imports: one line, the shell's status for SIGINT
        print(f"dsv4-ort{' ' + command if command in _COMMANDS else ''}: interrupted", file=sys.stderr)
        return 130


_COMMANDS = ("run", "generate", "export", "bench", "info", "serve")


if __name__ == "__main__":
    sys.exit(main())
