"""Weights in the checkpoint formats for the Linear / MoeExperts op tests, built with models.quant from random floats.

A format name selects the op and its weight inputs:
  f32, bf16      dense weight (Linear / MoeExperts)
  fp8_e8m0       float8e4m3fn + uint8 E8M0 block scales (LinearFp8 / MoeExpertsFp8)
  fp8_f32        float8e4m3fn + float32 block scales, deliberately not powers of two
  fp4            packed E2M1 (uint8, low nibble = even index) + uint8 E8M0 1x32 scales (LinearFp4 / MoeExpertsFp4)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnx_helpers import bf16, fp8_e4m3

from dsv4_ort.models import quant

FORMATS = ["f32", "bf16", "fp8_e8m0", "fp8_f32", "fp4"]
SUFFIX = {"f32": "", "bf16": "", "fp8_e8m0": "Fp8", "fp8_f32": "Fp8", "fp4": "Fp4"}


@dataclass
class Weight:
    data: np.ndarray               # the op's weight input
    scale: np.ndarray | None       # the op's scale input (None for dense)
    torch_args: tuple              # (weight,) or (weight, scale) for models.functional.linear
    dense: torch.Tensor            # exact float32 value of the weight


def make_weight(w: torch.Tensor, fmt: str, block: int = 128, seed: int = 0) -> Weight:
    """One [rows, cols] weight in `fmt`."""
    w = w.float()
    if fmt == "f32":
        return Weight(w.numpy().copy(), None, (w,), w)
    if fmt == "bf16":
        wb = w.to(torch.bfloat16)
        return Weight(bf16(w.numpy()), None, (wb,), wb.float())
    if fmt.startswith("fp8"):
        q, s = quant.quant_fp8_block(w, block, scale_dtype="uint8")
        if fmt == "fp8_f32":
            rng = np.random.default_rng(seed)
            s = quant.e8m0_to_float(s) * torch.from_numpy(rng.uniform(0.75, 1.25, tuple(s.shape)).astype(np.float32))
        dense = quant.dequant_fp8_block(q, s, block)
        return Weight(fp8_e4m3(q), s.numpy().copy(), (q, s), dense)
    if fmt == "fp4":
        packed, s = quant.quant_fp4(w, scale_dtype="uint8", packed_dtype="uint8")
        return Weight(packed.numpy().copy(), s.numpy().copy(), (packed, s), quant.dequant_fp4(packed, s))
    raise ValueError(fmt)


def make_stacked(w: torch.Tensor, fmt: str, block: int = 128, seed: int = 0) -> Weight:
    """[E, rows, cols] weights, each expert quantised on its own; data and scales stacked along E."""
    w = w.float()
    if fmt == "f32":
        return Weight(w.numpy().copy(), None, (), w)
    if fmt == "bf16":
        return Weight(bf16(w.numpy()), None, (), w.to(torch.bfloat16).float())
    parts = [make_weight(w[e], fmt, block, seed + e) for e in range(w.shape[0])]
    data = np.stack([np.asarray(p.data) for p in parts])
    if fmt.startswith("fp8"):
        data = fp8_e4m3(data)
    return Weight(data, np.stack([p.scale for p in parts]), (), torch.stack([p.dense for p in parts]))
