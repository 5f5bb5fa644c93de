"""Attention-side ops at DeepSeek-V4 shapes through onnxruntime: SparseAttention, Indexer, Compressor and NormRope,
one-node models with the dsv4_ort library, every ISA level, against the scalar reference and torch eager on
models.functional.

For every case it prints the median time over the repetitions, the bytes the op must read (inputs it touches: the
queries, the visible key rows -- the ring slots in the window, the selected or visible entries -- indices, weights
and state; outputs are not counted), the achieved GB/s for those bytes, and the ratio to the scalar reference and to
torch. "warm" runs back to back (the state stays in the last-level cache, which on large server parts holds all of
it); "cold" streams a buffer larger than the cache through a core before every run (then runs a private copy of the
inputs once to wake the session's threads), so the state comes from DRAM, as it does in a model whose weights flow
through the cache between two attention calls. The all-threads streaming-read bandwidth (bench/stream_read.cc,
compiled with g++ on the fly) is measured before and after, for comparison with the cold GB/s: %DRAM is the cold
GB/s as a share of its best figure (or of --dram-gbs). GF/s counts the arithmetic of the products: SparseAttention
4 H D flops per attended key and query (QK and PV), Indexer 2 nI cI per visible entry and query.

  python bench/bench_attention.py                          # everything (30 min or more on 2 cores)
  python bench/bench_attention.py --cases attn_decode_csa --contexts 16384 --levels avx512 amx
  python bench/bench_attention.py --list

Shapes: H = 64 heads of D = 512 (rope 64), window 128, CSA ratio 4 with top-k 512, HCA ratio 128; indexer 64 heads
of 128, top-k 512; contexts 4k and 16k (CSA: 1k and 4k entries); decode S = 1 at batch 1 and 4, prefill S = 512.
The top-k indices are random (no overlap between queries beyond chance), the worst case for reuse in prefill.
On a machine shared with other work, timings of runs longer than a scheduler slice vary a lot; the load average is
printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

import dsv4_ort
from dsv4_ort.export import schema
from dsv4_ort.models import functional as F

H, D, RD, N_WIN, TOPK = 64, 512, 64, 128, 512
NI, CI = 64, 128
INV_FREQ = (1.0 / 160000.0 ** (np.arange(0, RD, 2, dtype=np.float32) / RD)).astype(np.float32)
LEVELS = ["scalar", "avx2", "avx512", "amx"]


def as_bf16(a: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def onnx_type(a: np.ndarray, bf16: bool) -> int:
    if a.dtype == np.uint16 and bf16:
        return TensorProto.BFLOAT16
    return {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64}[a.dtype]


class OneNode:
    """A one-node session with inputs bound once (OrtValues over the numpy buffers) and outputs preallocated;
    outputs named in `alias` are bound to the input buffer of that name (in-place state, as the runtime does)."""

    def __init__(self, op: str, inputs: dict, attrs: dict, isa: str, threads: int, bf16: bool, alias=None):
        alias = alias or {}
        spec = schema.get(op)
        shapes = schema.infer_output_shapes(op, [np.shape(inputs[i.name]) if inputs.get(i.name) is not None else None
                                                 for i in spec.inputs], attrs)
        out_types = []
        for o in spec.outputs:
            if o.type in spec.type_constraints:
                src = next(i for i in spec.inputs if i.type == o.type and inputs.get(i.name) is not None)
                out_types.append(onnx_type(inputs[src.name], bf16))
            else:
                out_types.append(schema.ONNX_TYPES[o.type])
        names = [io.name for io in spec.inputs]
        node_inputs = [n if inputs.get(n) is not None else "" for n in names]
        while node_inputs and node_inputs[-1] == "":
            node_inputs.pop()
        node = schema.make_node(op, node_inputs, [o.name for o in spec.outputs], name=op.lower(), **attrs)
        g_in = [helper.make_tensor_value_info(n, onnx_type(a, bf16), list(a.shape)) for n, a in inputs.items()
                if a is not None]
        g_out = [helper.make_tensor_value_info(o.name, t, list(s)) for o, t, s in zip(spec.outputs, out_types, shapes)]
        model = helper.make_model(helper.make_graph([node], op, g_in, g_out),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                                  ir_version=10)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        with dsv4_ort.isa_cap(isa):
            dsv4_ort.register(so)
            self.sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.io, self.values, self.outputs = self._bind(inputs, spec, out_types, shapes, alias, bf16)
        # A second, private copy of the inputs: running it right before a timed cold run wakes the session's pool
        # threads (a sleeping worker can wait milliseconds for a core on a loaded machine) without warming the
        # timed run's own data.
        copies = {k: (None if a is None else a.copy()) for k, a in inputs.items()}
        self.waker = self._bind(copies, spec, out_types, shapes, alias, bf16)

    def _bind(self, inputs, spec, out_types, shapes, alias, bf16):
        io = self.sess.io_binding()
        values, outputs = {}, []
        for name, a in inputs.items():
            if a is None:
                continue
            values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, onnx_type(a, bf16))
            io.bind_ortvalue_input(name, values[name])
        for o, t, s in zip(spec.outputs, out_types, shapes):
            if o.name in alias:
                io.bind_ortvalue_output(o.name, values[alias[o.name]])
                continue
            buf = np.empty(s, {TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64,
                               TensorProto.BFLOAT16: np.uint16}[t])
            io.bind_output(o.name, "cpu", 0, t, list(s), buf.ctypes.data)
            outputs.append(buf)
        return io, values, outputs

    def __call__(self):
        self.sess.run_with_iobinding(self.io)

    def wake(self):
        self.sess.run_with_iobinding(self.waker[0])


class Flusher:
    """Streams a buffer larger than the last-level cache through one core (numpy: no thread pool left spinning on
    the other cores afterwards, which a torch reduction would leave behind)."""

    def __init__(self, gib: float):
        self.buf = np.ones(int(gib * (1 << 30)) // 8, np.float64) if gib > 0 else None

    def __call__(self):
        if self.buf is not None:
            np.add.reduce(self.buf)


def timeit(fn, reps: int, flush=None, wake=None) -> float:
    """Median seconds of fn over reps runs (after one untimed run); with flush, the caches are flushed and then
    wake() runs before every timed run."""
    fn()  # warm-up (first-run allocations, page faults)
    times = []
    while len(times) < reps:
        if flush is not None:
            flush()
            if wake is not None:
                wake()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- cases


def attention_case(kind: str, ctx: int, B: int, S: int, dtype: str, rng):
    """SparseAttention inputs: queries at positions ctx - S .. ctx - 1 of every row."""
    ratio = {"swa": 0, "hca": 128, "csa": 4}[kind]
    N = ctx // ratio if ratio else 0
    cast = as_bf16 if dtype == "bf16" else (lambda a: np.ascontiguousarray(a, np.float32))
    start = np.full(B, ctx - S, np.int64)
    inputs = {
        "q": cast(rng.standard_normal((B, S, H, D), np.float32)),
        "kv": cast(rng.standard_normal((B, S, D), np.float32)),
        "past_window": cast(rng.standard_normal((B, N_WIN, D), np.float32)),
        "entries": cast(rng.standard_normal((B, N, D), np.float32)) if N else None,
        "indices": None,
        "sink": rng.standard_normal(H).astype(np.float32),
        "inv_freq": INV_FREQ,
        "start_pos": start,
    }
    # ring rows any query of the chunk sees: positions start - n_win + 1 .. start - 1 (the chunk's own rows are kv)
    keys_read = B * min(N_WIN - 1, ctx - S)
    # keys per query (ring rows and chunk tokens in its window; entries added below), for the flop count
    p0 = ctx - S
    per_query = np.array([min(p0, max(0, N_WIN - 1 - s)) + min(s + 1, N_WIN) for s in range(S)], np.int64)
    attended = np.tile(per_query, (B, 1))
    if kind == "csa":
        idx = np.empty((B, S, TOPK), np.int64)
        sel = 0
        for b in range(B):
            chosen = set()
            for s in range(S):
                vis = (ctx - S + s + 1) // ratio
                idx[b, s] = rng.choice(vis, TOPK, replace=False) if vis >= TOPK else np.pad(
                    rng.permutation(vis), (0, TOPK - vis), constant_values=-1)
                chosen.update(int(i) for i in idx[b, s] if i >= 0)
                attended[b, s] += len({int(i) for i in idx[b, s] if 0 <= i < vis})
            sel += len(chosen)
        inputs["indices"] = idx
        keys_read += sel
    elif kind == "hca":
        keys_read += B * (ctx // ratio)
        attended += np.array([(p0 + s + 1) // ratio for s in range(S)], np.int64)[None, :]
    elem = 2 if dtype == "bf16" else 4
    nbytes = (inputs["q"].nbytes + inputs["kv"].nbytes + keys_read * D * elem
              + (inputs["indices"].nbytes if inputs["indices"] is not None else 0))
    flops = 4.0 * H * D * float(attended.sum())  # QK and PV, a multiply and an add each
    return inputs, dict(ratio=ratio), nbytes, flops


def indexer_case(ctx: int, B: int, S: int, dtype: str, rng):
    ratio = 4
    N = ctx // ratio
    cast = as_bf16 if dtype == "bf16" else (lambda a: np.ascontiguousarray(a, np.float32))
    inputs = {
        "q": cast(rng.standard_normal((B, S, NI, CI), np.float32)),
        "weights": rng.standard_normal((B, S, NI)).astype(np.float32),
        "keys": cast(rng.standard_normal((B, N, CI), np.float32)),
        "start_pos": np.full(B, ctx - S, np.int64),
    }
    visible = (ctx - S + S) // ratio  # the last query's
    elem = 2 if dtype == "bf16" else 4
    nbytes = inputs["q"].nbytes + inputs["weights"].nbytes + B * visible * CI * elem
    flops = 2.0 * NI * CI * B * sum((ctx - S + s + 1) // ratio for s in range(S))  # the q . key products
    return inputs, dict(ratio=ratio, index_topk=TOPK), nbytes, flops


def compressor_case(kind: str, ctx: int, B: int, S: int, dtype: str, rng):
    """Compressor inputs at the end of a context of ctx tokens: CSA (ratio 4, overlap, c = 512), HCA (ratio 128,
    c = 512) or the indexer's (ratio 4, overlap, c = 128). The state is updated in place."""
    ratio, c, coff = {"csa": (4, D, 2), "hca": (128, D, 1), "idx": (4, CI, 2)}[kind]
    W = coff * c
    N = ctx // ratio + 1
    inputs = {
        "kv": rng.standard_normal((B, S, W), np.float32),
        "score": rng.standard_normal((B, S, W), np.float32),
        "ape": rng.standard_normal((ratio, W), np.float32),
        "norm_weight": np.ones(c, np.float32),
        "inv_freq": INV_FREQ,
        "start_pos": np.full(B, ctx - S, np.int64),
        "past_entries": (as_bf16 if dtype == "bf16" else (lambda a: a))(np.zeros((B, N, c), np.float32)),
        "past_kv_state": np.zeros((B, coff * ratio, W), np.float32),
        "past_score_state": np.zeros((B, coff * ratio, W), np.float32),
    }
    # bytes that must be read: the new tokens' kv and score, ape, and the state (pooled when an entry is emitted)
    nbytes = sum(inputs[k].nbytes for k in ("kv", "score", "ape", "past_kv_state", "past_score_state"))
    return inputs, dict(rms_eps=1e-6), nbytes, None


def normrope_case(ctx: int, B: int, S: int, dtype: str, rng):
    """NormRope on the attention queries: [B, S, 64, 512], no weight."""
    cast = as_bf16 if dtype == "bf16" else (lambda a: np.ascontiguousarray(a, np.float32))
    inputs = {"x": cast(rng.standard_normal((B, S, H, D), np.float32)), "weight": None,
              "start_pos": np.full(B, ctx - S, np.int64), "inv_freq": INV_FREQ}
    return inputs, dict(eps=1e-6), inputs["x"].nbytes, None


def torch_inputs(inputs: dict, bf16: bool) -> dict:
    out = {}
    for k, a in inputs.items():
        if a is None:
            out[k] = None
        elif a.dtype == np.uint16 and bf16:
            out[k] = torch.from_numpy(a.astype(np.int32) << 16).view(torch.float32).to(torch.bfloat16)
        else:
            out[k] = torch.from_numpy(a)
    return out


def torch_attention(inputs, attrs, bf16):
    t = torch_inputs(inputs, bf16)
    return lambda: F.sparse_attention(t["q"], t["kv"], t["past_window"], t["entries"], t["indices"], t["sink"],
                                      t["inv_freq"], t["start_pos"], ratio=attrs["ratio"])


def torch_indexer(inputs, attrs, bf16):
    t = torch_inputs(inputs, bf16)
    return lambda: F.indexer_topk(t["q"], t["weights"], t["keys"], t["start_pos"], ratio=attrs["ratio"],
                                  index_topk=attrs["index_topk"])


def torch_compressor(inputs, attrs, bf16):
    t = torch_inputs(inputs, bf16)
    return lambda: F.compressor_step(t["kv"], t["score"], t["ape"], t["norm_weight"], t["inv_freq"],
                                     t["past_kv_state"], t["past_score_state"], t["past_entries"], t["start_pos"],
                                     rms_eps=attrs["rms_eps"])


def torch_normrope(inputs, attrs, bf16):
    t = torch_inputs(inputs, bf16)
    pos = t["start_pos"][:, None] + torch.arange(t["x"].shape[1])
    return lambda: F.q_norm_rope(t["x"], *F.rope_cos_sin(pos, t["inv_freq"]), rms_eps=attrs["eps"])


CASES = {
    # name: (op, kind, B, S)
    "attn_decode_csa": ("SparseAttention", "csa", [1, 4], 1),
    "attn_decode_hca": ("SparseAttention", "hca", [1, 4], 1),
    "attn_decode_swa": ("SparseAttention", "swa", [1, 4], 1),
    "attn_prefill_csa": ("SparseAttention", "csa", [1], 512),
    "indexer_decode": ("Indexer", None, [1, 4], 1),
    "indexer_prefill": ("Indexer", None, [1], 512),
    "compressor_decode_hca": ("Compressor", "hca", [1, 4], 1),
    "compressor_decode_csa": ("Compressor", "csa", [1, 4], 1),
    "compressor_prefill_csa": ("Compressor", "csa", [1], 512),
    "normrope_decode": ("NormRope", None, [1, 4], 1),
    "normrope_prefill": ("NormRope", None, [1], 512),
}


def stream_gbs(line: str):
    """The best GB/s of a stream_bandwidth line, or None."""
    import re

    m = re.search(r"best ([0-9.]+) GB/s", line)
    return float(m.group(1)) if m else None


def stream_bandwidth(threads: int) -> str:
    """All-threads streaming read of 2 GiB (bench/stream_read.cc, compiled with g++ on the fly): the DRAM figure the
    cold GB/s are compared with. Returns the program's line, or a note when g++ is missing."""
    src = Path(__file__).with_name("stream_read.cc")
    exe = Path(tempfile.gettempdir()) / "dsv4_stream_read"
    gxx = shutil.which("g++")
    if gxx is None or not src.exists():
        return "stream read: g++ or bench/stream_read.cc not available"
    subprocess.run([gxx, "-O2", "-mavx512f", "-pthread", str(src), "-o", str(exe)], check=True)
    return subprocess.run([str(exe), "2", str(threads), "10"], capture_output=True, text=True,
                          check=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--contexts", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--dtypes", nargs="*", default=["f32", "bf16"])
    ap.add_argument("--levels", nargs="*", default=None, help="ISA levels (default: all this CPU has)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--flush-gib", type=float, default=1.5, help="cache flush buffer for the cold runs (0: no cold)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--scalar-max-ms", type=float, default=3000.0, help="one scalar run only above this time")
    ap.add_argument("--torch-max-s", type=float, default=3.0, help="one torch run only above this time")
    ap.add_argument("--no-stream", action="store_true", help="skip the DRAM bandwidth probe")
    ap.add_argument("--dram-gbs", type=float, default=None,
                    help="DRAM read bandwidth for the %%DRAM column (default: the probe's best figure)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        print("\n".join(CASES))
        return
    torch.set_num_threads(args.threads)
    info = dsv4_ort.library_info()
    top = info["isa_max"]
    levels = args.levels or LEVELS[: LEVELS.index(top) + 1]
    flush = Flusher(args.flush_gib) if args.flush_gib > 0 else None
    print(f"library {info['library_path']}; ISA max {top}; threads {args.threads}; median of {args.reps}")
    print(f"load average at start: {os.getloadavg()}")
    dram = args.dram_gbs
    if not args.no_stream:
        line = stream_bandwidth(args.threads)
        print(line)
        dram = dram or stream_gbs(line)
    # GFLOP/s: the arithmetic of the products (SparseAttention: QK and PV over the keys each query attends;
    # Indexer: the q . key dots); %DRAM: cold GB/s as a share of the DRAM read bandwidth
    hdr = (f"{'case':<18} {'ctx':>6} {'B':>2} {'S':>4} {'dtype':<5} {'level':<7} {'warm ms':>9} {'cold ms':>9} "
           f"{'MB read':>8} {'warm GB/s':>9} {'cold GB/s':>9} {'warm GF/s':>9} {'cold GF/s':>9} {'%DRAM':>6} "
           f"{'x scalar':>8} {'x torch':>8}")
    print(hdr)
    rng = np.random.default_rng(0)
    for name in args.cases:
        op, kind, batches, S = CASES[name]
        for ctx in args.contexts:
            for B in batches:
                for dtype in args.dtypes:
                    bf16 = dtype == "bf16"
                    if op == "SparseAttention":
                        inputs, attrs, nbytes, flops = attention_case(kind, ctx, B, S, dtype, rng)
                        alias = {"present_window": "past_window"}
                        tfn = torch_attention(inputs, attrs, bf16)
                    elif op == "Indexer":
                        inputs, attrs, nbytes, flops = indexer_case(ctx, B, S, dtype, rng)
                        alias = {}
                        tfn = torch_indexer(inputs, attrs, bf16)
                    elif op == "Compressor":
                        inputs, attrs, nbytes, flops = compressor_case(kind, ctx, B, S, dtype, rng)
                        alias = {"present_entries": "past_entries", "present_kv_state": "past_kv_state",
                                 "present_score_state": "past_score_state"}
                        tfn = torch_compressor(inputs, attrs, bf16)
                    else:
                        inputs, attrs, nbytes, flops = normrope_case(ctx, B, S, dtype, rng)
                        alias = {}
                        tfn = torch_normrope(inputs, attrs, bf16)
                    t_torch = None
                    if not args.no_torch:
                        t0 = time.perf_counter()
                        tfn()
                        first = time.perf_counter() - t0
                        t_torch = first if first > args.torch_max_s else timeit(tfn, max(3, args.reps // 3))
                    t_scalar = None
                    for level in levels:
                        run = OneNode(op, inputs, attrs, level, args.threads, bf16, alias)
                        if level == "scalar":
                            t0 = time.perf_counter()
                            run()
                            first = time.perf_counter() - t0
                            reps = 1 if first * 1e3 > args.scalar_max_ms else max(3, args.reps // 3)
                            warm = timeit(run, reps)
                            cold = None
                            t_scalar = warm
                        else:
                            warm = timeit(run, args.reps)
                            cold = timeit(run, max(5, args.reps // 2), flush, run.wake) if flush else None
                        mb = nbytes / 1e6
                        cold_s = f"{cold * 1e3:9.3f}" if cold else f"{'-':>9}"
                        cold_bw = f"{nbytes / cold / 1e9:9.2f}" if cold else f"{'-':>9}"
                        xs = f"{t_scalar / warm:8.1f}" if t_scalar else f"{'-':>8}"
                        xt = f"{t_torch / warm:8.1f}" if t_torch else f"{'-':>8}"
                        wgf = f"{flops / warm / 1e9:9.1f}" if flops else f"{'-':>9}"
                        cgf = f"{flops / cold / 1e9:9.1f}" if flops and cold else f"{'-':>9}"
                        pct = f"{100 * nbytes / cold / 1e9 / dram:6.1f}" if cold and dram else f"{'-':>6}"
                        print(f"{name:<18} {ctx:>6} {B:>2} {S:>4} {dtype:<5} {level:<7} {warm * 1e3:9.3f} {cold_s} "
                              f"{mb:8.2f} {nbytes / warm / 1e9:9.2f} {cold_bw} {wgf} {cgf} {pct} {xs} {xt}",
                              flush=True)
                    if t_torch:
                        print(f"{name:<18} {ctx:>6} {B:>2} {S:>4} {dtype:<5} {'torch':<7} {t_torch * 1e3:9.3f}",
                              flush=True)


    print(f"load average at end: {os.getloadavg()}")
    if not args.no_stream:
        print(stream_bandwidth(args.threads))


if __name__ == "__main__":
    main()
