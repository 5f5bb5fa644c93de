"""``dsv4-ort run`` and ``dsv4-ort generate``: the runtime's command-line subcommands."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

# The built-in demo: the deterministic `tiny` preset and a fixed prompt of token ids (its vocabulary has no text).
DEMO_PRESET = "tiny"
DEMO_SEED = 0
DEMO_PROMPT = [0, 17, 42, 311, 7, 99, 256, 488, 3, 64, 128, 5]
DEMO_NEW_TOKENS = 32


def cache_dir() -> Path:
    base = os.environ.get("DSV4_ORT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dsv4_ort")
    return Path(base)


def checkpoint_key(path: Path) -> str:
    """A content key for a checkpoint directory: config, index, and every shard's name, size and header."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix == ".json":
            h.update(f.name.encode() + f.read_bytes())
        elif f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                h.update(f.name.encode() + str(f.stat().st_size).encode() + head + fh.read(min(n, 1 << 24)))
    return h.hexdigest()[:16]


def ensure_export(checkpoint: str | None, *, quiet: bool) -> Path:
    """Exports the demo preset (or a checkpoint) into the cache once; returns the model directory."""
    import dsv4_ort
    from dsv4_ort.export import schema

    tag = f"v{dsv4_ort.__version__}-ops{schema.TABLE_VERSION}"
    if checkpoint is None:
        out = cache_dir() / "models" / f"{DEMO_PRESET}-seed{DEMO_SEED}-{tag}"
    else:
        ck = Path(checkpoint)
        if not ck.is_dir():
            raise FileNotFoundError(f"checkpoint directory {checkpoint!r} does not exist")
        out = cache_dir() / "models" / f"{ck.name}-{checkpoint_key(ck)}-{tag}"
    if (out / "model.onnx").is_file() and (out / "dsv4_ort.json").is_file():
        return out
    try:
        from dsv4_ort.export import export_model
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise RuntimeError(f"exporting needs the export extra ({e}); pip install 'dsv4-ort[export]'") from None
    if not quiet:
        print(f"exporting {'the built-in ' + DEMO_PRESET + ' model' if checkpoint is None else checkpoint} "
              f"into {out} (cached for next time)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    if checkpoint is None:
        export_model(None, out, preset=DEMO_PRESET, seed=DEMO_SEED, logits="last", progress=not quiet)
    else:
        export_model(checkpoint, out, logits="last", progress=not quiet)
    return out


def _speeds(stats: dict) -> str:
    pre = stats["prefill_tokens"] / stats["prefill_s"] if stats.get("prefill_s") else float("nan")
    dec = stats["decode_tokens"] / stats["decode_s"] if stats.get("decode_s") else float("nan")
    return f"prefill {stats['prefill_tokens']} tokens at {pre:.1f} tokens/s, decode {stats['decode_tokens']} " \
           f"tokens at {dec:.1f} tokens/s"


def cmd_run(args) -> int:
    from .session import Session

    model_dir = ensure_export(args.checkpoint, quiet=args.quiet)
    sess = Session(model_dir, intra_op_threads=args.threads or None, isa=args.isa)
    prompt = DEMO_PROMPT if args.checkpoint is None or sess.tokenizer is None else sess.encode(args.prompt)
    stats: dict = {}
    ids = list(sess.stream(prompt, args.max_new_tokens, stats=stats))
    text = "" if sess.tokenizer is None else f"\ntext: {sess.decode(ids)!r}"
    print(f"model: {model_dir}\nisa: {sess.isa} ({sess.threads} threads)\nprompt ids: {prompt}\n"
          f"generated ids: {ids}{text}\n{_speeds(stats)}")
    return 0


def _parse_ids(text: str) -> list:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--ids is empty")
    return ids


def cmd_generate(args) -> int:
    from .session import Session

    sess = Session(args.model_dir, intra_op_threads=args.threads or None, isa=args.isa)
    prompt = _parse_ids(args.ids) if args.ids is not None else sess.encode(args.prompt)
    stats: dict = {}
    stop = [int(sess.config.get("eos_token_id", 1))] if args.stop_at_eos else None
    for tok in sess.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, stop_ids=stop, stats=stats):
        piece = str(tok) if sess.tokenizer is None else sess.decode([tok])
        sys.stdout.write(piece + (" " if sess.tokenizer is None else ""))
        sys.stdout.flush()
    sys.stdout.write("\n")
    if not args.quiet:
        print(_speeds(stats), file=sys.stderr)
    return 0


def add_parsers(sub, common) -> None:
    run = sub.add_parser("run", parents=[common], help="export (once, cached) and run a model: the built-in tiny "
                                                         "model by default")
    run.add_argument("--checkpoint", default=None, metavar="DIR", help="a DeepSeek-V4 checkpoint instead of the "
                                                                       "built-in tiny model")
    run.add_argument("--prompt", default="Hello", help="prompt text (checkpoints with a tokenizer)")
    run.add_argument("--max-new-tokens", type=int, default=DEMO_NEW_TOKENS)
    run.add_argument("--threads", type=int, default=0, help="intra-op threads (default: physical cores)")
    run.add_argument("--quiet", action="store_true")
    run.set_defaults(func=cmd_run)

    gen = sub.add_parser("generate", parents=[common], help="generate from an exported model, streaming tokens")
    gen.add_argument("model_dir", metavar="MODEL_DIR")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in MODEL_DIR)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop-at-eos", action="store_true", help="stop after the end-of-sequence token")
    gen.add_argument("--threads", type=int, default=0, help="intra-op threads (default: physical cores)")
    gen.add_argument("--quiet", action="store_true", help="no speed summary")
    gen.set_defaults(func=cmd_generate)


__all__ = ["add_parsers", "ensure_export", "cache_dir", "checkpoint_key", "DEMO_PROMPT"]
