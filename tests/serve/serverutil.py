"""Shared pieces of the server tests: a word-level tokenizer for the tiny model and a `dsv4-ort serve` subprocess
on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from dsv4_ort.runtime.chat import ASSISTANT, BOS, EOS, USER

SPECIALS = [BOS, EOS, USER, ASSISTANT, "<think>", "</think>"]  # ids 0-5; BOS = 0 and EOS = 1 as in the tiny config
THINK_END = 5


def vocabulary(size: int = 512) -> list:
    """Tokens by id: the specials, [UNK], two words with multi-byte UTF-8 characters, then w0, w1, ..."""
    words = ["[UNK]", "héllo", "世界"]
    return SPECIALS + words + [f"w{i}" for i in range(size - len(SPECIALS) - len(words))]


def save_tokenizer(path, tokens: list) -> None:
    """A WordLevel tokenizer over ``tokens`` (id = position); decoding joins the words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))


class ServerProcess:
    """``dsv4-ort serve MODEL_DIR --port 0 ...``; ``url`` is read from the line it prints when it listens."""

    def __init__(self, model_dir, *args: str, timeout: float = 180):
        exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
        self.proc = subprocess.Popen([exe, "serve", str(model_dir), "--port", "0", "--threads", "1", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._collect, daemon=True).start()
        deadline = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout} s: {''.join(self.stderr)}")
            if line is None:
                raise RuntimeError(f"the server exited with {self.proc.wait()}: {''.join(self.stderr)}")
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                self.ready_line = line

    @staticmethod
    def _pump(stream, out):
        for line in stream:
            out.put(line)
        out.put(None)

    def _collect(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
