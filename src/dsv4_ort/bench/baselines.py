"""Kernel-level baselines measured beside the ops, on the same shapes and with the same weight rotation.

* ``torch_fp32`` / ``torch_bf16`` - the PyTorch reference (``dsv4_ort.models.functional``, eager) with activations
  and weights in float32 / bfloat16, as the reference model holds them (dense weights: the reference model keeps
  FP8/FP4 checkpoint weights dequantised). For the linear cases this is ``torch.nn.functional.linear``, so
  ``torch_bf16`` there is also the plain bf16 GEMM of PyTorch.
* ``ort_matmul_fp32`` - onnxruntime's own ``MatMul`` on float32 weights (constant, so MLAS pre-packs them).
* ``ort_matmulnbits_int4`` - onnxruntime's ``com.microsoft.MatMulNBits``: 4-bit weights in blocks of 32 with a
  float scale per block (its format, not FP4 E2M1; same shape and a similar 4.5 bits per weight), float32
  activations, ``accuracy_level`` 4 (int8 compute, its fastest CPU path) and 0 (float32 compute) in full runs.

Each baseline gets its own weights from the pool in its own format, so bytes and rotation are its own.
"""

from __future__ import annotations

import math

import numpy as np

from .ortgraph import Input, NodeGraph, NodeSpec, nbytes

TORCH_DTYPES = {"float32": "float", "bfloat16": "bfloat16"}


def _torch_tensor(arr: np.ndarray, onnx_dtype: str):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(arr))
    if onnx_dtype == "bfloat16":
        return t.view(torch.bfloat16)
    return t


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, np.float32)
    return ((a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)


class TorchBaseline:
    """n copies of the reference call, each on its own pool tensors; ``run`` calls all of them."""

    def __init__(self, case, dtype: str, pool, n: int):
        import torch

        self.case, self.dtype, self.n = case, dtype, n
        inputs = case.torch_inputs or case.inputs
        self.experts = None
        if case.torch_rotate is not None:  # MoE: as many experts as fit the pool (routing walks through them)
            w_in = [i for i in inputs if i.kind == "weight"]
            per_expert = sum(nbytes(i.shape[1:], TORCH_DTYPES[dtype] if i.dtype == "float" else i.dtype)
                             for i in w_in)
            k = next(i.data.shape[1] for i in inputs if i.name == "indices")
            E = w_in[0].shape[0]
            self.experts = int(max(k, min(E, pool.size // max(per_expert, 1))))
            inputs = [Input(i.name, i.kind, (self.experts, *i.shape[1:]), i.dtype, i.data) if i.kind == "weight"
                      else i for i in inputs]
            # the case's own routing may name experts past the ones held here: start from run 0 of the rotation
            routed = case.torch_rotate(0, self.experts)
            inputs = [Input(i.name, i.kind, i.shape, i.dtype, routed[i.name]) if i.name in routed else i
                      for i in inputs]
        self.inputs = inputs
        self.nodes = []
        self.cold_bytes_alloc = 0
        keep32 = set(case.torch_fp32_inputs)
        for node in range(n):
            t = {}
            for inp in inputs:
                if inp.kind == "absent":
                    continue
                if inp.kind in ("act", "const"):
                    if node > 0:
                        t[inp.name] = self.nodes[0][inp.name]
                        continue
                    if inp.dtype == "float" and inp.kind == "act" and dtype == "bfloat16" and inp.name not in keep32:
                        t[inp.name] = _torch_tensor(_to_bf16_bits(inp.data), "bfloat16")
                    else:
                        t[inp.name] = _torch_tensor(inp.data, inp.dtype)
                elif inp.kind == "node":
                    t[inp.name] = _torch_tensor(inp.data(node), inp.dtype)
                elif inp.kind == "scale":
                    t[inp.name] = _torch_tensor(pool.take_scales(inp.shape), inp.dtype)
                else:  # weight / state
                    dt = TORCH_DTYPES[dtype] if inp.dtype == "float" and inp.name not in keep32 else inp.dtype
                    arr = pool.take(inp.shape, dt)
                    t[inp.name] = _torch_tensor(arr, dt)
                    self.cold_bytes_alloc += arr.nbytes
            self.nodes.append(t)
        self.torch = torch

    def rotate(self, run: int):
        if self.case.torch_rotate is None:
            return
        for name, arr in self.case.torch_rotate(run, self.experts).items():
            self.nodes[0][name] = _torch_tensor(arr, "int64")

    def run(self):
        with self.torch.inference_mode():
            for t in self.nodes:
                self.case.torch_fn(t, self.dtype)


# ---------------------------------------------------------------------------------------------------- ORT


def ort_matmul_spec(case, pool_dtype="float"):
    x = next(i for i in case.inputs if i.name == "x")
    N, K = case.shape["N"], case.shape["K"]
    spec = NodeSpec("MatMul", "", [Input("A", "act", dtype="float", data=x.data),
                                   Input("B", "weight", (K, N), "float")], [("Y", None, "float")], {})
    weight_bytes = K * N * 4
    return spec, weight_bytes, {}


def ort_matmulnbits_spec(case, accuracy_level: int):
    x = next(i for i in case.inputs if i.name == "x")
    N, K = case.shape["N"], case.shape["K"]
    block = 32
    nb = math.ceil(K / block)
    spec = NodeSpec("MatMulNBits", "com.microsoft",
                    [Input("A", "act", dtype="float", data=x.data),
                     Input("B", "weight", (N, nb, block // 2), "uint8"),
                     Input("scales", "weight", (N * nb,), "float")],
                    [("Y", None, "float")],
                    {"K": K, "N": N, "bits": 4, "block_size": block, "accuracy_level": accuracy_level})
    weight_bytes = N * nb * (block // 2) + N * nb * 4
    return spec, weight_bytes, {"com.microsoft": 1}


ORT_BASELINES = {
    "matmul_fp32": ("ort_matmul_fp32", lambda case: ort_matmul_spec(case)),
    "matmulnbits_int4": ("ort_matmulnbits_int4", lambda case: ort_matmulnbits_spec(case, 4)),
    "matmulnbits_int4_fp32": ("ort_matmulnbits_int4_acc0", lambda case: ort_matmulnbits_spec(case, 0)),
}

# Compute path that bounds each baseline (see machine.PEAK_PATHS).
BASELINE_PATHS = {
    "torch_fp32": ("float32", ["fp32_fma_zmm", "fp32_fma_ymm", "fp32_sse_muladd"]),
    "torch_bf16": ("bfloat16", ["amx_bf16", "bf16_dp_zmm", "fp32_fma_zmm", "fp32_fma_ymm", "fp32_sse_muladd"]),
    "ort_matmul_fp32": ("float32", ["fp32_fma_zmm", "fp32_fma_ymm", "fp32_sse_muladd"]),
    "ort_matmulnbits_int4": ("float32", ["amx_int8", "int8_vnni_zmm", "fp32_fma_zmm", "fp32_fma_ymm"]),
    "ort_matmulnbits_int4_acc0": ("float32", ["fp32_fma_zmm", "fp32_fma_ymm", "fp32_sse_muladd"]),
}


def best_path(peaks: dict, impl: str):
    for p in BASELINE_PATHS.get(impl, ("float32", ["fp32_fma_zmm"]))[1]:
        if p in peaks:
            return p, peaks[p]["best"]
    return None, None


def ort_baseline_graph(spec, opsets, n, pool, threads):
    return NodeGraph(spec, n, pool, threads=threads, register_library=False, opsets=opsets)


__all__ = ["TorchBaseline", "ORT_BASELINES", "BASELINE_PATHS", "best_path", "ort_baseline_graph"]
