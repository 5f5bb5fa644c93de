"""The two RoPE inverse-frequency tables of DeepSeek-V4, in numpy (no torch).

:func:`dsv4_ort.models.functional.rope_freqs` (the reference model) and the exporter (an initializer of the graph)
both take their tables from :func:`inv_freq`, so the exported graph and the reference rotate by identical angles.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["inv_freq"]


def inv_freq(config, compressed: bool) -> np.ndarray:
    """Inverse frequencies ``[rd/2]`` float32 of one of the two RoPE tables.

    ``compressed=False``: ratio-0 layers and MTP, base ``rope_theta``, plain: ``f_i = base ** -(2i / rd)``.
    ``compressed=True``: ratio > 0 layers (attention, compressors, indexer), base ``compress_rope_theta``
    with YaRN from ``config.rope_scaling`` (if set): ``f_i' = f_i/factor * ramp_i + f_i * (1 - ramp_i)``,
    ``ramp_i = clamp((i - low) / (high - low), 0, 1)``, low/high from beta_fast/beta_slow (floored /
    ceiled). No YaRN attention factor (mscale) is applied anywhere.

    The exponents ``2i / rd`` are float32 (as in transformers); the rest is computed in float64 and rounded once,
    so the table is the same on every platform (transformers computes in float32: within 2 ulps of this).
    """
    rd = config.qk_rope_head_dim
    base = float(config.compress_rope_theta if compressed else config.rope_theta)
    exps = np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)
    pos_freqs = np.array([math.pow(base, float(e)) for e in exps], dtype=np.float64)
    inv = 1.0 / pos_freqs
    rs = config.rope_scaling
    if not compressed or rs is None or rs.get("type", rs.get("rope_type")) != "yarn":
        return inv.astype(np.float32)
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])

    def corr_dim(n_rot: float) -> float:
        return rd * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs.get("beta_fast") or 32)), 0)
    high = min(math.ceil(corr_dim(rs.get("beta_slow") or 1)), rd - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rd // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    return ((1.0 / (factor * pos_freqs)) * (1.0 - keep) + inv * keep).astype(np.float32)
