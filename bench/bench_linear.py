"""Linear and MoE expert ops at DeepSeek-V4 shapes through onnxruntime, every ISA level, against torch.

Models are built here with their weights as constant initializers in an external-data file (4 KiB aligned, so
onnxruntime memory-maps it, as it does for an exported model), run with 2 intra-op threads through IOBinding.

  decode   Linear, M = 1, 2, 4, 8 rows. Each model holds enough distinct weight matrices of one shape (about 1.2 GB
           in all) to defeat the caches; one run calls them all. GB/s = weight bytes (codes + scales) / time.
  prefill  one Linear node, M = 128 ... 2048 rows; GFLOP/s = 2 M N K / time.
  moe      MoeExperts* decode (T = 1 and 4 tokens, top-6 of 128 experts, different experts every run: GB/s of the
           expert bytes the run touches) and prefill (T = 512, top-6 of 64: GFLOP/s).
  torch    torch.nn.functional.linear in bf16 and fp32 (2 threads) on the same shapes (decode over the same number
           of distinct weights).
  stream   the all-threads streaming-read bandwidth (bench/stream_read.cc, compiled with g++ on the fly).
  rss      resident memory of a process that creates a session on a decode model vs its weight bytes.

  python bench/bench_linear.py                       # everything (~15 min on 2 cores)
  python bench/bench_linear.py --cases decode --formats fp4 --acts float32 --levels avx512 amx
  DSV4_ORT_LIBRARY=build/dev/custom_ops/libdsv4_ort.so python bench/bench_linear.py --cases prefill

Timings are medians over --reps runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as dsv4-ort bench (bench/cli.py quiet_numpy_blas)

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import dsv4_ort
from dsv4_ort.export import schema

LEVELS = ["scalar", "avx2", "avx512", "amx"]
FORMATS = ["bf16", "fp8", "fp4"]
ALIGN = 4096
THREADS = 2


# ---------------------------------------------------------------------------------------------------------------
# Weights and models.

def random_weight(rng, fmt: str, n: int, k: int):
    """(data array, onnx dtype, scale array or None, scale onnx dtype) of an [n, k] weight in `fmt`."""
    if fmt == "bf16":
        w = (rng.standard_normal((n, k), dtype=np.float32) * np.float32(1.0 / np.sqrt(k))).view(np.uint32)
        return (w >> 16).astype(np.uint16), TensorProto.BFLOAT16, None, None
    if fmt == "fp8":
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
        scale = np.full(((n + 127) // 128, (k + 127) // 128), 127 - 12, np.uint8)
        return codes, TensorProto.FLOAT8E4M3FN, scale, TensorProto.UINT8
    if fmt == "fp4":
        packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        scale = np.full((n, k // 32), 127 - 6, np.uint8)
        return packed, TensorProto.UINT8, scale, TensorProto.UINT8
    raise ValueError(fmt)


class ExternalData:
    """Writes arrays into one file at 4 KiB-aligned offsets and returns initializers that reference them."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")
        self.offset = 0

    def add(self, name: str, a: np.ndarray, dtype: int):
        pad = (-self.offset) % ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        data = np.ascontiguousarray(a).tobytes()
        self.f.write(data)
        t = TensorProto()
        t.name = name
        t.data_type = dtype
        t.dims.extend(a.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(len(data)))):
            e = t.external_data.add()
            e.key, e.value = key, value
        self.offset += len(data)
        return t

    def close(self):
        self.f.close()


def linear_op(fmt: str) -> str:
    return {"bf16": "Linear", "fp8": "LinearFp8", "fp4": "LinearFp4"}[fmt]


def build_linear_model(workdir: Path, tag: str, fmt: str, n: int, k: int, copies: int, act: int, seed: int = 0):
    """A model with `copies` Linear nodes of [n, k] weights (distinct), one shared input x [M, k]. Returns
    (model path, weight bytes)."""
    rng = np.random.default_rng(seed)
    data_path = workdir / f"{tag}.bin"
    ext = ExternalData(data_path)
    nodes, inits, outputs = [], [], []
    total = 0
    for i in range(copies):
        w, wdt, s, sdt = random_weight(rng, fmt, n, k)
        inits.append(ext.add(f"w{i}", w, wdt))
        total += w.nbytes
        ins = ["x", f"w{i}"]
        if s is not None:
            inits.append(ext.add(f"s{i}", s, sdt))
            total += s.nbytes
            ins.append(f"s{i}")
        nodes.append(helper.make_node(linear_op(fmt), ins, [f"y{i}"], domain=schema.DOMAIN, name=f"lin{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", act, ["M", n]))
    ext.close()
    graph = helper.make_graph(nodes, tag, [helper.make_tensor_value_info("x", act, ["M", k])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                              ir_version=10)
    path = workdir / f"{tag}.onnx"
    path.write_bytes(model.SerializeToString())
    return path, total


def build_moe_model(workdir: Path, tag: str, fmt: str, experts: int, dim: int, inter: int, act: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ext = ExternalData(workdir / f"{tag}.bin")
    inits, total = [], 0
    ins = ["x", "weights", "indices"]
    scales = []
    for name, (rows, cols) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
        parts = [random_weight(rng, fmt, rows, cols) for _ in range(experts)]
        w = np.stack([p[0] for p in parts])
        inits.append(ext.add(name, w, parts[0][1]))
        total += w.nbytes
        ins.append(name)
        if parts[0][2] is not None:
            s = np.stack([p[2] for p in parts])
            inits.append(ext.add("s" + name[1], s, parts[0][3]))
            total += s.nbytes
            scales.append("s" + name[1])
        del parts, w
    ext.close()
    op = {"bf16": "MoeExperts", "fp8": "MoeExpertsFp8", "fp4": "MoeExpertsFp4"}[fmt]
    node = helper.make_node(op, ins + scales, ["y"], domain=schema.DOMAIN, name="moe", swiglu_limit=10.0)
    graph = helper.make_graph(
        [node], tag,
        [helper.make_tensor_value_info("x", act, ["T", dim]), helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", "K"]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", "K"])],
        [helper.make_tensor_value_info("y", act, ["T", dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(schema.DOMAIN, 1)],
                              ir_version=10)
    path = workdir / f"{tag}.onnx"
    path.write_bytes(model.SerializeToString())
    return path, total


def session(path: Path, level: str):
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.log_severity_level = 3
    with dsv4_ort.isa_cap(level):
        dsv4_ort.register(so)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def activation(rng, shape, act: int) -> ort.OrtValue:
    x = rng.standard_normal(shape).astype(np.float32)
    if act == TensorProto.BFLOAT16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type((x.view(np.uint32) >> 16).astype(np.uint16), act)
    return ort.OrtValue.ortvalue_from_numpy(x)


_STREAM_EXE = None


def stream_exe():
    """bench/stream_read.cc compiled once (None without g++)."""
    global _STREAM_EXE
    if _STREAM_EXE is None:
        src = Path(__file__).with_name("stream_read.cc")
        exe = Path(tempfile.gettempdir()) / f"dsv4_stream_read_{os.getpid()}"
        gxx = shutil.which("g++")
        if gxx is None or not src.exists():
            _STREAM_EXE = ""
        else:
            subprocess.run([gxx, "-O2", "-mavx512f", "-pthread", str(src), "-o", str(exe)], check=True)
            _STREAM_EXE = str(exe)
    return _STREAM_EXE or None


def paired(run, nbytes: float, reps: int):
    """Runs `run` reps times, each right after a short streaming-read measurement; returns (median GB/s, median of
    the per-pair ratios to the stream bandwidth or None). On a shared machine the available bandwidth drifts by 2x
    within minutes, so each run is compared with the bandwidth of the same moment."""
    run()  # warm-up
    rates, ratios = [], []
    for _ in range(reps):
        bw = stream_gbs(0.5, 1)
        t = time.perf_counter()
        run()
        rate = nbytes / (time.perf_counter() - t) / 1e9
        rates.append(rate)
        if bw:
            ratios.append(rate / bw)
    return statistics.median(rates), (statistics.median(ratios) if ratios else None)


def stream_gbs(gib: float = 1.0, reps: int = 5) -> float | None:
    """Median all-threads streaming-read bandwidth right now (the machine is shared: measured next to each row)."""
    exe = stream_exe()
    if exe is None:
        return None
    out = subprocess.run([exe, str(gib), str(THREADS), str(reps)], capture_output=True, text=True, check=True).stdout
    return float(out.split("median")[1].split("GB/s")[0])


def time_runs(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bind_outputs(sess, io):
    for o in sess.get_outputs():
        io.bind_output(o.name, "cpu")


ACTS = {"float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16}


# ---------------------------------------------------------------------------------------------------------------
# Cases.

DECODE_SHAPES = {"4096x4096": (4096, 4096), "4096x7168": (4096, 7168), "wq_b 32768x1024": (32768, 1024)}
PREFILL_SHAPES = {"4096x4096": (4096, 4096), "7168x4096": (7168, 4096)}


def decode(args, workdir: Path):
    print("\n## Decode: Linear GEMV / small GEMM, weights streamed from DRAM")
    print("median GB/s of weight bytes (median ratio to the streaming-read bandwidth measured right before each run)\n")
    print("| shape | format | act | level | " + " | ".join(f"M={m}" for m in args.decode_m) + " |")
    print("|---|---|---|---|" + "---|" * len(args.decode_m))
    rng = np.random.default_rng(1)
    for shape_name in args.decode_shapes:
        n, k = DECODE_SHAPES[shape_name]
        for fmt in args.formats:
            per = n * k * {"bf16": 2, "fp8": 1, "fp4": 0.5}[fmt]
            copies = max(2, int(round(args.decode_gb * 1e9 / per)))
            for act_name in args.acts:
                act = ACTS[act_name]
                path, wbytes = build_linear_model(workdir, "decode", fmt, n, k, copies, act)
                for level in args.levels:
                    sess = session(path, level)
                    cells = []
                    for m in args.decode_m:
                        if level == "scalar" and m > 1:
                            cells.append("-")
                            continue
                        io = sess.io_binding()
                        io.bind_ortvalue_input("x", activation(rng, (m, k), act))
                        bind_outputs(sess, io)
                        gbs, ratio = paired(lambda: sess.run_with_iobinding(io), wbytes,
                                            args.reps if level != "scalar" else 1)
                        cells.append(f"{gbs:.2f}" + (f" ({ratio:.2f})" if ratio else ""))
                    print(f"| {shape_name} | {fmt} | {act_name} | {level} | " + " | ".join(cells) + " |", flush=True)
                    del sess
                os.remove(path)
                os.remove(workdir / "decode.bin")


def prefill(args, workdir: Path):
    print("\n## Prefill: one Linear node (GFLOP/s = 2 M N K / time)\n")
    print("| shape | format | act | level | " + " | ".join(f"M={m}" for m in args.prefill_m) + " |")
    print("|---|---|---|---|" + "---|" * len(args.prefill_m))
    rng = np.random.default_rng(2)
    for shape_name in args.prefill_shapes:
        n, k = PREFILL_SHAPES[shape_name]
        for fmt in args.formats:
            for act_name in args.acts:
                act = ACTS[act_name]
                path, _ = build_linear_model(workdir, "prefill", fmt, n, k, 1, act)
                for level in args.levels:
                    if level == "scalar":
                        continue
                    sess = session(path, level)
                    cells = []
                    for m in args.prefill_m:
                        io = sess.io_binding()
                        io.bind_ortvalue_input("x", activation(rng, (m, k), act))
                        bind_outputs(sess, io)
                        t = time_runs(lambda: sess.run_with_iobinding(io), max(2, args.reps // 2))
                        cells.append(f"{2 * m * n * k / t / 1e9:.0f}")
                    print(f"| {shape_name} | {fmt} | {act_name} | {level} | " + " | ".join(cells) + " |", flush=True)
                    del sess
                os.remove(path)
                os.remove(workdir / "prefill.bin")


def torch_baseline(args):
    import torch

    torch.set_num_threads(THREADS)
    print("\n## torch.nn.functional.linear (2 threads)\n")
    print("| case | dtype | " + " | ".join(f"M={m}" for m in args.decode_m) + " |")
    print("|---|---|" + "---|" * len(args.decode_m))
    for shape_name in args.decode_shapes:
        n, k = DECODE_SHAPES[shape_name]
        for dtype in (torch.bfloat16, torch.float32):
            esize = 2 if dtype == torch.bfloat16 else 4
            copies = max(2, int(round(args.decode_gb * 1e9 / (n * k * esize))))
            ws = [torch.randn(n, k, dtype=torch.float32).to(dtype) for _ in range(copies)]
            cells = []
            for m in args.decode_m:
                x = torch.randn(m, k).to(dtype)
                t = time_runs(lambda: [torch.nn.functional.linear(x, w) for w in ws], args.reps)
                cells.append(f"{copies * n * k * esize / t / 1e9:.2f} GB/s")
            print(f"| decode {shape_name} | {dtype} | " + " | ".join(cells) + " |", flush=True)
            del ws
    print("\n| case | dtype | " + " | ".join(f"M={m}" for m in args.prefill_m) + " |")
    print("|---|---|" + "---|" * len(args.prefill_m))
    for shape_name in args.prefill_shapes:
        n, k = PREFILL_SHAPES[shape_name]
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(n, k).to(dtype)
            cells = []
            for m in args.prefill_m:
                x = torch.randn(m, k).to(dtype)
                t = time_runs(lambda: torch.nn.functional.linear(x, w), max(2, args.reps // 2))
                cells.append(f"{2 * m * n * k / t / 1e9:.0f} GFLOP/s")
            print(f"| prefill {shape_name} | {dtype} | " + " | ".join(cells) + " |", flush=True)


def moe(args, workdir: Path):
    print("\n## MoE experts (d=4096, I=2048, top-6, swiglu_limit 10)\n")
    print("| case | format | act | level | result |")
    print("|---|---|---|---|---|")
    dim, inter, top_k = 4096, 2048, 6
    rng = np.random.default_rng(3)
    for fmt in args.moe_formats:
        per_expert = 3 * dim * inter * {"bf16": 2, "fp8": 1, "fp4": 0.5}[fmt]
        per_expert += 3 * {"bf16": 0, "fp8": (dim // 128) * (inter // 128), "fp4": dim * inter // 32}[fmt]
        for act_name in args.acts:
            act = ACTS[act_name]
            experts = args.moe_experts
            path, _ = build_moe_model(workdir, "moe", fmt, experts, dim, inter, act)
            for level in args.levels if "decode" in args.moe_modes else []:
                if level == "scalar":
                    continue
                sess = session(path, level)
                # Steady state first: one call whose routing covers every expert, so that every weight page is
                # mapped (the weights are memory-mapped external data; first touches would time page faults).
                cover = np.arange((experts + top_k - 1) // top_k * top_k, dtype=np.int64) % experts
                io = sess.io_binding()
                io.bind_ortvalue_input("x", activation(rng, (len(cover) // top_k, dim), act))
                io.bind_ortvalue_input("weights", ort.OrtValue.ortvalue_from_numpy(
                    np.full((len(cover) // top_k, top_k), 0.5, np.float32)))
                io.bind_ortvalue_input("indices", ort.OrtValue.ortvalue_from_numpy(cover.reshape(-1, top_k)))
                bind_outputs(sess, io)
                sess.run_with_iobinding(io)
                for tokens in (1, 4):
                    # different experts every run: a fresh routing per repetition
                    runs = []
                    for _ in range(args.reps + 1):
                        idx = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int64)
                        io = sess.io_binding()
                        io.bind_ortvalue_input("x", activation(rng, (tokens, dim), act))
                        io.bind_ortvalue_input("weights", ort.OrtValue.ortvalue_from_numpy(
                            rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)))
                        io.bind_ortvalue_input("indices", ort.OrtValue.ortvalue_from_numpy(idx))
                        bind_outputs(sess, io)
                        runs.append((io, len(np.unique(idx))))
                    sess.run_with_iobinding(runs[0][0])
                    rates, ratios = [], []
                    for io, used in runs[1:]:
                        bw = stream_gbs(0.5, 1)
                        t = time.perf_counter()
                        sess.run_with_iobinding(io)
                        rates.append(used * per_expert / (time.perf_counter() - t) / 1e9)
                        if bw:
                            ratios.append(rates[-1] / bw)
                    rate = statistics.median(rates)
                    print(f"| decode T={tokens} of E={experts} | {fmt} | {act_name} | {level} | {rate:.2f} GB/s"
                          + (f" ({statistics.median(ratios):.2f} of stream)" if ratios else "") + " |", flush=True)
                del sess
            os.remove(path)
            os.remove(workdir / "moe.bin")
            if "prefill" not in args.moe_modes:
                continue
            # prefill: 512 tokens over 64 experts
            path, _ = build_moe_model(workdir, "moe", fmt, 64, dim, inter, act)
            tokens = 512
            for level in args.levels:
                if level in ("scalar", "avx2"):
                    continue
                sess = session(path, level)
                idx = np.stack([rng.permutation(64)[:top_k] for _ in range(tokens)]).astype(np.int64)
                io = sess.io_binding()
                io.bind_ortvalue_input("x", activation(rng, (tokens, dim), act))
                io.bind_ortvalue_input("weights", ort.OrtValue.ortvalue_from_numpy(
                    rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)))
                io.bind_ortvalue_input("indices", ort.OrtValue.ortvalue_from_numpy(idx))
                bind_outputs(sess, io)
                t = time_runs(lambda: sess.run_with_iobinding(io), max(2, args.reps // 3))
                flops = 2 * 3 * dim * inter * tokens * top_k
                print(f"| prefill T={tokens} of E=64 | {fmt} | {act_name} | {level} | {flops / t / 1e9:.0f} GFLOP/s "
                      f"({t * 1e3:.0f} ms) |", flush=True)
                del sess
            os.remove(path)
            os.remove(workdir / "moe.bin")


def stream(args):
    exe = stream_exe()
    if exe is None:
        print("\n(stream read: g++ or bench/stream_read.cc not available)")
        return
    out = subprocess.run([exe, "2", str(THREADS), "10"], capture_output=True, text=True, check=True).stdout
    print("\n## Streaming read bandwidth\n\n" + out.strip())


RSS_CHILD = r"""
import sys, json, onnxruntime as ort, numpy as np, dsv4_ort
def rss():
    d = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('VmRSS', 'RssAnon', 'RssFile', 'VmHWM'):
            d[k] = int(v.split()[0]) * 1024
    return d
path, level, k, act = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
out = {'start': rss()}
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
with dsv4_ort.isa_cap(level):
    dsv4_ort.register(so)
    sess = ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])
out['created'] = rss()
x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
for i in range(3):
    sess.run(None, {'x': x})
out['after 3 runs'] = rss()
print(json.dumps(out))
"""


def rss(args, workdir: Path):
    import json

    print("\n## Resident memory of a session vs its weight bytes (fp32 activations, M = 1)\n")
    print("| format | level | weight bytes | stage | VmRSS | RssAnon | RssFile | peak (VmHWM) |")
    print("|---|---|---|---|---|---|---|---|")
    n, k = DECODE_SHAPES["4096x7168"]
    for fmt in args.formats:
        per = n * k * {"bf16": 2, "fp8": 1, "fp4": 0.5}[fmt]
        copies = max(2, int(round(args.decode_gb * 1e9 / per)))
        path, wbytes = build_linear_model(workdir, "rss", fmt, n, k, copies, TensorProto.FLOAT)
        for level in [lv for lv in args.levels if lv != "scalar"][-1:]:
            r = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path), level, str(k), str(TensorProto.FLOAT)],
                               capture_output=True, text=True, check=True)
            stages = json.loads(r.stdout.strip().splitlines()[-1])
            for stage, v in stages.items():
                gb = {key: f"{val / 1e9:.2f} GB" for key, val in v.items()}
                print(f"| {fmt} | {level} | {wbytes / 1e9:.2f} GB | {stage} | {gb['VmRSS']} | {gb['RssAnon']} | "
                      f"{gb['RssFile']} | {gb['VmHWM']} |", flush=True)
        os.remove(path)
        os.remove(workdir / "rss.bin")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["stream", "decode", "prefill", "moe", "torch", "rss"],
                   choices=["stream", "decode", "prefill", "moe", "torch", "rss"])
    p.add_argument("--levels", nargs="+", default=["avx2", "avx512", "amx"], choices=LEVELS)
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--moe-formats", nargs="+", default=["fp4", "fp8"], choices=FORMATS)
    p.add_argument("--acts", nargs="+", default=["float32", "bfloat16"], choices=list(ACTS))
    p.add_argument("--decode-shapes", nargs="+", default=["4096x7168", "wq_b 32768x1024"], choices=list(DECODE_SHAPES))
    p.add_argument("--prefill-shapes", nargs="+", default=["4096x4096"], choices=list(PREFILL_SHAPES))
    p.add_argument("--decode-m", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--prefill-m", nargs="+", type=int, default=[16, 64, 128, 256, 512, 2048])
    p.add_argument("--decode-gb", type=float, default=1.2, help="weight bytes per decode model (GB)")
    p.add_argument("--moe-experts", type=int, default=128)
    p.add_argument("--moe-modes", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--workdir", default=None, help="where the model files go (default: a temporary directory)")
    args = p.parse_args()
    available = dsv4_ort.library_info()["cpu"] if "cpu" in dsv4_ort.library_info() else None
    print(f"library: {dsv4_ort.get_library_path()}")
    if available:
        print(f"cpu: {available}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsv4_bench_linear_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for case in args.cases:
            {"stream": lambda: stream(args), "decode": lambda: decode(args, workdir),
             "prefill": lambda: prefill(args, workdir), "moe": lambda: moe(args, workdir),
             "torch": lambda: torch_baseline(args), "rss": lambda: rss(args, workdir)}[case]()
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
