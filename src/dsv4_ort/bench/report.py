"""The results document: schema check, ratios to the baselines, headline figures and the markdown summary.

Every number in the summary is read from the results (never typed in), with its spread and conditions.
"""

from __future__ import annotations

import math

from .timing import fmt_time

# Our decode measured a second time right after the llama.cpp runs (suite._run_e2e): not a baseline, the other end
# of the range the speed-ups over llama.cpp are given as.
AGAIN = "dsv4-ort (again, after llama.cpp)"
# The smallest weight option (export --head fp4 --dense fp4; suite._run_e2e): decode only, timed beside the
# native run and again after llama.cpp's, compared with the llama.cpp baselines only (its quality is not native's).
SMALLEST = "dsv4-ort fp4 head+dense"
SMALLEST_AGAIN = "dsv4-ort fp4 head+dense (again, after llama.cpp)"
# Each of our e2e implementations -> its second run.
OURS_AGAIN = {"dsv4-ort": AGAIN, SMALLEST: SMALLEST_AGAIN}

BASELINE_LABELS = {
    "torch_fp32": "PyTorch ref fp32",
    "torch_bf16": "PyTorch ref bf16",
    "hf_fp32": "transformers fp32 (eager)",
    "ort_matmul_fp32": "ORT MatMul fp32",
    "ort_matmulnbits_int4": "ORT MatMulNBits int4 (acc. level 4)",
    "ort_matmulnbits_int4_acc0": "ORT MatMulNBits int4 (acc. level 0)",
}

# ---------------------------------------------------------------------------------------------------- schema

_REQUIRED = {
    "schema": str, "created": str, "mode": str, "settings": dict, "conditions": dict, "machine": dict,
    "kernels": list, "e2e": dict, "ratios": dict, "notes": list, "errors": list, "summary": dict,
}
_COND = {"cpu": dict, "threads": int, "versions": dict, "isa_caps": list, "families": dict, "caches": dict}
_KERNEL = {"id": str, "key": str, "group": str, "op": str, "label": str, "phase": str, "m": int, "impl": str,
           "shape": dict}
_MEASURED = {"time": dict, "flops": (int, float), "bytes": (int, float), "gflops": (int, float),
             "gbs": (int, float), "roofline": dict, "rotation": dict}
_TIME = {"median_s": (int, float), "min_s": (int, float), "max_s": (int, float), "p10_s": (int, float),
         "p90_s": (int, float), "n": int, "cv": (int, float), "conditions": dict}


def _check(obj, spec, where, problems):
    for k, t in spec.items():
        if k not in obj:
            problems.append(f"{where}: missing '{k}'")
        elif not isinstance(obj[k], t):
            problems.append(f"{where}.{k}: expected {t}, got {type(obj[k]).__name__}")


def validate(results: dict) -> list:
    """Problems with the document's structure (empty list = valid)."""
    problems = []
    _check(results, _REQUIRED, "results", problems)
    if problems:
        return problems
    _check(results["conditions"], _COND, "conditions", problems)
    mach = results["machine"]
    if "bandwidth" not in mach or "all_threads" not in mach.get("bandwidth", {}):
        problems.append("machine: missing bandwidth.all_threads")
    else:
        _check(mach["bandwidth"]["all_threads"], {"best": (int, float), "median": (int, float), "samples": list},
               "machine.bandwidth.all_threads", problems)
    if not isinstance(mach.get("peaks"), dict):
        problems.append("machine: missing peaks")
    for i, r in enumerate(results["kernels"]):
        _check(r, _KERNEL, f"kernels[{i}]", problems)
        if r.get("skipped") or r.get("error"):
            continue
        _check(r, _MEASURED, f"kernels[{i}]", problems)
        if isinstance(r.get("time"), dict):
            _check(r["time"], _TIME, f"kernels[{i}].time", problems)
        if r.get("impl") == "dsv4-ort":
            _check(r, {"isa_cap": str, "levels": dict, "level": str}, f"kernels[{i}]", problems)
    e2e = results["e2e"]
    for i, r in enumerate(e2e.get("runs", [])):
        if "impl" not in r:
            problems.append(f"e2e.runs[{i}]: missing 'impl'")
        if r.get("skipped") or r.get("error"):
            continue
        _check(r, {"kind": str, "time": dict, "tokens_per_s": (int, float)}, f"e2e.runs[{i}]", problems)
    for i, a in enumerate(e2e.get("accounting", [])):
        _check(a, {"context": int, "batch": int, "bytes": dict}, f"e2e.accounting[{i}]", problems)
    return problems


# ---------------------------------------------------------------------------------------------------- ratios


def _measured(r):
    return not r.get("skipped") and not r.get("error") and isinstance(r.get("time"), dict)


def ratios(results: dict) -> dict:
    """Speed-ups of dsv4-ort over each baseline: kernels (per case, ours at its fastest measured level) and end to
    end (per prefill size / decode context and batch, ours at the top ISA level)."""
    out = {"kernels": [], "e2e": []}
    by_id = {}
    for r in results.get("kernels", []):
        if _measured(r):
            by_id.setdefault(r["id"], []).append(r)
    for cid, recs in by_id.items():
        ours = [r for r in recs if r["impl"] == "dsv4-ort"]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["time"]["median_s"])
        top = ours[-1]
        for b in recs:
            if b["impl"] == "dsv4-ort":
                continue
            out["kernels"].append({"id": cid, "baseline": b["impl"], "ours_level": best.get("level"),
                                   "ours_s": best["time"]["median_s"], "baseline_s": b["time"]["median_s"],
                                   "speedup": b["time"]["median_s"] / best["time"]["median_s"],
                                   "speedup_top_level": b["time"]["median_s"] / top["time"]["median_s"]})
    runs = [r for r in results.get("e2e", {}).get("runs", []) if _measured(r)]
    mine = set(OURS_AGAIN) | set(OURS_AGAIN.values())
    for impl, again_impl in OURS_AGAIN.items():
        again = {(r.get("context"), r.get("batch")): r for r in runs
                 if r["impl"] == again_impl and r.get("kind") == "decode"}
        for o in (r for r in runs if r["impl"] == impl):
            for b in runs:
                if b["impl"] in mine or b.get("kind") != o.get("kind") or b.get("batch") != o.get("batch"):
                    continue
                if impl != "dsv4-ort" and not b["impl"].startswith("llama.cpp"):
                    continue
                if o["kind"] == "prefill" and b.get("tokens") != o.get("tokens"):
                    continue
                if o["kind"] == "decode" and b.get("context") != o.get("context"):
                    continue
                rec = {"ours": impl, "kind": o["kind"], "tokens": o.get("tokens"), "context": o.get("context"),
                       "batch": o["batch"], "isa_cap": o.get("isa_cap"), "baseline": b["impl"],
                       "ours_tokens_per_s": o["tokens_per_s"], "baseline_tokens_per_s": b["tokens_per_s"],
                       "speedup": o["tokens_per_s"] / b["tokens_per_s"]}
                a = again.get((o.get("context"), o.get("batch"))) if o["kind"] == "decode" else None
                if a is not None and b["impl"].startswith("llama.cpp"):
                    rec["ours_again_tokens_per_s"] = a["tokens_per_s"]
                    rec["speedup_again"] = a["tokens_per_s"] / b["tokens_per_s"]
                out["e2e"].append(rec)
    return out


def headline(results: dict) -> dict:
    """A few figures for the top of the summary and the README."""
    h = {}
    m = results.get("machine", {})
    bw = m.get("bandwidth", {}).get("all_threads")
    if bw:
        h["bandwidth_gbs"] = bw["best"]
    peaks = m.get("peaks", {})
    for p in ("fp32_fma_zmm", "amx_bf16"):
        if p in peaks:
            h[f"peak_{p}_gflops"] = peaks[p]["best"]
    runs = [r for r in results.get("e2e", {}).get("runs", []) if _measured(r) and r["impl"] == "dsv4-ort"]
    for r in runs:
        if r["kind"] == "decode":
            h[f"decode_ctx{r['context']}_b{r['batch']}_tokens_per_s"] = r["tokens_per_s"]
        else:
            h[f"prefill_{r['tokens']}_tokens_per_s"] = r["tokens_per_s"]
    loads = [r["time"]["conditions"].get("other_cpu") for r in results.get("kernels", []) if _measured(r)]
    loads = [x for x in loads if x is not None]
    if loads:
        loads.sort()
        h["other_cpu_median"] = loads[len(loads) // 2]
        h["other_cpu_max"] = loads[-1]
    return h


# ---------------------------------------------------------------------------------------------------- markdown


def _num(x, fmt="{:.1f}"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return fmt.format(x)


def _spread(t) -> str:
    return f"{fmt_time(t['median_s'])} ({fmt_time(t['p10_s'])}-{fmt_time(t['p90_s'])}, n={t['n']})"


def conditions_md(results: dict) -> list:
    c = results["conditions"]
    h = results.get("summary", {})
    cpu = c["cpu"]
    v = c["versions"]
    lines = [f"- CPU: {cpu['model']} ({cpu.get('physical_cores')} cores"
             + (", virtualised" if cpu.get("virtualised") else "") + f"), {c['threads']} threads used; "
             f"caches {', '.join(f'{k} {_size(val)}' for k, val in c.get('caches', {}).items())}",
             f"- ISA levels measured: {', '.join(c['isa_caps'])} (library maximum {c['library'].get('isa_max')})",
             f"- versions: dsv4-ort {v.get('dsv4-ort')}, onnxruntime {v.get('onnxruntime')}, torch {v.get('torch')}, "
             f"transformers {v.get('transformers')}, numpy {v.get('numpy')}; Python {c.get('python')}, {c.get('os')}"]
    if "other_cpu_median" in h:
        lines.append(f"- other processes used a median {h['other_cpu_median'] * 100:.0f}% (max "
                     f"{h['other_cpu_max'] * 100:.0f}%) of the CPUs during the kernel measurements; load average "
                     f"{c.get('load_start', {}).get('loadavg')} at the start, "
                     f"{c.get('load_end', {}).get('loadavg')} at the end")
    lines.append(f"- mode `{results['mode']}`, {c.get('wall_s')} s, {results['created']}")
    return lines


def roofs_md(results: dict) -> list:
    m = results["machine"]
    bw = m["bandwidth"]["all_threads"]
    lines = ["| limit | best | median | samples | how |", "|---|---:|---:|---:|---|"]
    lines.append(f"| DRAM read, {bw['threads']} threads | {bw['best']:.1f} GB/s | {bw['median']:.1f} GB/s | "
                 f"{len(bw['samples'])} | {bw['method']}, {bw['bytes'] / 2**20:.0f} MiB |")
    one = m["bandwidth"].get("one_thread")
    if one:
        lines.append(f"| DRAM read, 1 thread | {one['best']:.1f} GB/s | {one['median']:.1f} GB/s | "
                     f"{len(one['samples'])} | |")
    end = m.get("bandwidth_end")
    if end:
        lines.append(f"| DRAM read at the end | {end['best']:.1f} GB/s | {end['median']:.1f} GB/s | "
                     f"{len(end['samples'])} | drift check |")
    for name, p in m.get("peaks", {}).items():
        one = m.get("peaks_1thread", {}).get(name)
        extra = f"; 1 thread {one['best']:.0f}" if one else ""
        lines.append(f"| {name}, {p['threads']} threads | {p['best']:.0f} GFLOP/s | {p['median']:.0f} GFLOP/s | "
                     f"{len(p['samples'])} | {p['description']}{extra} |")
    return lines


def e2e_md(results: dict) -> list:
    e = results.get("e2e") or {}
    runs = e.get("runs", [])
    if not runs:
        err = [x for x in results.get("errors", []) if str(x.get("where", "")).startswith("e2e")]
        return ["(not run)" if not err else f"(failed: {err[0].get('error')})"]
    lines = []
    model = e.get("model", {})
    if model:
        cfg = model.get("config", {})
        lines.append(f"Model: `{model.get('preset')}` preset, {model.get('weights')} weights "
                     f"({model.get('weight_bytes', 0) / 1e9:.2f} GB), {cfg.get('num_hidden_layers')} layers, hidden "
                     f"{cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} heads x {cfg.get('head_dim')}, "
                     f"{cfg.get('n_routed_experts')} experts (top-{cfg.get('num_experts_per_tok')}), capacity "
                     f"{model.get('max_seq_len')} positions. Contexts are reached with a synthetic state "
                     "(positions set, buffers filled with random values) except for transformers (real prefill). "
                     "The PyTorch reference and transformers run random weights of the same configuration "
                     "(a speed-only comparison).")
        lines.append("")
    def col(r):
        return r.get("impl", "?") + (f" [{r['isa_cap']}]" if r.get("isa_cap") else "")

    impls = []
    for r in runs:
        if col(r) not in impls:
            impls.append(col(r))
    ours_name = "dsv4-ort"

    def cell(impl, kind, **key):
        for r in runs:
            if col(r) != impl or r.get("kind") != kind or any(r.get(k) != v for k, v in key.items()):
                continue
            if r.get("skipped"):
                return "skipped"
            if r.get("error"):
                return "error"
            return f"{r['tokens_per_s']:.2f}"
        return "-"

    pre = sorted({r["tokens"] for r in runs if r.get("kind") == "prefill"})
    probes = {r["tokens"] for r in runs if r.get("kind") == "prefill" and r.get("probe")}
    if pre:
        pimpls = [i for i in impls if any(col(r) == i and r.get("kind") == "prefill" for r in runs)]  # not the
        # decode-only runs (our second run, the smallest weight option)
        lines += ["Prefill, batch 1 (tokens/s; median of the repetitions):", "",
                  "| prompt tokens | " + " | ".join(pimpls) + " | roofline (ours) |",
                  "|---:|" + "---:|" * (len(pimpls) + 1)]
        for S in pre:
            roof = next((r.get("roofline_tokens_per_s") for r in runs if r.get("impl") == ours_name and
                         r.get("kind") == "prefill" and r.get("tokens") == S and "time" in r), None)
            label = f"{S} (probe)" if S in probes else str(S)
            lines.append(f"| {label} | " + " | ".join(cell(i, "prefill", tokens=S) for i in pimpls) +
                         f" | {_num(roof)} |")
        lines.append("")
    dec = sorted({(r["context"], r["batch"]) for r in runs if r.get("kind") == "decode"})
    if dec:
        acc = {(a["context"], a["batch"]): a for a in e.get("accounting", [])}
        lines += ["Decode (tokens/s over all rows; median step):", "",
                  "| context | batch | " + " | ".join(impls) + " | MB read / token | roofline tokens/s | "
                  "ours / roofline |", "|---:|---:|" + "---:|" * (len(impls) + 3)]
        for ctx, B in dec:
            a = acc.get((ctx, B))
            ours = next((r for r in runs if r.get("impl") == ours_name and r.get("kind") == "decode" and
                         r.get("context") == ctx and r.get("batch") == B and "time" in r), None)
            frac = ours.get("roof_fraction") if ours else None
            lines.append(f"| {ctx} | {B} | " + " | ".join(cell(i, "decode", context=ctx, batch=B) for i in impls) +
                         f" | {_num(a['bytes']['per_token'] / 1e6 if a else None, '{:.0f}')} | "
                         f"{_num(a.get('roofline_tokens_per_s') if a else None)} | "
                         f"{_num(frac * 100 if frac else None, '{:.1f}%')} |")
        lines.append("")
    rat = results.get("ratios", {}).get("e2e", [])
    if rat:
        for impl, label in (("dsv4-ort", "dsv4-ort"), (SMALLEST, f"the smallest weight option (`{SMALLEST}`)")):
            mine = [r for r in rat if r.get("ours", "dsv4-ort") == impl]
            if mine:
                lines.append(f"Speed-up of {label}: " + "; ".join(
                    f"{BASELINE_LABELS.get(r['baseline'], r['baseline'])} {r['kind']} "
                    + (f"{r['tokens']} tokens" if r["kind"] == "prefill" else f"ctx {r['context']} b{r['batch']}")
                    + f" x{r['speedup']:.2f}" + (f" / x{r['speedup_again']:.2f}" if "speedup_again" in r else "")
                    for r in mine))
                lines.append("")
        if any("speedup_again" in r for r in rat):
            lines.append("(x before / after: against our decode measured before llama.cpp ran and again right "
                         "after it, the `(again, after llama.cpp)` columns; the bandwidth this machine gets drifts "
                         "within minutes.)")
            lines.append("")
    if sm := e.get("smallest"):
        q = sm.get("quality") or {}
        a = (sm.get("accounting") or [{}])[0]
        per_token = a.get("bytes", {}).get("per_token")
        lines.append(f"Smallest weight option: `dsv4-ort export --head {sm['head']} --dense {sm['dense']}` "
                     f"({sm['weight_bytes'] / 1e9:.2f} GB"
                     + (f", {per_token / 1e6:.0f} MB read per token at context {a['context']}" if per_token else "")
                     + ")" + (f"; its quality against native, teacher-forced over {q['steps']} tokens: logit NMSE "
                              f"{q['nmse']:.1e}, top-1 agreement {q['top1_agreement']:.3f}." if q else "."))
        lines.append("")
    if acc := e.get("accounting"):
        a = acc[0]
        b = a["bytes"]
        lines.append(f"Bytes per decode step (context {a['context']}, batch {a['batch']}): dense weights "
                     f"{b['dense_weights'] / 1e6:.0f} MB, routed experts {b['routed_experts'] / 1e6:.0f} MB "
                     f"({b['experts_source']}), embedding rows {b['embedding_rows'] / 1e3:.0f} kB, state "
                     f"{b['state'] / 1e6:.1f} MB; roofline = batch x {a.get('bandwidth_gbs') or 0:.1f} GB/s / bytes.")
    from .overhead import markdown as overhead_md

    more = overhead_md(e.get("overhead"), e.get("scaling"))
    if more:
        lines += [""] + more
    notes = [f"{r['impl']}: {r['skipped']}" for r in runs if r.get("skipped")]
    if notes:
        lines += ["", "Skipped: " + "; ".join(sorted(set(notes)))]
    return lines


def _cold(r) -> str:
    v = r.get("rotation", {}).get("exceeds_llc")
    return "-" if v is None else "yes" if v else "no"


def _size(n) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def kernels_md(results: dict, phase: str, limit: int | None = None) -> list:
    recs = [r for r in results.get("kernels", []) if r.get("phase") == phase]
    if not recs:
        return ["(none)"]
    lines = ["| op | case | M | impl [level] | median (p10-p90, n) | GB/s | GFLOP/s | bound | % of roof | "
             "LLC-cold |", "|---|---|---:|---|---|---:|---:|---|---:|:---:|"]
    n = 0
    for r in recs:
        impl = r["impl"] + (f" [{r['level']}]" if r.get("level") else "")
        if r.get("skipped") or r.get("error"):
            lines.append(f"| {r['op']} | {r['label']} | {r['m']} | {impl} | "
                         f"{'skipped: ' + r['skipped'] if r.get('skipped') else 'error: ' + r['error']} | | | | | |")
            continue
        rf = r.get("roofline", {})
        frac = rf.get("fraction")
        lines.append(f"| {r['op']} | {r['label']} | {r['m']} | {impl} | {_spread(r['time'])} | "
                     f"{_num(r.get('gbs'), '{:.2f}')} | {_num(r.get('gflops'), '{:.2f}')} | {rf.get('bound', '-')} | "
                     f"{_num(frac * 100 if frac is not None else None, '{:.1f}')} | "
                     f"{_cold(r)} |")
        n += 1
        if limit and n >= limit:
            break
    return lines


def kernel_ratios_md(results: dict) -> list:
    rat = results.get("ratios", {}).get("kernels", [])
    if not rat:
        return []
    by_case = {}
    for r in rat:
        by_case.setdefault(r["id"], []).append(r)
    lines = ["| case | ours (level) | " + " | ".join(BASELINE_LABELS.get(b, b) for b in sorted(
        {r["baseline"] for r in rat})) + " |"]
    bases = sorted({r["baseline"] for r in rat})
    lines.append("|---|---|" + "---:|" * len(bases))
    for cid, rs in by_case.items():
        d = {r["baseline"]: r for r in rs}
        first = rs[0]
        lines.append(f"| {cid} | {fmt_time(first['ours_s'])} ({first['ours_level']}) | " + " | ".join(
            (f"x{d[b]['speedup']:.2f}" if b in d else "-") for b in bases) + " |")
    return lines


def markdown(results: dict) -> str:
    out = [f"# dsv4-ort benchmark ({results['mode']})", "", "## Conditions", ""]
    out += conditions_md(results)
    out += ["", "## Machine roofs", "", "Roofs are the best repetition (other processes can only slow a probe).", ""]
    out += roofs_md(results)
    out += ["", "## End to end", ""] + e2e_md(results)
    out += ["", "## Kernels: decode", "",
            "Time per call (median over runs; each run calls every node copy once). GB/s and GFLOP/s use the "
            "case's compulsory bytes and operations; the roof is the slower of bytes / DRAM bandwidth and "
            "operations / peak of the best compute path available at the kernel's ISA level (an upper bound: at the "
            "amx level that is AMX-BF16 even for float32 activations). 'LLC-cold': one run streamed more than "
            "twice the last-level cache ('-': the op reads only activations, which stay in cache); otherwise "
            "part of the data may have come from cache and > 100% is possible.", ""]
    out += kernels_md(results, "decode")
    out += ["", "## Kernels: prefill", ""] + kernels_md(results, "prefill")
    kr = kernel_ratios_md(results)
    if kr:
        out += ["", "## Kernel speed-ups over the baselines", "",
                "Baseline time / dsv4-ort time at its fastest measured ISA level (> 1: dsv4-ort is faster).", ""]
        out += kr
    if results.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    if results.get("errors"):
        out += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    return "\n".join(out) + "\n"


__all__ = ["validate", "ratios", "headline", "markdown", "BASELINE_LABELS", "e2e_md", "roofs_md", "conditions_md",
           "write_mode"]


def write_mode(out_dir, name: str, result: dict, text: str) -> None:
    """The figures of a single-case mode (``bench --formats`` etc.): DIR/<name>.json, every figure, and DIR/<name>.md,
    its tables."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(text)
