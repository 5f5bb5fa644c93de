"""The compute-bound paths side by side in both compute modes (export ``--compute fp32`` / ``bf16``), in one run on
one CPU: prefill of 128, 1024 and 8192 tokens, the time to first token of an 8k and a 16k prompt (one call, and in
2048-token chunks), batched decode of B = 1 .. 32 rows at different positions, and as baselines transformers' bf16
prefill of the same configuration and llama.cpp's prefill of the same model when it is installed (see
:mod:`.llamacpp`).

Each prefill figure comes with the fraction of the CPU's compute roof it reaches for its mode: the model's real
multiply-adds (2 x the parameters a token touches, routed experts at top-k, plus attention over the window and the
selected compressed entries: :func:`.e2e.attention_flops`) over the peak of the mode's best instruction path
measured here (fp32 FMA for fp32 products; VDPBF16PS or AMX-BF16 for bf16 products).

usage: dsv4-ort bench --prefill [--out DIR] [--threads N] [--smoke]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .timing import warm_page_cache

MODES = ("fp32", "bf16")
PREFILL = (128, 1024, 8192)
TTFT = (8192, 16384)
CHUNK = 2048
BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXT = 256
DECODE_STEPS = 9  # timed steps per batch size (median); with five one run showed fp32 B=4 at 39.5 tok/s, the run before 57.4
SMOKE = {"prefill": (16, 64), "ttft": (128,), "chunk": 32, "batches": (1, 2, 4), "max_seq_len": 256,
         "decode_context": 64}


def export(preset: str, compute: str, max_seq_len: int, log) -> Path:
    """The preset (seed 0, native weights) exported with one compute mode into the bench cache, once."""
    from .e2e import cached_export, ensure_export

    if compute == "fp32":
        return ensure_export(preset, max_seq_len, log)
    return cached_export(f"{preset}-native-{compute}-seed0-len{max_seq_len}", log, preset=preset, seed=0,
                         max_seq_len=max_seq_len, logits="last", compute=compute)


def positions_flops(model_dir: Path, positions) -> float:
    """Multiply-adds x 2 of the tokens at the given positions (bench cost model: every weight a token multiplies,
    the routed experts it picks, attention over the keys it sees)."""
    from dsv4_ort.runtime.session import read_metadata

    from .e2e import attention_flops, inventory, weight_costs

    meta = read_metadata(model_dir)
    positions = list(positions)
    wc = weight_costs(inventory(model_dir), meta["config"])
    return 2.0 * wc["params_per_token"] * len(positions) + attention_flops(meta["config"], positions)


def prefill_flops(model_dir: Path, tokens: int) -> float:
    """FLOPs of a prefill of ``tokens`` tokens from position 0."""
    return positions_flops(model_dir, range(tokens))


def decode_flops(model_dir: Path, context: int) -> float:
    """FLOPs of one decoded token at position ``context``."""
    return positions_flops(model_dir, [context])


def _prefill_seconds(sess, tokens: int, chunk: int | None, repeats: int, rng) -> list:
    ids = rng.integers(0, sess.vocab_size, (1, tokens))
    out = []
    for _ in range(repeats):
        state = sess.new_state(1)
        t0 = time.perf_counter()
        sess.forward(ids, state, chunk_size=chunk or tokens)
        out.append(time.perf_counter() - t0)
    return out


def batched_decode(sess, batches, context: int, steps: int, rng, *, token_flops: float | None = None,
                   roof_gflops: float | None = None) -> list:
    """tokens/s over all rows of B-row decode steps, rows at positions context .. context - B + 1 (synthetic state).
    With ``token_flops`` (one token's FLOPs) and the mode's compute roof, each row also gets the fraction of that
    roof it reaches: every decoded token costs the same FLOPs whatever the batch, so the roof caps tokens/s at
    roof / token_flops for every B (the ceiling no batch size can pass)."""
    from .e2e import fill_state

    rows = []
    for B in batches:
        state = sess.new_state(B)
        fill_state([buf for _, _, buf, _ in state.tensors], rng)
        state.positions[:] = context - np.arange(B)
        ids = rng.integers(0, sess.vocab_size, (B, 1))
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            logits = sess.forward(ids, state)
            if i:
                times.append(time.perf_counter() - t0)
            ids = logits[:, -1].argmax(-1).reshape(B, 1)
        step = statistics.median(times)
        row = {"batch": B, "step_s": step, "tokens_per_s": B / step}
        if token_flops and roof_gflops:
            row["roof_fraction"] = B / step * token_flops / (roof_gflops * 1e9)
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_batch1"] = r["tokens_per_s"] / base
    return rows


def hf_bf16_prefill(preset: str, tokens, threads: int, log, max_s: float = 150.0) -> list:
    """transformers' DeepseekV4ForCausalLM (eager, bfloat16, random weights of the same config): prefill tokens/s.
    A size whose projection from the previous one exceeds ``max_s`` is skipped."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    from dsv4_ort.models import DeepseekV4Config

    from .e2e import _fill_params, _fill_routing_tables

    config = DeepseekV4Config.from_preset(preset)
    torch.set_num_threads(threads)
    hc = transformers.DeepseekV4Config(**config.to_hf_dict())
    hc._attn_implementation = "eager"
    with no_init_weights():
        hf = transformers.DeepseekV4ForCausalLM(hc)
    _fill_params(hf.named_parameters())
    _fill_routing_tables(hf, config.n_routed_experts)
    hf = hf.to(torch.bfloat16).eval()
    rng = np.random.default_rng(2)
    out, last = [], None
    for S in tokens:
        if last is not None and last[1] * S / last[0] > max_s:
            out.append({"tokens": S, "skipped": f"projected {last[1] * S / last[0]:.0f} s"})
            continue
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (1, S)))
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf(ids, use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t0
        last = (S, dt)
        out.append({"tokens": S, "seconds": dt, "tokens_per_s": S / dt})
        log(f"    transformers bf16 prefill {S:>5}: {S / dt:8.1f} tokens/s")
    del hf
    return out


def llama_prefill(preset: str, tokens, threads: int, log) -> dict:
    """llama.cpp's prefill tokens/s of the preset's q8_0 and Q4_K_M conversions ({} when llama.cpp is not here)."""
    from dsv4_ort.runtime.cli import cache_dir

    from . import llamacpp

    if llamacpp.available() is not None:
        log(f"    llama.cpp: {llamacpp.available()}")
        return {}
    root = cache_dir() / "bench"
    ck = root / f"{preset}-checkpoint-seed0"
    if not (ck / "config.json").is_file():
        from dsv4_ort.models import DeepseekV4Config, write_random_checkpoint

        write_random_checkpoint(ck, DeepseekV4Config.from_preset(preset), seed=0, weights="native")
    ggufs = {"q8_0": llamacpp.convert(ck, root / f"{preset}-seed0-q8_0.gguf", "q8_0", log=log)}
    if llamacpp.llama_quantize():
        ggufs["Q4_K_M"] = llamacpp.quantize(ggufs["q8_0"], root / f"{preset}-seed0-Q4_K_M.gguf", threads=threads,
                                            log=log)
    out = {}
    for name, path in ggufs.items():
        for S in tokens:
            r = llamacpp.run_bench(path, threads=threads, prompt=S, gen=0, repetitions=2)
            out.setdefault(name, {})[str(S)] = r.get("prefill_tokens_per_s")
            log(f"    llama.cpp {name} prefill {S:>5}: {out[name][str(S)]:8.1f} tokens/s")
    return out


def run(preset: str = "bench", *, threads: int = 2, smoke: bool = False, baselines: bool = True, log=None) -> dict:
    from dsv4_ort.runtime import Session

    from .machine import compute_roof, peak_compute
    from .speculative import cpu_name

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    prefill, ttft = (SMOKE["prefill"], SMOKE["ttft"]) if smoke else (PREFILL, TTFT)
    chunk, batches = (SMOKE["chunk"], SMOKE["batches"]) if smoke else (CHUNK, BATCHES)
    max_seq_len = SMOKE["max_seq_len"] if smoke else max(ttft) + 128
    peaks = peak_compute(threads, 0.2 if smoke else 1.0, 3)
    level = "amx" if any(p.startswith("amx") for p in peaks) else "avx512" if "fp32_fma_zmm" in peaks else "avx2"
    roofs = {"fp32": max((peaks[p]["best"] for p in ("fp32_fma_zmm", "fp32_fma_ymm", "fp32_sse_muladd")
                          if p in peaks), default=None),
             "bf16": compute_roof(peaks, level, "bfloat16")[1]}
    rng = np.random.default_rng(0)
    context = SMOKE["decode_context"] if smoke else DECODE_CONTEXT
    result = {"preset": preset, "threads": threads, "cpu": cpu_name(), "chunk": chunk, "decode_context": context,
              "roofs_gflops": roofs, "modes": {}}
    for mode in MODES:
        model_dir = export(preset, mode, max_seq_len, log)
        warm_page_cache(model_dir)
        sess = Session(model_dir, intra_op_threads=threads)
        sess.forward(rng.integers(0, sess.vocab_size, (1, 8)), sess.new_state(1))  # warm-up
        log(f"prefill: compute {mode} ({sess.isa})")
        m = {"prefill": [], "ttft": [], "decode": []}
        for S in prefill:
            t = min(_prefill_seconds(sess, S, None, 2 if S <= 1024 else 1, rng))
            flops = prefill_flops(model_dir, S)
            m["prefill"].append({"tokens": S, "seconds": t, "tokens_per_s": S / t, "gflops": flops / 1e9,
                                 "roof_fraction": flops / t / 1e9 / roofs[mode] if roofs[mode] else None})
            log(f"    prefill {S:>5}: {S / t:8.1f} tokens/s")
        for S in ttft:
            # one call: the prefill figure above when it measured this size
            one = next((p["seconds"] for p in m["prefill"] if p["tokens"] == S), None) or \
                min(_prefill_seconds(sess, S, None, 1, rng))
            chunked = min(_prefill_seconds(sess, S, chunk, 1, rng))
            m["ttft"].append({"tokens": S, "one_call_s": one, "chunked_s": chunked, "chunked_vs_one": chunked / one})
            log(f"    TTFT {S:>5}: one call {one:.2f} s, chunks of {chunk} {chunked:.2f} s")
        token_flops = decode_flops(model_dir, context)
        m["decode"] = batched_decode(sess, batches, context, 3 if smoke else DECODE_STEPS, rng,
                                     token_flops=token_flops, roof_gflops=roofs[mode])
        m["decode_token_gflops"] = token_flops / 1e9
        if roofs[mode]:
            # tokens/s no batch size can pass on this roof, and that as a multiple of the measured batch-1 speed
            m["decode_ceiling_tokens_per_s"] = roofs[mode] * 1e9 / token_flops
            m["decode_ceiling_vs_batch1"] = m["decode_ceiling_tokens_per_s"] / m["decode"][0]["tokens_per_s"]
        log("    batched decode tokens/s: " + ", ".join(f"B={r['batch']} {r['tokens_per_s']:.1f}" for r in m["decode"]))
        result["modes"][mode] = m
        del sess
    if baselines and not smoke:
        try:
            result["hf_bf16"] = hf_bf16_prefill(preset, PREFILL[:2], threads, log)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            result["hf_bf16"] = {"skipped": f"{type(e).__name__}: {e}"}
        try:
            result["llama_cpp"] = llama_prefill(preset, PREFILL[:2], threads, log)
        except Exception as e:  # noqa: BLE001
            result["llama_cpp"] = {"skipped": f"{type(e).__name__}: {e}"}
    return result


def suite(*, smoke: bool = False, threads: int | None = None, log=None) -> dict:
    """``dsv4-ort bench --prefill``: the bench preset (tiny with ``smoke``)."""
    from dsv4_ort.runtime.session import physical_cores

    return run("tiny" if smoke else "bench", threads=int(threads or physical_cores()), smoke=smoke, log=log)


def suite_markdown(r: dict) -> str:
    modes = [m for m in MODES if m in r["modes"]]
    roofs = r["roofs_gflops"]
    lines = [f"Compute-bound paths, {r['preset']} preset, {r['threads']} threads ({r['cpu']}); roofs: fp32 "
             f"{roofs['fp32'] or 0:.0f} GFLOP/s, bf16 {roofs['bf16'] or 0:.0f} GFLOP/s", "",
             "| prefill tokens | " + " | ".join(f"{m} tok/s (of its roof)" for m in modes) + " | transformers bf16 |"
             " llama.cpp q8_0 / Q4_K_M |", "|---:|" + "---:|" * (len(modes) + 2)]
    hf = {x["tokens"]: x for x in r.get("hf_bf16", []) if isinstance(x, dict)} if isinstance(r.get("hf_bf16"), list) \
        else {}
    ll = r.get("llama_cpp") if isinstance(r.get("llama_cpp"), dict) and "skipped" not in r.get("llama_cpp", {}) else {}
    for i, p in enumerate(r["modes"][modes[0]]["prefill"]):
        S = p["tokens"]
        cells = []
        for m in modes:
            q = r["modes"][m]["prefill"][i]
            frac = f" ({q['roof_fraction']:.2f})" if q.get("roof_fraction") else ""
            cells.append(f"{q['tokens_per_s']:.1f}{frac}")
        h = hf.get(S, {})
        hcell = f"{h['tokens_per_s']:.1f}" if "tokens_per_s" in h else "-"
        lcell = " / ".join(f"{ll[q][str(S)]:.1f}" if ll.get(q, {}).get(str(S)) else "-" for q in ("q8_0", "Q4_K_M")) \
            if ll else "-"
        lines.append(f"| {S} | " + " | ".join(cells) + f" | {hcell} | {lcell} |")
    lines += ["", f"| prompt | " + " | ".join(f"{m} TTFT one call / chunks of {r['chunk']} (s)" for m in modes) + " |",
              "|---:|" + "---:|" * len(modes)]
    for i, t in enumerate(r["modes"][modes[0]]["ttft"]):
        lines.append(f"| {t['tokens']} | " + " | ".join(
            f"{r['modes'][m]['ttft'][i]['one_call_s']:.2f} / {r['modes'][m]['ttft'][i]['chunked_s']:.2f}"
            for m in modes) + " |")
    lines += ["", f"| decode rows (context {r['decode_context']}) | " +
              " | ".join(f"{m} tok/s (x batch 1, of its roof)" for m in modes) + " |", "|---:|" + "---:|" * len(modes)]

    def cell(d: dict) -> str:
        frac = f", {d['roof_fraction']:.2f}" if d.get("roof_fraction") else ""
        return f"{d['tokens_per_s']:.1f} ({d['vs_batch1']:.2f}x{frac})"

    for i, d in enumerate(r["modes"][modes[0]]["decode"]):
        lines.append(f"| {d['batch']} | " + " | ".join(cell(r["modes"][m]["decode"][i]) for m in modes) + " |")
    ceil = [(m, r["modes"][m]) for m in modes if r["modes"][m].get("decode_ceiling_tokens_per_s")]
    if ceil:
        lines += ["", "Compute ceiling of batched decode (the roof / one token's "
                  f"{ceil[0][1]['decode_token_gflops']:.2f} GFLOP; no batch size passes it): " + ", ".join(
                      f"{m} {c['decode_ceiling_tokens_per_s']:.0f} tok/s = {c['decode_ceiling_vs_batch1']:.1f}x batch 1"
                      for m, c in ceil) + "."]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir) -> None:
    from .report import write_mode

    write_mode(out_dir, "prefill", result, suite_markdown(result))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dsv4_ort.bench.prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    res = suite(smoke=a.smoke, threads=a.threads)
    write(res, a.out)
    print(suite_markdown(res))
