"""End to end: prefill and decode speed of a whole exported model, the bytes a decode step must move, and the same
workload on the PyTorch reference and on transformers.

Model: the ``bench`` preset (real per-head geometry: 64 heads x 512, rope 64, indexer 64 x 128, window 128, CSA
and HCA layers, 32 FP4 experts of width 1024, FP8 linears, hidden 2048, 6 layers, the full 129280 vocabulary;
about 2 GB of native weights), exported once with random weights into the cache directory
(``DSV4_ORT_CACHE``/bench) with room for 16384 + 128 positions, and reused by later runs.

Contexts: a decode step at context C runs with C positions already in the state. The state is *synthetic*: the
positions are set to C and every state buffer (window ring, compressed entries, indexer keys, compressor rows) is
filled with random unit-scale values, which the ops read exactly like real ones (the work of a step depends only on
the positions and sizes). Prefills run for real from position 0. The PyTorch reference reaches its contexts the same
way; transformers' cache has no such layout, so it reaches a context by a real prefill (and only small ones).

Bytes per decoded token: the weights the step actually reads - every dense tensor once per step (shared by the
batch), the embedding rows of the batch's tokens, and of each layer's routed experts only those the step selected
(read from the routing indices, which the benchmark adds as extra graph outputs; nothing else in the graph changes)
- plus the state each row reads (window ring, selected CSA entries, all visible HCA entries and indexer keys,
compressor rows). Implied roofline tokens/s = batch x bandwidth / bytes per step.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from .machine import LoadMeter
from .timing import Timing, fmt_time, warm_page_cache

CONTEXT_HEADROOM = 128  # positions kept free after the largest context for the measured decode steps
# One export per preset serves every mode: capacity for the full suite's largest context.
DEFAULT_CAPACITY = {"bench": 16384 + CONTEXT_HEADROOM, "tiny": 256}


# ---------------------------------------------------------------------------------------------------- export


def model_capacity(contexts, preset: str | None = None) -> int:
    need = max(list(contexts) + [0]) + CONTEXT_HEADROOM
    return max(DEFAULT_CAPACITY.get(preset, 256), int(math.ceil(need / 128) * 128))


def cached_export(name: str, log, *, check=None, **export_kw) -> Path:
    """``export_model(None, DIR, **export_kw)`` into the bench cache once (DIR: ``<cache>/bench/<name>-v<version>-
    ops<op table version>-<digest of the op table>``, so a changed op contract, such as a new attribute the exporter
    sets, exports again); returns DIR. A directory that ``check`` (default: read_metadata) refuses, damaged or of an
    older format, is exported again."""
    import dsv4_ort
    from dsv4_ort.export import export_model, schema
    from dsv4_ort.runtime.cli import cache_dir
    from dsv4_ort.runtime.session import ModelError, read_metadata

    out = cache_dir() / "bench" / f"{name}-v{dsv4_ort.__version__}-ops{schema.TABLE_VERSION}-{schema.TABLE_DIGEST}"
    if out.is_dir():
        try:
            (check or read_metadata)(out)
            return out
        except ModelError:
            shutil.rmtree(out)
    log(f"  exporting {name} into {out} (once; later runs reuse it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    export_model(None, out, progress=False, **export_kw)
    log(f"  exported in {time.perf_counter() - t0:.0f} s")
    return out


def ensure_export(preset: str, max_seq_len: int, log) -> Path:
    """The preset exported with native weights into the cache (once); returns the model directory."""
    return cached_export(f"{preset}-native-seed0-len{max_seq_len}", log, preset=preset, seed=0,
                         max_seq_len=max_seq_len, logits="last")


def inventory(model_dir: Path, graph: str = "model.onnx") -> list:
    """[(name, dims, onnx type, bytes)] of every initializer of the exported graph (``graph``: another graph of the
    export, e.g. its MTP block)."""
    import onnx

    m = onnx.load(str(Path(model_dir) / graph), load_external_data=False)
    out = []
    for t in m.graph.initializer:
        length = next((int(e.value) for e in t.external_data if e.key == "length"), None)
        if length is None:
            length = len(t.raw_data) or int(np.prod(t.dims)) * 4
        out.append((t.name, list(t.dims), t.data_type, length))
    return out


def routed_model(model_dir: Path) -> tuple:
    """The exported graph with every routing op's ``indices`` output added as a graph output, written next to a link
    to the weights in a temporary directory. Returns (model path, [output names], temp dir)."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    names = []
    for node in m.graph.node:
        if node.op_type in ("MoeRouteTopK", "MoeRouteHash"):
            names.append(node.output[1])
            m.graph.output.append(helper.make_tensor_value_info(node.output[1], TensorProto.INT64, None))
    # onnxruntime resolves external data inside the model's directory: write next to the weights when the
    # directory is writable, else into a temporary directory holding a hard link to them.
    data = "model.onnx.data"
    if os.access(model_dir, os.W_OK):
        tmp = model_dir
    else:
        tmp = Path(tempfile.mkdtemp(prefix="dsv4-bench-"))
        os.link(model_dir / data, tmp / data)
    path = tmp / "model.routes.onnx"
    onnx.save(m, str(path))
    return path, names, tmp


# ---------------------------------------------------------------------------------------------------- cost model


def _layer_ratios(config: dict) -> list:
    return list(config["compress_ratios"][: config["num_hidden_layers"]])


def weight_costs(inv: list, config: dict) -> dict:
    """Bytes and multiply-add parameters per token from the initializer list."""
    E, k = config["n_routed_experts"], config["num_experts_per_tok"]
    dense_bytes = 0
    expert_bytes = {}  # layer -> bytes of one routed expert (all three matrices + scales)
    params_per_token = 0
    embed_row = 0
    tid2eid_row = 0
    total = 0
    for name, dims, dtype, nbytes in inv:
        total += nbytes
        if name == "embed.weight":
            embed_row = nbytes // dims[0]
            continue
        if name.endswith("tid2eid"):
            tid2eid_row = nbytes // dims[0]
            continue
        if ".ffn.experts." in name:
            layer = int(name.split(".")[1])
            expert_bytes[layer] = expert_bytes.get(layer, 0) + nbytes // dims[0]
            if name.endswith(".weight"):
                per = int(np.prod(dims[1:])) * (2 if dtype == 2 else 1)  # packed FP4: two codes per byte
                params_per_token += k * per
            continue
        dense_bytes += nbytes
        if len(dims) >= 2 and name.endswith((".weight", "_fn")) and dtype != 7 and not name.endswith(".scale"):
            params_per_token += int(np.prod(dims)) * (2 if dtype == 2 else 1)
    return {"dense_bytes": dense_bytes, "expert_bytes": expert_bytes, "embed_row": embed_row,
            "tid2eid_row": tid2eid_row, "params_per_token": params_per_token, "total_bytes": total,
            "experts": E, "top_k": k}


def state_read_per_row(meta: dict, context: int) -> int:
    """Bytes of state one row's decode step reads at a context."""
    cfg = meta["config"]
    ratios = _layer_ratios(cfg)
    topk = cfg["index_topk"]
    total = 0
    for t in meta["state"]["tensors"]:
        shape = [d for d in t["shape"] if not isinstance(d, str)]
        elem = 2 if t["dtype"] == "bfloat16" else 4
        row = int(np.prod(shape[1:])) * elem if len(shape) > 1 else elem
        r = ratios[t["layer"]]
        name = t["name"]
        if name == "window":
            total += min(context + 1, shape[0]) * row
        elif name == "entries":
            visible = (context + 1) // r
            total += (min(topk, visible) if r == 4 else visible) * row
        elif name == "index_keys":
            total += (context + 1) // 4 * row
        else:  # compressor rows
            total += int(np.prod(shape)) * elem
    return total


def decode_bytes(meta: dict, wc: dict, context: int, batch: int, unique_experts: dict | None) -> dict:
    """Bytes one decode step of ``batch`` rows reads; unique_experts: layer -> experts selected (None: estimate)."""
    E, k = wc["experts"], wc["top_k"]
    experts = 0
    touched = {}
    for layer, per in wc["expert_bytes"].items():
        u = unique_experts.get(layer) if unique_experts else None
        if u is None:  # uniform routing estimate
            u = E * (1 - (1 - k / E) ** batch)
        touched[layer] = u
        experts += u * per
    state = batch * state_read_per_row(meta, context)
    rows = batch * (wc["embed_row"] + wc["tid2eid_row"])
    total = wc["dense_bytes"] + experts + state + rows
    return {"dense_weights": wc["dense_bytes"], "routed_experts": experts, "embedding_rows": rows, "state": state,
            "total": total, "per_token": total / batch, "experts_touched": touched,
            "experts_source": "routing outputs" if unique_experts else "uniform estimate"}


def attention_flops(config: dict, positions) -> float:
    """Attention + indexer multiply-adds x2 for queries at the given positions (all layers)."""
    H, D, win = config["num_attention_heads"], config["head_dim"], config["sliding_window"]
    nI, cI, topk = config["index_n_heads"], config["index_head_dim"], config["index_topk"]
    p = np.asarray(list(positions), np.float64)
    total = 0.0
    for r in _layer_ratios(config):
        keys = np.minimum(win, p + 1)
        if r == 4:
            vis = np.floor((p + 1) / 4)
            keys = keys + np.minimum(topk, vis)
            total += float((2 * nI * cI * vis).sum())
        elif r > 0:
            keys = keys + np.floor((p + 1) / r)
        total += float((4 * H * D * keys).sum())
    return total


# ---------------------------------------------------------------------------------------------------- synthetic state


def _tile(rng, n: int) -> np.ndarray:
    base = rng.standard_normal(1 << 20).astype(np.float32)
    reps = -(-n // base.size)
    return np.tile(base, reps)[:n] if reps > 1 else base[:n]


def fill_state(buffers, rng) -> None:
    """Unit-scale random values in every float buffer (compressor score rows included: any finite value is valid)."""
    for buf in buffers:
        if buf.dtype == np.float32:
            buf.reshape(-1)[:] = _tile(rng, buf.size)
        elif buf.dtype == np.uint16:  # bfloat16 storage
            buf.reshape(-1)[:] = (_tile(rng, buf.size).view(np.uint32) >> 16).astype(np.uint16)


# ---------------------------------------------------------------------------------------------------- ours


class OursRunner:
    """An exported model in a runtime Session, with the routing indices of every step captured."""

    def __init__(self, model_dir: Path, *, threads: int, isa: str | None):
        import onnxruntime as ort

        import dsv4_ort
        from dsv4_ort.runtime import Session

        self.sess = Session(model_dir, intra_op_threads=threads, isa=isa)
        path, self.route_names, self.tmp = routed_model(model_dir)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        with dsv4_ort.isa_cap(isa):
            dsv4_ort.register(so)
            self.sess.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.routes = None

    def close(self):
        if self.tmp != self.sess.model_dir:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            try:
                (self.tmp / "model.routes.onnx").unlink()
            except OSError:
                pass

    def forward(self, ids: np.ndarray, state) -> np.ndarray:
        """Session._run plus the routing outputs (kept in self.routes as layer -> [T, k] indices)."""
        import onnxruntime as ort

        B, S = ids.shape
        if state.owner is not self.sess.session:  # state tensors and start_pos bound once, as Session does
            state.bind(self.sess.session)
        io = state.binding
        ids_value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ids, np.int64))
        logits = np.empty((B, S if self.sess.logits_mode == "all" else 1, self.sess.vocab_size), np.float32)
        state._run_buffers = (ids, ids_value, logits)  # alive for the run on every onnxruntime
        io.bind_ortvalue_input("input_ids", ids_value)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        for name in self.route_names:
            io.bind_output(name, "cpu")
        self.sess.session.run_with_iobinding(io)
        outs = io.get_outputs()
        k = len(state.tensors) + 1  # outputs in binding order: state tensors, logits, then the routes
        self.routes = {int(n.split(".")[1]): o.numpy() for n, o in zip(self.route_names, outs[k:])}
        state.positions += S
        return logits


def _stats(samples, units=1, meter=None, truncated=False) -> dict:
    return Timing(list(samples), units, 0, meter.stop() if meter else {}, truncated).stats()


def run_ours(model_dir: Path, *, cap: str, levels: dict, caps: list, threads: int, settings: dict, limits: dict,
             deadline: float, log, impl: str = "dsv4-ort") -> tuple:
    """Prefill and decode records for one ISA group, and the bytes accounting of each decode configuration
    (records named ``impl``: the native export's are "dsv4-ort")."""
    warm_page_cache(model_dir)
    meta_runner = OursRunner(model_dir, threads=threads, isa=cap)
    sess = meta_runner.sess
    meta = sess.meta
    wc = weight_costs(inventory(model_dir), meta["config"])
    rng = np.random.default_rng(0)
    base = {"impl": impl, "isa_cap": cap, "isa_caps": caps, "levels": levels, "threads": sess.threads}
    records, accounting = [], []
    step_s = None
    try:
        for ctx in settings["contexts"]:
            for B in settings["batches"]:
                if time.monotonic() > deadline:
                    records.append({**base, "kind": "decode", "context": ctx, "batch": B,
                                    "skipped": "end-to-end time budget exhausted"})
                    continue
                state = sess.new_state(B)
                fill_state([buf for _, _, buf, _ in state.tensors], rng)
                state.positions[:] = ctx
                ids = rng.integers(0, sess.vocab_size, (B, 1))
                steps, uniq = [], []
                meter = LoadMeter()
                n_steps = settings["decode_steps"] + settings["decode_warmup"]
                for i in range(n_steps):
                    t0 = time.perf_counter()
                    logits = meta_runner.forward(ids, state)
                    dt = time.perf_counter() - t0
                    if i >= settings["decode_warmup"]:
                        steps.append(dt)
                        uniq.append({layer: len(np.unique(r)) for layer, r in meta_runner.routes.items()})
                    ids = logits[:, -1].argmax(-1).reshape(B, 1)
                    if dt * (n_steps - i - 1) > settings["max_decode_s"] and len(steps) >= 2:
                        break
                st = _stats(steps, meter=meter, truncated=len(steps) < settings["decode_steps"])
                med = st["median_s"]
                mean_u = {layer: float(np.mean([u[layer] for u in uniq])) for layer in uniq[0]} if uniq else None
                acc = decode_bytes(meta, wc, ctx, B, mean_u)
                bw = limits["bandwidth"]["all_threads"]["best"] if limits.get("bandwidth") else None
                roof = B * bw * 1e9 / acc["total"] if bw else None
                tps = B / med
                accounting.append({"context": ctx, "batch": B, "bytes": acc, "bandwidth_gbs": bw,
                                   "roofline_tokens_per_s": roof, "isa_cap": cap})
                records.append({**base, "kind": "decode", "context": ctx, "batch": B, "time": st,
                                "tokens_per_s": tps, "state": "synthetic", "bytes_per_token": acc["per_token"],
                                "roofline_tokens_per_s": roof, "roof_fraction": tps / roof if roof else None})
                log(f"    decode ctx {ctx:>6} batch {B}: {tps:8.2f} tokens/s (step {fmt_time(med)}, "
                    f"n={st['n']}); {acc['per_token'] / 1e6:.0f} MB/token -> roofline {roof or 0:.1f} tokens/s")
                if B == 1 and step_s is None:
                    step_s = med
        records += _prefills(lambda ids, st: meta_runner.forward(ids, st), lambda: sess.new_state(1),
                             sess.vocab_size, settings, deadline, base, log, reset=lambda st: st.reset(),
                             decode_step_s=step_s)
        # prefill roofline (compute and weight streaming) for the prefill records
        peaks = limits.get("peaks", {})
        fp32 = max((peaks[p]["best"] for p in ("fp32_fma_zmm", "fp32_fma_ymm", "fp32_sse_muladd") if p in peaks),
                   default=None)
        bw = limits["bandwidth"]["all_threads"]["best"] if limits.get("bandwidth") else None
        for r in records:
            if r.get("kind") == "prefill" and "time" in r:
                S = r["tokens"]
                flops = 2.0 * wc["params_per_token"] * S + attention_flops(meta["config"], range(S))
                t_c = flops / (fp32 * 1e9) if fp32 else 0.0
                t_m = (wc["total_bytes"] - wc["embed_row"] * meta["config"]["vocab_size"]) / (bw * 1e9) if bw else 0
                roof_t = max(t_c, t_m)
                r["flops"] = flops
                r["roofline_tokens_per_s"] = S / roof_t if roof_t else None
                r["roofline_bound"] = "compute (fp32 FMA)" if t_c >= t_m else "memory (weights once)"
                r["roof_fraction"] = r["tokens_per_s"] / r["roofline_tokens_per_s"] if roof_t else None
    finally:
        meta_runner.close()
        del meta_runner, sess
        import gc

        gc.collect()  # no idle onnxruntime thread pool while the baselines run
    return records, accounting, wc


PROBE_TOKENS = 16


def _prefills(forward, new_state, vocab, settings, deadline, base, log, reset, decode_step_s=None):
    """Prefill records for settings["prefill_tokens"], smallest first. Each size is projected from the previous
    one (or from a 16-token probe, or the decode step time x tokens as an upper bound) and skipped when the
    projection exceeds settings["max_prefill_s"]; a probe that was needed is kept as a record (``probe``)."""
    out = []
    rng = np.random.default_rng(1)
    last = None

    def once(S, reps):
        ids = rng.integers(0, vocab, (1, S))
        state = new_state()
        times = []
        meter = LoadMeter()
        for _ in range(reps):
            reset(state)
            t0 = time.perf_counter()
            forward(ids, state)
            times.append(time.perf_counter() - t0)
            if sum(times) > settings["max_prefill_s"]:
                break
        return _stats(times, meter=meter, truncated=len(times) < reps)

    for S in sorted(settings["prefill_tokens"]):
        rec = {**base, "kind": "prefill", "tokens": S, "batch": 1}
        if time.monotonic() > deadline:
            out.append({**rec, "skipped": "end-to-end time budget exhausted"})
            continue
        limit = settings["max_prefill_s"]
        if last is None and decode_step_s is not None and decode_step_s * S > limit and S > PROBE_TOKENS:
            st = once(PROBE_TOKENS, 1)
            out.append({**base, "kind": "prefill", "tokens": PROBE_TOKENS, "batch": 1, "probe": True, "time": st,
                        "tokens_per_s": PROBE_TOKENS / st["median_s"]})
            log(f"    prefill {PROBE_TOKENS:>5} tokens (probe): {PROBE_TOKENS / st['median_s']:8.1f} tokens/s")
            last = (PROBE_TOKENS, st["median_s"])
        if last is not None:
            proj = last[1] * S / last[0]
            if proj > limit:
                out.append({**rec, "skipped": f"projected {proj:.0f} s (from {last[1]:.1f} s at {last[0]} tokens) "
                                              f"exceeds the prefill limit {limit:.0f} s"})
                log(f"    prefill {S:>5} tokens: skipped (projected {proj:.0f} s)")
                continue
        st = once(S, settings["prefill_reps"])
        last = (S, st["median_s"])
        rec.update(time=st, tokens_per_s=S / st["median_s"])
        out.append(rec)
        log(f"    prefill {S:>5} tokens: {S / st['median_s']:8.1f} tokens/s ({fmt_time(st['median_s'])}, n={st['n']})")
    return out


# ---------------------------------------------------------------------------------------------------- PyTorch


def _fill_params(named, rng_seed=0):
    """Fills uninitialised parameters quickly: matrices from a tiled N(0, 0.02) block, norms and scales 1, other
    vectors from a tiled N(0, 0.5) block (the values only matter for routing, which stays well spread)."""
    import torch

    g = torch.Generator().manual_seed(rng_seed)
    block = torch.randn((1 << 22) + 11, generator=g)
    scaled = {}
    for name, p in named:
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if "norm" in name and leaf == "weight" or leaf.endswith("_scale") or leaf == "scale":
                p.fill_(1.0)
                continue
            std = 0.02 if p.dim() >= 2 and not leaf.startswith("hc_") else 0.5
            key = (std, p.dtype)
            if key not in scaled:
                scaled[key] = (block * std).to(p.dtype)
            src = scaled[key]
            flat = p.view(-1)
            for off in range(0, flat.numel(), src.numel()):
                n = min(src.numel(), flat.numel() - off)
                flat[off:off + n].copy_(src[:n])


def _fill_routing_tables(model, n_experts, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], n_experts, generator=g).argsort(-1)[:, : b.shape[1]].to(b.dtype))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_reference(config, dtype):
    """models.DeepseekV4ForCausalLM with random weights filled fast (no MTP block: never run here)."""
    import torch

    from dsv4_ort.models import DeepseekV4ForCausalLM

    orig = DeepseekV4ForCausalLM.init_weights
    DeepseekV4ForCausalLM.init_weights = lambda self, *a, **k: None
    try:
        model = DeepseekV4ForCausalLM(config, dtype=dtype)
    finally:
        DeepseekV4ForCausalLM.init_weights = orig
    model.mtp = torch.nn.ModuleList()
    _fill_params(model.named_parameters())
    _fill_routing_tables(model, config.n_routed_experts)
    return model.eval()


def _fill_torch_state(state, rng):
    import torch

    for layer in state.layers:
        for f in ("window", "kv_state", "score_state", "entries", "idx_kv_state", "idx_score_state", "idx_entries"):
            t = getattr(layer, f, None)
            if t is None:
                continue
            arr = np.empty(t.shape, np.float32)
            fill_state([arr], rng)
            t.copy_(torch.from_numpy(arr).to(t.dtype))


def run_torch(config, dtype_name: str, *, threads: int, settings: dict, max_seq_len: int, deadline: float,
              log) -> list:
    import torch

    torch.set_num_threads(threads)
    dtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    impl = "torch_fp32" if dtype_name == "float32" else "torch_bf16"
    base = {"impl": impl, "threads": threads,
            "weights": "random init of the same config (speed-only comparison; values differ from the export)"}
    t0 = time.perf_counter()
    model = build_reference(config, dtype)
    base["build_s"] = round(time.perf_counter() - t0, 1)
    log(f"    built the PyTorch reference ({dtype_name}) in {base['build_s']} s")
    records = []
    rng = np.random.default_rng(0)

    def fwd(ids, st):
        with torch.inference_mode():
            return model(torch.from_numpy(np.asarray(ids, np.int64)), state=st)

    def reset(st):
        st.pos = torch.zeros_like(st.pos)

    try:
        with torch.inference_mode():
            records += _prefills(fwd, lambda: model.new_state(1, max_seq_len), config.vocab_size, settings, deadline,
                                 base, log, reset=reset)
            for ctx in settings["contexts"]:
                for B in settings["batches"]:
                    rec = {**base, "kind": "decode", "context": ctx, "batch": B, "state": "synthetic"}
                    if time.monotonic() > deadline:
                        records.append({**rec, "skipped": "end-to-end time budget exhausted"})
                        continue
                    st = model.new_state(B, max_seq_len)
                    _fill_torch_state(st, rng)
                    st.pos = torch.full((B,), ctx, dtype=torch.int64)
                    ids = torch.from_numpy(rng.integers(0, config.vocab_size, (B, 1)))
                    times = []
                    meter = LoadMeter()
                    w = settings["decode_warmup"]
                    n = settings["decode_steps_baseline"] + w
                    for i in range(n):
                        t1 = time.perf_counter()
                        logits = model(ids, state=st)
                        dt = time.perf_counter() - t1
                        if i >= w:
                            times.append(dt)
                        ids = logits[:, -1].argmax(-1).reshape(B, 1)
                        if dt * (n - i - 1) > settings["max_decode_s"] and times:
                            break
                    if not times:
                        times = [dt]
                    stt = _stats(times, meter=meter, truncated=len(times) < n - w)
                    records.append({**rec, "time": stt, "tokens_per_s": B / stt["median_s"]})
                    log(f"    {impl} decode ctx {ctx:>6} batch {B}: {B / stt['median_s']:8.2f} tokens/s")
                    del st
    finally:
        del model
    return records


def run_hf(config, *, threads: int, settings: dict, deadline: float, log) -> list:
    """transformers' DeepseekV4ForCausalLM (eager attention, float32), random weights, speed only."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    torch.set_num_threads(threads)
    base = {"impl": "hf_fp32", "threads": threads, "transformers": transformers.__version__,
            "weights": "random init of the same config (speed-only comparison)", "attention": "eager"}
    hc = transformers.DeepseekV4Config(**config.to_hf_dict())
    hc._attn_implementation = "eager"
    t0 = time.perf_counter()
    with no_init_weights():
        hf = transformers.DeepseekV4ForCausalLM(hc)
    _fill_params(hf.named_parameters())
    _fill_routing_tables(hf, config.n_routed_experts)
    hf.eval()
    base["build_s"] = round(time.perf_counter() - t0, 1)
    log(f"    built transformers' model in {base['build_s']} s")
    records = []
    rng = np.random.default_rng(0)
    # the cache keyword is `cache` from transformers 5.24, `past_key_values` before (an unknown one runs uncached)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def fwd(ids, cache):
        return hf(torch.from_numpy(np.asarray(ids, np.int64)), use_cache=True, logits_to_keep=1,
                  **{cache_kw: cache}).logits

    try:
        with torch.inference_mode():
            records += _prefills(fwd, lambda: transformers.DynamicCache(config=hf.config), config.vocab_size,
                                 settings, deadline, base, log, reset=lambda c: None)
            for ctx in settings["contexts"]:
                for B in settings["batches"]:
                    rec = {**base, "kind": "decode", "context": ctx, "batch": B, "state": "prefilled"}
                    if ctx > settings["hf_max_context"]:
                        records.append({**rec, "skipped": f"transformers reaches a context only by a real prefill; "
                                                          f"limited to {settings['hf_max_context']} positions"})
                        continue
                    if time.monotonic() > deadline:
                        records.append({**rec, "skipped": "end-to-end time budget exhausted"})
                        continue
                    cache = transformers.DynamicCache(config=hf.config)
                    prompt = rng.integers(0, config.vocab_size, (B, ctx))
                    logits = fwd(prompt, cache)
                    ids = logits[:, -1].argmax(-1).reshape(B, 1)
                    times = []
                    meter = LoadMeter()
                    w = settings["decode_warmup"]
                    n = settings["decode_steps_baseline"] + w
                    for i in range(n):
                        t1 = time.perf_counter()
                        logits = fwd(ids, cache)
                        dt = time.perf_counter() - t1
                        if i >= w:
                            times.append(dt)
                        ids = logits[:, -1].argmax(-1).reshape(B, 1)
                        if dt * (n - i - 1) > settings["max_decode_s"] and times:
                            break
                    if not times:
                        times = [dt]
                    stt = _stats(times, meter=meter, truncated=len(times) < n - w)
                    records.append({**rec, "time": stt, "tokens_per_s": B / stt["median_s"]})
                    log(f"    hf_fp32 decode ctx {ctx:>6} batch {B}: {B / stt['median_s']:8.2f} tokens/s")
    finally:
        del hf
    return records


__all__ = ["ensure_export", "run_ours", "run_torch", "run_hf", "decode_bytes", "weight_costs", "model_capacity",
           "state_read_per_row", "attention_flops"]
