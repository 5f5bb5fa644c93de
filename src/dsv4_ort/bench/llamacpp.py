"""llama.cpp as a baseline of ``dsv4-ort bench``: the same model, converted by llama.cpp's own converter, timed by
llama.cpp's own ``llama-bench`` in the same run. Optional and off unless found on the machine:

* ``llama-bench``: ``DSV4_ORT_LLAMA_BENCH`` (a path) or ``llama-bench`` on the PATH;
* the converter: ``DSV4_ORT_LLAMA_CPP`` (a llama.cpp source tree holding ``convert_hf_to_gguf.py`` and
  ``gguf-py``), run with this environment's Python (it needs torch, numpy and safetensors);
* ``llama-quantize`` next to ``llama-bench`` (or on the PATH) for the ``Q4_K_M`` variant.

The bench presets are random weights without a tokenizer, and llama.cpp's converter reads the vocabulary from
tokenizer files; the conversion therefore runs the converter with a placeholder vocabulary of the model's size
(token ``i`` spelled ``<i>``, one merge). Tokens never matter for speed: ``llama-bench`` feeds random ids.

Converted files are cached next to the bench exports (``~/.cache/dsv4_ort/bench``), keyed by preset and type.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .timing import warm_page_cache

# Runs llama.cpp's converter with a placeholder vocabulary (argv: llama.cpp dir, then the converter's arguments).
_CONVERT = r"""
import runpy, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
sys.path.insert(1, str(root / "gguf-py"))
import gguf
from conversion import base

def placeholder_vocab(self):
    n = int(self.hparams["vocab_size"])
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges(["<0> <1>"])  # llama.cpp's BPE loader wants a merges list

base.TextModel._set_vocab_gpt2 = placeholder_vocab
sys.argv = [str(root / "convert_hf_to_gguf.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_bench() -> str | None:
    path = os.environ.get("DSV4_ORT_LLAMA_BENCH") or shutil.which("llama-bench")
    return path if path and os.access(path, os.X_OK) else None


def llama_quantize() -> str | None:
    bench = llama_bench()
    near = Path(bench).with_name("llama-quantize") if bench else None
    if near is not None and os.access(near, os.X_OK):
        return str(near)
    return shutil.which("llama-quantize")


def converter_dir() -> Path | None:
    d = os.environ.get("DSV4_ORT_LLAMA_CPP")
    return Path(d) if d and (Path(d) / "convert_hf_to_gguf.py").is_file() else None


def available() -> str | None:
    """None when the baseline can run, else why not (one line)."""
    if llama_bench() is None:
        return "llama-bench not found (set DSV4_ORT_LLAMA_BENCH or put it on the PATH)"
    if converter_dir() is None:
        return "llama.cpp's converter not found (set DSV4_ORT_LLAMA_CPP to a llama.cpp source tree)"
    return None


def convert(checkpoint_dir, out: Path, outtype: str = "q8_0", log=print) -> Path:
    """``checkpoint_dir`` converted by llama.cpp's converter into ``out`` (kept when it exists); ``outtype`` is the
    converter's (``q8_0``: dense weights Q8_0; the FP4 experts stay MXFP4)."""
    if out.is_file():
        return out
    root = converter_dir()
    if root is None:
        raise RuntimeError(available())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    log(f"  converting {checkpoint_dir} to GGUF ({outtype}) with llama.cpp's converter")
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(root), str(checkpoint_dir), "--outtype", outtype,
                        "--outfile", str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama.cpp's converter failed: {tail[0]}")
    os.replace(tmp, out)
    return out


def quantize(src: Path, out: Path, qtype: str = "Q4_K_M", threads: int = 2, log=print) -> Path:
    """``src`` requantised by ``llama-quantize`` (kept when ``out`` exists)."""
    if out.is_file():
        return out
    exe = llama_quantize()
    if exe is None:
        raise RuntimeError("llama-quantize not found next to llama-bench or on the PATH")
    log(f"  llama-quantize {src.name} -> {qtype}")
    tmp = out.with_name(out.name + ".partial")
    # --allow-requantize: the source is the converter's Q8_0 + MXFP4 file (the checkpoint is already quantised)
    r = subprocess.run([exe, "--allow-requantize", str(src), str(tmp), qtype, str(threads)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama-quantize failed: {tail[0]}")
    os.replace(tmp, out)
    return out


def run_bench(gguf: Path, *, threads: int, prompt: int = 128, gen: int = 32, depth: int = 0,
              repetitions: int = 3) -> dict:
    """``llama-bench`` on ``gguf``: prefill of ``prompt`` tokens and ``gen`` decode steps after ``depth`` tokens of
    context. Returns {"prefill_tokens_per_s", "decode_tokens_per_s", with their standard deviations}."""
    exe = llama_bench()
    if exe is None:
        raise RuntimeError(available())
    cmd = [exe, "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", str(repetitions),
           "-o", "json"]
    if depth:
        cmd += ["-d", str(depth)]
    if Path(gguf).is_file():  # llama.cpp maps the file, as onnxruntime maps ours: both timed on a warm page cache
        warm_page_cache(gguf)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama-bench failed: {tail[0]}")
    rows = json.loads(r.stdout)
    out = {"threads": threads, "depth": depth, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_gen"):
            out.update(prefill_tokens=row["n_prompt"], prefill_tokens_per_s=row["avg_ts"],
                       prefill_stddev=row.get("stddev_ts"))
        elif row.get("n_gen") and not row.get("n_prompt"):
            out.update(decode_steps=row["n_gen"], decode_tokens_per_s=row["avg_ts"],
                       decode_stddev=row.get("stddev_ts"))
    out["build"] = rows[0].get("build_commit") if rows else None
    return out
