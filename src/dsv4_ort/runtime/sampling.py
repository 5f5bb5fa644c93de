"""Next-token selection from float32 logits, in numpy (no torch at inference).

Rule, per row: greedy argmax when temperature == 0; otherwise logits / temperature, keep the top_k largest
(top_k > 0), then the smallest set of most likely tokens whose probability reaches top_p (top_p < 1; the token
that crosses the threshold is kept), renormalise, and draw with the exponential-race trick
``argmax(p / E)``, ``E ~ Exp(1)`` (equivalent to sampling from p; it is what DeepSeek's reference generator
and gpt-fast do). Ties in argmax go to the lowest token id. A ``numpy.random.Generator`` makes it reproducible.
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def sample(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """logits [B, V] float32 -> token ids [B] int64."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2:
        raise ValueError(f"sample: logits must be [batch, vocab], got shape {logits.shape}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sample: invalid temperature={temperature}, top_p={top_p}, top_k={top_k}")
    if temperature == 0:
        return logits.argmax(axis=-1).astype(np.int64)
    if rng is None:
        rng = np.random.default_rng()
    scaled = logits.astype(np.float64) / temperature
    V = scaled.shape[-1]
    if 0 < top_k < V:
        kth = np.sort(scaled, axis=-1)[:, V - top_k][:, None]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = softmax(scaled)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    race = probs / rng.exponential(1.0, size=probs.shape)
    return race.argmax(axis=-1).astype(np.int64)
