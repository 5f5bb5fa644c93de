"""Per-step overhead of a decode step: the time a step spends outside the kernels.

``overhead = step time - sum of the step's node times``, measured so that machine noise between runs does not
enter it (a shared machine drifts by 20 % between two runs of the same step):

* inside onnxruntime's run: onnxruntime's own profiler, per ``model_run`` event, its duration minus the
  ``*_kernel_time`` events of the nodes inside it (our custom ops and the few standard ones): the executor walking
  the graph, thread-pool wake-ups between nodes, allocations of intermediate values. The profiler's bookkeeping is
  counted in, so this is an upper bound.
* around it: :meth:`Session.forward`'s wall time minus the time of onnxruntime's run inside that same call
  (binding input_ids and logits, argument checks, the state bookkeeping). Both clocks read the same step, so the
  difference holds no drift between steps; an earlier form (forward against a separate run on the same binding)
  measured 1-4 ms of noise on a 40 ms step for 20-30 us of real work.

``overhead_fraction`` = the first as a fraction of the profiled run + the second as a fraction of the step. On a
toy model whose kernels take microseconds the per-node timer itself is a visible part of each node time, so the
figure is meaningful on the bench preset and larger.

usage: python -m dsv4_ort.bench.overhead MODEL_DIR [--threads N] [--context N] [--steps N]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _decode(forward, state, vocab: int, steps: int, rng) -> list:
    """Wall seconds of each greedy decode step."""
    ids = rng.integers(0, vocab, (state.batch_size, 1))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = forward(ids, state)
        times.append(time.perf_counter() - t0)
        ids = logits[:, -1].argmax(-1).reshape(state.batch_size, 1)
    return times


class _TimedRuns:
    """An InferenceSession whose ``run_with_iobinding`` records its wall seconds in ``last`` (everything else is
    the session's own)."""

    def __init__(self, session):
        self.session = session
        self.last = 0.0

    def run_with_iobinding(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return self.session.run_with_iobinding(*args, **kw)
        finally:
            self.last = time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.session, name)


def parse_profile(path) -> list:
    """[(run microseconds, node microseconds summed, {op type: microseconds})] per model_run of a profile."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    out = []
    for r in runs:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        inside = [n for n in nodes if lo <= n["ts"] < hi]
        by_op = {}
        for n in inside:
            op = n.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0) + n["dur"]
        out.append((r["dur"], sum(n["dur"] for n in inside), by_op))
    return out


def step_overhead(model_dir, *, threads: int, isa: str | None = None, context: int = 256, steps: int = 24,
                  warmup: int = 4) -> dict:
    """Decode-step time split into kernels, runtime overhead and the Python side, batch 1 at ``context``."""
    import onnxruntime as ort

    import dsv4_ort
    from dsv4_ort.runtime import Session
    from dsv4_ort.runtime.session import session_options

    from .e2e import fill_state

    model_dir = Path(model_dir)
    sess = Session(model_dir, intra_op_threads=threads, isa=isa)
    rng = np.random.default_rng(0)

    def fresh_state():
        st = sess.new_state(1)
        fill_state([buf for _, _, buf, _ in st.tensors], rng)
        st.positions[:] = context
        return st

    # Session.forward, with onnxruntime's run inside it timed on its own: the Python side of each step is the
    # forward's wall time less that run's, read in the same call
    timed = _TimedRuns(sess.session)
    sess.session = timed
    st = fresh_state()
    ids = rng.integers(0, sess.vocab_size, (1, 1))
    wall, raw = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = sess.forward(ids, st)
        t1 = time.perf_counter()
        ids = logits[:, -1].argmax(-1).reshape(1, 1)
        if i >= warmup:
            wall.append(t1 - t0)
            raw.append(timed.last)
    sess.session = timed.session

    with tempfile.TemporaryDirectory(prefix="dsv4-profile-") as tmp:
        so = session_options(sess.threads)  # as the session it stands in for, plus the profiler
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "decode")
        with dsv4_ort.isa_cap(isa):
            dsv4_ort.register(so)
            sess.session = ort.InferenceSession(str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
        st = fresh_state()
        _decode(sess.forward, st, sess.vocab_size, warmup + steps, rng)
        profile = sess.session.end_profiling()
        runs = parse_profile(profile)[warmup:]
    run_us = statistics.median(r[0] for r in runs)
    node_us = statistics.median(r[1] for r in runs)
    wall_us = statistics.median(wall) * 1e6
    python_us = statistics.median(w - r for w, r in zip(wall, raw)) * 1e6
    raw_us = wall_us - python_us
    ops = {}
    for _, _, by_op in runs:
        for op, us in by_op.items():
            ops[op] = ops.get(op, 0) + us / len(runs)
    return {
        "context": context, "threads": sess.threads, "isa": sess.isa, "steps": len(runs),
        "step_wall_us": round(wall_us, 1), "ort_run_us": round(raw_us, 1),
        "python_us": round(python_us, 1),
        "profiled_run_us": round(run_us, 1), "kernels_us": round(node_us, 1),
        "in_run_overhead_fraction": round((run_us - node_us) / run_us, 4),
        "overhead_fraction": round((run_us - node_us) / run_us + python_us / wall_us, 4),
        "ops_us": {k: round(v, 1) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
    }


def thread_scaling(model_dir, *, thread_counts, isa: str | None = None, context: int = 256, steps: int = 12,
                   prefill_tokens: int = 128, repeats: int = 2) -> list:
    """Decode (batch 1 at ``context``, median step) and prefill (``prefill_tokens``, best of ``repeats``) at each
    thread count; ``efficiency`` = speed-up over the first count / thread ratio."""
    from dsv4_ort.runtime import Session

    from .e2e import fill_state

    rows = []
    rng = np.random.default_rng(0)
    for n in thread_counts:
        sess = Session(model_dir, intra_op_threads=n, isa=isa)
        st = sess.new_state(1)
        fill_state([buf for _, _, buf, _ in st.tensors], rng)
        st.positions[:] = context
        decode = statistics.median(_decode(sess.forward, st, sess.vocab_size, steps + 2, rng)[2:])
        S = min(prefill_tokens, int(sess.max_seq_len))
        prompt = rng.integers(0, sess.vocab_size, (1, S))
        best = None
        for _ in range(repeats):
            st = sess.new_state(1)
            t0 = time.perf_counter()
            sess.forward(prompt, st)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        rows.append({"threads": n, "decode_tokens_per_s": round(1 / decode, 3),
                     "prefill_tokens": S, "prefill_tokens_per_s": round(S / best, 2)})
        del sess
    base = rows[0]
    for r in rows:
        ratio = r["threads"] / base["threads"]
        r["decode_efficiency"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"] / ratio, 3)
        r["prefill_efficiency"] = round(r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"] / ratio, 3)
    return rows


def markdown(overhead: dict | None, scaling: list | None) -> list:
    lines = []
    if overhead:
        o = overhead
        lines.append(f"Per-step overhead (decode, batch 1, context {o['context']}, {o['threads']} threads, "
                     f"{o['isa']}): {o['overhead_fraction'] * 100:.1f}% of the step outside the kernels "
                     f"(inside onnxruntime's run {o['in_run_overhead_fraction'] * 100:.1f}%, an upper bound that "
                     f"includes the profiler; Python binding {o['python_us']:.0f} us of a {o['step_wall_us'] / 1e3:.1f} "
                     "ms step).")
        lines.append("")
    if scaling:
        lines += ["Thread scaling (efficiency = speed-up / thread ratio):", "",
                  "| threads | decode tok/s | decode efficiency | prefill tok/s | prefill efficiency |",
                  "|---:|---:|---:|---:|---:|"]
        for r in scaling:
            lines.append(f"| {r['threads']} | {r['decode_tokens_per_s']:.2f} | {r['decode_efficiency']:.2f} | "
                         f"{r['prefill_tokens_per_s']:.1f} ({r['prefill_tokens']} tokens) | "
                         f"{r['prefill_efficiency']:.2f} |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    import argparse

    from dsv4_ort.runtime.session import physical_cores

    p = argparse.ArgumentParser(prog="python -m dsv4_ort.bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--isa", default=None)
    args = p.parse_args(argv)
    r = step_overhead(args.model_dir, threads=args.threads or physical_cores(), isa=args.isa, context=args.context,
                      steps=args.steps)
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
