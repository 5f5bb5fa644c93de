"""``dsv4-ort run`` and ``dsv4-ort generate``: the runtime's command-line subcommands."""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import shutil
import stat
import sys
from pathlib import Path

from .engine import Detokenizer

# The built-in demo: the deterministic `demo` preset (the tiny geometry with the released vocabulary, so its export
# carries DeepSeek-V4's tokenizer and prints text) and, for models without a tokenizer, a fixed prompt of ids.
DEMO_PRESET = "demo"
DEMO_SEED = 0
DEMO_PROMPT = [0, 17, 42, 311, 7, 99, 256, 488, 3, 64, 128, 5]
DEMO_NEW_TOKENS = 32


def cache_dir() -> Path:
    base = os.environ.get("DSV4_ORT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dsv4_ort")
    return Path(base)


# checkpoint_key reads at most this much of a shard besides its header: SAMPLES blocks spread evenly over the
# file (a shard no larger than SAMPLES * SAMPLE_BYTES is read whole).
SAMPLES, SAMPLE_BYTES = 16, 4096


def checkpoint_key(path: Path) -> str:
    """A content key for a checkpoint directory, cheap for a 160 GB checkpoint (a few MB read).

    Covers every ``*.json`` file whole (config, index, tokenizer) and, per ``*.safetensors`` shard: its name, size,
    modification time (ns) and inode, its whole header (tensor names, dtypes, shapes, offsets) and 16 blocks of
    4 KiB spread over its data (all of it for a small shard). Rewriting weights changes the modification time (and
    most likely a sampled block) so the checkpoint is exported again; a change that keeps size, header, time stamp
    and every sampled block is not seen (use ``dsv4-ort export`` for such a checkpoint)."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        try:
            st = f.stat()
        except OSError:  # a dangling link
            continue
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read (check_checkpoint_path reports a shard one)
            continue
        if f.suffix == ".json":
            h.update(b"json\0" + f.name.encode() + b"\0" + f.read_bytes())
        elif f.suffix == ".safetensors":
            h.update(b"shard\0%s\0%d %d %d\0" % (f.name.encode(), st.st_size, st.st_mtime_ns, st.st_ino))
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                h.update(head + fh.read(min(n, 1 << 24)))
                start = fh.tell()
                span = st.st_size - start
                if span <= SAMPLES * SAMPLE_BYTES:
                    h.update(fh.read())
                else:
                    for i in range(SAMPLES):
                        fh.seek(start + (span - SAMPLE_BYTES) * i // (SAMPLES - 1))
                        h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def is_exported_model(path: Path) -> bool:
    """Whether ``path`` is (or tries to be) a directory written by ``dsv4-ort export`` rather than a checkpoint."""
    from dsv4_ort.export.files import META_FILE, MODEL_FILE

    return path.is_dir() and ((path / MODEL_FILE).exists() or (path / META_FILE).exists())


def _cached_export_ok(out: Path) -> bool:
    """A cache entry is used only when its metadata reads back whole (format, export id of the data file)."""
    from .session import ModelError, read_metadata

    try:
        read_metadata(out)
    except ModelError:
        return False
    return True


def ensure_export(checkpoint: str | None, *, quiet: bool, force: bool = False) -> Path:
    """Exports the demo preset (or a checkpoint) into the cache once; returns the model directory.

    A cache entry that does not read back (a damaged or partial export: see :func:`_cached_export_ok`), or any
    entry with ``force``, is removed and exported again."""
    import dsv4_ort
    from dsv4_ort.export import schema
    from dsv4_ort.export.cli import check_checkpoint_path

    tag = f"v{dsv4_ort.__version__}-ops{schema.TABLE_VERSION}-{schema.TABLE_DIGEST}"
    if checkpoint is None:
        out = cache_dir() / "models" / f"{DEMO_PRESET}-seed{DEMO_SEED}-{tag}"
    else:
        ck = Path(checkpoint)
        if not ck.is_dir():
            raise FileNotFoundError(f"checkpoint directory {checkpoint!r} does not exist")
        check_checkpoint_path(ck)  # before reading any file of it: a FIFO among them would block the read
        out = cache_dir() / "models" / f"{ck.name}-{checkpoint_key(ck)}-{tag}"
    if out.exists() or out.is_symlink():
        if not force and out.is_dir() and _cached_export_ok(out):
            return out
        if not quiet and not force:
            print(f"the cached export {out} is damaged; exporting it again", file=sys.stderr)
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        else:
            out.unlink()
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


def open_session(model_dir, *, threads: int, isa: str | None, need_text: bool = True, quiet: bool = False,
                 batch_invariant: int | None = None, pipeline: dict | None = None):
    """``Session(model_dir)`` with its tokenizer read up front. An unreadable tokenizer.json is a ModelError naming
    the file when text is needed (``need_text``); without it (``--ids``) the output is token ids, with a one-line
    warning. An export in pipeline stages opens as a :class:`~.pipeline.PipelineSession` (``pipeline``: its
    backend, ray_address, micro_batches; default: every stage in this process)."""
    from .pipeline import is_pipeline_export, open_pipeline
    from .session import ModelError, Session

    if is_pipeline_export(model_dir):
        sess = open_pipeline(model_dir, intra_op_threads=threads or None, isa=isa, batch_invariant=batch_invariant,
                             **(pipeline or {}))
    else:
        sess = Session(model_dir, intra_op_threads=threads or None, isa=isa, batch_invariant=batch_invariant)
    try:
        sess.tokenizer
    except ModelError as e:
        if need_text:
            raise
        if not quiet:
            print(f"warning: {e}; ignoring it, output is token ids", file=sys.stderr)
        sess.tokenizer = None
    return sess


def _speeds(stats: dict) -> str:
    pre = stats["prefill_tokens"] / stats["prefill_s"] if stats.get("prefill_s") else float("nan")
    dec = stats["decode_tokens"] / stats["decode_s"] if stats.get("decode_s") else float("nan")
    return f"prefill {stats['prefill_tokens']} tokens at {pre:.1f} tokens/s, decode {stats['decode_tokens']} " \
           f"tokens at {dec:.1f} tokens/s"


def cmd_run(args) -> int:
    from .session import ModelError

    direct = args.checkpoint is not None and is_exported_model(Path(args.checkpoint))
    if direct:  # an exported model directory: run it as it is (nothing to export, no torch needed)
        model_dir = Path(args.checkpoint)
        sess = open_session(model_dir, threads=args.threads, isa=args.isa)
    else:
        model_dir = ensure_export(args.checkpoint, quiet=args.quiet)
        try:
            sess = open_session(model_dir, threads=args.threads, isa=args.isa)
        except ModelError as e:  # the cache entry reads back but does not load: export it once more
            if not args.quiet:
                print(f"the cached export {model_dir} does not load ({e}); exporting it again", file=sys.stderr)
            model_dir = ensure_export(args.checkpoint, quiet=args.quiet, force=True)
            sess = open_session(model_dir, threads=args.threads, isa=args.isa)
    if sess.tokenizer is not None:
        prompt = sess.encode(args.prompt)
        shown = f"prompt: {args.prompt!r} (ids {prompt})"
    else:
        prompt = DEMO_PROMPT
        shown = f"prompt ids: {prompt}"
    print(f"model: {model_dir}\nisa: {sess.isa} ({sess.threads} threads)\n{shown}", flush=True)
    stats: dict = {}
    ids = []
    detok = Detokenizer(sess.tokenizer) if sess.tokenizer is not None else None
    if detok is not None:  # text as it is produced, never splitting a multi-byte character
        sys.stdout.write("text: ")
    for tok in sess.stream(prompt, args.max_new_tokens, stats=stats):
        ids.append(tok)
        if detok is not None:
            sys.stdout.write(detok.add(tok))
            sys.stdout.flush()
    if detok is not None:
        sys.stdout.write(detok.flush() + "\n")
    print(f"generated ids: {ids}\n{_speeds(stats)}")
    return 0


_ID = re.compile(r"[0-9]+")


def parse_ids(text: str) -> list:
    """``--ids``: token ids separated by commas and/or whitespace ("1,2,3", "1 2 3", "1, 2, 3")."""
    parts = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if not parts:
        raise ValueError(f"--ids is empty (give token ids separated by commas or spaces), got {text!r}")
    for t in parts:
        if not _ID.fullmatch(t):
            raise ValueError(f"--ids: {t!r} is not a token id (ids are integers >= 0 separated by commas or "
                             f"spaces), got {text!r}")
    return [int(t) for t in parts]


def cmd_generate(args) -> int:
    prompt = parse_ids(args.ids) if args.ids is not None else None
    sess = open_session(args.model_dir, threads=args.threads, isa=args.isa, need_text=prompt is None,
                        quiet=args.quiet)
    if prompt is not None:
        bad = [i for i in prompt if i >= sess.vocab_size]
        if bad:
            raise ValueError(f"--ids: id {bad[0]} is outside the vocabulary [0, {sess.vocab_size}) of "
                             f"{args.model_dir}")
    else:
        prompt = sess.encode(args.prompt)
    stats: dict = {}
    stop = [int(sess.config.get("eos_token_id", 1))] if args.stop_at_eos else None
    detok = Detokenizer(sess.tokenizer)  # incremental: a multi-byte character is written whole (ids without one)
    for tok in sess.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, stop_ids=stop, stats=stats):
        sys.stdout.write(detok.add(tok))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if not args.quiet:
        print(_speeds(stats), file=sys.stderr)
    return 0


# ---- argument types: each rejects a bad value with argparse's one-line usage error (status 2) ------------------

def max_threads() -> int:
    """The most intra-op threads accepted: 4 per CPU this process may use, at most 1024."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(1024, 4 * n))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


def nonnegative_int(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def thread_count(text: str) -> int:
    """0 (the default: physical cores) or 1 .. max_threads()."""
    v = _int(text)
    if not 0 <= v <= max_threads():
        raise argparse.ArgumentTypeError(f"must be 0 (physical cores) or 1 .. {max_threads()} (4 per available "
                                         f"CPU), got {v}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def temperature(text: str) -> float:
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


def probability(text: str) -> float:
    v = _float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def add_parsers(sub, common) -> None:
    run = sub.add_parser("run", parents=[common], help="export (once, cached) and run a model: the built-in demo "
                                                         "model (tiny, with DeepSeek-V4's tokenizer) by default")
    run.add_argument("--checkpoint", default=None, metavar="DIR", help="a DeepSeek-V4 checkpoint instead of the "
                                                                       "built-in demo model (or a model directory "
                                                                       "written by `dsv4-ort export`, run as it is)")
    run.add_argument("--prompt", default="Hello", help="prompt text (models with a tokenizer; default 'Hello')")
    run.add_argument("--max-new-tokens", type=nonnegative_int, default=DEMO_NEW_TOKENS)
    run.add_argument("--threads", type=thread_count, default=0, help="intra-op threads (default: physical cores)")
    run.add_argument("--quiet", action="store_true")
    run.set_defaults(func=cmd_run)

    gen = sub.add_parser("generate", parents=[common], help="generate from an exported model, streaming tokens")
    gen.add_argument("model_dir", metavar="MODEL_DIR")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in MODEL_DIR)")
    src.add_argument("--ids", help="prompt token ids, separated by commas and/or spaces (no tokenizer needed)")
    gen.add_argument("--max-new-tokens", type=nonnegative_int, default=64)
    gen.add_argument("--temperature", type=temperature, default=0.0,
                     help="0 (default): greedy; a positive temperature below 1e-6 is greedy too")
    gen.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the k most likely tokens (0: all)")
    gen.add_argument("--seed", type=nonnegative_int, default=None)
    gen.add_argument("--stop-at-eos", action="store_true", help="stop after the end-of-sequence token")
    gen.add_argument("--threads", type=thread_count, default=0, help="intra-op threads (default: physical cores)")
    gen.add_argument("--quiet", action="store_true", help="no speed summary")
    gen.set_defaults(func=cmd_generate)


__all__ = ["DEMO_PROMPT", "add_parsers", "cache_dir", "checkpoint_key", "ensure_export", "max_threads", "parse_ids"]
