"""Pipeline stages: what crosses a boundary, what a Ray hop costs, batched decode with micro-batches, and a sizing
of Flash and Pro over N nodes computed from those measurements.

Model: the ``--preset`` (default ``bench``) with random native weights (seed 0), exported once into the bench cache
both as a single graph and as ``--stages 2`` (:mod:`dsv4_ort.export.stages`), and reused by later runs. Ray runs
on this machine alone, on loopback (:func:`dsv4_ort.runtime.pipeline.start_local_ray`): the hop measured is
Ray's object passing between processes of one machine, not a network.

Measured (median decode step after a 16-token prompt, last-position logits, no batch invariance):

* bytes per token across each boundary: the hyper-connection streams ``hc_mult x hidden`` float32 (from the
  export's dsv4_ort.json, which the runtime sends as they are);
* the Ray hop: a batch-1 decode step of the 2 stages as Ray actors minus the same 2 stages in this process (1
  thread each, the stages running one after the other either way); per hop = that difference over the 3
  transfers of a step (driver -> stage 0 -> stage 1 -> driver);
* batched decode tokens/s (``--batch`` rows): 1 stage (the single graph) at ``--threads`` threads and at 1
  thread, 2 Ray stages at 1 thread each with 1 micro-batch and with 2. On a 2-core machine 2 stages x 1 thread
  use the same cores as 1 stage x 2 threads: the comparison is of the same hardware split two ways.

Sizing (``--sizing``, also printed after a measurement): Flash and Pro cut into N = 2, 4, 8 stages of consecutive
layers (the exporter's even split), with the weights each stage holds (native formats: FP8 linears, FP4 experts,
their scales), the bytes per token across each boundary, and the expected batch-1 decode tokens/s: every layer's
step time is the bytes it reads per token (dense weights, 6 routed experts, the embedding row or the head) over the
effective read bandwidth measured here on the preset (its decode step's bytes over its step time, one stage at
``--threads`` threads), plus per hop the stated network latency, the bytes over the stated bandwidth and the Ray
overhead measured here; N hops per token (N - 1 boundaries carry the streams, the last returns the logits to the
driver on stage 0's node). The KV / compressor state each stage also holds grows with rows x context and is not
in the weights column.

usage: python -m dsv4_ort.bench.pipeline [--preset bench] [--threads 2] [--batch 8] [--steps 8] [--rounds 3]
                                          [--out FILE]
       python -m dsv4_ort.bench.pipeline --sizing [--bandwidth-gbps 25] [--latency-us 50] [--from FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .formats import batch_speed, export_option
from .speculative import cpu_name

SIZING_NODES = (2, 4, 8)
SIZING_PRESETS = ("flash", "pro")
PROMPT = 16  # tokens before the measured decode steps (what formats.batch_speed prefills)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def staged_export(preset: str, stages, max_seq_len: int, log=_log) -> Path:
    """The preset (native weights, seed 0) exported with ``stages`` into the bench cache (once); returns the model
    directory. The single-graph counterpart is :func:`.formats.export_option`."""
    from dsv4_ort.runtime.pipeline import read_pipeline_metadata

    from .e2e import cached_export

    tag = str(stages).replace(":", "_").replace(",", "-")
    return cached_export(f"{preset}-native-stages{tag}-seed0-len{max_seq_len}", log, check=read_pipeline_metadata,
                         preset=preset, seed=0, max_seq_len=max_seq_len, logits="last", stages=stages)


def step_seconds(sess, batch: int, steps: int) -> float:
    """Median seconds of one decode step of ``batch`` rows."""
    return batch / batch_speed(sess, batch, steps)


def read_bandwidth(model_dir: Path, step_s: float) -> dict:
    """Effective read bandwidth of a batch-1 decode step: the bytes it reads (bench cost model, context
    ``PROMPT``) over its measured time."""
    from dsv4_ort.runtime.session import read_metadata

    from .e2e import decode_bytes, inventory, weight_costs

    meta = read_metadata(model_dir)
    wc = weight_costs(inventory(model_dir), meta["config"])
    b = decode_bytes(meta, wc, PROMPT, 1, None)["total"]
    return {"step_bytes": b, "step_s": step_s, "bytes_per_s": b / step_s}


def measure(preset: str = "bench", *, threads: int = 2, batch: int = 8, steps: int = 8, rounds: int = 3,
            log=_log) -> dict:
    """The figures of the module docstring. Every setup is open at once and they are measured in turns, ``rounds``
    times (medians over the rounds), so load from other work on the machine spreads over all of them."""
    import statistics

    from dsv4_ort.runtime import Session
    from dsv4_ort.runtime.pipeline import PipelineSession, start_local_ray

    cap = 256
    one_dir = export_option(preset, "native", "native", cap, log)
    two_dir = staged_export(preset, 2, cap, log)
    meta = json.loads((two_dir / "dsv4_ort.json").read_text())
    boundary = meta["pipeline"]["boundary"]
    out = {"preset": preset, "cpu": cpu_name(), "threads": threads, "batch": batch, "steps": steps,
           "rounds": rounds, "layers": meta["config"]["num_hidden_layers"],
           "stages": [s["layers"] for s in meta["pipeline"]["stages"]],
           "boundary_bytes_per_token": boundary["bytes_per_token"],
           "boundary_shape": boundary["shape"], "rows": [], "load_before": os.getloadavg()[0]}
    ray = start_local_ray(2)
    opened = []
    try:
        setups = []  # (name, session, micro-batches to set or None, row fields)
        for t in sorted({threads, 1}, reverse=True):
            opened.append(Session(one_dir, intra_op_threads=t))
            setups.append((f"1 stage, {t} thread{'s' if t > 1 else ''} (single graph)", opened[-1], None,
                           {"stages": 1, "threads": t}))
        opened.append(PipelineSession(two_dir, backend="local", intra_op_threads=1))
        setups.append(("2 stages in this process, 1 thread each (one after the other)", opened[-1], None,
                       {"stages": 2, "threads": 1, "backend": "local"}))
        opened.append(PipelineSession(two_dir, backend="ray", intra_op_threads=1, num_cpus=1, timeout=600))
        for m in (1, 2):
            setups.append((f"2 Ray stages, 1 thread each, {m} micro-batch{'es' if m > 1 else ''}", opened[-1], m,
                           {"stages": 2, "threads": 1, "backend": "ray", "micro_batches": m}))
        times = {name: ([], []) for name, *_ in setups}
        for r in range(rounds):
            log(f"  round {r + 1} of {rounds}")
            for name, sess, m, _ in setups:
                if m is not None:
                    sess.micro_batches = m
                times[name][0].append(step_seconds(sess, 1, steps))
                times[name][1].append(step_seconds(sess, batch, steps))
        for name, _, _, extra in setups:
            step1, stepb = (statistics.median(v) for v in times[name])
            out["rows"].append({"setup": name, "step1_ms": 1e3 * step1, "stepB_ms": 1e3 * stepb,
                                "tok_s_1": 1 / step1, "tok_s_B": batch / stepb, **extra})
    finally:
        for sess in opened:
            getattr(sess, "close", lambda: None)()
        ray.shutdown()
    out["load_after"] = os.getloadavg()[0]
    by = {(r["stages"], r.get("backend"), r.get("micro_batches"), r["threads"]): r for r in out["rows"]}
    out["bandwidth"] = read_bandwidth(one_dir, by[(1, None, None, threads)]["step1_ms"] / 1e3)
    hop = by[(2, "ray", 1, 1)]["step1_ms"] - by[(2, "local", None, 1)]["step1_ms"]
    out["ray_step_overhead_ms"] = hop
    out["ray_hop_ms"] = hop / 3
    return out


# ---- sizing --------------------------------------------------------------------------------------------------------

def _stored_bytes(spec) -> int:
    """Bytes of one tensor of the release inventory in native storage, with its block scales."""
    from dsv4_ort.models import quant as Q
    from dsv4_ort.models.inventory import storage_kind

    n = math.prod(spec.shape)
    kind = storage_kind(spec, "native")
    if kind == "fp8":
        *lead, r, c = spec.shape
        return n + math.prod(lead) * math.ceil(r / Q.FP8_BLOCK) * math.ceil(c / Q.FP8_BLOCK)
    if kind == "fp4":
        return n // 2 + n // spec.shape[-1] * math.ceil(spec.shape[-1] / Q.FP4_BLOCK)
    return n * {"bf16": 2, "fp32": 4, "int64": 8}[kind]


def model_bytes(preset: str) -> dict:
    """Native weight bytes of a preset by place: per layer (all, and read per token at batch 1: everything but
    the routed experts, plus top-k of them), the embedding, the head (hc_head, norm, LM head); the MTP block is
    left out (a pipeline does not run it)."""
    from dsv4_ort.models.config import DeepseekV4Config
    from dsv4_ort.models.inventory import deepseek_tensor_specs

    c = DeepseekV4Config.from_preset(preset)
    L, E, k = c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok
    held, read = [0] * L, [0.0] * L
    embed = head = embed_row = 0
    for spec in deepseek_tensor_specs(c):
        b = _stored_bytes(spec)
        if spec.name.startswith("mtp."):
            continue
        if spec.name.startswith("layers."):
            layer = int(spec.name.split(".")[1])
            held[layer] += b
            if ".ffn.experts." in spec.name:
                read[layer] += b * k / E  # one tensor per expert: top-k of the E are read
            elif spec.name.endswith("tid2eid"):
                read[layer] += b / spec.shape[0]  # one vocabulary row
            else:
                read[layer] += b
        elif spec.name == "embed.weight":
            embed, embed_row = b, b // spec.shape[0]
        else:
            head += b
    return {"preset": preset, "layers": L, "hidden": c.hidden_size, "hc_mult": c.hc_mult, "vocab": c.vocab_size,
            "layer_bytes": held, "layer_read": read, "embed": embed, "embed_row": embed_row, "head": head}


def sizing(measured: dict | None, *, presets=SIZING_PRESETS, nodes=SIZING_NODES, bandwidth_gbps: float = 25.0,
           latency_us: float = 50.0, node_bytes_per_s: float | None = None, ray_hop_ms: float | None = None) -> dict:
    """Per preset and node count: weights per stage (largest stage, first, last), bytes per token across a
    boundary and the expected batch-1 decode tokens/s (see the module docstring for the model)."""
    from dsv4_ort.export.stages import even_ranges

    bw = node_bytes_per_s or (measured["bandwidth"]["bytes_per_s"] if measured else None)
    if ray_hop_ms is None:
        ray_hop_ms = measured["ray_hop_ms"] if measured else 0.0
    ray_hop_s = max(0.0, ray_hop_ms / 1e3)
    net_bytes_per_s = bandwidth_gbps * 1e9 / 8
    out = {"bandwidth_gbps": bandwidth_gbps, "latency_us": latency_us, "node_read_bytes_per_s": bw,
           "ray_hop_s": ray_hop_s, "rows": []}
    for preset in presets:
        mb = model_bytes(preset)
        boundary = mb["hc_mult"] * mb["hidden"] * 4
        logits = mb["vocab"] * 4
        compute_s = (sum(mb["layer_read"]) + mb["embed_row"] + mb["head"]) / bw if bw else None
        for n in nodes:
            ranges = even_ranges(mb["layers"], n)
            held = [sum(mb["layer_bytes"][a:b]) for a, b in ranges]
            held[0] += mb["embed"]
            held[-1] += mb["head"]
            net_s = (n - 1) * (latency_us * 1e-6 + boundary / net_bytes_per_s) \
                + latency_us * 1e-6 + logits / net_bytes_per_s + n * ray_hop_s
            r = {"preset": preset, "nodes": n, "layers_per_stage": [b - a for a, b in ranges],
                 "stage_bytes_max": max(held), "stage_bytes_first": held[0], "stage_bytes_last": held[-1],
                 "boundary_bytes_per_token": boundary, "logits_bytes_per_token": logits,
                 "net_s_per_token": net_s, "compute_s_per_token": compute_s,
                 "layer_read_bytes": sum(mb["layer_read"]) / mb["layers"],
                 "layer_s": sum(mb["layer_read"]) / mb["layers"] / bw if bw else None}
            if compute_s is not None:
                r["decode_tok_s"] = 1 / (compute_s + net_s)
                r["decode_tok_s_no_network"] = 1 / compute_s
            out["rows"].append(r)
    return out


# ---- output --------------------------------------------------------------------------------------------------------

def markdown(m: dict) -> str:
    kib = m["boundary_bytes_per_token"] / 1024
    head = (f"Pipeline stages on the {m['preset']} preset ({m['layers']} layers, stages {m['stages']}); CPU: "
            f"{m['cpu']}; decode after a {PROMPT}-token prompt, median step of {m['steps']}, median of "
            f"{m['rounds']} rounds over all setups in turn; batch {m['batch']} for the throughput columns")
    crossing = (f"Bytes per token across each boundary: {m['boundary_bytes_per_token']} ({kib:.0f} KiB; float32 "
                f"{m['boundary_shape']}); a batch-{m['batch']} decode step sends {m['batch'] * kib:.0f} KiB.")
    lines = [head, "", crossing, "",
             f"| setup | batch-1 step (ms) | batch-1 tok/s | batch-{m['batch']} step (ms) | batch-{m['batch']} tok/s |",
             "|---|---|---|---|---|"]
    for r in m["rows"]:
        lines.append(f"| {r['setup']} | {r['step1_ms']:.1f} | {r['tok_s_1']:.1f} | {r['stepB_ms']:.1f} | "
                     f"{r['tok_s_B']:.1f} |")
    lines += ["", (f"Ray hop (loopback, one machine): a batch-1 step costs {m['ray_step_overhead_ms']:.2f} ms more "
                   f"with the stages as Ray actors than in this process, {m['ray_hop_ms']:.2f} ms per transfer (3 "
                   "per step)."),
              (f"1-minute load average {m['load_before']:.2f} before, {m['load_after']:.2f} after (other work on "
               "the machine slows the runs it overlaps).")]
    if "bandwidth" in m:
        b = m["bandwidth"]
        lines.append(f"Effective read bandwidth of a batch-1 decode step at {m['threads']} threads: "
                     f"{b['step_bytes'] / 1e6:.0f} MB in {1e3 * b['step_s']:.1f} ms = {b['bytes_per_s'] / 1e9:.2f} "
                     "GB/s.")
    return "\n".join(lines) + "\n"


def sizing_markdown(s: dict) -> str:
    gib = 1 << 30
    bw = s["node_read_bytes_per_s"]
    head = (f"Sizing (native weights: FP8 linears, FP4 experts; network {s['bandwidth_gbps']:g} Gb/s, "
            f"{s['latency_us']:g} us per hop, Ray overhead {1e3 * s['ray_hop_s']:.2f} ms per hop; per-node read "
            + (f"bandwidth {bw / 1e9:.2f} GB/s" if bw else "bandwidth not measured") + ")")
    columns = ("| model | nodes | layers per stage | weights per stage, max (GiB) | first / last stage (GiB) | "
               "boundary bytes per token | read per layer per token (MB) | layer step (ms) | network + Ray per token "
               "(ms) | batch-1 decode tok/s (no network) |")
    lines = [head, "", columns, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        lps = sorted(set(r["layers_per_stage"]), reverse=True)
        tok = (f"{r['decode_tok_s']:.2f} ({r['decode_tok_s_no_network']:.2f})" if "decode_tok_s" in r else "-")
        lines.append(f"| {r['preset']} | {r['nodes']} | {'-'.join(map(str, lps))} | "
                     f"{r['stage_bytes_max'] / gib:.1f} | {r['stage_bytes_first'] / gib:.1f} / "
                     f"{r['stage_bytes_last'] / gib:.1f} | {r['boundary_bytes_per_token']} "
                     f"({r['boundary_bytes_per_token'] // 1024} KiB) | {r['layer_read_bytes'] / 1e6:.0f} | "
                     + (f"{1e3 * r['layer_s']:.1f}" if r["layer_s"] else "-")
                     + f" | {1e3 * r['net_s_per_token']:.2f} | {tok} |")
    return "\n".join(lines) + "\n"


def suite(*, smoke: bool = False, threads: int | None = None, log=_log) -> dict:
    """``dsv4-ort bench --pipeline``: :func:`measure` on the bench preset (the tiny one, 1 round, with ``smoke``) and
    the sizing table from its figures."""
    m = measure("tiny" if smoke else "bench", threads=threads or 2, steps=2 if smoke else 8, rounds=1 if smoke else 3,
                log=log)
    return {"measured": m, "sizing": sizing(m)}


def suite_markdown(r: dict) -> str:
    return f"{markdown(r['measured'])}\n\n{sizing_markdown(r['sizing'])}\n"


def write(result: dict, out_dir) -> None:
    from .report import write_mode

    write_mode(out_dir, "pipeline", result, suite_markdown(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_ort.bench.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--threads", type=int, default=2, help="threads of the 1-stage run (2 stages: 1 thread each)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3, help="turns over all setups (medians over them)")
    p.add_argument("--sizing", action="store_true", help="only the sizing table (from --from, else no timing)")
    p.add_argument("--from", dest="source", default=None, help="a JSON written by --out: its measured figures")
    p.add_argument("--bandwidth-gbps", type=float, default=25.0)
    p.add_argument("--latency-us", type=float, default=50.0)
    p.add_argument("--node-gbps-read", type=float, default=None,
                   help="per-node memory read bandwidth in GB/s for the sizing (default: the measured one)")
    p.add_argument("--ray-hop-ms", type=float, default=None,
                   help="Ray overhead per hop for the sizing (default: the measured one)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.sizing:
        m = json.loads(Path(args.source).read_text())["measured"] if args.source else None
    else:
        t0 = time.perf_counter()
        m = measure(args.preset, threads=args.threads, batch=args.batch, steps=args.steps, rounds=args.rounds)
        m["seconds"] = round(time.perf_counter() - t0, 1)
        print(markdown(m))
    s = sizing(m, bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us,
               node_bytes_per_s=args.node_gbps_read * 1e9 if args.node_gbps_read else None,
               ray_hop_ms=args.ray_hop_ms)
    print(sizing_markdown(s))
    if args.out:
        Path(args.out).write_text(json.dumps({"measured": m, "sizing": s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
