"""Continuous batching over a fixed pool of state rows: many requests decode together in one graph call.

The engine owns one :class:`~.state.State` of ``max_batch`` rows, allocated once. A request waits in a bounded
queue until a row is free, prefills its prompt on its own row (a one-row view of the pool, ``State.rows``) in
chunks of ``prefill_chunk`` tokens, then decodes one token per step together with every other decoding request.

Row layout. The graph takes ``input_ids [B, S]`` with one S for all rows, so decode (S = 1) and prefill (S =
chunk) cannot share a call, and a decode call must cover only decoding rows (a prefilling row inside it would get
a token written at its position). The engine therefore keeps the decoding requests in rows ``[0, k)`` and runs
decode on the view ``rows(0, k)``; prefilling requests sit in rows ``>= k``. A request that finishes prefill moves
to row k, a finished decoding request's row is refilled by the last decoding row (``State.copy_row``), so the
decoding rows stay contiguous; a freed row is reused at once with its position reset to 0.

Per step (:meth:`Engine.step`): cancelled requests leave, waiting requests take free rows, one decode call runs
over rows ``[0, k)``, then prefill chunks of the oldest prefilling requests run, each on its row, up to
``prefill_chunk`` tokens in all (at least one chunk) when requests are decoding, one chunk of every prefilling
request when none is (nothing waits on that step); the first tokens of the prompts finished in the step are sent
when its prefill is done. With the engine thread (:meth:`start`) and ``admission_window`` > 0, an idle engine woken
by a request first waits for the requests sent with it. Chunk boundaries are multiples of ``prefill_chunk`` from
position 0, whatever else runs, so a request's prefill is the same computation alone or beside others; its decode
steps differ only in how many rows share the call. With a session made with ``batch_invariant >= max_batch``
(``dsv4-ort serve`` does that) that changes nothing: every row of a decode call is computed, bit for bit, as it
is alone (:attr:`Engine.batch_invariant`). Without it, the Linear and MoE expert kernels at the AVX2 / AVX512 /
AMX levels pick their inner loop by the number of rows, so a request's float32 rounding, and rarely a greedy
choice, can depend on its neighbours (the scalar level is invariant either way).

Speculative decoding (``speculative="mtp"``, an export with ``--mtp``; :mod:`.speculative`): prefill also runs
the MTP block over each chunk's main streams, and a decode step is one speculative cycle over rows ``[0, k)``:
``num_draft`` drafts per row, one verify call of ``num_draft + 1`` tokens per row, then each row keeps its accepted
drafts and the main model's next token (so a step emits 1 to ``num_draft + 1`` tokens per request) and the rows of
its rejected positions are rolled back. The MTP block's state is a second pool of ``max_batch`` rows that moves with
the main one. Greedy requests get the tokens of plain decoding when the session is batch-invariant over
``max_batch * (num_draft + 1)`` rows; sampled ones follow the same distribution.

Threads: :meth:`Engine.start` runs steps on one engine thread; :meth:`Engine.submit` may be called from any
thread and returns a :class:`Request` whose events (:class:`Event`) arrive through a per-request queue (iterate
the request) or a callback. Without :meth:`start`, :meth:`step` / :meth:`run_until_idle` drive it directly.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .sampling import check_count, check_logits, check_sampling, check_seed, sample
from .speculative import RowParams, Rollback, SpeculativeError, check_speculative


class EngineError(Exception):
    """Base of the errors :meth:`Engine.submit` raises."""


class QueueFull(EngineError):
    """The wait queue holds ``max_queue`` requests already; retry later."""


class PromptTooLong(EngineError, ValueError):
    """The prompt (with the tokens asked for) does not fit in a state row's capacity."""


class EngineStopped(EngineError):
    """The engine was stopped; it takes no more requests."""


# ---- parameters and events ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (see :mod:`.sampling` for temperature / top_k / top_p).

    ``max_tokens``: None (up to the row's capacity) or an integer >= 1. ``stop_ids``: token ids that end the
    request (the id counts as generated, its text is not returned). ``stop``: strings that end the request; the
    text stops right before the first one (text that could still become one is held back while streaming)."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple = ()
    stop: tuple = ()

    def checked(self) -> "SamplingParams":
        temperature, top_k, top_p = check_sampling(self.temperature, self.top_k, self.top_p)
        max_tokens = None if self.max_tokens is None else check_count("max_tokens", self.max_tokens, minimum=1)
        if isinstance(self.stop_ids, (str, bytes)) or not hasattr(self.stop_ids, "__iter__"):
            raise TypeError(f"stop_ids must be a sequence of token ids, got {type(self.stop_ids).__name__}")
        stop_ids = tuple(check_count("stop_ids item", t) for t in self.stop_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        return SamplingParams(max_tokens, temperature, top_p, top_k, check_seed(self.seed), stop_ids, stop)


@dataclass(frozen=True)
class Event:
    """One step of a request's output. ``token_id`` is the new token (None on a final event that carries no
    token); ``text`` the new text (possibly empty: held back until a UTF-8 character or a stop-string candidate
    is complete). The last event has ``finish_reason``: "stop" (stop id or string), "length" (max_tokens or the
    row's capacity), "cancelled" or "error" (then ``error`` holds the message)."""

    token_id: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Detokenizer:
    """Incremental decoding of a token stream that never splits a UTF-8 character.

    Each :meth:`add` decodes the ids since the last emitted piece with one token of context before it and returns
    the new text, or "" while the decoded tail ends in U+FFFD (a byte-level token that ends inside a multi-byte
    character); :meth:`flush` returns what is left. The pieces concatenate to ``tokenizer.decode(ids,
    skip_special_tokens=False)`` (special tokens such as ``</think>`` stay in the text). Without a tokenizer the
    text is the ids separated by spaces, like :meth:`Session.decode`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list = []
        self.prefix = self.read = 0  # ids[prefix:read] is context already emitted, ids[read:] pending

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        if self.tokenizer is None:
            return ("" if len(self.ids) == 1 else " ") + str(int(token))
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string (kept back while streaming)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


# ---- requests ----------------------------------------------------------------------------------------------------

_ids = itertools.count(1)


class Request:
    """A submitted request: iterate it for its :class:`Event` s (ends after the final one), or call
    :meth:`result`. :meth:`cancel` may be called from any thread; the engine frees the row within one step."""

    def __init__(self, prompt: np.ndarray, params: SamplingParams, tokenizer,
                 on_event: Callable[[Event], None] | None):
        self.id = next(_ids)
        self.prompt = prompt
        self.params = params
        self.max_tokens = params.max_tokens
        self.on_event = on_event
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.finish_reason: str | None = None
        self.error: str | None = None
        # engine-side state (touched by the engine thread only)
        self.row = -1
        self.prefilled = 0
        self.tokens: list = []
        self.last_token = -1
        self.rng = np.random.default_rng(params.seed)
        self.catch_h = None  # speculative: main streams of the positions the MTP block has not seen yet
        self.detok = Detokenizer(tokenizer)
        self.text = ""  # generated text so far (stop strings cut it)
        self.sent = 0  # characters of text already emitted
        self.submitted = time.perf_counter()
        self.last_time = 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        if self.on_event is not None:
            raise RuntimeError("this request delivers its events to a callback")
        while True:
            ev = self.events.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> dict:
        """Waits for the end; returns {"tokens", "text", "finish_reason", "error", "prompt_tokens",
        "completion_tokens"}."""
        tokens, text, last = [], [], None
        deadline = None if timeout is None else time.monotonic() + timeout
        while last is None or last.finish_reason is None:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                last = self.events.get(timeout=wait)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s") from None
            if last.token_id is not None:
                tokens.append(last.token_id)
            text.append(last.text)
        return {"tokens": tokens, "text": "".join(text), "finish_reason": last.finish_reason, "error": last.error,
                "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens}


# ---- metrics -----------------------------------------------------------------------------------------------------

class Histogram:
    """Cumulative histogram in Prometheus' sense: counts per upper bound (``le``), a sum and a count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if v <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        return {"bounds": self.bounds, "counts": list(itertools.accumulate(self.counts)), "sum": self.sum,
                "count": self.count}


_LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# ---- the engine --------------------------------------------------------------------------------------------------

class Engine:
    """Continuous batching over ``session`` (a :class:`Session`) with ``max_batch`` state rows.

    ``max_queue``: requests that may wait while every row is taken (more: :class:`QueueFull`; 0: none wait).
    ``prefill_chunk``: prompt tokens prefilled per step (the per-step prefill budget). ``tokenizer``: for text
    events and stop strings (default: the session's). ``speculative``: None or "mtp" (``num_draft`` 1 to 3 drafts
    per step; see the module docstring). ``admission_window``: seconds the engine thread, woken from idle by a
    request, waits for more (until none has come for that long, at most four windows, or every free row has one),
    so that requests sent together are prefilled in one step and start decoding together (0: start at once)."""

    def __init__(self, session, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 64,
                 tokenizer=None, speculative: str | None = None, num_draft: int = 1, admission_window: float = 0.0):
        self.session = session
        if not isinstance(admission_window, (int, float)) or not 0 <= admission_window <= 10:
            raise ValueError(f"admission_window must be 0 to 10 seconds, got {admission_window!r}")
        self.admission_window = float(admission_window)
        self.max_batch = check_count("max_batch", max_batch, minimum=1)
        self.max_queue = check_count("max_queue", max_queue, minimum=0)
        self.prefill_chunk = check_count("prefill_chunk", prefill_chunk, minimum=1)
        self.speculative, self.num_draft = check_speculative(speculative, num_draft)
        self.tokenizer = session.tokenizer if tokenizer is None else tokenizer
        self.capacity = int(session.max_seq_len)
        self.spec = self.mstate = None
        if self.speculative is not None:
            if not hasattr(session, "speculator"):
                raise SpeculativeError(f"speculative={self.speculative!r} needs a single-graph Session; "
                                       f"{type(session).__name__} has no MTP graph")
            self.spec = session.speculator()  # SpeculativeError when the export has no MTP graph
        self.state = session.new_state(self.max_batch)  # allocated once; rows are the slots
        if self.spec is not None:
            self.mstate = self.spec.new_mtp_state(self.max_batch)  # the MTP block's rows, moved with the main ones
        # every decode call (at most max_batch rows, times num_draft + 1 for a verify call) computes each row as it
        # is alone (Session batch_invariant)
        self.rows_per_call = self.max_batch * (self.num_draft + 1 if self.spec is not None else 1)
        self.batch_invariant = int(getattr(session, "batch_invariant", 0)) >= self.rows_per_call
        self._views: dict = {}  # (start, stop) -> State view, bound once
        self._mviews: dict = {}  # the same for the MTP pool, with the Rollback objects of both
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list = []  # FIFO of requests without a row (guarded by _lock)
        self._rows: list = [None] * self.max_batch  # row -> Request (engine thread)
        self._decoding: list = []  # decoding requests; _decoding[i].row == i
        self._prefilling: list = []  # FIFO of requests prefilling on their own rows
        self._stopping: str | None = None
        self._thread: threading.Thread | None = None
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.stats = {"requests": {}, "prompt_tokens": 0, "completion_tokens": 0, "steps": 0, "decode_rows": 0,
                      "drafted": 0, "accepted": 0}
        self.ttft = Histogram(_LATENCY_BOUNDS)
        self.itl = Histogram(_LATENCY_BOUNDS)

    # ---- submission (any thread) ---------------------------------------------------------------------------------

    def submit(self, prompt_ids, params: SamplingParams | None = None, *,
               on_event: Callable[[Event], None] | None = None) -> Request:
        """Queues a request. Raises TypeError / ValueError for bad ids or parameters, :class:`PromptTooLong`,
        :class:`QueueFull` or :class:`EngineStopped`; never blocks on the engine's work."""
        from .session import _token_ids

        params = (params or SamplingParams()).checked()
        prompt = _token_ids(prompt_ids, "prompt_ids", self.session.vocab_size)
        if prompt.ndim != 1:
            raise ValueError(f"prompt_ids must be one sequence of token ids, got shape {prompt.shape}")
        n = int(prompt.shape[0])
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.capacity:
            raise PromptTooLong(f"the prompt has {n} tokens but a request holds at most {self.capacity} "
                                "(prompt + generated tokens)")
        if params.max_tokens is not None and n + params.max_tokens > self.capacity:
            raise PromptTooLong(f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the capacity of "
                                f"{self.capacity} tokens")
        req = Request(prompt, params, self.tokenizer, on_event)
        if req.max_tokens is None:
            req.max_tokens = self.capacity - n
        with self._lock:
            if self._stopping is not None:
                raise EngineStopped(self._stopping)
            # rows the engine has not handed out yet take requests at its next step; beyond them max_queue wait
            free = sum(r is None for r in self._rows)
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFull(f"every state row is taken and {len(self._waiting) - free} requests are waiting "
                                f"already (max_queue {self.max_queue})")
            self._waiting.append(req)
            self._wake.notify()
        return req

    def warmup(self) -> float:
        """Runs the shapes of serving once before the first request and returns the seconds it took: a prompt of
        ``prefill_chunk`` tokens on one row and one-token prompts on the others, then decode steps over all
        ``max_batch`` rows (a full speculative cycle with MTP). The first call of a process at a new shape runs slower
        than the later ones (its buffers are allocated and first touched then; the effect was measured, its parts
        were not separated): bench preset, 16 rows, AMD EPYC, the first decode step of a fresh process took 1.10x
        the later ones' median on average, 0.99x after a warmup. Call it before :meth:`start`, with nothing
        submitted; the rows are left free with their positions at 0 (stale contents are never read), and the
        counters and latency histograms are reset, so /metrics counts requests only."""
        if self._thread is not None or self.has_work():
            raise EngineError("warmup() runs before start() and before any request")
        t0 = time.perf_counter()
        tokens = (self.num_draft if self.spec is not None else 0) + 2
        n = min(self.prefill_chunk, self.capacity - tokens - 1)
        if n >= 1:
            params = SamplingParams(max_tokens=tokens)  # greedy, no stop ids: every request runs its length
            reqs = [self.submit(np.zeros(n if i == 0 else 1, np.int64), params) for i in range(self.max_batch)]
            self.run_until_idle()
            failed = [r.error for r in reqs if r.finish_reason == "error"]
            if failed:
                raise EngineError(f"warmup failed: {failed[0]}")
        self.state.positions[:] = 0
        if self.mstate is not None:
            self.mstate.positions[:] = 0
        with self._lock:
            self._reset_stats()
        return time.perf_counter() - t0

    # ---- the engine thread ---------------------------------------------------------------------------------------

    def start(self) -> "Engine":
        """Runs steps on a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsv4-ort-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, reason: str = "the engine stopped", *, wait: bool = True) -> None:
        """Ends every running and waiting request with an error event and stops the thread (``wait``: join it).
        Safe to call from a signal handler with ``wait=False``."""
        with self._lock:
            if self._stopping is None:
                self._stopping = reason
            self._wake.notify_all()
        if self._thread is None:
            self._fail_all(reason)
        elif wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                idle = not self._decoding and not self._prefilling
                while self._stopping is None and not self._waiting and idle:
                    self._wake.wait()
                if idle and self.admission_window > 0:
                    self._gather()
                stopping = self._stopping
            if stopping is not None:
                self._fail_all(stopping)
                return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failing step fails its requests, never the engine
                self._fail_running(f"engine step failed: {' '.join(str(e).split()) or type(e).__name__}")

    def _gather(self) -> None:
        """(lock held) The admission window: waits while requests keep arriving, so that requests sent together
        reach the first step together. Without it, the first arrival's step starts at once and takes the cores; the
        requests parsed during it are prefilled in the next step, beside the first ones' decoding, which stalls
        their streams (bench preset, 16 clients released together: 14 in the first step, 2 in the next)."""
        start = last = time.monotonic()
        seen = len(self._waiting)
        free = sum(r is None for r in self._rows)
        while self._stopping is None and len(self._waiting) < free:
            end = min(last + self.admission_window, start + 4 * self.admission_window)
            now = time.monotonic()
            if now >= end:
                return
            self._wake.wait(end - now)
            if len(self._waiting) > seen:
                seen, last = len(self._waiting), time.monotonic()

    def _fail_all(self, reason: str) -> None:
        self._fail_running(reason)
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for req in waiting:
            self._finish(req, "error", error=reason)

    def _fail_running(self, reason: str) -> None:
        for req in list(self._decoding) + list(self._prefilling):
            self._release(req)
            self._finish(req, "error", error=reason)

    # ---- one step ------------------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._decoding or self._prefilling)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Steps until no request is left (for callers that drive the engine without its thread)."""
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        return n

    def step(self) -> None:
        """Cancellations, admissions, one decode call over the decoding rows, the step's prefill chunks (see the
        module docstring), then the first tokens of the prompts they finished."""
        self.stats["steps"] += 1
        for req in [r for r in self._decoding + self._prefilling if r.cancelled.is_set()]:
            self._release(req)
            self._finish(req, "cancelled")
        with self._lock:
            cancelled = [r for r in self._waiting if r.cancelled.is_set()]
            self._waiting = [r for r in self._waiting if not r.cancelled.is_set()]
            free = [i for i in range(self.max_batch) if self._rows[i] is None]
            admitted, self._waiting = self._waiting[:len(free)], self._waiting[len(free):]
        for req in cancelled:
            self._finish(req, "cancelled")
        for req, row in zip(admitted, free):
            req.row = row
            self._rows[row] = req
            self.state.positions[row] = 0  # a fresh sequence: stale contents are never read from position 0
            if self.mstate is not None:
                self.mstate.positions[row] = 0
            self._prefilling.append(req)
        decoding = bool(self._decoding)
        if decoding:
            self._decode() if self.spec is None else self._decode_speculative()
        # prefill budget: whole chunks of the oldest prefilling requests, up to prefill_chunk tokens (at least one
        # chunk) while requests decode, since each of them waits for the step; with none decoding, no stream waits,
        # so every prefilling request advances by one chunk (requests arriving together start decoding together
        # instead of each new prompt's step stalling the streams already started). A chunk is never cut to fit, so
        # its boundaries stay multiples of prefill_chunk. The first tokens of the prompts finished in the step go
        # out when its prefill is done, together, as from one batched prefill: a request whose prompt came first
        # would otherwise stream its first token, then wait for every later prompt of the step before its second.
        used = 0
        finished = []
        for req in list(self._prefilling):
            n = min(self.prefill_chunk, int(req.prompt.shape[0]) - req.prefilled)
            if decoding and used and used + n > self.prefill_chunk:
                break
            logits = self._prefill(req)
            if logits is not None:
                finished.append((req, logits))
            used += n
        for req, logits in finished:
            self._emit_sampled(req, logits)

    def _view(self, start: int, stop: int):
        key = (start, stop)
        if key not in self._views:
            self._views[key] = self.state.rows(start, stop)
        return self._views[key]

    def _mview(self, start: int, stop: int) -> tuple:
        """(MTP pool view, main Rollback, MTP Rollback) of rows [start, stop)."""
        key = (start, stop)
        if key not in self._mviews:
            view = self.mstate.rows(start, stop)
            self._mviews[key] = (view, Rollback(self._view(start, stop), self.spec.main_ratios),
                                 Rollback(view, self.spec.mtp_ratios))
        return self._mviews[key]

    def _fail_decoding(self, e: Exception) -> None:
        msg = f"decode failed: {' '.join(str(e).split()) or type(e).__name__}"
        for req in list(self._decoding):
            self._release(req)
            self._finish(req, "error", error=msg)

    def _decode(self) -> None:
        k = len(self._decoding)
        ids = np.array([[r.last_token] for r in self._decoding], np.int64)
        try:
            logits = self.session.forward(ids, self._view(0, k))[:, -1]
        except Exception as e:  # noqa: BLE001 - the decoding requests fail, the engine goes on
            self._fail_decoding(e)
            return
        self.stats["decode_rows"] += k
        for i, req in enumerate(list(self._decoding)):
            self._emit_sampled(req, logits[i:i + 1])

    def _decode_speculative(self) -> None:
        """One speculative cycle over the decoding rows: each request emits its accepted drafts and the next token."""
        reqs = list(self._decoding)
        B = len(reqs)
        view = self._view(0, B)
        mview, rb_main, rb_mtp = self._mview(0, B)
        left = min(r.max_tokens - len(r.tokens) for r in reqs)
        k = max(min(self.num_draft, left - 1, self.capacity - 1 - int(view.positions.max())), 0)
        # the MTP block's catch-up: streams of the positions accepted last cycle with the tokens after them, which
        # are the request's last emitted tokens
        catch = [(r.catch_h, np.array(r.tokens[-r.catch_h.shape[0]:], np.int64)) for r in reqs]
        params = [RowParams(r.params.temperature, r.params.top_k, r.params.top_p, r.rng) for r in reqs]
        pending = np.array([r.last_token for r in reqs], np.int64)
        try:
            c = self.spec.cycle(view, mview, pending, catch, k, params, np.ones(B, bool), rb_main, rb_mtp,
                                min(len(r.tokens) for r in reqs))
        except Exception as e:  # noqa: BLE001 - the decoding requests fail, the engine goes on
            self._fail_decoding(e)
            return
        with self._lock:
            self.stats["decode_rows"] += B
            self.stats["drafted"] += k * B
            self.stats["accepted"] += int(c.accepted.sum())
        for req, (h, _) in zip(reqs, c.catch):
            req.catch_h = h
        for i, req in enumerate(reqs):  # a request that ends releases its row: the others' rows move, not their data
            for tok in [int(t) for t in c.drafts[i, :c.accepted[i]]] + [int(c.next[i])]:
                if not self._emit_token(req, tok):
                    break

    def _prefill_speculative(self, req: Request, chunk: np.ndarray) -> np.ndarray:
        """A prefill chunk through the main graph with its streams, then the MTP block over the chunk's positions
        whose next token is a prompt token (the prompt's last position waits for the first generated token). A
        window-only MTP block skips positions more than its window before the prompt's end: the entries a position
        writes depend on its own inputs only, so skipped positions are never read."""
        spec, row, start = self.spec, req.row, req.prefilled
        view = self._view(row, row + 1)
        logits, hidden = spec.main_step(view, chunk.reshape(1, -1), 1)
        view.positions += chunk.shape[0]
        P, end = int(req.prompt.shape[0]), start + int(chunk.shape[0])
        mview = self._mview(row, row + 1)[0]
        lo = max(start, P - spec.n_win if spec.mtp_ratio == 0 else 0)
        hi = min(end, P - 1)
        if lo < hi:
            mview.positions[0] = max(int(mview.positions[0]), lo)
            spec.mtp_step(mview, hidden[:, lo - start:hi - start], req.prompt[None, lo + 1:hi + 1], 1)
            mview.positions[0] = hi
        if end == P:
            mview.positions[0] = P - 1
            req.catch_h = hidden[0, P - 1 - start:].copy()
        return logits[:, -1]

    def _prefill(self, req: Request) -> np.ndarray | None:
        """One chunk of ``req``'s prompt; the last chunk's logits (the first token's) once the prompt is done."""
        start = req.prefilled
        chunk = req.prompt[start:start + self.prefill_chunk]
        try:
            if self.spec is None:
                logits = self.session.forward(chunk.reshape(1, -1), self._view(req.row, req.row + 1))[:, -1]
            else:
                logits = self._prefill_speculative(req, chunk)
        except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
            self._release(req)
            self._finish(req, "error", error=f"prefill failed: {' '.join(str(e).split()) or type(e).__name__}")
            return None
        req.prefilled += chunk.shape[0]
        if req.prefilled < req.prompt.shape[0]:
            return None
        # prompt done: the request joins the decoding rows at row k (its first token comes from these logits)
        self._prefilling.remove(req)
        self._move(req, len(self._decoding))
        self._decoding.append(req)
        with self._lock:
            self.stats["prompt_tokens"] += int(req.prompt.shape[0])
        return logits

    def _move(self, req: Request, row: int) -> None:
        """Puts ``req``'s sequence in ``row`` (swapping with a prefilling request there, if any)."""
        old = req.row
        if old == row:
            return
        other = self._rows[row]
        if other is None:
            for pool in self._pools():
                pool.copy_row(old, row)
            self._rows[old] = None
        else:  # the two sequences exchange rows (State.swap_rows; a pipeline's state swaps in every stage)
            for pool in self._pools():
                pool.swap_rows(old, row)
            other.row = old
            self._rows[old] = other
        req.row = row
        self._rows[row] = req

    def _release(self, req: Request) -> None:
        """Frees ``req``'s row at once; the decoding rows stay contiguous (the last one fills the hole)."""
        if req in self._prefilling:
            self._prefilling.remove(req)
            self._rows[req.row] = None
        elif req in self._decoding:
            i = req.row
            last = self._decoding.pop()
            self._rows[last.row] = None
            if last is not req:
                for pool in self._pools():
                    pool.copy_row(last.row, i)
                last.row = i
                self._decoding[i] = last
                self._rows[i] = last
        req.row = -1

    def _pools(self) -> tuple:
        return (self.state,) if self.mstate is None else (self.state, self.mstate)

    def _emit_sampled(self, req: Request, logits: np.ndarray) -> None:
        """Samples ``req``'s next token from its logits [1, V], emits it and finishes the request if it ends."""
        p = req.params
        try:
            check_logits(logits, step=len(req.tokens))
            tok = int(sample(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, rng=req.rng)[0])
        except ValueError as e:
            self._release(req)
            self._finish(req, "error", error=str(e))
            return
        self._emit_token(req, tok)

    def _emit_token(self, req: Request, tok: int) -> bool:
        """Emits ``req``'s next token; finishes the request (and frees its row) if it ends. True if it goes on."""
        p = req.params
        now = time.perf_counter()
        with self._lock:
            (self.ttft if not req.tokens else self.itl).observe(now - (req.last_time or req.submitted))
            self.stats["completion_tokens"] += 1
        req.last_time = now
        req.tokens.append(tok)
        req.last_token = tok
        reason = None
        if tok in p.stop_ids:
            reason = "stop"
            piece = req.detok.flush()
        else:
            piece = req.detok.add(tok)
            if len(req.tokens) >= req.max_tokens:
                reason = "length"
                piece += req.detok.flush()
        req.text += piece
        if p.stop:
            hit = min((i for i in (req.text.find(s, max(0, req.sent - len(s) + 1)) for s in p.stop) if i >= 0),
                      default=-1)
            if hit >= 0:
                req.text = req.text[:hit]
                reason = "stop"
        keep = 0 if reason is not None else _held_back(req.text, p.stop)
        text = req.text[req.sent:len(req.text) - keep]
        req.sent += len(text)
        if reason is None:
            self._send(req, Event(tok, text))
            return True
        self._release(req)
        self._finish(req, reason, token=tok, text=text)
        return False

    def _finish(self, req: Request, reason: str, *, token: int | None = None, text: str = "",
                error: str | None = None) -> None:
        if req.done.is_set():
            return
        req.finish_reason, req.error = reason, error
        with self._lock:
            self.stats["requests"][reason] = self.stats["requests"].get(reason, 0) + 1
        self._send(req, Event(token, text, reason, error, int(req.prompt.shape[0]), len(req.tokens)))
        req.done.set()

    @staticmethod
    def _send(req: Request, ev: Event) -> None:
        if req.on_event is None:
            req.events.put(ev)
        else:
            try:
                req.on_event(ev)
            except Exception:  # noqa: BLE001 - a consumer that went away must not stop the engine
                req.cancel()

    # ---- introspection -------------------------------------------------------------------------------------------

    def metrics(self) -> dict:
        """A consistent snapshot: counters, queue depth, rows in use and the latency histograms."""
        with self._lock:
            return {"requests": dict(self.stats["requests"]), "prompt_tokens": self.stats["prompt_tokens"],
                    "completion_tokens": self.stats["completion_tokens"], "steps": self.stats["steps"],
                    "queue_depth": len(self._waiting),
                    "running": sum(r is not None for r in self._rows), "max_batch": self.max_batch,
                    "speculative": self.speculative, "drafted": self.stats["drafted"],
                    "accepted": self.stats["accepted"],
                    "ttft": self.ttft.snapshot(), "itl": self.itl.snapshot()}


__all__ = ["Detokenizer", "Engine", "EngineError", "EngineStopped", "Event", "PromptTooLong", "QueueFull",
           "Request", "SamplingParams"]
