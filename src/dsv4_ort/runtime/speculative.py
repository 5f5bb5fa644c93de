"""MTP speculative decoding: draft with the checkpoint's own MTP block, verify k drafts in one main-model step.

A model exported with ``mtp=True`` (:mod:`dsv4_ort.export.mtp`) has a second graph, ``mtp.onnx``, and a main graph
that also returns its last block's streams (``hidden``) and the logits of the last ``num_logits`` positions. Each
decode cycle of :class:`MtpSpeculator`, per row at main position ``n`` with the next token ``x_n`` already chosen:

1. **catch-up + draft**: the MTP block runs on the main streams of the positions the main model accepted since the
   last cycle (``h_t`` with the token ``x_{t+1}``; the last one is ``h_{n-1}`` with ``x_n``) and predicts ``d_1`` for
   position ``n + 1``; for ``k > 1`` it runs again on its own output streams with ``d_{j-1}`` (``d_j`` at
   ``n + j``). The draft positions of the MTP state are rolled back afterwards: the next catch-up writes them with
   the main model's streams.
2. **verify**: one main forward of ``[x_n, d_1 .. d_k]`` at positions ``n .. n + k`` with ``num_logits = k + 1``.
3. **accept**: greedy keeps the longest prefix of drafts equal to the main model's argmax, then the main model's
   own next token; sampling uses standard speculative sampling (accept ``d_j`` with probability
   ``min(1, p(d_j) / q(d_j))``, on rejection draw from ``max(0, p - q)`` renormalised, after ``k`` accepts draw from
   the last position), so tokens follow the main model's distribution (:func:`accept`).
4. **rollback**: the state rows written by rejected positions are put back (:class:`Rollback`), so the state is
   bit for bit the state of a plain run over the accepted tokens.

Rollback. A step of ``S`` tokens at positions ``P .. P+S-1`` writes, per layer (the op contracts of op_table.json;
the kernels are the token-by-token state machine of models/functional.py):

* window ring: slot ``p % n_win`` for each p (S <= n_win);
* compressor rows (ratio r, coff = 2 for r = 4): row ``off + p % r`` (off = r when overlapping, else 0) for each
  p, and, when p ends a block of an overlapping compressor, rows ``0 .. r-1`` (the block is copied down);
* compressed entries / indexer keys: slot ``p // r`` when ``(p + 1) % r == 0``.

With ``S <= 4 <= r`` and ``S <= n_win`` (hence ``num_draft <= 3``) no row is written twice in one step, so saving
those rows before the step and restoring the ones written by a rejected position gives exactly the state a run of
the accepted positions alone leaves (rows of accepted positions hold what that run writes, the others what they held
before). That is a few rows per layer (window rows, compressor rows, at most one entry): the snapshot and restore
copy kilobytes per step.

Exactness. Greedy speculative output equals plain greedy decoding when each row's logits do not depend on how many
rows a call has: verify steps run ``k + 1`` rows per sequence where a decode step runs one. That holds bit for bit at
the scalar ISA and with ``Session(batch_invariant=N)`` for N >= rows of a verify step (``batch * (k + 1)``); at other
settings logits differ in the last bits (~1e-6), which can flip a near-tie argmax.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .sampling import MIN_TEMPERATURE, check_logits, probabilities
from .state import State

SPECULATIVE_MODES = ("mtp",)
MAX_DRAFT = 3  # S = k + 1 <= 4 = the CSA ratio: no state row is written twice by one verify step


class SpeculativeError(ValueError):
    """The model or the arguments do not allow speculative decoding (names what is missing)."""


def check_speculative(speculative, num_draft) -> tuple:
    """Validated ``(speculative, num_draft)``: speculative None or "mtp", num_draft an integer in 1 .. 3."""
    from .sampling import check_count

    if speculative is not None and speculative not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be None or one of {SPECULATIVE_MODES}, got {speculative!r}")
    num_draft = check_count("num_draft", num_draft, minimum=1)
    if num_draft > MAX_DRAFT:
        raise ValueError(f"num_draft must be <= {MAX_DRAFT} (a verify step of num_draft + 1 tokens must not write a "
                         f"state row twice), got {num_draft}")
    return speculative, num_draft


# ---------------------------------------------------------------------------------------------------- rollback


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Which rows of one state tensor a position writes (see the module docstring)."""

    kind: str  # "ring" | "entries" | "block"
    period: int  # n_win (ring), r (entries, block)
    offset: int = 0  # block: row of the current block's first token (r when overlapping)
    shift: bool = False  # block: an emission copies rows [r, 2r) to [0, r)


def _rows_of(name: str, ratio: int, n_win: int) -> _Rows:
    if name == "window":
        return _Rows("ring", n_win)
    if name == "entries":
        return _Rows("entries", ratio)
    if name == "index_keys":
        return _Rows("entries", 4)
    if name in ("kv_state", "score_state"):
        overlap = ratio == 4
        return _Rows("block", ratio, ratio if overlap else 0, overlap)
    if name in ("index_kv_state", "index_score_state"):
        return _Rows("block", 4, 4, True)
    raise SpeculativeError(f"state tensor {name!r}: no rollback rule (runtime/speculative.py knows window, entries, "
                           "kv_state, score_state, index_keys, index_kv_state, index_score_state)")


def _written(rows: _Rows, p: np.ndarray, capacity: int) -> tuple:
    """(batch row, slot, writing position) arrays of the slots positions p [B, S] write."""
    B, S = p.shape
    b = np.repeat(np.arange(B), S)
    pf = p.ravel()
    if rows.kind == "ring":
        return b, pf % rows.period, pf
    r = rows.period
    emit = (pf + 1) % r == 0
    if rows.kind == "entries":
        m = emit & (pf // r < capacity)
        return b[m], pf[m] // r, pf[m]
    bs, slots, writers = [b], [rows.offset + pf % r], [pf]
    if rows.shift and emit.any():
        eb, ep = b[emit], pf[emit]
        bs.append(np.repeat(eb, r))
        slots.append(np.tile(np.arange(r), eb.size))
        writers.append(np.repeat(ep, r))
    return np.concatenate(bs), np.concatenate(slots), np.concatenate(writers)


class Rollback:
    """Snapshots of the state rows a step will write, and their restoration for the positions a row does not keep.

    ``ratios``: compress ratio of each layer id of the state's tensors (``past.L.<name>``).
    """

    def __init__(self, state: State, ratios: dict):
        self.state = state
        self.items = []
        for (in_name, _, buf, _) in state.tensors:
            _, layer, name = in_name.split(".", 2)
            rows = _rows_of(name, int(ratios[int(layer)]), buf.shape[1])
            self.items.append((buf, rows))

    def snapshot(self, start: np.ndarray, count: int) -> tuple:
        """Saves the rows positions ``start[b] .. start[b] + count - 1`` of each row will write."""
        p = np.asarray(start, np.int64)[:, None] + np.arange(count)
        saved = []
        for buf, rows in self.items:
            b, slot, writer = _written(rows, p, buf.shape[1])
            saved.append((buf, b, slot, writer, buf[b, slot]))  # fancy indexing: a copy
        return np.asarray(start, np.int64).copy(), saved

    @staticmethod
    def restore(snap: tuple, keep: np.ndarray) -> None:
        """Puts back every saved row written by a position >= start[b] + keep[b] (keep 0: the whole step)."""
        start, saved = snap
        limit = start + np.asarray(keep, np.int64)
        for buf, b, slot, writer, old in saved:
            m = writer >= limit[b]
            if m.any():
                buf[b[m], slot[m]] = old[m]


# ---------------------------------------------------------------------------------------------------- acceptance


def accept(drafts: np.ndarray, p: np.ndarray | None, q: np.ndarray | None, main_logits: np.ndarray,
           temperature: float, rng: np.random.Generator, top_k: int = 0, top_p: float = 1.0) -> tuple:
    """The accepted drafts and the next token of each row.

    drafts [B, k] int64; main_logits [B, k + 1, V] (position j predicts the token after drafts[:, :j]); p / q [B,
    k(+1), V] the main model's and the draft's distributions (sampling only; p computed here when None). Greedy
    (temperature < MIN_TEMPERATURE): a = the number of leading drafts equal to the main argmax, next = the argmax at
    a. Sampling: draft j is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the next token
    is drawn from max(0, p_j - q_j) renormalised (p_j where that is zero), else from p_k. Returns (a [B], next [B]).
    """
    B, k = drafts.shape
    if temperature < MIN_TEMPERATURE:
        best = main_logits.argmax(axis=-1)  # [B, k + 1]
        match = best[:, :k] == drafts
        a = np.where(match.all(axis=1), k, np.argmin(match, axis=1)) if k else np.zeros(B, np.int64)
        return a.astype(np.int64), best[np.arange(B), a].astype(np.int64)
    if p is None:
        p = probabilities(main_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    a = np.full(B, k, np.int64)
    nxt = np.empty(B, np.int64)
    for b in range(B):
        for j in range(k):
            d = drafts[b, j]
            if rng.random() * q[b, j, d] < p[b, j, d]:  # u < p / q without dividing by q
                continue
            a[b] = j
            resid = np.maximum(p[b, j] - q[b, j], 0.0)
            total = resid.sum()
            nxt[b] = _draw(resid / total if total > 0 else p[b, j], rng)
            break
        else:
            nxt[b] = _draw(p[b, k], rng)
    return a, nxt


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a distribution (the exponential race of runtime/sampling.py)."""
    return int((probs / rng.exponential(1.0, size=probs.shape)).argmax())


# ---------------------------------------------------------------------------------------------------- runner


@dataclasses.dataclass(frozen=True)
class RowParams:
    """One row's sampling: temperature (< MIN_TEMPERATURE: greedy), top_k, top_p and its generator."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    rng: np.random.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclasses.dataclass(frozen=True)
class Cycle:
    """What :meth:`MtpSpeculator.cycle` did: per row the accepted drafts' count ``accepted`` [B], the main model's
    ``next`` token [B], the ``drafts`` [B, k], the next cycle's ``catch`` input, and the phases' seconds."""

    accepted: np.ndarray
    next: np.ndarray
    drafts: np.ndarray
    catch: list
    mtp_s: float
    verify_s: float
    rollback_s: float


class MtpSpeculator:
    """Speculative decoding of one :class:`~dsv4_ort.runtime.session.Session` whose export has the MTP graph.

    The MTP graph runs in its own onnxruntime session with the main session's threads, ISA levels and batch
    invariance; both memory-map the same ``model.onnx.data``.
    """

    def __init__(self, session):
        import onnxruntime as ort

        import dsv4_ort

        meta = session.meta
        mtp = meta.get("mtp") or {}
        if not mtp.get("exported"):
            raise SpeculativeError(f"{session.model_dir} has no MTP graph: re-export with `dsv4-ort export --mtp` "
                                   "(needs a checkpoint with mtp.* tensors) to decode with speculative='mtp'")
        if meta.get("logits") != "last":
            raise SpeculativeError(f"{session.model_dir}: speculative decoding needs an export with logits='last' "
                                   f"(num_logits input), this one has logits={meta.get('logits')!r}")
        self.session = session
        self.meta = mtp
        cfg = session.config
        self.hc, self.d = int(cfg["hc_mult"]), int(cfg["hidden_size"])
        self.n_win = int(cfg["sliding_window"])
        self.mtp_ratio = int(mtp["ratio"])
        ratios = {int(lay["layer"]): int(lay["ratio"]) for lay in meta["state"]["layers"]}
        self.main_ratios = ratios
        self.mtp_ratios = {int(mtp["layer"]): self.mtp_ratio}
        self.mtp_meta = {"max_seq_len": meta["max_seq_len"], "state": mtp["state"]}
        path = session.model_dir / mtp["graph"]
        from .session import session_options

        # its own thread pool, which like the main session's spins only while a run lasts
        so = session_options(session.threads)
        kernels = ",".join(f"{k}={v}" for k, v in sorted(session.families.items()))
        with dsv4_ort.isa_cap(session.isa, kernels, getattr(session, "batch_invariant", None) or None):
            dsv4_ort.register(so)
            try:
                self.mtp_session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - reported as a model error naming the file
                from .session import ModelError, _last_line

                raise ModelError(f"cannot load {path}: {_last_line(e)}") from None

    # ---- states and runs -----------------------------------------------------------------------------------------

    def new_mtp_state(self, batch_size: int) -> State:
        """Zeroed MTP-block state (its own window ring, positions of the MTP block)."""
        return State(self.mtp_meta, batch_size, self.mtp_session)

    def _binding(self, state: State, sess) -> tuple:
        """A second IOBinding of ``state`` (the plain runs' binding never binds ``hidden``): state in place,
        ``start_pos`` over positions, ``num_logits`` over an array of ours."""
        import onnxruntime as ort

        cached = getattr(state, "_speculative_binding", None)
        if cached is not None and cached[0] is sess:
            return cached[1], cached[2]
        if state.owner is not sess:
            state.bind(sess)
        io = sess.io_binding()
        n = np.ones(1, np.int64)
        io.bind_ortvalue_input("start_pos", state._start_pos)
        io.bind_ortvalue_input("num_logits", ort.OrtValue.ortvalue_from_numpy(n))
        for in_name, out_name, _, value in state.tensors:
            io.bind_ortvalue_input(in_name, value)
            io.bind_ortvalue_output(out_name, value)
        state._speculative_binding = (sess, io, n)
        return io, n

    def _run(self, sess, state: State, inputs: dict, num_logits: int, hidden_name: str) -> tuple:
        """One run with ``num_logits`` last-position logits and all positions' streams; positions are not moved."""
        import onnxruntime as ort

        io, n = self._binding(state, sess)
        n[0] = num_logits
        ids = inputs["input_ids"]
        B, S = ids.shape
        logits = np.empty((B, num_logits, self.session.vocab_size), np.float32)
        hidden = np.empty((B, S, self.hc, self.d), np.float32)
        keep = [logits, hidden]
        for name, arr in inputs.items():
            arr = np.ascontiguousarray(arr)
            keep.append(arr)
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            keep.append(v)
            io.bind_ortvalue_input(name, v)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        io.bind_output(hidden_name, "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)
        state._run_buffers = tuple(keep)
        sess.run_with_iobinding(io)
        return logits, hidden

    def main_step(self, state: State, ids: np.ndarray, num_logits: int) -> tuple:
        """Main model on ids [B, S] at the rows' positions: (logits [B, num_logits, V], hidden [B, S, hc, d]); the
        positions are NOT advanced (the caller keeps what it accepts)."""
        return self._run(self.session.session, state, {"input_ids": ids.astype(np.int64)}, num_logits, "hidden")

    def mtp_step(self, mstate: State, hidden: np.ndarray, ids: np.ndarray, num_logits: int) -> tuple:
        """MTP block on streams [B, S, hc, d] and next tokens [B, S]: (logits [B, num_logits, V], hidden_out)."""
        return self._run(self.mtp_session, mstate, {"hidden": hidden.astype(np.float32, copy=False),
                                                     "input_ids": ids.astype(np.int64)}, num_logits, "hidden_out")

    # ---- one cycle -----------------------------------------------------------------------------------------------

    @staticmethod
    def _pick(logits: np.ndarray, params: list, q: np.ndarray | None, j: int) -> np.ndarray:
        """Per row, the token drawn from logits [B, V] with the row's parameters (greedy: argmax); sampled rows'
        distributions go to q[:, j] (the draft distribution speculative sampling compares with)."""
        out = np.empty(len(params), np.int64)
        for b, p in enumerate(params):
            if p.greedy:
                out[b] = int(logits[b].argmax())
                continue
            probs = probabilities(logits[b:b + 1], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)[0]
            if q is not None and j >= 0:
                q[b, j] = probs
            out[b] = _draw(probs, p.rng)
        return out

    def cycle(self, state: State, mstate: State, pending: np.ndarray, catch: list, k: int, params: list,
              live: np.ndarray, rb_main: Rollback, rb_mtp: Rollback, step: int = 0) -> Cycle:
        """One speculative cycle over the B rows of ``state`` / ``mstate`` (steps 1-4 of the module docstring).

        ``pending`` [B]: each row's next token x_n (not yet in the state; the row's main position is n).
        ``catch``: per row (h [n_b, hc, d], ids [n_b]): the main streams of the positions accepted since the last
        cycle and the token after each (n_b >= 1 for a live row; 0 for a finished one). ``k``: drafts (0 .. 3).
        ``params``: per row :class:`RowParams`. ``live`` [B] bool: finished rows keep nothing of this cycle.
        Positions of both states advance over what each row keeps; rejected positions are rolled back."""
        B = len(params)
        t0 = time.perf_counter()
        greedy = all(p.greedy for p in params)
        cat_len = np.array([c[0].shape[0] for c in catch], np.int64)
        S_m = int(max(cat_len.max(), 1))
        h_in = np.zeros((B, S_m, self.hc, self.d), np.float32)
        ids_in = np.zeros((B, S_m), np.int64)
        for b, (h, ids) in enumerate(catch):
            h_in[b, :h.shape[0]], ids_in[b, :h.shape[0]] = h, ids
        # 1. catch-up over the accepted positions, then drafts. Rows with a shorter catch-up run padding positions
        # (zeros) that are rolled back; logits only from the earliest last position of a live row on
        mpos = mstate.positions.copy()
        snap = rb_mtp.snapshot(mpos, S_m) if (cat_len < S_m).any() else None
        last = np.maximum(cat_len - 1, 0)
        n_log = S_m - int(last[live].min()) if live.any() else 1
        m_logits, m_hidden = self.mtp_step(mstate, h_in, ids_in, n_log)
        if snap is not None:
            Rollback.restore(snap, cat_len)
        mstate.positions[:] = mpos + cat_len
        rows = np.arange(B)
        drafts = np.zeros((B, k), np.int64)
        q = None if greedy else np.zeros((B, k, self.session.vocab_size))
        if k:
            lg = m_logits[rows, np.clip(last - (S_m - n_log), 0, n_log - 1)]  # [B, V] predicts position n + 1
            h_prev = m_hidden[rows, last][:, None]  # [B, 1, hc, d]
            drafts[:, 0] = self._pick(lg, params, q, 0)
            if k > 1:
                dpos = mstate.positions.copy()
                dsnap = rb_mtp.snapshot(dpos, k - 1)
                for j in range(1, k):
                    mstate.positions[:] = dpos + j - 1
                    lg, h_prev = self.mtp_step(mstate, h_prev, drafts[:, j - 1:j], 1)
                    drafts[:, j] = self._pick(lg[:, 0], params, q, j)
                Rollback.restore(dsnap, np.zeros(B, np.int64))
                mstate.positions[:] = dpos
        t1 = time.perf_counter()
        # 2. verify [x_n, d_1 .. d_k] at n .. n + k
        pos = state.positions.copy()
        snap = rb_main.snapshot(pos, k + 1)
        v_logits, v_hidden = self.main_step(state, np.concatenate([pending[:, None], drafts], axis=1), k + 1)
        for j in range(k + 1):
            check_logits(v_logits[:, j], step=step + j)
        t2 = time.perf_counter()
        # 3. accept, row by row with the row's parameters
        a = np.zeros(B, np.int64)
        nxt = np.zeros(B, np.int64)
        for b, p in enumerate(params):
            ab, nb = accept(drafts[b:b + 1], None, None if q is None else q[b:b + 1], v_logits[b:b + 1],
                            p.temperature, p.rng, p.top_k, p.top_p)
            a[b], nxt[b] = ab[0], nb[0]
        a = np.where(live, a, 0)
        keep = np.where(live, a + 1, 0)
        # 4. rollback of the rejected positions (and of finished rows' whole step)
        Rollback.restore(snap, keep)
        state.positions[:] = pos + keep
        # next catch-up: h at n .. n + a with the tokens d_1 .. d_a, next
        toks = np.concatenate([drafts, nxt[:, None]], axis=1)
        toks[rows, a] = nxt
        catch = [(v_hidden[b, :keep[b]], toks[b, :keep[b]]) for b in range(B)]
        t3 = time.perf_counter()
        return Cycle(a, nxt, drafts, catch, t1 - t0, t2 - t1, t3 - t2)

    # ---- generation ----------------------------------------------------------------------------------------------

    def generate(self, prompts: np.ndarray, max_new_tokens: int, *, num_draft: int, temperature: float, top_k: int,
                 top_p: float, rng: np.random.Generator, stops: set, stats: dict | None = None, state=None):
        """Yields, per cycle, a list with the new tokens of each row (empty for finished rows) for prompts [B, P].

        Stops a row after a stop id (yielded) or max_new_tokens; the first yield is the token of the prompt's
        logits. ``stats`` (a dict) receives prefill / decode counts and times, drafted and accepted tokens.
        """
        sess = self.session
        B, P = prompts.shape
        state = state if state is not None else sess.new_state(B)
        mstate = self.new_mtp_state(B)
        rb_main, rb_mtp = Rollback(state, self.main_ratios), Rollback(mstate, self.mtp_ratios)
        params = [RowParams(temperature, top_k, top_p, rng)] * B

        t0 = time.perf_counter()
        # prefill: main streams of the positions the MTP block needs (the last n_win when it is window-only: the
        # entries a position writes depend on its own inputs only, so skipped positions are never read)
        start = state.positions.copy()
        keep_from = max(P - self.n_win, 0) if self.mtp_ratio == 0 else 0
        chunk = sess.prefill_chunk or P
        tail = []
        for i in range(0, P, chunk):
            logits, hidden = self.main_step(state, prompts[:, i:i + chunk], 1)
            state.positions += min(chunk, P - i)
            lo = max(keep_from - i, 0)
            if lo < hidden.shape[1]:
                tail.append(hidden[:, lo:])
        logits = logits[:, -1]
        check_logits(logits, step=0)
        first = self._pick(logits, params, None, -1)
        if stats is not None:
            stats.update(prefill_tokens=P, prefill_s=time.perf_counter() - t0, decode_tokens=0, decode_s=0.0,
                         cycles=0, drafted=0, accepted=0, mtp_s=0.0, verify_s=0.0, rollback_s=0.0)
        done = np.zeros(B, bool)
        produced = np.ones(B, np.int64)
        for b in range(B):
            done[b] = int(first[b]) in stops or max_new_tokens <= 1
        yield [[int(t)] for t in first]

        # MTP catch-up input: streams h_t of positions keep_from .. P - 1 and the tokens x_{t+1}
        mstate.positions[:] = start + keep_from
        cat_h = np.concatenate(tail, axis=1)
        next_ids = np.concatenate([prompts[:, keep_from + 1:], first[:, None]], axis=1)
        catch = [(cat_h[b], next_ids[b]) for b in range(B)]
        pending = first.copy()
        cap = sess.max_seq_len

        while not done.all():
            t_cycle = time.perf_counter()
            left = max_new_tokens - produced[~done]
            k = max(int(min(num_draft, left.min() - 1, cap - 1 - state.positions.max())), 0)
            c = self.cycle(state, mstate, pending, catch, k, params, ~done, rb_main, rb_mtp, int(produced.min()))
            live = ~done
            out = []
            for b in range(B):
                if done[b]:
                    out.append([])
                    continue
                emit = []
                for t in [int(t) for t in c.drafts[b, :c.accepted[b]]] + [int(c.next[b])]:
                    emit.append(t)
                    produced[b] += 1
                    if t in stops or produced[b] >= max_new_tokens:
                        done[b] = True
                        break
                out.append(emit)
            catch, pending = c.catch, c.next
            if stats is not None:
                stats["cycles"] += 1
                stats["drafted"] += int(k * live.sum())
                stats["accepted"] += int(c.accepted[live].sum())
                stats["decode_tokens"] += sum(len(o) for o in out)
                stats["decode_s"] += time.perf_counter() - t_cycle
                stats["mtp_s"] += c.mtp_s
                stats["verify_s"] += c.verify_s
                stats["rollback_s"] += c.rollback_s
            yield out


def stream_tokens(spec: MtpSpeculator, prompt: np.ndarray, state, stats, num_draft: int, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float, seed, stops: set):
    """Session.stream's speculative path: the tokens of one prompt [1, P], one at a time."""
    if max_new_tokens == 0:
        return
    rng = np.random.default_rng(seed)
    for step in spec.generate(prompt, max_new_tokens, num_draft=num_draft, temperature=temperature, top_k=top_k,
                              top_p=top_p, rng=rng, stops=stops, stats=stats, state=state):
        yield from step[0]
