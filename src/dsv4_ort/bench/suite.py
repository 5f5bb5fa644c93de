"""The benchmark run: settings per mode, the order of the sections, and the results document.

Modes: ``smoke`` (seconds: tiny shapes and the tiny preset; checks that everything runs and the output is
complete, the numbers mean little), ``quick`` (about four minutes on a 2-core machine once the bench models are in
the cache: the headline kernels at decode M=1 and one prefill size, the end-to-end model at two contexts) and
``full`` (every case, M = 1/4/8 and 128/512/2048, contexts 256/4096/16384, batch 1 and 4, every baseline).

End to end: ours (native export) at the top ISA level, the per-step overhead and thread scaling, the smallest weight
option (``--head fp4 --dense fp4``: decode and its quality against native), llama.cpp when found, ours and the
smallest option again right after llama.cpp (the bandwidth drifts), then the PyTorch / transformers baselines.

Order: machine limits first, kernels, end to end, then the bandwidth probe again (so the roofs bracket the run and
show drift), then the outputs. Interference from other processes is measured for every figure
(:class:`.machine.LoadMeter`) and summarised in the conditions.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import time
from pathlib import Path

from . import machine
from .report import AGAIN, SMALLEST, SMALLEST_AGAIN
from .timing import error_text

SCHEMA = "dsv4-ort-bench/1"

MODES = {
    "smoke": dict(
        decode_ms=[1], prefill_ms=[16], contexts=[256], batches=[1],
        rotate_mb=16, pool_mb=48, max_nodes=32, hot_nodes=4, run_budget_s=0.03, warmup=1, reps=3, min_reps=2,
        max_seconds=0.06, max_call_s=1.0, kernel_budget_s=25, ort_baselines=["matmul_fp32"],
        torch_dtypes=["float32"],
        bw_mb=64, bw_reps=3, peak_seconds=0.01, peak_reps=2,
        e2e_preset="tiny", prefill_tokens=[16], e2e_contexts=[64], e2e_batches=[1], decode_steps=2,
        decode_warmup=1, decode_steps_baseline=2, prefill_reps=1, max_prefill_s=5, max_decode_s=5,
        e2e_budget_s=15, e2e_baselines=["torch_fp32"], e2e_baseline_contexts=None, hf_max_context=0),
    "quick": dict(
        decode_ms=[1], prefill_ms=[128], contexts=[4096], batches=[1],
        rotate_mb=None, pool_mb=None, max_nodes=256, hot_nodes=16, run_budget_s=0.25, warmup=1, reps=5, min_reps=3,
        max_seconds=0.6, max_call_s=1.5, kernel_budget_s=35, ort_baselines=["matmul_fp32", "matmulnbits_int4"],
        torch_dtypes=["float32", "bfloat16"], torch_bf16_groups=["Linear"],
        bw_mb=None, bw_reps=3, peak_seconds=0.04, peak_reps=3,
        # the model's files are read through before timing (timing.warm_page_cache: the kernel section's buffers
        # push them out of the page cache); 12 steps, as a noisy neighbour can double a few of them (one run had
        # 37-76 ms steps of a 40 ms median at context 4096 with 6)
        e2e_preset="bench", prefill_tokens=[128], e2e_contexts=[256, 4096], e2e_batches=[1], decode_steps=12,
        decode_warmup=3, decode_steps_baseline=2, prefill_reps=2, max_prefill_s=12, max_decode_s=10,
        e2e_budget_s=90, e2e_baselines=["torch_fp32"], e2e_baseline_contexts=[256], hf_max_context=0),
    "full": dict(
        decode_ms=[1, 4, 8], prefill_ms=[128, 512, 2048], contexts=[4096, 16384], batches=[1, 4],
        rotate_mb=None, pool_mb=None, max_nodes=512, hot_nodes=32, run_budget_s=1.0, warmup=2, reps=9, min_reps=5,
        max_seconds=4.0, max_call_s=30.0, kernel_budget_s=5400, torch_dtypes=["float32", "bfloat16"],
        ort_baselines=["matmul_fp32", "matmulnbits_int4", "matmulnbits_int4_fp32"],
        bw_mb=None, bw_reps=7, peak_seconds=0.2, peak_reps=5,
        e2e_preset="bench", prefill_tokens=[128, 512, 2048], e2e_contexts=[256, 4096, 16384], e2e_batches=[1, 4],
        decode_steps=8, decode_warmup=2, decode_steps_baseline=4, prefill_reps=3, max_prefill_s=180,
        max_decode_s=90, e2e_budget_s=5400, e2e_baselines=["torch_fp32", "torch_bf16", "hf_fp32"],
        e2e_baseline_contexts=None, hf_max_context=256),
}


def _mib(x):
    return int(x) << 20


def resolve_settings(mode: str, overrides: dict) -> dict:
    s = dict(MODES[mode])
    for k, v in overrides.items():
        if v is not None:
            s[k] = v
    llc = machine.llc_bytes()
    avail = machine.memory().get("MemAvailable", 8 << 30)
    rotate = _mib(s["rotate_mb"]) if s["rotate_mb"] else max(2 * llc, 1 << 30)
    if s["pool_mb"] and not s["rotate_mb"]:  # --pool-mb: stream the whole pool per run
        rotate = _mib(s["pool_mb"])
    pool = _mib(s["pool_mb"]) if s["pool_mb"] else max(rotate, 1 << 30 if mode == "full" else rotate)
    pool = min(pool, max(64 << 20, avail // 4))
    s["rotate_bytes"] = min(rotate, pool)
    s["pool_bytes"] = pool
    s["bw_bytes"] = _mib(s["bw_mb"]) if s["bw_mb"] else min(max(2 * llc, 512 << 20), max(64 << 20, avail // 4))
    s["llc_bytes"] = llc
    s["mode"] = mode
    return s


def _caps(requested, isa_max: str) -> list:
    from dsv4_ort import ISA_LEVELS

    top = ISA_LEVELS.index(isa_max) if isa_max in ISA_LEVELS else len(ISA_LEVELS) - 1
    avail = list(ISA_LEVELS[: top + 1])
    if not requested:
        return avail
    bad = [c for c in requested if c not in ISA_LEVELS]
    if bad:
        raise ValueError(f"unknown ISA level(s) {bad}; valid: {', '.join(ISA_LEVELS)}")
    return [c for c in avail if c in requested] or [avail[-1]]


def run(mode: str = "quick", *, out_dir: str | os.PathLike = "bench-results", threads: int | None = None,
        isa: list | None = None, e2e: bool = True, kernels: bool = True, baselines: list | None = None,
        plot: bool = False, filter: str | None = None, e2e_isa: list | None = None, model_dir: str | None = None,
        overrides: dict | None = None, log=None) -> dict:
    """Runs the suite and writes results.json + summary.md (+ PNG charts with ``plot``) into ``out_dir``."""
    import dsv4_ort
    from dsv4_ort.runtime.session import physical_cores

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if plot:
        from .plots import _plt

        _plt()  # fail now, not after the run, when matplotlib is missing
    t_start = time.monotonic()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    s = resolve_settings(mode, overrides or {})
    threads = int(threads or physical_cores())
    info = dsv4_ort.library_info()
    caps = _caps(isa, info["isa_max"])
    families = {c: dsv4_ort.library_info(c)["families"] for c in caps}
    from . import llamacpp

    llama_missing = llamacpp.available()
    wanted = set(baselines) if baselines is not None else {"torch", "ort", "hf"} | ({"llama"} if not llama_missing
                                                                                     else set())
    missing = []
    try:
        import torch  # noqa: F401
    except ImportError:
        missing.append("torch")
    if "hf" in wanted:
        try:
            import transformers  # noqa: F401
        except ImportError:
            missing.append("transformers")
    if "torch" in missing:
        wanted -= {"torch", "hf"}
    if "transformers" in missing:
        wanted.discard("hf")
    results = {"schema": SCHEMA, "created": started, "mode": mode, "command": sys.argv[1:],
               "settings": {k: v for k, v in s.items() if not callable(v)}, "notes": [], "errors": [],
               "baselines": sorted(wanted)}
    for m in missing:
        results["notes"].append(f"{m} is not installed: its baselines are left out")
    if "llama" in wanted and llama_missing:
        results["notes"].append(f"llama.cpp baseline left out: {llama_missing}")
        wanted.discard("llama")
    log(f"dsv4-ort bench ({mode}): {threads} threads, ISA levels {', '.join(caps)}")
    conditions = machine.describe(threads)
    conditions.update(isa_caps=caps, families=families, load_start=machine.LoadMeter().stop())
    results["conditions"] = conditions

    # ---- machine limits
    log("machine limits")
    limits = machine.measure_limits(threads, bw_bytes=s["bw_bytes"], bw_reps=s["bw_reps"],
                                    peak_seconds=s["peak_seconds"], peak_reps=s["peak_reps"], log=log)
    results["machine"] = limits

    # ---- kernels
    results["kernels"] = []
    if kernels:
        from . import cases as C
        from . import kernels as K
        from .ortgraph import DataPool

        if "torch" in wanted:
            import torch

            torch.set_num_threads(threads)
        log(f"kernels (pool {s['pool_bytes'] / 2**20:.0f} MiB, {s['rotate_bytes'] / 2**20:.0f} MiB streamed per "
            f"run, LLC {s['llc_bytes'] / 2**20:.0f} MiB)")
        t0 = time.perf_counter()
        pool = DataPool(s["pool_bytes"])
        log(f"  data pool ready in {time.perf_counter() - t0:.1f} s")
        all_cases = C.all_cases(s, smoke=mode == "smoke", quick=mode == "quick")
        if filter:
            all_cases = [c for c in all_cases if filter in c.key or filter in c.group.lower()]
        ctx = K.Context(pool=pool, threads=threads, caps=caps, families=families, limits=limits, settings=s,
                        baselines=wanted, deadline=time.monotonic() + s["kernel_budget_s"], log=log,
                        llc=s["llc_bytes"])
        results["kernels"] = K.run_cases(all_cases, ctx)
        del pool, ctx

    # ---- end to end
    results["e2e"] = {}
    if e2e:
        results["e2e"] = _run_e2e(s, threads, caps, families, limits, wanted, e2e_isa, model_dir, log, results)

    # ---- bandwidth again (drift), ratios, outputs
    log("machine limits again (drift check)")
    results["machine"]["bandwidth_end"] = machine.read_bandwidth(s["bw_bytes"], threads, max(2, s["bw_reps"] - 1))
    conditions["load_end"] = machine.LoadMeter().stop()
    conditions["wall_s"] = round(time.monotonic() - t_start, 1)
    from . import report

    results["ratios"] = report.ratios(results)
    results["summary"] = report.headline(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems = report.validate(results)
    if problems:
        results["errors"].append({"where": "schema", "problems": problems})
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_jsonable) + "\n")
    (out / "summary.md").write_text(report.markdown(results))
    if plot:
        from . import plots

        try:
            for p in plots.write_all(results, out):
                log(f"  wrote {p}")
        except Exception as e:  # charts are extras: the results are already written
            log(f"  charts failed: {type(e).__name__}: {e}")
    log(f"wrote {out / 'results.json'} and {out / 'summary.md'} ({conditions['wall_s']} s)")
    return results


def _jsonable(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


def _run_e2e(s, threads, caps, families, limits, wanted, e2e_isa, model_dir, log, results) -> dict:
    from . import e2e as E

    out = {"runs": [], "accounting": []}
    start = time.monotonic()
    deadline = start + s["e2e_budget_s"]
    # dsv4-ort gets at most 55% of the section when baselines follow, so they are not starved
    ours_deadline = start + (0.55 if s["e2e_baselines"] else 1.0) * s["e2e_budget_s"]
    settings = dict(s, prefill_tokens=s["prefill_tokens"], contexts=s["e2e_contexts"], batches=s["e2e_batches"])
    try:
        if model_dir:
            mdir = Path(model_dir)
        else:
            cap_len = E.model_capacity(settings["contexts"], s["e2e_preset"])
            log(f"end to end ({s['e2e_preset']} preset, capacity {cap_len} positions)")
            mdir = E.ensure_export(s["e2e_preset"], cap_len, log)
        from dsv4_ort.runtime import read_metadata

        meta = read_metadata(mdir)
        max_ctx = int(meta["max_seq_len"]) - E.CONTEXT_HEADROOM // 2
        dropped = [c for c in settings["contexts"] if c > max_ctx]
        if dropped:
            results["notes"].append(f"contexts {dropped} exceed the model's capacity {meta['max_seq_len']}; skipped")
            settings["contexts"] = [c for c in settings["contexts"] if c <= max_ctx]
        wc = E.weight_costs(E.inventory(mdir), meta["config"])
        out["model"] = {"dir": str(mdir), "preset": meta.get("source", {}).get("preset"),
                        "max_seq_len": meta["max_seq_len"], "weights": meta.get("weights", {}).get("mode"),
                        "weight_bytes": wc["total_bytes"], "params_per_token": wc["params_per_token"],
                        "config": {k: meta["config"].get(k) for k in (
                            "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "index_topk",
                            "compress_ratios", "vocab_size")}}
        # ours: the top ISA level, plus any levels asked for
        want_caps = [caps[-1]] if not e2e_isa else [c for c in caps if c in e2e_isa] or [caps[-1]]
        seen = {}
        for cap in want_caps:
            sig = tuple(sorted(families[cap].items()))
            if sig in seen:
                continue
            seen[sig] = cap
            log(f"  dsv4-ort, ISA cap {cap}")
            recs, acc, _ = E.run_ours(mdir, cap=cap, levels=families[cap], caps=[cap], threads=threads,
                                      settings=settings, limits=limits, deadline=ours_deadline, log=log)
            out["runs"] += recs
            out["accounting"] += acc
        # the step's time outside the kernels, and thread scaling (1 .. threads), at the top level
        from . import overhead

        if time.monotonic() < ours_deadline + 0.1 * s["e2e_budget_s"]:
            ctx0 = settings["contexts"][0] if settings["contexts"] else 16
            log("  per-step overhead (onnxruntime profiler) and thread scaling")
            out["overhead"] = overhead.step_overhead(mdir, threads=threads, isa=want_caps[-1], context=ctx0,
                                                     steps=s.get("overhead_steps", 16))
            counts = sorted({1, threads})
            out["scaling"] = overhead.thread_scaling(mdir, thread_counts=counts, isa=want_caps[-1], context=ctx0,
                                                     prefill_tokens=min(settings["prefill_tokens"] or [16]),
                                                     steps=s.get("overhead_steps", 16) // 2)
        top = want_caps[-1]

        def decode_b1(model, impl):
            """Decode only, batch 1, every context, recorded as ``impl``, with its own time allowance (a quarter of
            the section) so a late run still measures; returns run_ours' accounting and weight costs."""
            own = max(deadline, time.monotonic() + 0.25 * s["e2e_budget_s"])
            recs, acc, wc = E.run_ours(model, cap=top, levels=families[top], caps=[top], threads=threads,
                                       settings=dict(settings, prefill_tokens=[], batches=[1]), limits=limits,
                                       deadline=own, log=log, impl=impl)
            out["runs"] += [r for r in recs if r.get("kind") == "decode"]
            return acc, wc

        def failed(impl, where, e):
            msg = error_text(e)
            out["runs"].append({"impl": impl, "error": msg})
            results["errors"].append({"where": where, "error": msg})
            log(f"    {where} failed: {msg}")

        # the smallest weight option (after the overhead measurement: its first export takes a minute), and again after
        # llama.cpp's runs, below (whose budget check comes first: the export's minute is not theirs)
        llama_due = "llama" in wanted and not model_dir and time.monotonic() < deadline
        small_dir = None
        if not model_dir:
            try:
                log(f"  dsv4-ort, smallest weight option (--head {SMALLEST_OPTION['head']} "
                    f"--dense {SMALLEST_OPTION['dense']})")
                small_dir = _export_smallest(s, cap_len, log)
                acc, wc = decode_b1(small_dir, SMALLEST)
                out["smallest"] = _smallest_quality(mdir, small_dir, threads, top, log)
                out["smallest"].update(weight_bytes=wc["total_bytes"], accounting=acc)
            except Exception as e:
                failed(SMALLEST, "e2e smallest weight option", e)
        # llama.cpp: the same preset converted by its own converter, timed by llama-bench in this run
        if llama_due:
            try:
                out["runs"] += _run_llama(s, settings, threads, log)
                llama_ran = True
            except Exception as e:
                llama_ran = False
                failed("llama.cpp", "e2e llama.cpp", e)
            # ours again, right after: this machine's bandwidth drifts within minutes, so the speed-up over llama.cpp
            # is given as the range over our decode before and after its runs (report.ratios)
            if llama_ran:
                for model, impl in ((mdir, AGAIN), (small_dir, SMALLEST_AGAIN)):
                    if model is None:
                        continue
                    try:
                        log(f"  {impl}")
                        decode_b1(model, impl)
                    except Exception as e:
                        failed(impl, f"e2e {impl}", e)
        # baselines
        from dsv4_ort.models import DeepseekV4Config

        config = DeepseekV4Config.from_dict(meta["config"])
        base_settings = dict(settings)
        if s["mode"] != "full":
            base_settings["prefill_tokens"] = []  # quick / smoke: decode only for the baselines
        if s.get("e2e_baseline_contexts"):
            base_settings["contexts"] = [c for c in settings["contexts"] if c in s["e2e_baseline_contexts"]]
        for name in s["e2e_baselines"]:
            kind = name.split("_")[0]
            if kind not in wanted:
                continue
            if time.monotonic() > deadline:
                out["runs"].append({"impl": name, "skipped": "end-to-end time budget exhausted"})
                continue
            try:
                if name.startswith("torch"):
                    log(f"  PyTorch reference {name}")
                    out["runs"] += E.run_torch(config, "float32" if name == "torch_fp32" else "bfloat16",
                                               threads=threads, settings=base_settings,
                                               max_seq_len=int(meta["max_seq_len"]), deadline=deadline, log=log)
                elif name == "hf_fp32":
                    try:
                        import transformers  # noqa: F401
                    except ImportError:
                        out["runs"].append({"impl": name, "skipped": "transformers is not installed"})
                        continue
                    log("  transformers DeepseekV4ForCausalLM (eager)")
                    out["runs"] += E.run_hf(config, threads=threads, settings=base_settings, deadline=deadline,
                                            log=log)
            except Exception as e:
                msg = error_text(e)
                out["runs"].append({"impl": name, "error": msg})
                results["errors"].append({"where": f"e2e {name}", "error": msg})
                log(f"    {name} failed: {msg}")
    except Exception as e:
        msg = error_text(e)
        results["errors"].append({"where": "e2e", "error": msg})
        log(f"  end to end failed: {msg}")
    return out


# The smallest weight option the exporter has (4.25 bits per weight in the LM head and the dense projections, the
# routed experts FP4 as released): the one to put beside llama.cpp's Q4_K_M.
SMALLEST_OPTION = {"head": "fp4", "dense": "fp4"}
QUALITY_TOKENS = 32


def _export_smallest(s, cap_len, log):
    """The preset exported with :data:`SMALLEST_OPTION` into the bench cache (once); returns its directory."""
    from . import formats

    return formats.export_option(s["e2e_preset"], SMALLEST_OPTION["head"], SMALLEST_OPTION["dense"], cap_len, log)


def _smallest_quality(native_dir, small_dir, threads, cap, log) -> dict:
    """The smallest option against native, teacher-forced over :data:`QUALITY_TOKENS` random tokens."""
    import numpy as np

    from dsv4_ort.runtime import Session

    from . import formats

    ids = np.random.default_rng(0).integers(0, 1 << 30, QUALITY_TOKENS)
    logits = []
    for d in (native_dir, small_dir):
        sess = Session(d, intra_op_threads=threads, isa=cap)
        logits.append(formats.teacher_forced_logits(sess, ids % sess.vocab_size))
        del sess
    q = formats.quality(*logits)
    log(f"    quality against native: logit NMSE {q['nmse']:.2e}, top-1 agreement {q['top1_agreement']:.3f}")
    return {**SMALLEST_OPTION, "dir": str(small_dir), "quality": q}


def _run_llama(s, settings, threads, log) -> list:
    """llama.cpp on the e2e preset (Q8_0 dense + MXFP4 experts as its converter writes it, and Q4_K_M when
    llama-quantize is there): prefill of the first prompt length and decode at each context, batch 1."""
    from dsv4_ort.models import DeepseekV4Config, write_random_checkpoint
    from dsv4_ort.runtime.cli import cache_dir

    from . import llamacpp

    preset = s["e2e_preset"]
    root = cache_dir() / "bench"
    ck = root / f"{preset}-checkpoint-seed0"
    if not (ck / "config.json").is_file():
        log(f"  writing the {preset} preset as a checkpoint for llama.cpp's converter")
        tmp = root / f".{preset}-checkpoint-seed0.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_checkpoint(tmp, DeepseekV4Config.from_preset(preset), seed=0, weights="native")
        os.replace(tmp, ck)
    ggufs = {"llama.cpp q8_0": llamacpp.convert(ck, root / f"{preset}-seed0-q8_0.gguf", "q8_0", log=log)}
    if llamacpp.llama_quantize() and s["mode"] != "smoke":
        ggufs["llama.cpp Q4_K_M"] = llamacpp.quantize(ggufs["llama.cpp q8_0"], root / f"{preset}-seed0-Q4_K_M.gguf",
                                                     threads=threads, log=log)
    prompt = min(settings["prefill_tokens"] or [128])
    runs = []
    for impl, path in ggufs.items():
        for i, ctx in enumerate(settings["contexts"]):
            log(f"  {impl}: llama-bench prefill {prompt}, decode at context {ctx}")
            r = llamacpp.run_bench(path, threads=threads, prompt=prompt if i == 0 else 0, gen=16, depth=ctx,
                                   repetitions=3 if s["mode"] == "full" else 2)
            base = {"impl": impl, "threads": threads, "gguf_bytes": r["gguf_bytes"], "build": r["build"]}
            if i == 0 and "prefill_tokens_per_s" in r:
                tps = r["prefill_tokens_per_s"]
                runs.append({**base, "kind": "prefill", "tokens": prompt, "tokens_per_s": tps,
                             "time": {"median_s": prompt / tps, "n": 1, "stddev_tokens_per_s": r["prefill_stddev"]}})
            tps = r["decode_tokens_per_s"]
            runs.append({**base, "kind": "decode", "context": ctx, "batch": 1, "tokens_per_s": tps,
                         "time": {"median_s": 1 / tps, "n": 1, "stddev_tokens_per_s": r["decode_stddev"]}})
    return runs


__all__ = ["run", "MODES", "SCHEMA", "resolve_settings"]
