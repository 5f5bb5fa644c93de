"""Next-token selection from float32 logits, in numpy (no torch at inference).

Rule, per row: greedy argmax when temperature == 0; otherwise logits / temperature, keep the top_k largest
(top_k > 0), then the smallest set of most likely tokens whose probability reaches top_p (top_p < 1; the token
that crosses the threshold is kept), renormalise, and draw with the exponential-race trick
``argmax(p / E)``, ``E ~ Exp(1)`` (equivalent to sampling from p; it is what DeepSeek's reference generator
and gpt-fast do). Ties in argmax go to the lowest token id. A ``numpy.random.Generator`` makes it reproducible.

Parameters (checked by :func:`check_sampling`; a bad one is a ``TypeError`` or ``ValueError`` naming it):

* ``temperature``: a finite real number >= 0. A positive temperature below :data:`MIN_TEMPERATURE` (1e-6, which
  includes every denormal) is greedy, the limit of sampling as the temperature goes to 0: dividing by it would
  overflow the scaled logits to infinity, and at 1e-6 a logit gap of 1e-3 is already a factor of e^-1000.
* ``top_p``: a finite real number in (0, 1]; ``top_k``: an integer >= 0 (0: no limit; bools are not integers).
* ``logits``: NaN and +inf are errors naming the row and token (never a silent token 0); -inf is a masked token,
  allowed while each row keeps at least one finite logit.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

# Positive temperatures below this are greedy (see the module docstring).
MIN_TEMPERATURE = 1e-6


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def check_count(name: str, value, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``; TypeError for a non-integer (bools included), ValueError below it."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_seed(seed):
    """None or an integer >= 0 (what ``numpy.random.default_rng`` takes as a seed)."""
    if seed is None:
        return None
    return check_count("seed", seed)


def check_sampling(temperature=0.0, top_k=0, top_p=1.0) -> tuple:
    """Validated ``(temperature, top_k, top_p)`` as (float, int, float); see the module docstring."""
    if not _is_real(temperature):
        raise TypeError(f"temperature must be a real number, got {temperature!r} ({type(temperature).__name__})")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_real(top_p):
        raise TypeError(f"top_p must be a real number, got {top_p!r} ({type(top_p).__name__})")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    top_k = check_count("top_k", top_k)
    return float(temperature), top_k, float(top_p)


def check_logits(logits: np.ndarray, step: int | None = None) -> None:
    """Raises ValueError if a row of ``logits`` [B, V] holds NaN or +inf or has no finite value at all."""
    if logits.shape[-1] > 0 and np.isfinite(logits).all():  # the usual case, in one pass (a third of the time)
        return
    where = "" if step is None else f" at step {step}"
    bad = np.isnan(logits) | (logits == np.inf)
    if bad.any():
        b, v = map(int, np.argwhere(bad)[0])
        raise ValueError(f"non-finite logits{where}: row {b}, token {v} is {float(logits[b, v])}")
    dead = ~np.isfinite(logits).any(axis=-1)
    if dead.any():
        raise ValueError(f"non-finite logits{where}: row {int(np.argmax(dead))} has no finite logit (all -inf)")


def softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def sample(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """logits [B, V] float32 -> token ids [B] int64."""
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2 or logits.shape[-1] < 1:
        raise ValueError(f"sample: logits must be [batch, vocab], got shape {logits.shape}")
    check_logits(logits)
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(axis=-1).astype(np.int64)
    if rng is None:
        rng = np.random.default_rng()
    elif not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    probs = probabilities(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    race = probs / rng.exponential(1.0, size=probs.shape)
    return race.argmax(axis=-1).astype(np.int64)


def probabilities(logits: np.ndarray, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution :func:`sample` draws from at a temperature >= MIN_TEMPERATURE: float64 [..., V] (the
    temperature, top_k and top_p rules of the module docstring, per row; speculative sampling compares these)."""
    lead = logits.shape[:-1]
    logits = np.asarray(logits).reshape(-1, logits.shape[-1])
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
    return probs.reshape(*lead, -1)
