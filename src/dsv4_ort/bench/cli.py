"""``dsv4-ort bench``: the benchmark suite's command-line subcommand.

``add_parser(subparsers)`` adds it to the ``dsv4-ort`` parser (importing nothing heavy); ``main(argv)`` runs it
standalone (``python -m dsv4_ort.bench``).
"""

from __future__ import annotations

import argparse
import os
import sys

USAGE = "dsv4-ort bench [--smoke | --quick] [--out DIR] [--plot] [--isa LEVELS] [--threads N] [--e2e | --no-e2e] ..."

DESCRIPTION = """\
Benchmarks dsv4-ort on this machine and writes DIR/results.json (every figure with its spread and conditions) and
DIR/summary.md (and PNG charts with --plot): the machine's limits (DRAM read bandwidth, peak arithmetic of each
instruction path), every op family at DeepSeek-V4 shapes for decode (M = 1..8) and prefill (M = 128..2048) at each
ISA level with its roofline fraction, side by side with the PyTorch reference, torch bf16 GEMMs and onnxruntime's
MatMul / MatMulNBits, and the bench preset end to end (prefill and decode tokens/s, bytes per decoded token, implied
roofline tokens/s; the smallest weight option's decode and quality beside it) next to the PyTorch reference,
transformers and llama.cpp when found. The default mode is the full suite (tens of minutes); --quick takes about four
minutes on 2 cores once the bench models are in the cache; --smoke takes seconds (tiny shapes, checks that everything
runs)."""


def _levels(text: str) -> list:
    return [t for t in text.replace(" ", "").split(",") if t]


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _max_threads() -> int:
    """The most threads accepted: 4 per CPU this process may use, at most 1024."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(1024, 4 * n))


def _threads(text: str) -> int:
    v = _positive(text)
    if v > _max_threads():
        raise argparse.ArgumentTypeError(f"must be 1 .. {_max_threads()} (4 per available CPU), got {v}")
    return v


def _ints(text: str) -> list:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _seconds(text: str) -> float:
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def check_out_dir(path: str) -> None:
    """Before anything runs: ``--out`` must be a directory this process can create and write in (a run of tens
    of minutes must not fail at its end). Raises ValueError naming the option."""
    import tempfile

    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {path!r} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"--out {path!r} is not a writable directory ({e.strerror or e})") from None


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="headline cases only (about 4 min on 2 cores with the models cached)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes and the tiny preset (seconds; for CI)")
    p.add_argument("--out", default="bench-results", metavar="DIR", help="output directory (default: bench-results)")
    p.add_argument("--plot", action="store_true", help="also write PNG charts (needs matplotlib: the bench extra)")
    p.add_argument("--isa", type=_levels, default=None, metavar="LEVELS",
                   help="comma-separated ISA caps to measure the kernels at (default: every level the CPU has)")
    p.add_argument("--threads", type=_threads, default=None, metavar="N",
                   help="threads for every implementation (default: physical cores)")
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                   help="run the end-to-end model benchmarks (default: yes)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="run the kernel benchmarks (default: yes)")
    p.add_argument("--baselines", type=_levels, default=None, metavar="LIST",
                   help="baselines to include: torch, ort, hf, llama (default: all that are installed; llama.cpp "
                        "when found, see dsv4_ort.bench.llamacpp; 'none' for none)")
    p.add_argument("--e2e-isa", type=_levels, default=None, metavar="LEVELS",
                   help="ISA caps for the end-to-end runs (default: the highest)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="use this exported model for the end-to-end runs instead of the cached bench preset")
    p.add_argument("--filter", default=None, metavar="TEXT", help="only kernel cases whose key or group contains TEXT")
    p.add_argument("--decode-m", type=_ints, default=None, metavar="LIST", help="decode token counts (e.g. 1,4,8)")
    p.add_argument("--prefill-m", type=_ints, default=None, metavar="LIST",
                   help="prefill token counts for the kernels (e.g. 128,512,2048)")
    p.add_argument("--contexts", type=_ints, default=None, metavar="LIST",
                   help="end-to-end decode contexts (e.g. 256,4096,16384)")
    p.add_argument("--pool-mb", type=_positive, default=None, metavar="MB",
                   help="size of the rotating weight pool, all of it streamed per decode run "
                        "(default: max(2 x LLC, 1 GiB))")
    p.add_argument("--budget", type=_seconds, default=None, metavar="S",
                   help="time budget in seconds for each of the kernel and end-to-end sections")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--debug", action="store_true", help="print tracebacks of failing measurements")
    p.add_argument("--formats", action="store_true",
                   help="instead of the suite: the export weight options (--head / --dense) side by side, quality "
                        "against native and decode speed, on the tiny and bench presets (tiny only with --smoke); "
                        "writes formats.json + formats.md into --out")
    p.add_argument("--serving", action="store_true",
                   help="instead of the suite: the bench preset (tiny with --smoke) behind a dsv4-ort serve "
                        "process on loopback with 1, 4 and 16 concurrent streaming clients: output tokens/s, TTFT "
                        "and inter-token latency p50 / p99 (needs the serve extra); writes serving.json + "
                        "serving.md into --out")
    p.add_argument("--serving-tokens", type=_ints, default=None, metavar="P,O",
                   help="--serving: prompt tokens and output tokens per client (default 48,32; 48,8 with --smoke)")
    p.add_argument("--serving-rounds", type=int, default=None, metavar="R",
                   help="--serving: rounds of every client count, the order reversed every other round, pooled "
                        "(default 2; 1 with --smoke)")
    p.add_argument("--serving-compute", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="--serving: the preset's export products (--compute of dsv4-ort export; default fp32; "
                        "not with --model-dir)")
    p.add_argument("--speculative", action="store_true",
                   help="instead of the suite: MTP speculative decoding on the bench preset (verify and draft step "
                        "costs against a decode step, greedy tokens/s with and without, the speed-up projected at "
                        "acceptance 0.6 / 0.8 / 0.9) and the fitted MTP block's acceptance on the tiny preset; "
                        "writes speculative.json + speculative.md into --out")
    p.add_argument("--pipeline", action="store_true",
                   help="instead of the suite: the bench preset in 2 pipeline stages, in this process and as Ray "
                        "actors on a loopback-only local Ray (bytes per boundary, the Ray hop, micro-batched decode "
                        "against 1 stage) and the Flash / Pro sizing table (needs the cluster extra); writes "
                        "pipeline.json + pipeline.md into --out")
    p.add_argument("--prefill", action="store_true",
                   help="instead of the suite: the compute-bound paths in both compute modes (export --compute fp32 "
                        "/ bf16) on the bench preset: prefill of 128 / 1024 / 8192 tokens with the fraction of the "
                        "mode's compute roof, time to first token of 8k and 16k prompts in one call and in chunks, "
                        "batched decode of 1-32 rows, transformers' bf16 prefill and llama.cpp's (when found) as "
                        "baselines; writes prefill.json + prefill.md into --out")
    return p


def quiet_numpy_blas() -> None:
    """Keeps numpy's BLAS single-threaded (before numpy loads): its idle worker threads spin for a while after any
    numpy matmul in the suite's setup and take cycles from the measured sessions on a machine with few cores."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# --formats / --serving / --speculative / --pipeline / --prefill: (option, modules it needs, the extra that has them)
_MODES = (("formats", (), ""), ("serving", ("starlette", "uvicorn"), "serve"), ("speculative", (), ""),
          ("pipeline", ("ray",), "cluster"), ("prefill", (), ""))


def _run_mode(name: str, module, args, log) -> tuple:
    """(result, its markdown function) of one single-case mode."""
    if name == "formats":
        return module.run(("tiny",) if args.smoke else ("tiny", "bench"), threads=args.threads, log=log), \
            module.markdown
    if name == "serving":
        prompt, output = args.serving_tokens or ((48, 8) if args.smoke else (48, 32))
        return module.run("tiny" if args.smoke else "bench", threads=args.threads, model_dir=args.model_dir,
                          prompt_tokens=prompt, max_tokens=output, compute=args.serving_compute,
                          rounds=args.serving_rounds or (1 if args.smoke else 2), log=log), \
            module.markdown
    return module.suite(smoke=args.smoke, threads=args.threads, log=log), module.suite_markdown


def cmd_bench(args) -> int:
    quiet_numpy_blas()
    check_out_dir(args.out)
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        raise FileNotFoundError(f"--model-dir {args.model_dir!r} does not exist")
    if args.serving_tokens is not None and len(args.serving_tokens) != 2:
        raise ValueError(f"--serving-tokens takes two counts (prompt,output), got {args.serving_tokens}")
    if args.serving_rounds is not None and args.serving_rounds < 1:
        raise ValueError(f"--serving-rounds takes a count of at least 1, got {args.serving_rounds}")
    if args.serving_compute != "fp32" and args.model_dir is not None:
        raise ValueError("--serving-compute chooses the preset's export; a --model-dir export has its own")
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    for name, needs, extra in _MODES:  # the single-case modes, instead of the suite
        if not getattr(args, name):
            continue
        import importlib

        try:
            for mod in needs:
                importlib.import_module(mod)
        except ImportError:
            print(f"dsv4-ort bench: {name}: skipped (install '.[{extra}]')", file=sys.stderr)
            return 0
        module = importlib.import_module(f".{name}", __package__)
        result, markdown = _run_mode(name, module, args, log)
        module.write(result, args.out)
        print(markdown(result))
        return 0
    from .suite import run

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    baselines = None
    if args.baselines is not None:
        baselines = [] if args.baselines == ["none"] else args.baselines
        bad = [b for b in baselines if b not in ("torch", "ort", "hf", "llama")]
        if bad:
            raise ValueError(f"--baselines: unknown baseline(s) {bad}; valid: torch, ort, hf, llama, none")
    overrides = {"decode_ms": args.decode_m, "prefill_ms": args.prefill_m, "e2e_contexts": args.contexts,
                 "pool_mb": args.pool_mb, "debug": args.debug or None}
    if args.budget is not None:
        overrides.update(kernel_budget_s=args.budget, e2e_budget_s=args.budget)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = run(mode, out_dir=args.out, threads=args.threads, isa=args.isa, e2e=args.e2e, kernels=args.kernels,
                  baselines=baselines, plot=args.plot, filter=args.filter, e2e_isa=args.e2e_isa,
                  model_dir=args.model_dir, overrides=overrides, log=log)
    return 1 if any(e.get("where") == "schema" for e in results["errors"]) else 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``bench`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("bench", usage=USAGE, help="benchmark kernels and the model; roofline; baselines",
                              description=DESCRIPTION)
    configure(p)
    p.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    from dsv4_ort.cli import OneLineErrors

    p = configure(OneLineErrors(prog="dsv4-ort bench", usage=USAGE, description=DESCRIPTION))
    args = p.parse_args(argv)
    try:
        return cmd_bench(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"dsv4-ort bench: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dsv4-ort bench: interrupted", file=sys.stderr)
        return 130


__all__ = ["add_parser", "check_out_dir", "cmd_bench", "main"]
