"""Runs the kernel cases: our ops at every distinct ISA level, then the baselines, each placed on the roofline.

ISA levels: ``DSV4_ORT_ISA`` caps the level when a session registers the library, and ``library_info(cap)`` tells
which level every kernel family then runs. A case is measured once per distinct combination of its families'
levels (a family without an AVX-512 kernel runs the same AVX2 code under the avx512 and amx caps; measuring it
twice would only add noise); the record lists every cap it stands for.

Rotation: a case whose call reads ``cold_bytes`` from weights or caches gets enough node copies (distinct pool
memory) that one run streams at least ``rotate_bytes`` (a multiple of the last-level cache), unless the kernel is so
slow that a run would exceed ``run_budget_s``; the record says how many bytes one run streamed and whether that
exceeds the LLC. Single-node cases (the routed experts) rotate their routing between runs instead.
"""

from __future__ import annotations

import gc
import math
import time
import traceback

from . import machine
from .baselines import ORT_BASELINES, TorchBaseline, best_path, ort_baseline_graph
from .ortgraph import NodeGraph
from .timing import error_text, fmt_time, measure


class Context:
    """Everything a kernel run needs: pool, threads, ISA caps, roofs, settings, deadline, log."""

    def __init__(self, *, pool, threads, caps, families, limits, settings, baselines, deadline, log, llc):
        self.pool, self.threads, self.caps, self.families = pool, threads, caps, families
        self.limits, self.settings, self.baselines = limits, settings, baselines
        self.deadline, self.log, self.llc = deadline, log, llc
        self.peaks = limits.get("peaks", {})
        self.bw = limits["bandwidth"]["all_threads"]["best"] if limits.get("bandwidth") else None
        self.last_call = {}  # (key, impl, signature) -> (m, seconds per call): projections for larger M


def roofline(flops, nbytes, seconds, bw, path, peak) -> dict:
    out = {"bw_gbs": bw, "compute_path": path, "peak_gflops": peak}
    mem_s = nbytes / (bw * 1e9) if bw else None
    cmp_s = flops / (peak * 1e9) if peak and flops else None
    if mem_s is None and cmp_s is None:
        return out
    roof = max(x for x in (mem_s, cmp_s) if x is not None)
    out.update(memory_s=mem_s, compute_s=cmp_s, roof_s=roof,
               bound="memory" if (cmp_s is None or (mem_s or 0) >= cmp_s) else "compute",
               intensity=flops / nbytes if nbytes else None,
               fraction=roof / seconds if seconds else None)
    return out


def _signature(case, families_by_cap, cap):
    fam = families_by_cap.get(cap, {})
    return tuple(fam.get(f, cap) for f in case.families)


def _groups(case, ctx):
    """[(cap to use, [caps it stands for], {family: level})] in ascending level order."""
    groups = {}
    for cap in ctx.caps:
        sig = _signature(case, ctx.families, cap)
        groups.setdefault(sig, []).append(cap)
    out = []
    for sig, caps in groups.items():
        out.append((caps[-1], caps, dict(zip(case.families, sig))))
    return out


def _record_base(case):
    return {"id": case.id, "key": case.key, "group": case.group, "op": case.op, "label": case.label,
            "phase": case.phase, "m": case.m, "shape": case.shape, "act_dtype": case.act_dtype,
            "note": case.note or None}


def _finish(rec, timing, flops, nbytes, bw, path, peak):
    med = timing.median
    rec["time"] = timing.stats()
    rec["flops"] = flops
    rec["bytes"] = nbytes
    rec["gflops"] = flops / med / 1e9 if med > 0 else None
    rec["gbs"] = nbytes / med / 1e9 if med > 0 else None
    rec["roofline"] = roofline(flops, nbytes, med, bw, path, peak)
    return rec


def _calibrated(build, n_target, run_budget, probe_max=2):
    """Builds with a few copies and times a run; rebuilds with n_target copies unless a run would then take more
    than run_budget (a kernel that slow is far from memory-bound, so fewer copies change little; the record
    says how much one run streamed)."""
    n0 = max(1, min(n_target, probe_max))
    g = build(n0)
    g.run()
    t0 = time.perf_counter()
    g.run()
    per = (time.perf_counter() - t0) / n0
    n = n_target if per * n_target <= run_budget else int(max(1, min(n_target, run_budget // max(per, 1e-9))))
    if n > n0:
        del g
        g = build(n)
    return g, n, per


def _n_target(case, ctx, cold_bytes, node_bytes):
    s = ctx.settings
    if case.single_node:
        return 1
    if cold_bytes <= 0:
        return s["hot_nodes"]
    # Views wrap around the pool; caches larger than what a call reads (attention entries) may overlap between
    # copies, which is harmless: the copies read different rows.
    n = math.ceil(s["rotate_bytes"] / cold_bytes)
    return int(max(1, min(n, s["max_nodes"])))


def _project_skip(ctx, key, impl, sig, m):
    last = ctx.last_call.get((key, impl, sig))
    if last is None:
        return None
    m0, t0 = last
    proj = t0 * m / max(m0, 1)  # linear in M: exact for compute-bound kernels, pessimistic for overhead-bound ones
    if proj > 2.5 * ctx.settings["max_call_s"]:
        return f"projected {proj:.1f} s per call (from {t0:.2f} s at M={m0}) exceeds 2.5 x the per-call limit " \
               f"{ctx.settings['max_call_s']:g} s"
    return None


def measure_ours(case, ctx, cap, caps, levels) -> dict:
    rec = _record_base(case)
    rec.update(impl="dsv4-ort", isa_cap=cap, isa_caps=caps, levels=levels,
               level=levels.get(case.families[0], cap))
    sig = tuple(levels.values())
    skip = _project_skip(ctx, case.key, "ours", sig, case.m)
    if skip:
        rec["skipped"] = skip
        return rec
    s = ctx.settings
    node_bytes = case.node_pool_bytes()
    n_target = _n_target(case, ctx, case.cold_bytes, node_bytes)
    spec = case.spec()
    build = (lambda n: NodeGraph(spec, n, ctx.pool, threads=ctx.threads, isa=cap, opsets={"ai.dsv4ort": 1}))
    graph, n, per = _calibrated(build, n_target, s["run_budget_s"])
    setup = None
    if case.rotate is not None:
        def setup(i, g=graph):
            for name, arr in case.rotate(i).items():
                g.bind_shared(name, arr)
    timing = measure(graph.run, units=n, warmup=s["warmup"], reps=s["reps"], min_reps=s["min_reps"],
                     max_seconds=s["max_seconds"], setup=setup)
    ctx.last_call[(case.key, "ours", sig)] = (case.m, timing.median)
    path, peak = machine.compute_roof(ctx.peaks, rec["level"], case.act_dtype)
    streamed = n * case.cold_bytes if not case.single_node else case.cold_bytes
    rec["rotation"] = {"nodes": n, "target_nodes": n_target, "cold_bytes_per_run": streamed,
                       "pool_bytes_per_node": node_bytes,
                       "exceeds_llc": None if case.cold_bytes == 0 else bool(case.single_node or
                                                                             streamed >= 2 * ctx.llc)}
    if case.single_node:
        rec["rotation"]["note"] = "one node; inputs rotate between runs"
    del graph
    return _finish(rec, timing, case.flops, case.bytes, ctx.bw, path, peak)


def measure_torch(case, ctx, dtype) -> dict:
    rec = _record_base(case)
    impl = f"torch_{'fp32' if dtype == 'float32' else 'bf16'}"
    rec.update(impl=impl, act_dtype=dtype)
    skip = _project_skip(ctx, case.key, impl, (), case.m)
    if skip:
        rec["skipped"] = skip
        return rec
    s = ctx.settings
    inputs = case.torch_inputs or case.inputs
    elem = 4 if dtype == "float32" else 2
    cold = case.cold_bytes
    if case.torch_inputs is not None:  # dense weights: recompute the bytes the baseline streams
        w = sum(math.prod(i.shape) for i in inputs if i.kind == "weight")
        if case.single_node:  # experts: only those selected
            E = next(i.shape[0] for i in inputs if i.kind == "weight")
            w = w / E * case.shape.get("experts_touched", E)
        cold = w * elem
    nbytes = case.bytes - case.cold_bytes + cold
    if dtype == "bfloat16":  # activations in bf16 too (roughly half the non-weight bytes)
        nbytes = cold + (case.bytes - case.cold_bytes) / 2
    node_bytes = sum(math.prod(i.shape) * elem for i in inputs if i.kind in ("weight", "state"))
    n_target = _n_target(case, ctx, cold, node_bytes)
    tb, n, per = _calibrated(lambda n: TorchBaseline(case, dtype, ctx.pool, n), n_target, s["run_budget_s"])
    timing = measure(tb.run, units=n, warmup=s["warmup"], reps=s["reps"], min_reps=s["min_reps"],
                     max_seconds=s["max_seconds"], setup=tb.rotate if case.torch_rotate else None)
    ctx.last_call[(case.key, impl, ())] = (case.m, timing.median)
    if tb.experts is not None:  # fewer dense experts than the op's stack: a call touches at most all of them
        w = sum(math.prod(i.shape[1:]) for i in inputs if i.kind == "weight")
        cold = w * elem * min(case.shape.get("experts_touched", tb.experts), tb.experts)
        nbytes = cold + (case.bytes - case.cold_bytes) / (2 if dtype == "bfloat16" else 1)
    path, peak = best_path(ctx.peaks, impl)
    rec["rotation"] = {"nodes": n, "cold_bytes_per_run": n * cold,
                       "exceeds_llc": None if cold == 0 else bool(case.single_node or n * cold >= 2 * ctx.llc)}
    if tb.experts is not None:
        rec["shape"] = {**case.shape, "E": tb.experts}
        rec["note"] = f"dense experts: {tb.experts} fit the pool (routing walks through them)"
    return _finish(rec, timing, case.flops, nbytes, ctx.bw, path, peak)


def measure_ort_baseline(case, ctx, name) -> dict:
    impl, make = ORT_BASELINES[name]
    rec = _record_base(case)
    rec.update(impl=impl)
    skip = _project_skip(ctx, case.key, impl, (), case.m)
    if skip:
        rec["skipped"] = skip
        return rec
    s = ctx.settings
    spec, wbytes, opsets = make(case)
    n_target = _n_target(case, ctx, wbytes, wbytes)
    graph, n, per = _calibrated(lambda n: ort_baseline_graph(spec, opsets, n, ctx.pool, ctx.threads), n_target,
                                s["run_budget_s"])
    timing = measure(graph.run, units=n, warmup=s["warmup"], reps=s["reps"], min_reps=s["min_reps"],
                     max_seconds=s["max_seconds"])
    ctx.last_call[(case.key, impl, ())] = (case.m, timing.median)
    nbytes = case.bytes - case.cold_bytes + wbytes
    path, peak = best_path(ctx.peaks, impl)
    rec["rotation"] = {"nodes": n, "cold_bytes_per_run": n * wbytes, "exceeds_llc": bool(n * wbytes >= 2 * ctx.llc)}
    rec["note"] = "onnxruntime MatMulNBits: 4-bit blocks of 32 + float scale (not FP4 E2M1)" \
        if "nbits" in impl else "onnxruntime MatMul on float32 weights"
    del graph
    return _finish(rec, timing, case.flops, nbytes, ctx.bw, path, peak)


def _line(rec) -> str:
    if rec.get("skipped"):
        return f"    {rec['impl']:<26} skipped: {rec['skipped']}"
    if rec.get("error"):
        return f"    {rec['impl']:<26} error: {rec['error']}"
    t = rec["time"]
    rf = rec.get("roofline", {})
    frac = rf.get("fraction")
    lvl = f" [{rec['level']}]" if rec.get("level") else ""
    return (f"    {rec['impl'] + lvl:<26} {fmt_time(t['median_s']):>10} (p10-p90 {fmt_time(t['p10_s'])}-"
            f"{fmt_time(t['p90_s'])}, n={t['n']})  {rec['gbs']:8.2f} GB/s {rec['gflops']:9.2f} GFLOP/s  "
            f"{(frac or 0) * 100:5.1f}% of {rf.get('bound', '?')} roof")


def run_cases(cases, ctx) -> list:
    """Measures every case; decode cases get 60% of the section's time budget, prefill cases the rest."""
    records = []
    now = time.monotonic()
    has_prefill = any(c.phase == "prefill" for c in cases)
    decode_deadline = now + (0.6 if has_prefill else 1.0) * max(0.0, ctx.deadline - now)
    for case in cases:
        limit = decode_deadline if case.phase == "decode" else ctx.deadline
        if time.monotonic() > limit:
            rec = _record_base(case)
            rec.update(impl="dsv4-ort", skipped=f"{case.phase} share of the kernel time budget exhausted")
            records.append(rec)
            continue
        ctx.log(f"  {case.group}: {case.label}, {case.phase} M={case.m}")
        jobs = [("ours", cap, caps, levels) for cap, caps, levels in _groups(case, ctx)]
        if "torch" in ctx.baselines and case.torch_fn is not None:
            bf16_groups = ctx.settings.get("torch_bf16_groups")
            jobs += [("torch", dt) for dt in case.torch_dtypes if dt in ctx.settings["torch_dtypes"]
                     and (dt != "bfloat16" or bf16_groups is None or case.group in bf16_groups)]
        if "ort" in ctx.baselines:
            jobs += [("ort", name) for name in case.ort_baselines
                     if name in ctx.settings["ort_baselines"]]
        for job in jobs:
            try:
                if job[0] == "ours":
                    rec = measure_ours(case, ctx, *job[1:])
                elif job[0] == "torch":
                    rec = measure_torch(case, ctx, job[1])
                else:
                    rec = measure_ort_baseline(case, ctx, job[1])
            except Exception as e:  # one failing configuration must not end the run
                rec = _record_base(case)
                impl = {"ours": "dsv4-ort", "ort": ORT_BASELINES.get(job[-1], (job[-1],))[0],
                        "torch": "torch_fp32" if job[-1] == "float32" else "torch_bf16"}[job[0]]
                rec.update(impl=impl,
                           error=error_text(e))
                if job[0] == "ours":
                    rec.update(isa_cap=job[1], isa_caps=job[2], levels=job[3])
                if ctx.settings.get("debug"):
                    traceback.print_exc()
            records.append(rec)
            ctx.log(_line(rec))
            gc.collect()  # tear sessions (and their spinning thread pools) down before the next implementation
    return records


__all__ = ["Context", "run_cases", "roofline"]
