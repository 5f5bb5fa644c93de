"""The kernel benchmark cases: every op family of the ``ai.dsv4ort`` domain at DeepSeek-V4 shapes.

Shapes (DeepSeek-V4-Flash / -Pro): hidden 4096 / 7168, 64 / 128 heads of head_dim 512 with 64 RoPE channels, one
shared K=V head, sliding window 128, compress ratios 4 (CSA, with a 64 x 128 lightning indexer picking the top
512 / 1024 entries) and 128 (HCA), q_lora 1024 / 1536, grouped output projection (8 / 16 groups of rank 1024),
routed experts 2048 / 3072 wide (top-6), FP8 E4M3 linears with 128 x 128 E8M0 block scales, FP4 E2M1 experts
with 1 x 32 scales, bf16 LM head, float32 activations (what the exporter emits). Very large matrices are benchmarked
as slices (the kernels split output rows across threads, so a slice behaves like the whole).

Decode cases have M = 1..8 tokens (batch rows at one new token each, at a context of 4096 / 16384 positions for
attention-side ops); prefill cases M = 128..2048 tokens of one sequence starting at position 0.

Cost model (per call): ``flops`` counts multiply-adds as 2 operations for the products the op must compute
(GEMMs, attention scores and values, indexer scores; element-wise work is counted roughly and only where it is
the whole op); ``bytes`` is the compulsory traffic: every input the op must read and every output it writes,
once; ``cold_bytes`` the part served from the rotating pool (weights, caches), which the harness arranges to come
from DRAM. The routed-expert op reads only the experts its tokens select; the CSA attention only the selected
entries; the compressor only its state rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .ortgraph import TYPES, Input, NodeSpec, nbytes

DOMAIN = "ai.dsv4ort"

FLASH = dict(name="Flash", d=4096, H=64, D=512, rd=64, q_lora=1024, G=8, o_lora=1024, nI=64, cI=128, topk=512,
             E=256, I=2048, k=6, win=128, vocab=129280, hc=4)
PRO = dict(name="Pro", d=7168, H=128, D=512, rd=64, q_lora=1536, G=16, o_lora=1024, nI=64, cI=128, topk=1024,
           E=384, I=3072, k=6, win=128, vocab=129280, hc=4)

# Bytes per weight element by format (FP4 packs two codes per byte); scales are counted separately.
WEIGHT_BYTES = {"f32": 4.0, "bf16": 2.0, "fp8": 1.0, "fp4": 0.5}
ACT_BYTES = {"float32": 4, "bfloat16": 2}


def inv_freq(rd: int = 64, theta: float = 160000.0) -> np.ndarray:
    return (1.0 / theta ** (np.arange(0, rd, 2, dtype=np.float32) / rd)).astype(np.float32)


@dataclass
class KernelCase:
    key: str            # stable id of the case (without the token count)
    group: str          # report group ("Linear", "MoE experts", ...)
    op: str
    families: tuple     # kernel families of dsv4_ort.library_info() whose level decides this op's speed
    label: str
    phase: str          # "decode" | "prefill"
    m: int              # tokens per call
    inputs: list        # ortgraph.Input list, in op input order
    outputs: list       # (name, aliased input or None, type)
    attrs: dict
    flops: float
    bytes: float
    cold_bytes: float   # per call, from the pool (per-node weights / caches)
    act_dtype: str = "float32"
    shape: dict = field(default_factory=dict)
    single_node: bool = False            # one node; per-run rotation via `rotate` instead of node copies
    rotate: object = None                # callable(run index) -> {shared input name: array}
    torch_fn: object = None              # callable(tensors: dict, dtype) -> result, the PyTorch reference
    torch_inputs: list | None = None     # inputs for the PyTorch baselines when they differ (dense weights)
    torch_dtypes: tuple = ("float32", "bfloat16")
    torch_rotate: object = None          # callable(run index, n_experts) -> {name: array} for the torch baseline
    torch_fp32_inputs: tuple = ()        # inputs the reference keeps in float32 in its bf16 variant (mHC, ...)
    ort_baselines: tuple = ()            # names from baselines.ORT_BASELINES that apply
    quick: bool = False                  # part of --quick
    smoke: bool = False                  # part of --smoke
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.key}@M={self.m}"

    def spec(self) -> NodeSpec:
        return NodeSpec(self.op, DOMAIN, self.inputs, self.outputs, self.attrs)

    def node_pool_bytes(self, inputs=None) -> int:
        return sum(nbytes(i.shape, i.dtype) for i in (inputs or self.inputs) if i.kind in ("weight", "state"))


def _act(name, arr, dtype="float"):
    return Input(name, "act", dtype=dtype, data=np.ascontiguousarray(arr))


def _rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


def _io_bytes(inputs, outputs_bytes) -> int:
    """Bytes of the act / const inputs (read once) plus the outputs."""
    b = 0
    for i in inputs:
        if i.kind in ("act", "const") and i.data is not None:
            b += i.data.nbytes
    return b + outputs_bytes


# ---------------------------------------------------------------------------------------------------- linear


LINEAR_SHAPES = [
    # key, label, N, Kw, groups, format, in quick, in smoke
    ("wq_a.flash", "wq_a Flash (q down-proj)", 1024, 4096, 1, "fp8", True, False),
    ("wkv.flash", "wkv Flash (kv proj)", 512, 4096, 1, "fp8", False, False),
    ("wq_b.flash", "wq_b Flash, 1/4 slice", 8192, 1024, 1, "fp8", False, False),
    ("wo_a.flash", "wo_a Flash grouped (8 groups)", 8192, 4096, 8, "fp8", False, False),
    ("wo_b.flash", "wo_b Flash (out proj)", 4096, 8192, 1, "fp8", True, False),
    ("wq_a.pro", "wq_a Pro", 1536, 7168, 1, "fp8", False, False),
    ("wo_b.pro", "wo_b Pro, 1/4 slice", 7168, 4096, 1, "fp8", False, False),
    ("head.flash", "LM head Flash bf16, 1/8 slice", 16384, 4096, 1, "bf16", True, False),
    ("gate.flash", "router gate Flash (256 experts) bf16", 256, 4096, 1, "bf16", False, False),
    ("compressor.flash", "compressor wkv (CSA) bf16", 1024, 4096, 1, "bf16", False, False),
    # one 4096 x 4096 matrix in every weight format
    ("sq.f32", "4096x4096 fp32 weight", 4096, 4096, 1, "f32", False, False),
    ("sq.bf16", "4096x4096 bf16 weight", 4096, 4096, 1, "bf16", False, False),
    ("sq.fp8", "4096x4096 FP8 weight", 4096, 4096, 1, "fp8", False, False),
    ("sq.fp4", "4096x4096 FP4 weight", 4096, 4096, 1, "fp4", True, False),
    # smoke: small
    ("smoke.fp8", "1024x1024 FP8 (smoke)", 1024, 1024, 1, "fp8", False, True),
]

# onnxruntime's MatMulNBits against our weights with products of the same class: the Flash shapes as FP4 (`export
# --dense fp4`) with fp32 products beside MatMul fp32 and both MatMulNBits accuracy levels, and with bf16 products
# (`--compute bf16`) beside accuracy level 4 (int8 activations, its fastest path); wq_a as FP8 (native) with bf16
# products beside level 4. The FP8 / bf16 shapes above compare MatMulNBits with our fp32 products, and there it reads
# a quarter to a half of our weight bytes.
# key, label, N, Kw, weight format, products (the op's compute attribute)
PRODUCT_TWINS = [
    ("wq_a.flash.fp4", "wq_a Flash as FP4", 1024, 4096, "fp4", "fp32"),
    ("wq_a.flash.fp4.bf16", "wq_a Flash as FP4, bf16 products", 1024, 4096, "fp4", "bf16"),
    ("wo_b.flash.fp4", "wo_b Flash as FP4", 4096, 8192, "fp4", "fp32"),
    ("wo_b.flash.fp4.bf16", "wo_b Flash as FP4, bf16 products", 4096, 8192, "fp4", "bf16"),
    ("sq.fp4.bf16", "4096x4096 FP4 weight, bf16 products", 4096, 4096, "fp4", "bf16"),
    ("wq_a.flash.fp8.bf16", "wq_a Flash (FP8), bf16 products", 1024, 4096, "fp8", "bf16"),
]
TWIN_BASELINES = {"fp32": ("matmul_fp32", "matmulnbits_int4", "matmulnbits_int4_fp32"),
                  "bf16": ("matmulnbits_int4",)}


def _weight_inputs(fmt: str, N: int, Kw: int, names=("weight", "scale"), lead=()) -> list:
    w, s = names
    if fmt == "f32":
        return [Input(w, "weight", (*lead, N, Kw), "float")]
    if fmt == "bf16":
        return [Input(w, "weight", (*lead, N, Kw), "bfloat16")]
    if fmt == "fp8":
        return [Input(w, "weight", (*lead, N, Kw), "float8e4m3fn"),
                Input(s, "scale", (*lead, math.ceil(N / 128), math.ceil(Kw / 128)), "uint8")]
    if fmt == "fp4":
        return [Input(w, "weight", (*lead, N, Kw // 2), "uint8"), Input(s, "scale", (*lead, N, Kw // 32), "uint8")]
    raise ValueError(fmt)


def _scale_bytes(fmt: str, N: int, Kw: int) -> int:
    if fmt == "fp8":
        return math.ceil(N / 128) * math.ceil(Kw / 128)
    if fmt == "fp4":
        return N * (Kw // 32)
    return 0


def _torch_linear(t, dtype, groups):
    import torch

    x, w = t["x"], t["weight"]
    if groups == 1:
        return torch.nn.functional.linear(x, w)
    M, K = x.shape
    G = groups
    return torch.einsum("mgk,gnk->mgn", x.view(M, G, K // G), w.view(G, w.shape[0] // G, w.shape[1])).reshape(M, -1)


def linear_cases(Ms, phase, *, smoke=False, quick=False, act="float32") -> list:
    out = []
    rng = np.random.default_rng(1)
    for key, label, N, Kw, G, fmt, in_quick, in_smoke in LINEAR_SHAPES:
        if smoke != in_smoke:
            continue
        if quick and not in_quick:
            continue
        op = {"f32": "Linear", "bf16": "Linear", "fp8": "LinearFp8", "fp4": "LinearFp4"}[fmt]
        attrs = {"groups": G}
        if fmt == "fp8":
            attrs["block_size"] = 128
        K = Kw * G
        for M in Ms:
            x = _rand(rng, (M, K))
            if act == "bfloat16":
                x = (x.view(np.uint32) >> 16).astype(np.uint16)
            tname = "bfloat16" if act == "bfloat16" else "float"
            inputs = [_act("x", x, tname)] + _weight_inputs(fmt, N, Kw)
            a = ACT_BYTES[act]
            wbytes = N * Kw * WEIGHT_BYTES[fmt] + _scale_bytes(fmt, N, Kw)
            dense = [Input("x", "act", dtype="float", data=None), Input("weight", "weight", (N, Kw), "float")]
            out.append(KernelCase(
                key=f"linear.{key}" + (".bf16act" if act == "bfloat16" else ""), group="Linear", op=op,
                families=("linear",), label=label + (" (bf16 activations)" if act == "bfloat16" else ""),
                phase=phase, m=M, inputs=inputs, outputs=[("y", None, tname)], attrs=attrs,
                flops=2.0 * M * N * Kw, bytes=wbytes + M * K * a + M * N * a, cold_bytes=wbytes, act_dtype=act,
                shape={"M": M, "N": N, "K": K, "groups": G, "weight": fmt},
                torch_fn=lambda t, dt, G=G: _torch_linear(t, dt, G), torch_inputs=[_act("x", x, tname)] + dense[1:],
                torch_dtypes=("bfloat16",) if act == "bfloat16" else ("float32", "bfloat16"),
                ort_baselines=("matmul_fp32", "matmulnbits_int4") if G == 1 and act == "float32" else (),
                quick=in_quick, smoke=in_smoke))
    if smoke or quick or act != "float32":
        return out
    for key, label, N, Kw, fmt, products in PRODUCT_TWINS:
        op = {"fp8": "LinearFp8", "fp4": "LinearFp4"}[fmt]
        attrs = {"groups": 1, **({"block_size": 128} if fmt == "fp8" else {}),
                 **({"compute": products} if products != "fp32" else {})}
        for M in Ms:
            x = _rand(rng, (M, Kw))
            wbytes = N * Kw * WEIGHT_BYTES[fmt] + _scale_bytes(fmt, N, Kw)
            dense = [Input("x", "act", dtype="float", data=None), Input("weight", "weight", (N, Kw), "float")]
            out.append(KernelCase(
                key=f"linear.{key}", group="Linear", op=op, families=("linear",), label=label, phase=phase,
                m=M, inputs=[_act("x", x)] + _weight_inputs(fmt, N, Kw), outputs=[("y", None, "float")],
                attrs=attrs, flops=2.0 * M * N * Kw, bytes=wbytes + 4 * M * (Kw + N), cold_bytes=wbytes,
                shape={"M": M, "N": N, "K": Kw, "groups": 1, "weight": fmt, "products": products},
                torch_fn=lambda t, dt: _torch_linear(t, dt, 1), torch_inputs=[_act("x", x)] + dense[1:],
                torch_dtypes=("float32",) if products == "fp32" else ("bfloat16",),
                ort_baselines=TWIN_BASELINES[products]))
    return out


# ---------------------------------------------------------------------------------------------------- MoE


def _route_cycle(M, k, E, run):
    """Deterministic routing that walks through all experts: run r, token t, slot j -> expert
    ((r*M + t)*k + j) mod E. Consecutive runs touch different experts, so the stack streams from DRAM."""
    base = (run * M * k) % E
    idx = (base + np.arange(M * k)) % E
    return idx.reshape(M, k).astype(np.int64)


def _route_random(M, k, E, seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int64)


def moe_cases(Ms, phase, *, smoke=False, quick=False, act="float32") -> list:
    out = []
    rng = np.random.default_rng(2)
    tname = "bfloat16" if act == "bfloat16" else "float"
    # key, label, model dims, E, format, quick, smoke
    variants = [
        ("routed.flash.fp4", "routed experts Flash FP4 (64 experts, top-6)", FLASH, 64, "fp4", True, False),
        ("routed.pro.fp4", "routed experts Pro FP4 (32 experts, top-6)", PRO, 32, "fp4", False, False),
        ("routed.flash.bf16", "routed experts Flash bf16 (16 experts, top-6)", FLASH, 16, "bf16", False, False),
        ("routed.smoke.fp4", "routed experts FP4 (smoke: 8 x 256 x 512)", dict(d=512, I=256, k=2), 8, "fp4", False,
         True),
    ]
    for key, label, cfg, E, fmt, in_quick, in_smoke in variants:
        if smoke != in_smoke or (quick and not in_quick):
            continue
        d, I, k = cfg["d"], cfg["I"], cfg["k"]
        op = {"fp4": "MoeExpertsFp4", "fp8": "MoeExpertsFp8", "bf16": "MoeExperts", "f32": "MoeExperts"}[fmt]
        for M in Ms:
            x = _rand(rng, (M, d))
            if act == "bfloat16":
                x = (x.view(np.uint32) >> 16).astype(np.uint16)
            idx = _route_cycle(M, k, E, 0) if phase == "decode" else _route_random(M, k, E, M)
            w = np.full((M, k), 1.5 / k, np.float32)
            inputs = [_act("x", x, tname), _act("weights", w), _act("indices", idx, "int64")]
            wi = _weight_inputs(fmt, I, d, ("w1", "s1"), (E,))
            w2 = _weight_inputs(fmt, d, I, ("w2", "s2"), (E,))
            w3 = _weight_inputs(fmt, I, d, ("w3", "s3"), (E,))
            inputs += [wi[0], w2[0], w3[0]] + ([wi[1], w2[1], w3[1]] if len(wi) > 1 else [])
            per_expert = 3 * I * d * WEIGHT_BYTES[fmt] + _scale_bytes(fmt, I, d) * 2 + _scale_bytes(fmt, d, I)
            unique = len(np.unique(idx))
            wbytes = unique * per_expert
            rotate = None
            if phase == "decode":
                rotate = (lambda r, M=M, k=k, E=E: {"indices": _route_cycle(M, k, E, r)})
            dense_inputs = [_act("x", x, tname), _act("weights", w), _act("indices", idx, "int64"),
                            Input("w1", "weight", (E, I, d), "float"), Input("w2", "weight", (E, d, I), "float"),
                            Input("w3", "weight", (E, I, d), "float")]
            out.append(KernelCase(
                key=f"moe.{key}" + (".bf16act" if act == "bfloat16" else ""), group="MoE experts", op=op,
                families=("moe_experts",), label=label + (" (bf16 activations)" if act == "bfloat16" else ""),
                phase=phase, m=M, inputs=inputs, outputs=[("y", None, tname)], attrs={"swiglu_limit": 10.0},
                flops=6.0 * M * k * I * d, bytes=wbytes + 2 * M * d * ACT_BYTES[act] + M * k * 12, cold_bytes=wbytes,
                act_dtype=act, torch_dtypes=("bfloat16",) if act == "bfloat16" else ("float32", "bfloat16"),
                shape={"M": M, "d": d, "I": I, "E": E, "k": k, "weight": fmt, "experts_touched": unique,
                       "tokens_per_expert": round(M * k / E, 2)},
                single_node=True, rotate=rotate, torch_fn=_torch_moe, torch_inputs=dense_inputs,
                torch_rotate=(lambda r, n, M=M, k=k: {"indices": _route_cycle(M, k, n, r)}) if phase == "decode"
                else (lambda r, n, M=M, k=k: {"indices": _route_random(M, k, n, M)}),
                quick=in_quick, smoke=in_smoke,
                note="routing walks through the experts so every call reads experts the previous calls did not"
                if phase == "decode" else "uniform random routing"))
    # the shared expert (dense-MLP mode, FP8), node copies for rotation
    if not smoke and act == "float32":
        cfg = FLASH
        d, I = cfg["d"], cfg["I"]
        for M in Ms:
            if quick:
                break
            x = _rand(rng, (M, d))
            wi = _weight_inputs("fp8", I, d, ("w1", "s1"), (1,))
            w2 = _weight_inputs("fp8", d, I, ("w2", "s2"), (1,))
            w3 = _weight_inputs("fp8", I, d, ("w3", "s3"), (1,))
            inputs = [_act("x", x), Input("weights", "absent"), Input("indices", "absent"), wi[0], w2[0], w3[0],
                      wi[1], w2[1], w3[1]]
            wbytes = 3 * I * d + 2 * _scale_bytes("fp8", I, d) + _scale_bytes("fp8", d, I)
            dense_inputs = [_act("x", x), Input("w1", "weight", (1, I, d), "float"),
                            Input("w2", "weight", (1, d, I), "float"), Input("w3", "weight", (1, I, d), "float")]
            out.append(KernelCase(
                key="moe.shared.flash.fp8", group="MoE experts", op="MoeExpertsFp8",
                families=("moe_experts",), label="shared expert Flash FP8 (dense MLP)", phase=phase, m=M,
                inputs=inputs, outputs=[("y", None, "float")], attrs={"swiglu_limit": 10.0, "block_size": 128},
                flops=6.0 * M * I * d, bytes=wbytes + 2 * M * d * 4, cold_bytes=wbytes,
                shape={"M": M, "d": d, "I": I, "weight": "fp8"}, torch_fn=_torch_shared, torch_inputs=dense_inputs))
    return out


def _torch_moe(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.moe_ffn(t["x"], t["weights"], t["indices"], t["w1"], t["w2"], t["w3"], swiglu_limit=10.0)


def _torch_shared(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.expert_ffn(t["x"], t["w1"][0], t["w2"][0], t["w3"][0], swiglu_limit=10.0)


# ---------------------------------------------------------------------------------------------------- attention


def _csa_indices(rng, B, S, start, topk, ratio=4):
    """[B, S, topk] int64: per query the min(topk, visible) best entries (random distinct visible ones), -1 pad."""
    out = np.full((B, S, topk), -1, np.int64)
    for b in range(B):
        for s in range(S):
            vis = (start + s + 1) // ratio
            if vis <= 0:
                continue
            n = min(topk, vis)
            out[b, s, :n] = rng.choice(vis, n, replace=False) if vis > n else rng.permutation(vis)
    return out


def attention_cases(settings, phase, *, smoke=False, quick=False) -> list:
    out = []
    rng = np.random.default_rng(3)
    kinds = [("csa", 4), ("hca", 128), ("swa", 0)]
    models = [FLASH] if (quick or smoke) else [FLASH, PRO]
    for cfg in models:
        H, D, win, topk = cfg["H"], cfg["D"], cfg["win"], cfg["topk"]
        if smoke:
            H, D, win, topk = 8, 128, 16, 16
        for kind, ratio in kinds:
            if cfg is PRO and kind != "csa":
                continue
            if quick and kind == "swa":
                continue
            if smoke and kind != "csa":
                continue
            configs = []
            if phase == "decode":
                for ctx in settings["contexts"]:
                    for B in settings["batches"]:
                        configs.append((B, 1, ctx))
            else:
                for S in settings["prefill_ms"]:
                    configs.append((1, S, 0))
            for B, S, start in configs:
                N = (start + S + max(ratio, 1)) // max(ratio, 1) if ratio else 0
                q = _rand(rng, (B, S, H, D))
                kv = _rand(rng, (B, S, D))
                sink = _rand(rng, (H,), 0.5)
                sp = np.full(B, start, np.int64)
                inputs = [_act("q", q), _act("kv", kv), Input("past_window", "state", (B, win, D), "float")]
                if ratio:
                    inputs.append(Input("entries", "state", (B, N, D), "float"))
                else:
                    inputs.append(Input("entries", "absent"))
                n_sel = 0
                if kind == "csa":
                    if phase == "decode":
                        inputs.append(Input("indices", "node", (B, S, topk), "int64",
                                            data=lambda i, B=B, S=S, start=start, topk=topk:
                                            _csa_indices(np.random.default_rng(100 + i), B, S, start, topk)))
                        n_sel = min(topk, (start + 1) // 4)
                        sel_rows = B * n_sel
                    else:
                        idx = _csa_indices(rng, B, S, start, topk)
                        inputs.append(_act("indices", idx, "int64"))
                        sel_rows = sum(len(np.unique(idx[b][idx[b] >= 0])) for b in range(B))
                        n_sel = float(np.mean((idx >= 0).sum(-1)))
                elif kind == "hca":
                    inputs.append(Input("indices", "absent"))
                    n_sel = float(np.mean([(start + s + 1) // ratio for s in range(S)]))
                    sel_rows = B * ((start + S) // ratio)
                else:
                    inputs.append(Input("indices", "absent"))
                    sel_rows = 0
                inputs += [Input("sink", "const", dtype="float", data=sink),
                           Input("inv_freq", "const", dtype="float", data=inv_freq(cfg["rd"] if not smoke else 32)),
                           _act("start_pos", sp, "int64")]
                n_win = float(np.mean([min(win, start + s + 1) for s in range(S)]))
                keys = n_win + n_sel
                state_read = B * min(win, start + S) * D * 4 + sel_rows * D * 4
                flops = 4.0 * B * S * H * keys * D
                io = 2 * B * S * H * D * 4 + B * S * D * 4 + (B * S * topk * 8 if kind == "csa" else 0)
                ctx_label = f"ctx {start}" if phase == "decode" else f"S {S}"
                out.append(KernelCase(
                    key=f"attn.{kind}.{cfg['name'].lower()}" + (f".ctx{start}" if phase == "decode" else ""),
                    group="Attention", op="SparseAttention", families=("sparse_attention",),
                    label=f"{kind.upper()} attention {cfg['name']} ({H} heads" +
                          (f", top-{topk}" if kind == "csa" else "") + f", {ctx_label})",
                    phase=phase, m=B * S, inputs=inputs,
                    outputs=[("o", None, "float"), ("present_window", "past_window", "float")],
                    attrs={"ratio": ratio}, flops=flops, bytes=state_read + io, cold_bytes=state_read,
                    shape={"B": B, "S": S, "H": H, "D": D, "context": start, "keys_per_query": round(keys, 1),
                           "ratio": ratio},
                    torch_fn=(lambda t, dt, ratio=ratio: _torch_attention(t, ratio)),
                    quick=True, smoke=smoke))
    return out


def _torch_attention(t, ratio):
    from dsv4_ort.models import functional as Fn

    return Fn.sparse_attention(t["q"], t["kv"], t["past_window"], t.get("entries"), t.get("indices"), t["sink"],
                               t["inv_freq"], t["start_pos"], ratio=ratio)


# ---------------------------------------------------------------------------------------------------- indexer


def indexer_cases(settings, phase, *, smoke=False, quick=False) -> list:
    out = []
    rng = np.random.default_rng(4)
    for cfg in ([FLASH] if (quick or smoke) else [FLASH, PRO]):
        nI, cI, topk = cfg["nI"], cfg["cI"], cfg["topk"]
        if smoke:
            nI, cI, topk = 8, 32, 16
        configs = ([(B, 1, ctx) for ctx in settings["contexts"] for B in settings["batches"]]
                   if phase == "decode" else [(1, S, 0) for S in settings["prefill_ms"]])
        for B, S, start in configs:
            N = (start + S) // 4 + 1
            q = _rand(rng, (B, S, nI, cI))
            w = _rand(rng, (B, S, nI))
            inputs = [_act("q", q), _act("weights", w), Input("keys", "state", (B, N, cI), "float"),
                      _act("start_pos", np.full(B, start, np.int64), "int64")]
            vis = np.array([(start + s + 1) // 4 for s in range(S)], np.float64)
            flops = 2.0 * B * nI * cI * vis.sum() + 2.0 * B * nI * vis.sum()
            keys_read = B * ((start + S) // 4) * cI * 4
            io = q.nbytes + w.nbytes + B * S * topk * 8
            out.append(KernelCase(
                key=f"indexer.{cfg['name'].lower()}" + (f".ctx{start}" if phase == "decode" else ""),
                group="Indexer", op="Indexer", families=("indexer",),
                label=f"lightning indexer {cfg['name']} ({nI}x{cI}, top-{topk}, " +
                      (f"ctx {start})" if phase == "decode" else f"S {S})"),
                phase=phase, m=B * S, inputs=inputs, outputs=[("indices", None, "int64")],
                attrs={"ratio": 4, "index_topk": topk}, flops=flops, bytes=keys_read + io, cold_bytes=keys_read,
                shape={"B": B, "S": S, "nI": nI, "cI": cI, "context": start, "entries_scored": int(vis.max())},
                torch_fn=(lambda t, dt, topk=topk: _torch_indexer(t, topk)), quick=cfg is FLASH, smoke=smoke))
    return out


def _torch_indexer(t, topk):
    from dsv4_ort.models import functional as Fn

    return Fn.indexer_topk(t["q"], t["weights"], t["keys"], t["start_pos"], ratio=4, index_topk=topk)


# ---------------------------------------------------------------------------------------------------- compressor


def compressor_cases(settings, phase, *, smoke=False, quick=False) -> list:
    out = []
    rng = np.random.default_rng(5)
    # key, label, ratio, coff, width c
    variants = [("csa", "CSA compressor (r=4, overlapping, 512 wide)", 4, 2, 512),
                ("hca", "HCA compressor (r=128, 512 wide)", 128, 1, 512),
                ("index", "indexer compressor (r=4, overlapping, 128 wide)", 4, 2, 128)]
    if smoke:
        variants = [("csa", "CSA compressor (smoke)", 4, 2, 64)]
    for key, label, r, coff, c in variants:
        if quick and key != "csa":
            continue
        W = coff * c
        configs = ([(B, 1, ctx) for ctx in settings["contexts"][:1] for B in settings["batches"]]
                   if phase == "decode" else [(1, S, 0) for S in settings["prefill_ms"]])
        for B, S, start in configs:
            N = (start + S + 8 * r) // r + 1
            kv = _rand(rng, (B, S, W))
            score = _rand(rng, (B, S, W))
            norm_w = (np.ones(c, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            inputs = [_act("kv", kv), _act("score", score),
                      Input("ape", "const", dtype="float", data=_rand(rng, (r, W), 0.5)),
                      Input("norm_weight", "const", dtype="bfloat16", data=norm_w),
                      Input("inv_freq", "const", dtype="float", data=inv_freq(64 if c >= 64 else 32)),
                      _act("start_pos", np.full(B, start, np.int64), "int64"),
                      Input("past_entries", "state", (B, N, c), "float"),
                      Input("past_kv_state", "state", (B, coff * r, W), "float"),
                      Input("past_score_state", "state", (B, coff * r, W), "float")]
            emitted = B * ((start + S) // r - start // r)
            state_bytes = 2 * B * coff * r * W * 4
            rotate = None
            if phase == "decode":
                rotate = (lambda run, B=B, start=start, r=r: {"start_pos": np.full(B, start + run % max(r, 8),
                                                                                    np.int64)})
            out.append(KernelCase(
                key=f"compressor.{key}" + (f".ctx{start}" if phase == "decode" else ""), group="Compressor",
                op="Compressor", families=("compressor",), label=label, phase=phase, m=B * S, inputs=inputs,
                outputs=[("present_entries", "past_entries", "float"),
                         ("present_kv_state", "past_kv_state", "float"),
                         ("present_score_state", "past_score_state", "float")],
                attrs={"rms_eps": 1e-6}, flops=B * S * W * 12.0 + emitted * c * 8.0,
                bytes=2 * kv.nbytes + state_bytes + emitted * c * 4, cold_bytes=state_bytes,
                shape={"B": B, "S": S, "ratio": r, "width": c, "context": start},
                rotate=rotate, torch_fn=_torch_compressor, torch_dtypes=("float32",), quick=True, smoke=smoke,
                note="decode: consecutive positions, an entry every r-th call" if phase == "decode" else ""))
    return out


def _torch_compressor(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.compressor_step(t["kv"], t["score"], t["ape"], t["norm_weight"], t["inv_freq"], t["past_kv_state"],
                              t["past_score_state"], t["past_entries"], t["start_pos"], rms_eps=1e-6)


# ---------------------------------------------------------------------------------------------------- norms, rope


def norm_rope_cases(settings, phase, *, smoke=False, quick=False) -> list:
    out = []
    rng = np.random.default_rng(6)
    cfg = FLASH
    d, H, D = (512, 8, 128) if smoke else (cfg["d"], cfg["H"], cfg["D"])
    nI, cI = (8, 32) if smoke else (cfg["nI"], cfg["cI"])
    rd = 32 if smoke else cfg["rd"]
    Ms = settings["decode_ms"] if phase == "decode" else settings["prefill_ms"]
    bf1 = lambda n: (np.ones(n, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    for M in Ms:
        B, S = (M, 1) if phase == "decode" else (1, M)
        start = 4096 if phase == "decode" else 0
        sp = np.full(B, start, np.int64)
        x = _rand(rng, (M, d))
        out.append(KernelCase(
            key="norm.rmsnorm", group="Norm / RoPE", op="RmsNorm", families=("norm_rope",),
            label=f"RmsNorm ({d} wide, bf16 weight)", phase=phase, m=M,
            inputs=[_act("x", x), Input("weight", "const", dtype="bfloat16", data=bf1(d))],
            outputs=[("y", None, "float")], attrs={"eps": 1e-6}, flops=4.0 * M * d, bytes=2 * x.nbytes + 2 * d,
            cold_bytes=0, shape={"M": M, "n": d}, torch_fn=_torch_rmsnorm, quick=True, smoke=smoke))
        if smoke:
            continue
        q = _rand(rng, (B, S, H, D))
        out.append(KernelCase(
            key="norm.q_norm_rope", group="Norm / RoPE", op="NormRope", families=("norm_rope",),
            label=f"q RMSNorm + RoPE ({H} heads x {D})", phase=phase, m=M,
            inputs=[_act("x", q), Input("weight", "absent"), _act("start_pos", sp, "int64"),
                    Input("inv_freq", "const", dtype="float", data=inv_freq(rd))],
            outputs=[("y", None, "float")], attrs={"eps": 1e-6}, flops=(4.0 * D + 3.0 * rd) * B * S * H,
            bytes=2 * q.nbytes, cold_bytes=0, shape={"B": B, "S": S, "H": H, "D": D},
            torch_fn=_torch_q_norm_rope, quick=not quick or M == Ms[0]))
        kvx = _rand(rng, (B, S, D))
        out.append(KernelCase(
            key="norm.kv_norm_rope", group="Norm / RoPE", op="NormRope", families=("norm_rope",),
            label=f"kv RMSNorm + RoPE ({D})", phase=phase, m=M,
            inputs=[_act("x", kvx), Input("weight", "const", dtype="bfloat16", data=bf1(D)),
                    _act("start_pos", sp, "int64"), Input("inv_freq", "const", dtype="float", data=inv_freq(rd))],
            outputs=[("y", None, "float")], attrs={"eps": 1e-6}, flops=(4.0 * D + 3.0 * rd) * B * S,
            bytes=2 * kvx.nbytes, cold_bytes=0, shape={"B": B, "S": S, "D": D}, torch_fn=_torch_kv_norm_rope))
        xi = _rand(rng, (B, S, nI, cI))
        out.append(KernelCase(
            key="norm.rope_indexer_q", group="Norm / RoPE", op="Rope", families=("norm_rope",),
            label=f"RoPE on indexer q ({nI} x {cI})", phase=phase, m=M,
            inputs=[_act("x", xi), _act("start_pos", sp, "int64"),
                    Input("inv_freq", "const", dtype="float", data=inv_freq(rd))],
            outputs=[("y", None, "float")], attrs={"inverse": 0}, flops=3.0 * rd * B * S * nI,
            bytes=2 * xi.nbytes, cold_bytes=0, shape={"B": B, "S": S, "heads": nI, "D": cI},
            torch_fn=_torch_rope))
    return [c for c in out if not quick or c.quick]


def _positions(t):
    import torch

    sp = t["start_pos"]
    S = t["x"].shape[1]
    return sp[:, None] + torch.arange(S)


def _torch_rmsnorm(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.rms_norm(t["x"], t["weight"], 1e-6)


def _torch_q_norm_rope(t, dtype):
    from dsv4_ort.models import functional as Fn

    cos, sin = Fn.rope_cos_sin(_positions(t), t["inv_freq"])
    return Fn.q_norm_rope(t["x"], cos, sin, rms_eps=1e-6)


def _torch_kv_norm_rope(t, dtype):
    from dsv4_ort.models import functional as Fn

    cos, sin = Fn.rope_cos_sin(_positions(t), t["inv_freq"])
    return Fn.kv_norm_rope(t["x"], t["weight"], cos, sin, rms_eps=1e-6)


def _torch_rope(t, dtype):
    from dsv4_ort.models import functional as Fn

    cos, sin = Fn.rope_cos_sin(_positions(t), t["inv_freq"])
    return Fn.apply_rope(t["x"], cos[:, :, None, :], sin[:, :, None, :])


# ---------------------------------------------------------------------------------------------------- mHC


def hc_cases(settings, phase, *, smoke=False, quick=False) -> list:
    out = []
    rng = np.random.default_rng(7)
    hc = 4
    d = 512 if smoke else FLASH["d"]
    mix = (2 + hc) * hc
    Ms = settings["decode_ms"] if phase == "decode" else settings["prefill_ms"]
    for M in Ms:
        x = _rand(rng, (M, hc, d))
        out.append(KernelCase(
            key="hc.pre", group="mHC", op="HcPre", families=("hyper_connection",),
            label=f"HcPre (4 streams x {d}, Sinkhorn 20)", phase=phase, m=M,
            inputs=[_act("x", x), Input("fn", "weight", (mix, hc * d), "float"),
                    Input("scale", "const", dtype="float", data=np.ones(3, np.float32)),
                    Input("base", "const", dtype="float", data=_rand(rng, (mix,), 0.5))],
            outputs=[("h", None, "float"), ("post", None, "float"), ("comb", None, "float")],
            attrs={"rms_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20},
            flops=2.0 * M * mix * hc * d + 2.0 * M * hc * d + M * 20 * hc * hc * 6.0,
            bytes=x.nbytes + mix * hc * d * 4 + M * d * 4, cold_bytes=mix * hc * d * 4,
            shape={"M": M, "hc": hc, "d": d}, torch_fn=_torch_hc_pre, torch_fp32_inputs=("fn",), quick=True,
            smoke=smoke))
        if smoke:
            continue
        f = _rand(rng, (M, d))
        post = _rand(rng, (M, hc))
        comb = _rand(rng, (M, hc, hc))
        out.append(KernelCase(
            key="hc.post", group="mHC", op="HcPost", families=("hyper_connection",),
            label=f"HcPost (4 streams x {d})", phase=phase, m=M,
            inputs=[_act("f", f), _act("residual", x), _act("post", post), _act("comb", comb)],
            outputs=[("out", None, "float")], attrs={}, flops=2.0 * M * hc * d * (1 + hc),
            bytes=f.nbytes + 2 * x.nbytes, cold_bytes=0, shape={"M": M, "hc": hc, "d": d},
            torch_fn=_torch_hc_post, torch_fp32_inputs=("post", "comb"), quick=False))
        out.append(KernelCase(
            key="hc.head", group="mHC", op="HcHead", families=("hyper_connection",),
            label=f"HcHead (4 streams x {d})", phase=phase, m=M,
            inputs=[_act("x", x), Input("fn", "weight", (hc, hc * d), "float"),
                    Input("scale", "const", dtype="float", data=np.ones(1, np.float32)),
                    Input("base", "const", dtype="float", data=_rand(rng, (hc,), 0.5))],
            outputs=[("y", None, "float")], attrs={"rms_eps": 1e-6, "hc_eps": 1e-6},
            flops=2.0 * M * hc * hc * d + 2.0 * M * hc * d, bytes=x.nbytes + hc * hc * d * 4 + M * d * 4,
            cold_bytes=hc * hc * d * 4, shape={"M": M, "hc": hc, "d": d}, torch_fn=_torch_hc_head,
            torch_fp32_inputs=("fn",), quick=False))
    return [c for c in out if not quick or c.quick]


def _torch_hc_pre(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.hc_pre(t["x"], t["fn"], t["scale"], t["base"], rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


def _torch_hc_post(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.hc_post(t["f"], t["residual"], t["post"], t["comb"])


def _torch_hc_head(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.hc_head(t["x"], t["fn"], t["scale"], t["base"], rms_eps=1e-6, hc_eps=1e-6)


# ---------------------------------------------------------------------------------------------------- routing


def routing_cases(settings, phase, *, smoke=False, quick=False) -> list:
    out = []
    rng = np.random.default_rng(8)
    E, k, V = (16, 2, 1000) if smoke else (FLASH["E"], FLASH["k"], FLASH["vocab"])
    Ms = settings["decode_ms"] if phase == "decode" else settings["prefill_ms"]
    tid2eid = np.stack([rng.choice(E, k, replace=False) for _ in range(V)]).astype(np.int64)
    for M in Ms:
        logits = _rand(rng, (M, E))
        attrs = {"scoring": "sqrtsoftplus", "norm_topk_prob": 1, "routed_scaling_factor": 1.5}
        out.append(KernelCase(
            key="route.topk", group="MoE routing", op="MoeRouteTopK", families=("moe_routing",),
            label=f"MoeRouteTopK (top-{k} of {E}, sqrt-softplus, bias)", phase=phase, m=M,
            inputs=[_act("logits", logits), Input("bias", "const", dtype="float", data=_rand(rng, (E,), 0.1))],
            outputs=[("weights", None, "float"), ("indices", None, "int64")], attrs={"top_k": k, **attrs},
            flops=M * E * 8.0, bytes=logits.nbytes + M * k * 12, cold_bytes=0, shape={"M": M, "E": E, "k": k},
            torch_fn=(lambda t, dt, k=k: _torch_route_topk(t, k)), torch_dtypes=("float32",), quick=True,
            smoke=smoke))
        if smoke:
            continue
        ids = rng.integers(0, V, M).astype(np.int64)
        out.append(KernelCase(
            key="route.hash", group="MoE routing", op="MoeRouteHash", families=("moe_routing",),
            label=f"MoeRouteHash (tid2eid, {k} of {E})", phase=phase, m=M,
            inputs=[_act("logits", logits), _act("input_ids", ids, "int64"),
                    Input("tid2eid", "const", dtype="int64", data=tid2eid)],
            outputs=[("weights", None, "float"), ("indices", None, "int64")], attrs=attrs,
            flops=M * E * 4.0, bytes=logits.nbytes + M * k * 20, cold_bytes=0, shape={"M": M, "E": E, "k": k},
            torch_fn=_torch_route_hash, torch_dtypes=("float32",), quick=False))
    return [c for c in out if not quick or c.quick]


def _torch_route_topk(t, k):
    from dsv4_ort.models import functional as Fn

    return Fn.route_topk(t["logits"], t["bias"], top_k=k, scoring="sqrtsoftplus", norm_topk_prob=True,
                         routed_scaling_factor=1.5)


def _torch_route_hash(t, dtype):
    from dsv4_ort.models import functional as Fn

    return Fn.route_hash(t["logits"], t["input_ids"], t["tid2eid"], scoring="sqrtsoftplus", norm_topk_prob=True,
                         routed_scaling_factor=1.5)


# ---------------------------------------------------------------------------------------------------- all


def all_cases(settings: dict, *, smoke: bool = False, quick: bool = False) -> list:
    """Every case for the given settings: decode_ms, prefill_ms, contexts, batches."""
    cases = []
    for phase in ("decode", "prefill"):
        ms = settings["decode_ms"] if phase == "decode" else settings["prefill_ms"]
        if not ms:
            continue
        cases += linear_cases(ms, phase, smoke=smoke, quick=quick)
        if not smoke and not quick:
            cases += [c for c in linear_cases(ms, phase, act="bfloat16") if c.key.startswith("linear.sq.bf16")]
        cases += moe_cases(ms if phase == "decode" else ms, phase, smoke=smoke, quick=quick)
        if not smoke and not quick:
            cases += [c for c in moe_cases(ms, phase, act="bfloat16") if c.key.startswith("moe.routed.flash.fp4")]
        cases += attention_cases(settings, phase, smoke=smoke, quick=quick)
        cases += indexer_cases(settings, phase, smoke=smoke, quick=quick)
        cases += compressor_cases(settings, phase, smoke=smoke, quick=quick)
        cases += norm_rope_cases(settings, phase, smoke=smoke, quick=quick)
        cases += hc_cases(settings, phase, smoke=smoke, quick=quick)
        cases += routing_cases(settings, phase, smoke=smoke, quick=quick)
    return interleave(cases)


def interleave(cases: list) -> list:
    """Per phase, round-robin over the groups (each group keeps its order, smaller M first within a case), so a
    run cut short by its time budget still covers every op family."""
    out = []
    for phase in ("decode", "prefill"):
        groups = {}
        for c in cases:
            if c.phase == phase:
                groups.setdefault(c.group, []).append(c)
        # within a group: cases in definition order, each case's M values together (ascending)
        queues = []
        for g in groups.values():
            keys = []
            for c in g:
                if c.key not in keys:
                    keys.append(c.key)
            queues.append([c for k in keys for c in sorted((x for x in g if x.key == k), key=lambda x: x.m)])
        while any(queues):
            for q in queues:
                if q:
                    head = q.pop(0)
                    out.append(head)
                    while q and q[0].key == head.key:  # keep the M sweep of one case together
                        out.append(q.pop(0))
    return out


__all__ = ["KernelCase", "all_cases", "FLASH", "PRO", "TYPES"]
