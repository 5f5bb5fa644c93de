"""MTP speculative decoding: step costs, measured acceptance and tokens/s, and the speed-up they project.

For an export with its MTP block (``dsv4-ort export --mtp``), at a context of ``--context`` tokens, batch 1:

* ``decode``: a plain decode step (one token, last-position logits);
* ``verify[k]``: one main forward of k + 1 tokens with k + 1 logits and the streams (what a speculative cycle
  runs), and its ratio to ``decode``;
* ``draft[k]``: the MTP block's catch-up (k + 1 positions, the most a cycle needs) plus k - 1 one-token drafts;
* ``rollback``: snapshot + restore of the state rows of a k + 1-token step (runtime/speculative.py).

Then a greedy generation of ``--tokens`` tokens plain and with ``speculative="mtp"`` for each k (same tokens: the
session runs with batch invariance), giving the measured acceptance (accepted / drafted) and tokens/s, and the
speed-up projected at acceptance 0.6 / 0.8 / 0.9 from the measured costs: a cycle emits ``(1 - a^(k+1)) / (1 - a)``
tokens on average (each draft accepted with probability a, independently) for ``verify[k] + draft[k] +
rollback`` seconds. Beside it, the same projection from bytes alone (:func:`byte_costs`: every step at the
bandwidth roofline), the most any machine bound by memory bandwidth can get from this model's MTP block.

usage: python -m dsv4_ort.bench.speculative MODEL_DIR [--threads N] [--context N] [--tokens N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .timing import alternating_rounds, warm_page_cache

PROJECTED_ACCEPTANCE = (0.6, 0.8, 0.9)


def _interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each function, timed side by side (:func:`.timing.alternating_rounds`): the ratios of
    these costs (a verify step to a plain step) must compare like with like."""
    def timed(fn):
        def run():
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    times = alternating_rounds({name: timed(fn) for name, fn in fns.items()}, repeats)
    return {name: statistics.median(t) for name, t in times.items()}


def step_costs(sess, context: int, repeats: int = 7, drafts=(1, 2, 3)) -> dict:
    """Median seconds of the steps of a speculative cycle at ``context`` tokens (state rolled back after each), all
    timed interleaved (:func:`_interleaved_medians`)."""
    from dsv4_ort.runtime.speculative import Rollback

    spec = sess.speculator()
    rng = np.random.default_rng(0)
    state = sess.new_state(1)
    sess.forward(rng.integers(0, sess.vocab_size, (1, context)), state, chunk_size=256)
    rb = Rollback(state, spec.main_ratios)
    pos = state.positions.copy()

    def plain():
        snap = rb.snapshot(pos, 1)
        sess.forward(rng.integers(0, sess.vocab_size, (1, 1)), state)
        rb.restore(snap, np.zeros(1, np.int64))
        state.positions[:] = pos

    fns = {"decode_s": plain}
    mstate = spec.new_mtp_state(1)
    mstate.positions[:] = pos
    mrb = Rollback(mstate, spec.mtp_ratios)
    hc, d = spec.hc, spec.d
    for k in drafts:
        ids = rng.integers(0, sess.vocab_size, (1, k + 1))

        def verify(k=k, ids=ids):
            snap = rb.snapshot(pos, k + 1)
            spec.main_step(state, ids, k + 1)
            rb.restore(snap, np.zeros(1, np.int64))

        def draft(k=k, ids=ids):
            snap = mrb.snapshot(pos, 2 * k)
            _, h = spec.mtp_step(mstate, np.zeros((1, k + 1, hc, d), np.float32), ids, 1)
            for j in range(k - 1):
                mstate.positions[:] = pos + k + 1 + j
                _, h = spec.mtp_step(mstate, h[:, -1:], ids[:, :1], 1)
            mstate.positions[:] = pos
            mrb.restore(snap, np.zeros(1, np.int64))

        def rollback(k=k):
            rb.restore(rb.snapshot(pos, k + 1), np.ones(1, np.int64))

        fns[f"verify_{k}_s"], fns[f"draft_{k}_s"], fns[f"rollback_{k}_s"] = verify, draft, rollback
    out = {"context": context, **_interleaved_medians(fns, repeats)}
    for k in drafts:
        out[f"verify_{k}_ratio"] = out[f"verify_{k}_s"] / out["decode_s"]
    return out


def projected_speedup(costs: dict, k: int, acceptance: float) -> float:
    """Plain step time per token / speculative time per token at per-draft acceptance ``acceptance``."""
    a = acceptance
    per_cycle = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    cycle = costs[f"verify_{k}_s"] + costs[f"draft_{k}_s"] + costs[f"rollback_{k}_s"]
    return per_cycle * costs["decode_s"] / cycle


def byte_costs(model_dir, context: int, drafts=(1, 2, 3)) -> dict:
    """Bytes that a plain decode step, a verify of k + 1 tokens and one MTP draft step read, from the export's own
    tensors (the bench cost model, :mod:`.e2e`; routing estimated uniform: a verify's tokens each pick their own
    experts). A draft step reads its graph's weights but one embedding row and top_k of its routed experts; the MTP
    block's own small state is left out."""
    from .e2e import decode_bytes, inventory, weight_costs

    meta = json.loads((Path(model_dir) / "dsv4_ort.json").read_text())
    wc = weight_costs(inventory(model_dir), meta["config"])
    one = decode_bytes(meta, wc, context=context, batch=1, unique_experts=None)
    out = {"decode": one["total"]}
    for k in drafts:
        routed = decode_bytes(meta, wc, context=context, batch=k + 1, unique_experts=None)["routed_experts"]
        out[f"verify_{k}"] = one["total"] - one["routed_experts"] + routed + k * (wc["embed_row"] + wc["tid2eid_row"])
    mwc = weight_costs(inventory(model_dir, meta["mtp"]["graph"]), meta["config"])
    out["draft"] = (mwc["dense_bytes"] + mwc["top_k"] * sum(mwc["expert_bytes"].values()) + mwc["embed_row"] +
                    mwc["tid2eid_row"])
    return out


def bytes_bound(nbytes: dict, k: int, acceptance: float) -> float:
    """:func:`projected_speedup` with every step's time proportional to the bytes it reads (:func:`byte_costs`)."""
    costs = {"decode_s": nbytes["decode"], f"verify_{k}_s": nbytes[f"verify_{k}"], f"draft_{k}_s": k * nbytes["draft"],
             f"rollback_{k}_s": 0.0}
    return projected_speedup(costs, k, acceptance)


def generation(sess, tokens: int, prompt_len: int = 32, drafts=(1, 2, 3)) -> dict:
    """Greedy tokens/s plain and speculative (decode phase), acceptance, and whether the tokens agree."""
    prompt = np.random.default_rng(1).integers(0, sess.vocab_size, prompt_len).tolist()
    st = {}
    want = list(sess.stream(prompt, tokens, stats=st))
    out = {"tokens": tokens, "plain_tok_s": st["decode_tokens"] / st["decode_s"]}
    for k in drafts:
        st = {}
        got = list(sess.stream(prompt, tokens, speculative="mtp", num_draft=k, stats=st))
        out[f"mtp_{k}"] = {"tok_s": st["decode_tokens"] / st["decode_s"], "acceptance": st["accepted"] / st["drafted"],
                           "tokens_per_cycle": st["decode_tokens"] / st["cycles"], "identical": got == want,
                           "mtp_s": st["mtp_s"], "verify_s": st["verify_s"], "rollback_s": st["rollback_s"]}
        out[f"mtp_{k}"]["speedup"] = out[f"mtp_{k}"]["tok_s"] / out["plain_tok_s"]
    return out


def cpu_name() -> str:
    """The CPU as the README names it: model name, family and model number."""
    import re
    from pathlib import Path

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"

    def field(name):
        m = re.search(rf"^{name}\s*:\s*(.+)$", text, re.M)
        return m.group(1).strip() if m else "?"

    model = field("model")
    return f"{field('model name')}, family {field('cpu family')} model {hex(int(model)) if model.isdigit() else model}"


def run(model_dir, *, threads: int = 2, context: int = 512, tokens: int = 128, repeats: int = 7) -> dict:
    from dsv4_ort.runtime import Session

    warm_page_cache(model_dir)
    sess = Session(model_dir, intra_op_threads=threads, batch_invariant=8)
    costs = step_costs(sess, context, repeats)
    gen = generation(sess, tokens)
    proj = {k: {str(a): projected_speedup(costs, k, a) for a in PROJECTED_ACCEPTANCE} for k in (1, 2, 3)}
    nbytes = byte_costs(model_dir, context)
    bound = {k: {str(a): bytes_bound(nbytes, k, a) for a in PROJECTED_ACCEPTANCE} for k in (1, 2, 3)}
    return {"model": str(model_dir), "threads": threads, "cpu": cpu_name(), "costs": costs, "generation": gen,
            "projected_speedup": proj, "bytes": nbytes, "bytes_bound": bound}


def mtp_export(preset: str, max_seq_len: int, log, fitted: bool = False) -> Path:
    """The preset with its MTP block (FP4 draft head) in the bench cache, once; ``fitted``: MTP weights fitted to the
    main model (:func:`dsv4_ort.models.mtp_fit.cached_fit`; the tiny preset's fit), else the random ones."""
    from .e2e import cached_export

    kw = {}
    if fitted:
        from dsv4_ort.models.config import DeepseekV4Config
        from dsv4_ort.models.mtp_fit import cached_fit

        log(f"  fitting the {preset} preset's MTP block to its main model (once per machine)")
        kw["mtp_weights"] = cached_fit(DeepseekV4Config.from_preset(preset))[0]
    name = f"{preset}-mtp{'fitted' if fitted else 'random'}-seed0-len{max_seq_len}"
    return cached_export(name, log, preset=preset, seed=0, max_seq_len=max_seq_len, logits="last", mtp=True, **kw)


def suite(*, smoke: bool = False, threads: int | None = None, log=None) -> dict:
    """``dsv4-ort bench --speculative``: step costs, greedy generation with and without MTP and the projected
    speed-ups on the bench preset (its MTP block is random: acceptance ~0, the costs are what matter), and the
    acceptance and speed-up of the fitted MTP block on the tiny preset (the only preset with a fit). ``smoke``: the
    tiny preset for both, few tokens."""
    from dsv4_ort.runtime.session import physical_cores

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    threads = int(threads or physical_cores())
    tokens, context = (24, 64) if smoke else (64, 512)
    big = "tiny" if smoke else "bench"
    log(f"speculative: step costs and generation on the {big} preset")
    costs = run(mtp_export(big, 1024, log), threads=threads, context=context, tokens=tokens,
                repeats=3 if smoke else 7)
    log("speculative: acceptance of the fitted MTP block on the tiny preset")
    fitted = run(mtp_export("tiny", 1024, log, fitted=True), threads=threads, context=64,
                 tokens=tokens if smoke else 400, repeats=3)
    return {"preset": big, "threads": threads, "cpu": cpu_name(), "costs": costs, "fitted_tiny": fitted}


def suite_markdown(r: dict) -> str:
    f = r["fitted_tiny"]["generation"]
    acc = " / ".join(f"k={k}: {f[f'mtp_{k}']['acceptance']:.2f} ({f[f'mtp_{k}']['tokens_per_cycle']:.2f} tokens per "
                     f"cycle, {f[f'mtp_{k}']['speedup']:.2f}x, identical {f[f'mtp_{k}']['identical']})"
                     for k in (1, 2, 3))
    return (f"{markdown(r['costs'])}\n\nfitted MTP block, tiny preset, greedy {f['tokens']} tokens: acceptance {acc}\n")


def write(result: dict, out_dir) -> None:
    from .report import write_mode

    write_mode(out_dir, "speculative", result, suite_markdown(result))


def markdown(r: dict) -> str:
    c, g = r["costs"], r["generation"]
    lines = [f"MTP speculative decoding, {r['threads']} threads, context {c['context']} ({r['cpu']})", "",
             "| k | verify k+1 / decode | draft ms | rollback ms | measured acceptance | tok/s (plain "
             f"{g['plain_tok_s']:.2f}) | identical | projected x at 0.6 / 0.8 / 0.9 | bound from bytes at 0.6 / 0.8 / "
             "0.9 |", "|---|---|---|---|---|---|---|---|---|"]
    for k in (1, 2, 3):
        m, p, b = g[f"mtp_{k}"], r["projected_speedup"][k], r["bytes_bound"][k]
        lines.append(f"| {k} | {c[f'verify_{k}_ratio']:.3f} | {1e3 * c[f'draft_{k}_s']:.1f} | "
                     f"{1e3 * c[f'rollback_{k}_s']:.2f} | {m['acceptance']:.2f} | {m['tok_s']:.2f} "
                     f"({m['speedup']:.2f}x) | {m['identical']} | "
                     f"{' / '.join(f'{p[str(a)]:.2f}' for a in PROJECTED_ACCEPTANCE)} | "
                     f"{' / '.join(f'{b[str(a)]:.2f}' for a in PROJECTED_ACCEPTANCE)} |")
    nb = r["bytes"]
    verify_mb = " / ".join(f"{nb['verify_' + str(k)] / 1e6:.1f}" for k in (1, 2, 3))
    lines.append(f"\nplain decode step {1e3 * c['decode_s']:.1f} ms; bytes read: plain step {nb['decode'] / 1e6:.1f} MB, "
                 f"verify of 2 / 3 / 4 tokens {verify_mb} MB, one draft step {nb['draft'] / 1e6:.1f} MB (the bound: "
                 "every step at the bandwidth roofline)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_ort.bench.speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    r = run(args.model_dir, threads=args.threads, context=args.context, tokens=args.tokens, repeats=args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=2)
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
