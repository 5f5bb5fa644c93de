"""Weight-format options side by side: quality against ``native`` and decode speed, in one run on one CPU.

Each option is an export of the same preset weights (seed 0) with ``--head`` / ``--dense`` (see
:func:`dsv4_ort.export.weights.requantize`) and ``--compute`` (fp32, bf16 or int8 products). Quality is teacher-forced: both models read the same random token
sequence one token at a time (decode steps, so every position's logits are compared) and we report the logit NMSE
``sum((l - l_native)^2) / sum(l_native^2)`` over all steps and the top-1 agreement (fraction of steps whose argmax
equals native's). Speed is decode tokens/s after a short prompt, with the bytes one decode step reads (the bench
cost model, :func:`.e2e.decode_bytes`, uniform routing estimate); also an 8-row decode step (tokens/s over the rows)
and a 128-token prefill, where the compute mode matters. Each option's decode is timed side by side with native's
(:func:`decode_speeds`, rounds alternating the two sessions): this machine's bandwidth drifts within minutes, so
options timed one after the other were ranked by the moment each ran (``--head fp8`` once came out 0.93x native
that way, and 1.11-1.29x interleaved). ``decode_vs_native`` is the ratio of the two medians.

usage: dsv4-ort bench --formats [--out DIR] [--threads N]   (or python -m dsv4_ort.bench.formats)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

# (head, dense, compute) options measured, native first (the reference of the quality columns).
OPTIONS = (("native", "native", "fp32"), ("native", "native", "bf16"), ("fp8", "native", "fp32"),
           ("fp8", "fp8", "fp32"), ("fp8", "fp4", "fp32"), ("fp4", "fp4", "fp32"), ("fp4", "fp4", "bf16"),
           ("native", "native", "int8"))


def export_option(preset: str, head: str, dense: str, max_seq_len: int, log, compute: str = "fp32") -> Path:
    """The preset exported with one option into the bench cache (once); returns the model directory."""
    from .e2e import cached_export

    return cached_export(f"{preset}-head{head}-dense{dense}-{compute}-seed0-len{max_seq_len}", log, preset=preset,
                         seed=0, max_seq_len=max_seq_len, logits="last", head=head, dense=dense, compute=compute)


def teacher_forced_logits(sess, ids: np.ndarray) -> np.ndarray:
    """float32 [len(ids), vocab]: the logits after each token, fed one at a time."""
    state = sess.new_state(1)
    return np.stack([sess.forward(ids[None, i:i + 1], state)[0, -1] for i in range(len(ids))])


def quality(ref: np.ndarray, got: np.ndarray) -> dict:
    """Logit NMSE and top-1 agreement of ``got`` against ``ref`` (both [steps, vocab])."""
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    nmse = float(((got64 - ref64) ** 2).sum() / max((ref64 ** 2).sum(), 1e-30))
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    return {"nmse": nmse, "top1_agreement": top1, "steps": int(ref.shape[0])}


def decode_speed(sess, prompt_len: int, steps: int, repeats: int) -> float:
    """Median decode tokens/s of ``steps`` greedy steps after a ``prompt_len`` prompt."""
    return decode_speeds([sess], prompt_len, steps, repeats)[0]


def decode_speeds(sessions: list, prompt_len: int, steps: int, repeats: int) -> list:
    """Median decode tokens/s of each session: ``repeats`` rounds, each running every session's ``steps`` greedy
    steps after the same ``prompt_len`` prompt, side by side (:func:`.timing.alternating_rounds`)."""
    from .timing import alternating_rounds

    prompt = np.random.default_rng(1).integers(0, min(s.vocab_size for s in sessions), (1, prompt_len))

    def rate(sess):
        def run():
            state = sess.new_state(1)
            tok = np.array([[int(sess.forward(prompt, state)[0, -1].argmax())]])
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = np.array([[int(sess.forward(tok, state)[0, -1].argmax())]])
            return steps / (time.perf_counter() - t0)
        return run

    rates = alternating_rounds({i: rate(sess) for i, sess in enumerate(sessions)}, repeats)
    return [statistics.median(rates[i]) for i in range(len(sessions))]


def prefill_speed(sess, tokens: int, repeats: int) -> float:
    """Best prefill tokens/s of a ``tokens``-token prompt (batch 1)."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, sess.vocab_size, (1, tokens))
    best = None
    for _ in range(repeats):
        state = sess.new_state(1)
        t0 = time.perf_counter()
        sess.forward(prompt, state)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return tokens / best


def batch_speed(sess, batch: int, steps: int) -> float:
    """Median decode tokens/s over all rows of a ``batch``-row step (rows after a 16-token prompt)."""
    rng = np.random.default_rng(3)
    state = sess.new_state(batch)
    logits = sess.forward(rng.integers(0, sess.vocab_size, (batch, 16)), state)
    tok = logits[:, -1].argmax(-1).reshape(batch, 1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = sess.forward(tok, state)[:, -1].argmax(-1).reshape(batch, 1)
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def run(presets=("tiny", "bench"), *, tokens: int = 48, steps: int = 32, repeats: int = 3,
        threads: int | None = None, log=None) -> dict:
    """Measures every option of :data:`OPTIONS` on each preset; returns {"rows": [...], "machine": {...}}."""
    from dsv4_ort.runtime import Session
    from dsv4_ort.runtime.session import physical_cores

    from . import e2e
    from .machine import _cpuinfo

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    threads = int(threads or physical_cores())
    rows = []
    for preset in presets:
        max_seq_len = 256
        ids = np.random.default_rng(0).integers(0, 1 << 30, tokens)
        ref = native = None
        native_rates = []
        for head, dense, compute in OPTIONS:
            d = export_option(preset, head, dense, max_seq_len, log, compute)
            sess = Session(d, intra_op_threads=threads)
            ids_p = ids % sess.vocab_size
            logits = teacher_forced_logits(sess, ids_p)
            if ref is None:  # native: the reference of the quality columns and of every option's decode
                ref, native = logits, sess
                decode = [decode_speed(sess, 16, steps, repeats)]
            else:  # side by side with native, rounds alternating (repeats at least 2: one round of each order)
                decode = decode_speeds([sess, native], 16, steps, max(repeats, 2))
                native_rates.append(decode[1])
            wc = e2e.weight_costs(e2e.inventory(d), sess.meta["config"])
            mb = e2e.decode_bytes(sess.meta, wc, context=16, batch=1, unique_experts=None)["per_token"] / 1e6
            row = {"preset": preset, "head": head, "dense": dense, "compute": compute, **quality(ref, logits),
                   "decode_tok_s": round(decode[0], 2),
                   "decode_vs_native": round(decode[0] / decode[-1], 3),
                   "batch8_tok_s": round(batch_speed(sess, 8, max(4, steps // 4)), 2),
                   "prefill128_tok_s": round(prefill_speed(sess, 128, 2), 1), "mb_per_token": round(mb, 2),
                   "isa": sess.isa, "threads": threads}
            log(f"  {preset:6s} head={head:6s} dense={dense:6s} compute={compute} nmse={row['nmse']:.2e} "
                f"top1={row['top1_agreement']:.3f} decode={row['decode_tok_s']} (x{row['decode_vs_native']} native) "
                f"b8={row['batch8_tok_s']} "
                f"prefill128={row['prefill128_tok_s']} tok/s {row['mb_per_token']} MB/token")
            rows.append(row)
            del sess
        if native_rates:  # native's own figure: the median of its runs beside the other options
            rows[-len(OPTIONS)]["decode_tok_s"] = round(statistics.median(native_rates), 2)
        del native
    import dsv4_ort

    cpu = dsv4_ort.library_info()["cpu"]
    name = f"{_cpuinfo()['model']} ({cpu['vendor']} family {cpu['family']:#x} model {cpu['model']:#x})"
    return {"rows": rows, "machine": {"cpu": name, "threads": threads}}


def markdown(result: dict) -> str:
    lines = [f"CPU: {result['machine']['cpu']}, {result['machine']['threads']} threads; quality teacher-forced "
             "against native on the same weights.", "",
             "| preset | head | dense | compute | logit NMSE | top-1 agreement | decode tok/s | decode x native "
             "(side by side) | batch 8 tok/s | prefill 128 tok/s | MB read / token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['preset']} | {r['head']} | {r['dense']} | {r['compute']} | {r['nmse']:.2e} | "
                     f"{r['top1_agreement']:.3f} | {r['decode_tok_s']} | {r['decode_vs_native']:.2f} | "
                     f"{r['batch8_tok_s']} | "
                     f"{r['prefill128_tok_s']} | {r['mb_per_token']} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir) -> None:
    from .report import write_mode

    write_mode(out_dir, "formats", result, markdown(result))


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsv4_ort.bench.formats", description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,bench")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    result = run(tuple(args.presets.split(",")), threads=args.threads)
    write(result, args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
