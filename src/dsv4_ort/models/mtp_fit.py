"""MTP weights that predict the main model: self-distillation of a random-weight preset's MTP block.

With random weights the checkpoint's MTP block predicts noise, so speculative decoding would accept nothing. For
tests and benchmarks :func:`fit_mtp` fits the MTP block 0 of a preset's random model (the weights
``export_model(preset=..., seed=...)`` writes, :mod:`.synthetic`) to the main model's own next-next token with the
PyTorch reference: on sequences the main model continues from random prompts (greedy and sampled), the block's
output at position t (streams h_t + embedding of token t+1) is trained towards the main model's distribution at
t+1 (soft cross-entropy, Adam). Only ``mtp.0.*`` tensors move; the main model, the shared embedding and head stay
as they are. Everything is seeded and runs on one torch thread, so a fit is deterministic.

The result (float32 arrays, DeepSeek names) goes to ``export_model(..., mtp=True, mtp_weights=...)``, which stores
them in the release formats (FP8 linears, FP4 experts) like the rest of the checkpoint. ``python -m
dsv4_ort.models.mtp_fit --preset tiny --out mtp_tiny.npz`` writes a fit to a file.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

# The tiny preset's fit: ~70 s on one core, held-out top-1 agreement with the main model's next-next token ~13 %
# (random-weight logits are nearly flat and depend on the whole context, so one block predicts them only in part);
# more data helps slowly (400 sequences: ~17 % in ~200 s).
DEFAULTS = {"tiny": dict(steps=200, n_seq=96, seq_len=80, batch=16, lr=1e-2)}


def reference_from_preset(config, seed: int = 0):
    """The PyTorch reference holding a preset's random weights (:func:`.synthetic.random_arrays`, dequantised)."""
    import torch

    from .model import DeepseekV4ForCausalLM
    from .synthetic import random_arrays

    model = DeepseekV4ForCausalLM(config).eval()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for t in random_arrays(config, weights="native", seed=seed):
            dst = params.get(t.name, buffers.get(t.name))
            if dst is None:
                raise KeyError(f"mtp_fit: the reference has no tensor {t.name!r}")
            dst.copy_(torch.from_numpy(np.ascontiguousarray(t.dequantize())).to(dst.dtype))
    return model


def _continuations(model, n_seq: int, seq_len: int, prompt_len: int, gen: np.random.Generator):
    """``n_seq`` sequences of ``seq_len`` tokens: random prompts continued by the main model, greedy for the first
    half of the rows and sampled at temperature 1 for the rest."""
    import torch

    V = model.config.vocab_size
    ids = torch.as_tensor(gen.integers(0, V, size=(n_seq, prompt_len)), dtype=torch.int64)
    sampled = torch.arange(n_seq) >= n_seq // 2
    tg = torch.Generator().manual_seed(int(gen.integers(2**31)))
    with torch.no_grad():
        state = model.new_state(n_seq, seq_len)
        logits = model(ids, state=state)[:, -1]
        out = [ids]
        for _ in range(seq_len - prompt_len):
            probs = torch.softmax(logits, -1)
            tok = torch.where(sampled, torch.multinomial(probs, 1, generator=tg)[:, 0], logits.argmax(-1))
            out.append(tok[:, None])
            if sum(o.shape[1] for o in out) == seq_len:
                break
            logits = model(tok[:, None], state=state)[:, -1]
    return torch.cat(out, 1)


def fit_mtp(config, *, seed: int = 0, fit_seed: int = 0, steps: int = 200, n_seq: int = 96, seq_len: int = 80,
            batch: int = 16, lr: float = 1e-2, hard_weight: float = 1.0, progress: bool = False) -> tuple[dict, dict]:
    """Fits MTP block 0 of the preset model with random weights ``seed``; returns (``mtp.0.*`` name -> float32
    array, report: losses, top-1 agreement with the main model's next-next token on held-out sequences, seconds)."""
    import torch

    from .model import DeepseekV4ForCausalLM  # noqa: F401 - the reference
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(fit_seed)
        gen = np.random.default_rng(fit_seed)
        model = reference_from_preset(config, seed)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("mtp.0."))
        data = _continuations(model, n_seq + n_seq // 4, seq_len, 8, gen)
        train, held = data[:n_seq], data[n_seq:]

        def targets(ids):
            with torch.no_grad():
                logits, hidden = model(ids, return_hidden=True)
            # MTP at t (h_t, token t+1) learns the main model's distribution of token t+2 (its logits at t+1)
            return hidden[:, :-1], ids[:, 1:], torch.log_softmax(logits[:, 1:], -1)

        cached = [targets(train[i:i + batch]) for i in range(0, n_seq, batch)]
        held_t = targets(held)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        losses = []
        for step in range(steps):
            h, nxt, logp = cached[step % len(cached)]
            q = torch.log_softmax(model.forward_mtp(h, nxt), -1)
            # soft cross-entropy towards the main distribution, plus the main model's argmax (what greedy verifies)
            soft = -(logp.exp() * q).sum(-1).mean()
            hard = torch.nn.functional.nll_loss(q.flatten(0, 1), logp.argmax(-1).flatten())
            loss = soft + hard_weight * hard
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if progress and step % 50 == 0:
                print(f"mtp_fit step {step}: loss {losses[-1]:.4f}", flush=True)
        with torch.no_grad():
            h, nxt, logp = held_t
            agree = float((model.forward_mtp(h, nxt).argmax(-1) == logp.argmax(-1)).float().mean())
        weights = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()
                   if n.startswith("mtp.0.")}
    finally:
        torch.set_num_threads(threads)
    report = {"steps": steps, "first_loss": losses[0], "last_loss": float(np.mean(losses[-20:])),
              "held_out_top1": agree, "seconds": time.perf_counter() - t0}
    return weights, report


def cached_fit(config, *, seed: int = 0, cache_dir=None, **kw) -> tuple[dict, dict]:
    """:func:`fit_mtp` through a file cache (``cache_dir``, else $DSV4_ORT_CACHE, else ~/.cache/dsv4_ort), keyed by
    the config, the seeds, the fit's arguments and this module's source, so a fit runs once per machine."""
    import hashlib
    import json
    import os
    from pathlib import Path

    args = {**DEFAULTS["tiny"], **kw}
    key = json.dumps({"config": config.to_dict(), "seed": seed, "args": args,
                      "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir or os.environ.get("DSV4_ORT_CACHE") or Path.home() / ".cache" / "dsv4_ort") / "mtp_fit"
    path = root / f"mtp-{digest}.npz"
    if path.is_file():
        with np.load(path) as z:
            weights = {k: z[k] for k in z.files if k != "__report__"}
            report = json.loads(str(z["__report__"]))
        return weights, report
    weights, report = fit_mtp(config, seed=seed, **args)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}.npz")
    np.savez(tmp, __report__=np.array(json.dumps(report)), **weights)
    os.replace(tmp, path)
    return weights, report


def main(argv=None) -> int:
    from .config import DeepseekV4Config

    p = argparse.ArgumentParser(prog="python -m dsv4_ort.models.mtp_fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0, help="the preset's random-weight seed")
    p.add_argument("--out", required=True, help=".npz file of the fitted mtp.0.* tensors")
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args(argv)
    kw = dict(DEFAULTS.get(args.preset, {}))
    if args.steps is not None:
        kw["steps"] = args.steps
    weights, report = fit_mtp(DeepseekV4Config.from_preset(args.preset), seed=args.seed, progress=True, **kw)
    np.savez(args.out, **weights)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
