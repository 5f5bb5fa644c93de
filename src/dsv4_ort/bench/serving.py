"""Serving: a preset behind a real ``dsv4-ort serve`` process on loopback, N concurrent streaming clients.

Each client sends one ``/v1/completions`` request (a fixed prompt of token ids, ``max_tokens`` new tokens,
``ignore_eos`` so every request generates them all, ``stream`` with usage) at the same moment; per client we
record the time to the first token chunk (TTFT) and the gaps between token chunks (inter-token latency, ITL;
the server streams one chunk per generated token, its text empty while a multi-byte character is incomplete).
Per N we report output tokens/s over all clients (output tokens / wall time from the first request sent to the
last stream closed), TTFT and ITL p50 / p99. Server start-up is not timed. Only the standard library is used on
the client side, so the bench needs nothing beyond the ``serve`` extra.

The client counts run in rounds, in order and then in reverse (1, 4, 16, 16, 4, 1 for two rounds), so that a
shared machine's drift over the minutes of a run (its memory bandwidth moves by a third) weighs on every count
alike: the figures per N pool every round (tokens / wall summed, percentiles over all samples), and the ratios of
each round are listed beside the pooled ones, as their spread.

usage: dsv4-ort bench --serving [--smoke] [--out DIR] [--threads N] [--serving-tokens P,O] [--serving-compute bf16]
                      [--serving-rounds R]
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .timing import warm_page_cache

CLIENTS = (1, 4, 16)
ROUNDS = 2


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


class Server:
    """``dsv4-ort serve MODEL --port 0`` as a child process; ``url`` from the line it prints when it listens."""

    def __init__(self, model_dir, *, threads: int, max_batch: int, timeout: float = 300):
        exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
        cmd = [exe, "serve", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
               "--max-batch", str(max_batch), "--max-queue", str(4 * max_batch)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        found: list = []
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                if " on http://" in line and not found:
                    found.append(line.split(" on http://", 1)[1].split()[0])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or not found:
            self.stop()
            raise RuntimeError(f"dsv4-ort serve did not start: {''.join(self.err)[-2000:]}")
        host, port = found[0].rsplit(":", 1)
        self.host, self.port = host, int(port)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def stream_one(host: str, port: int, body: dict, start: threading.Barrier, timeout: float) -> dict:
    """One streaming completion: {"sent", "chunks": [arrival times of token chunks], "output_tokens"}."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    payload = json.dumps(body)
    start.wait()
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    chunks, tokens = [], None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj.get("choices") and obj["choices"][0].get("finish_reason") is None:  # one chunk per token
            chunks.append(time.perf_counter())
    conn.close()
    return {"sent": sent, "chunks": chunks, "output_tokens": tokens, "done": time.perf_counter()}


def measure(host: str, port: int, clients: int, *, prompt: list, max_tokens: int, timeout: float) -> dict:
    """N clients at once; the aggregate figures of one round."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = threading.Barrier(clients)
    results: list = [None] * clients
    errors: list = []

    def client(i):
        try:
            results[i] = stream_one(host, port, body, start, timeout)
        except Exception as e:  # noqa: BLE001 - reported, the round fails
            errors.append(f"{type(e).__name__}: {e}")
            start.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors or any(r is None for r in results):
        raise RuntimeError(errors[0] if errors else "a client did not finish in time")
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    ttft = [r["chunks"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    out_tokens = sum(r["output_tokens"] for r in results)
    return summarize(clients, out_tokens, wall, ttft, itl)


def summarize(clients: int, out_tokens: int, wall: float, ttft: list, itl: list) -> dict:
    """The figures of one round, or of several pooled (tokens and wall summed, samples joined); the samples (s)
    are kept under ``samples`` for pooling and dropped from the written result."""
    return {"clients": clients, "output_tokens": out_tokens, "wall_s": wall, "output_tok_s": out_tokens / wall,
            "ttft_ms": {"p50": 1e3 * percentile(ttft, 50), "p99": 1e3 * percentile(ttft, 99)},
            "itl_ms": {"p50": 1e3 * percentile(itl, 50), "p99": 1e3 * percentile(itl, 99)},
            "samples": {"ttft": ttft, "itl": itl}}


def pooled(rounds: list) -> dict:
    """One client count's rounds as one row."""
    ttft = [t for r in rounds for t in r["samples"]["ttft"]]
    itl = [t for r in rounds for t in r["samples"]["itl"]]
    return summarize(rounds[0]["clients"], sum(r["output_tokens"] for r in rounds), sum(r["wall_s"] for r in rounds),
                     ttft, itl)


def _ratios(one: dict, most: dict) -> tuple:
    return most["output_tok_s"] / one["output_tok_s"], most["itl_ms"]["p99"] / one["itl_ms"]["p99"]


def run(preset: str = "bench", *, clients=CLIENTS, prompt_tokens: int = 48, max_tokens: int = 32,
        threads: int | None = None, model_dir=None, compute: str = "fp32", rounds: int = ROUNDS, log=None,
        timeout: float = 600) -> dict:
    """The serving rounds on ``preset`` (exported once into the bench cache, with ``compute`` products) or on
    ``model_dir``: every client count once per round, the order reversed every other round."""
    if rounds < 1:
        raise ValueError(f"serving rounds must be at least 1, got {rounds}")
    from dsv4_ort.runtime.session import physical_cores

    from .formats import export_option
    from .machine import _cpuinfo

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    threads = int(threads or physical_cores())
    exported = model_dir is None
    if exported:
        model_dir = export_option(preset, "native", "native", max(256, prompt_tokens + max_tokens + 8), log,
                                  compute=compute)
    vocab = json.loads((Path(model_dir) / "dsv4_ort.json").read_text())["config"]["vocab_size"]
    prompt = [2 + (7919 * i) % (vocab - 2) for i in range(prompt_tokens)]
    warm_page_cache(model_dir)
    server = Server(model_dir, threads=threads, max_batch=max(clients))
    per_count: dict = {n: [] for n in clients}
    try:
        measure(server.host, server.port, 1, prompt=prompt, max_tokens=2, timeout=timeout)  # warm-up
        for k in range(rounds):
            for n in (clients if k % 2 == 0 else tuple(reversed(clients))):
                log(f"  serving, round {k + 1} of {rounds}: {n} concurrent streaming client(s), {max_tokens} "
                    "tokens each")
                per_count[n].append(measure(server.host, server.port, n, prompt=prompt, max_tokens=max_tokens,
                                            timeout=timeout))
    finally:
        rc = server.stop()
    rows = [pooled(per_count[n]) for n in clients]
    round_rows = [[per_count[n][k] for n in clients] for k in range(rounds)]
    round_ratios = [list(_ratios(rr[0], rr[-1])) for rr in round_rows] if len(clients) > 1 and clients[0] == 1 \
        else []
    for r in rows + [r for rr in round_rows for r in rr]:
        r.pop("samples", None)
    return {"preset": preset if exported else Path(model_dir).name, "model_dir": str(model_dir),
            "compute": compute if exported else None,
            "threads": threads, "max_batch": max(clients), "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "server_exit": rc, "rounds": rounds, "rows": rows,
            "round_rows": round_rows, "round_ratios": round_ratios,
            "machine": {"cpu": _cpuinfo()["model"], "threads": threads}}


def markdown(result: dict) -> str:
    compute = f", --compute {result['compute']} export" if result.get("compute") else ""
    lines = [f"Serving ({result['preset']} preset{compute} behind dsv4-ort serve, loopback; "
             f"CPU: {result['machine']['cpu']}, "
             f"{result['threads']} threads, --max-batch {result['max_batch']}; prompt {result['prompt_tokens']} "
             f"tokens, {result['max_tokens']} output tokens per client; {result.get('rounds', 1)} round(s), "
             "alternating order, pooled)", "",
             "| clients | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['clients']} | {r['output_tok_s']:.1f} | {r['ttft_ms']['p50']:.0f} / "
                     f"{r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} |")
    rows = result["rows"]
    if len(rows) > 1 and rows[0]["clients"] == 1:  # how batching pays: throughput and ITL p99 ratios
        one, most = rows[0], rows[-1]
        tput, itl = _ratios(one, most)
        lines += ["", f"{most['clients']} clients against 1: output tokens/s {tput:.2f}x, ITL p99 {itl:.2f}x"]
        if len(result.get("round_ratios", [])) > 1:
            lines[-1] += " (per round: " + ", ".join(f"{a:.2f}x / {b:.2f}x" for a, b in result["round_ratios"]) + ")"
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir) -> None:
    from .report import write_mode

    write_mode(out_dir, "serving", result, markdown(result))
