"""dsv4_ort.runtime.engine: continuous batching over state rows gives each request what it gets alone; State row
views; slot reuse, cancellation, the bounded queue, capacity errors, stop ids and strings, threads, and the
incremental detokenizer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from model_fixtures import random_ids, require_library

from dsv4_ort.runtime import Session
from dsv4_ort.runtime.engine import (Detokenizer, Engine, EngineError, EngineStopped, PromptTooLong, QueueFull,
                                     SamplingParams, _held_back)

CHUNK = 16


@pytest.fixture(scope="module")
def model(cache):
    require_library()
    return cache.export(("tiny",), logits="last", max_seq_len=256).parent


@pytest.fixture(scope="module")
def session(model):
    return Session(model, intra_op_threads=1, prefill_chunk=CHUNK)


def prompts(vocab: int, n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(1, 70))).tolist() for _ in range(n)]


def run_all(engine: Engine, reqs) -> list:
    engine.run_until_idle()
    return [r.result(timeout=0) for r in reqs]


# ---- State row views -------------------------------------------------------------------------------------------

def test_row_view_shares_memory_and_runs_only_its_rows(session):
    ids = random_ids(session.vocab_size, (3, 9), seed=1)
    whole = session.new_state(3)
    session.forward(ids[:, :4], whole)
    before = [buf.copy() for _, _, buf, _ in whole.tensors]
    view = whole.rows(1, 2)
    assert view.batch_size == 1 and all(np.shares_memory(v[2], w[2]) for v, w in zip(view.tensors, whole.tensors))
    got = session.forward(ids[1:2, 4:], view)
    np.testing.assert_array_equal(whole.positions, [4, 9, 4])
    for (_, _, buf, _), old in zip(whole.tensors, before):  # rows 0 and 2 untouched
        np.testing.assert_array_equal(buf[0], old[0])
        np.testing.assert_array_equal(buf[2], old[2])
    alone = session.new_state(1)
    session.forward(ids[1:2, :4], alone)
    np.testing.assert_array_equal(got, session.forward(ids[1:2, 4:], alone))
    with pytest.raises(ValueError, match="not a non-empty range"):
        whole.rows(2, 2)


def test_copy_row_moves_a_sequence(session):
    ids = random_ids(session.vocab_size, (1, 12), seed=2)
    st = session.new_state(2)
    session.forward(ids[:, :8], st.rows(0, 1))
    st.copy_row(0, 1)
    assert st.positions[1] == 8
    a = session.forward(ids[:, 8:], st.rows(0, 1))
    b = session.forward(ids[:, 8:], st.rows(1, 2))
    np.testing.assert_array_equal(a, b)


# ---- batching gives each request what it gets alone ------------------------------------------------------------

def test_engine_alone_equals_session_stream(session):
    """Greedy and seeded sampling: the engine on one request reproduces Session.stream (same prefill chunks)."""
    for i, p in enumerate(prompts(session.vocab_size, 3, seed=3)):
        for params in (SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9,
                                                                     top_k=50, seed=i)):
            eng = Engine(session, max_batch=2, prefill_chunk=CHUNK)
            (res,) = run_all(eng, [eng.submit(p, params)])
            want = list(session.stream(p, 12, temperature=params.temperature, top_p=params.top_p,
                                       top_k=params.top_k, seed=params.seed))
            assert res["tokens"] == want and res["finish_reason"] == "length"
            assert res["prompt_tokens"] == len(p) and res["completion_tokens"] == 12


@pytest.mark.parametrize("isa", [None, "scalar"])
def test_sixteen_together_equal_alone(model, isa):
    """Greedy tokens of each of 16 requests do not depend on what decodes beside it (rows join and leave at
    different steps: prompts of 1-69 tokens, 4-40 new tokens, so decode batches range over 1..16 rows)."""
    sess = Session(model, intra_op_threads=1, isa=isa, batch_invariant=16)
    ps = prompts(sess.vocab_size, 16, seed=4)
    lengths = [4 + (7 * i) % 37 for i in range(16)]
    alone = []
    for p, n in zip(ps, lengths):
        eng = Engine(sess, max_batch=1, prefill_chunk=CHUNK)
        alone.append(run_all(eng, [eng.submit(p, SamplingParams(max_tokens=n))])[0]["tokens"])
    eng = Engine(sess, max_batch=16, prefill_chunk=CHUNK)
    assert eng.batch_invariant
    together = run_all(eng, [eng.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(ps, lengths)])
    assert [r["tokens"] for r in together] == alone
    assert eng.metrics()["running"] == 0


def test_kernels_per_row_results_do_not_depend_on_batch_at_scalar(model):
    """The engine's batch invariance rests on each row's decode logits not depending on the number of rows in the
    call. The scalar level is invariant without being asked."""
    _check_rows_bitwise(Session(model, intra_op_threads=1, isa="scalar"), (1, 2, 3, 5, 16))


@pytest.mark.parametrize("isa", [None, "avx2"])
def test_batch_invariant_session_rows_do_not_depend_on_batch(model, isa):
    """With batch_invariant=N every level computes each row of a call of up to N rows, bit for bit, as alone
    (the row counts cross the in-register decode limit, the scratch-decoded rows and the panels' crossover)."""
    sess = Session(model, intra_op_threads=2, isa=isa, batch_invariant=32)
    assert sess.batch_invariant == 32
    _check_rows_bitwise(sess, (1, 2, 3, 4, 5, 16, 17, 24, 32))


def test_batch_invariance_is_off_by_default_and_checked(model, monkeypatch):
    assert Session(model, intra_op_threads=1).batch_invariant == 0
    monkeypatch.setenv("DSV4_ORT_BATCH_INVARIANT", "8")  # the variable works as the argument does
    assert Session(model, intra_op_threads=1).batch_invariant == 8
    monkeypatch.setenv("DSV4_ORT_BATCH_INVARIANT", "eight")
    with pytest.raises(ValueError, match="DSV4_ORT_BATCH_INVARIANT='eight' is not a row count"):
        Session(model, intra_op_threads=1)
    monkeypatch.delenv("DSV4_ORT_BATCH_INVARIANT")
    assert not Engine(Session(model, intra_op_threads=1, batch_invariant=4), max_batch=8).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant must be >= 0"):
        Session(model, batch_invariant=-1)
    with pytest.raises(TypeError, match="batch_invariant must be an integer"):
        Session(model, batch_invariant=1.5)


def _check_rows_bitwise(sess: Session, batches) -> None:
    base = sess.new_state(1)
    sess.forward(random_ids(sess.vocab_size, (1, 20), seed=5), base)
    tok = np.array([[7]], np.int64)
    outs = {}
    for B in batches:
        st = sess.new_state(B)
        for (_, _, src, _), (_, _, dst, _) in zip(base.tensors, st.tensors):
            dst[:] = src[0]
        st.positions[:] = base.positions[0]
        outs[B] = sess.forward(np.repeat(tok, B, 0), st)[:, -1]
    for B, out in outs.items():
        np.testing.assert_array_equal(out, np.repeat(outs[1], B, 0), err_msg=f"batch {B} vs batch 1")


def test_rows_are_reused_at_once(session):
    """Five requests through two rows: freed rows take the next waiting request, each output as if alone."""
    ps = prompts(session.vocab_size, 5, seed=6)
    alone = [session.generate(p, 9) for p in ps]
    eng = Engine(session, max_batch=2, max_queue=5, prefill_chunk=CHUNK)
    reqs = [eng.submit(p, SamplingParams(max_tokens=9)) for p in ps]
    eng.step()
    assert eng.metrics()["running"] == 2 and eng.metrics()["queue_depth"] == 3
    assert [r["tokens"] for r in run_all(eng, reqs)] == alone
    m = eng.metrics()
    assert m["running"] == 0 and m["queue_depth"] == 0 and m["requests"] == {"length": 5}
    assert m["completion_tokens"] == 45 and m["prompt_tokens"] == sum(map(len, ps))
    assert m["ttft"]["count"] == 5 and m["itl"]["count"] == 40


def test_warmup_leaves_a_new_engine(session, monkeypatch):
    """warmup() runs a prompt chunk and a decode step over every row, then leaves the engine as new: rows free at
    position 0, counters and histograms empty, and requests get what they get alone. It refuses to run once the
    engine has work or its thread."""
    eng = Engine(session, max_batch=4, prefill_chunk=CHUNK)
    calls = []
    forward = session.forward

    def counting(ids, state, *a, **k):
        calls.append(ids.shape)
        return forward(ids, state, *a, **k)

    monkeypatch.setattr(session, "forward", counting)
    assert eng.warmup() > 0
    monkeypatch.undo()
    assert (1, CHUNK) in calls and (4, 1) in calls  # the prefill shape and a decode over all four rows
    m = eng.metrics()
    assert m["running"] == 0 and m["queue_depth"] == 0 and m["requests"] == {} and m["steps"] == 0
    assert m["completion_tokens"] == 0 and m["prompt_tokens"] == 0 and m["ttft"]["count"] == m["itl"]["count"] == 0
    np.testing.assert_array_equal(eng.state.positions, 0)
    ps = prompts(session.vocab_size, 4, seed=12)
    alone = [session.generate(p, 7) for p in ps]
    assert [r["tokens"] for r in run_all(eng, [eng.submit(p, SamplingParams(max_tokens=7)) for p in ps])] == alone
    eng.submit(ps[0], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="before start"):
        eng.warmup()
    eng.run_until_idle()
    eng.start()
    try:
        with pytest.raises(EngineError, match="before start"):
            eng.warmup()
    finally:
        eng.stop()


def test_long_prompt_prefills_in_chunks_beside_decoding(session):
    """A 200-token prompt takes 13 chunks, one per step, while a running request keeps decoding every step."""
    eng = Engine(session, max_batch=2, prefill_chunk=CHUNK)
    short = eng.submit([5, 6, 7], SamplingParams(max_tokens=30))
    eng.step()
    long = eng.submit(random_ids(session.vocab_size, (200,), seed=7).tolist(), SamplingParams(max_tokens=3))
    for _ in range(13):
        eng.step()
    assert short.events.qsize() == 14  # one token per step throughout the long prefill
    assert run_all(eng, [short, long])[1]["tokens"] == session.generate(long.prompt, 3)


def test_short_prompts_share_a_steps_prefill_budget(session):
    """Beside a decoding request, whole chunks of several prompts fill one step's budget (5 + 5 + 5 <= 16; the
    fourth waits a step)."""
    eng = Engine(session, max_batch=5, prefill_chunk=CHUNK)
    first = eng.submit([2, 3], SamplingParams(max_tokens=20))
    eng.step()
    reqs = [eng.submit([3 + i] * 5, SamplingParams(max_tokens=4)) for i in range(4)]
    eng.step()
    assert first.events.qsize() == 2
    assert [r.events.qsize() for r in reqs] == [1, 1, 1, 0]
    eng.step()
    assert [r.events.qsize() for r in reqs] == [2, 2, 2, 1]
    assert [r["tokens"] for r in run_all(eng, reqs)] == [session.generate([3 + i] * 5, 4) for i in range(4)]


def test_with_nothing_decoding_every_prompt_advances_a_chunk(session):
    """No stream waits on a step without decoding rows: every prefilling request takes one chunk in it (a 40-token
    prompt its first 16 tokens), whatever the budget; then the budget holds again."""
    eng = Engine(session, max_batch=4, prefill_chunk=CHUNK)
    long_prompt = random_ids(session.vocab_size, (40,), seed=3).tolist()
    reqs = [eng.submit([3 + i] * 9, SamplingParams(max_tokens=3)) for i in range(3)]
    long = eng.submit(long_prompt, SamplingParams(max_tokens=3))
    eng.step()
    assert [r.events.qsize() for r in reqs] == [1, 1, 1] and long.events.qsize() == 0
    assert long.prefilled == CHUNK
    eng.step()  # three rows decode: the long prompt's next chunk is the step's whole budget
    assert long.prefilled == 2 * CHUNK and [r.events.qsize() for r in reqs] == [2, 2, 2]
    results = run_all(eng, reqs + [long])
    assert [r["tokens"] for r in results] == [session.generate(r.prompt, 3) for r in reqs + [long]]


def test_first_tokens_of_a_step_go_out_after_its_prefill(session, monkeypatch):
    """Prompts finished in one step send their first tokens when the step's last prefill call is done, not each
    right after its own call (which would hold the first request's second token behind the later prompts)."""
    calls = []
    forward = session.forward
    monkeypatch.setattr(session, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    eng = Engine(session, max_batch=3, prefill_chunk=CHUNK)
    seen, tokens = [], [[], [], []]

    def on_event(i):
        return lambda ev: (seen.append(len(calls)), tokens[i].append(ev.token_id))

    for i in range(3):
        eng.submit([3 + i] * 4, SamplingParams(max_tokens=2), on_event=on_event(i))
    eng.step()
    assert seen == [3, 3, 3]  # every first token after the third prefill call
    eng.run_until_idle()
    assert tokens == [session.generate([3 + i] * 4, 2) for i in range(3)]


def test_admission_window_gathers_requests_sent_together(session):
    """An idle engine woken by one request waits for the ones sent right after it: both are prefilled in the first
    step (with max_tokens 1 each request finishes in its prefill step, so the step count tells)."""
    eng = Engine(session, max_batch=4, prefill_chunk=CHUNK, admission_window=0.5).start()
    try:
        a = eng.submit([3, 4, 5], SamplingParams(max_tokens=1))
        time.sleep(0.05)
        b = eng.submit([6, 7], SamplingParams(max_tokens=1))
        assert a.result(60)["tokens"] == session.generate([3, 4, 5], 1)
        assert b.result(60)["tokens"] == session.generate([6, 7], 1)
        assert eng.stats["steps"] == 1
    finally:
        eng.stop()
    with pytest.raises(ValueError, match="admission_window"):
        Engine(session, max_batch=1, admission_window=-1)


# ---- request life cycle ----------------------------------------------------------------------------------------

def test_cancel_frees_the_row_within_one_step(session):
    eng = Engine(session, max_batch=1, max_queue=2, prefill_chunk=CHUNK)
    a = eng.submit([3, 4, 5], SamplingParams(max_tokens=100))
    b = eng.submit([6, 7], SamplingParams(max_tokens=2))
    eng.step()
    eng.step()
    a.cancel()
    eng.step()
    res = a.result(0)
    assert res["finish_reason"] == "cancelled" and res["completion_tokens"] == 2
    assert eng.metrics()["running"] == 1  # b took the row in the same step
    assert run_all(eng, [b])[0]["tokens"] == session.generate([6, 7], 2)
    c, d = eng.submit([1], SamplingParams(max_tokens=5)), eng.submit([2], SamplingParams(max_tokens=1))
    d.cancel()  # still waiting: dropped at the next step without taking a row
    eng.step()
    assert d.result(0)["finish_reason"] == "cancelled" and eng.metrics()["queue_depth"] == 0
    run_all(eng, [c])


def test_queue_full_and_capacity_errors(session):
    eng = Engine(session, max_batch=1, max_queue=2, prefill_chunk=CHUNK)
    for n in (5, 1, 1):  # one for the free row, two waiting
        eng.submit([3], SamplingParams(max_tokens=n))
    with pytest.raises(QueueFull, match="2 requests are waiting already .max_queue 2"):
        eng.submit([3], SamplingParams(max_tokens=1))
    eng.step()  # the row is taken: still two may wait
    with pytest.raises(QueueFull):
        eng.submit([3], SamplingParams(max_tokens=1))
    none_wait = Engine(session, max_batch=1, max_queue=0)
    none_wait.submit([3], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFull):
        none_wait.submit([3], SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLong, match="256"):
        eng.submit([3] * 256)
    with pytest.raises(PromptTooLong, match="max_tokens"):
        eng.submit([3] * 200, SamplingParams(max_tokens=57))
    with pytest.raises(ValueError, match="empty"):
        eng.submit([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([session.vocab_size])
    with pytest.raises(ValueError, match="temperature"):
        eng.submit([3], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="stop strings"):
        eng.submit([3], SamplingParams(stop=("",)))
    eng.run_until_idle()
    r = eng.submit([3] * 250)  # max_tokens None: up to the capacity
    assert run_all(eng, [r])[0]["completion_tokens"] == 6


def test_stop_ids_and_strings(session):
    p = [9, 8, 7, 6]
    free = session.generate(p, 12)
    eng = Engine(session, max_batch=2, prefill_chunk=CHUNK)
    by_id = eng.submit(p, SamplingParams(max_tokens=12, stop_ids=(free[4],)))
    # no tokenizer: the text is the ids separated by spaces, so a stop string can end it mid-stream
    stop = f" {free[5]} "
    by_str = eng.submit(p, SamplingParams(max_tokens=12, stop=(stop,)))
    eng.run_until_idle()
    pieces = []
    for ev in by_str:
        pieces.append(ev.text)
    r1 = by_id.result(0)
    assert r1["tokens"] == free[:free.index(free[4]) + 1] and r1["finish_reason"] == "stop"
    want = " ".join(map(str, free))
    want = want[:want.find(stop)]
    assert "".join(pieces) == want and ev.finish_reason == "stop"


def test_held_back():
    assert _held_back("abc", ["cd"]) == 1
    assert _held_back("abc", ["bcd", "x"]) == 2
    assert _held_back("abc", ["zz"]) == 0
    assert _held_back("", ["ab"]) == 0


def test_threads_submit_and_stop(session):
    """Requests from several threads while the engine thread runs; stop() ends the rest with an error event."""
    ps = prompts(session.vocab_size, 6, seed=8)
    alone = [session.generate(p, 6) for p in ps]
    eng = Engine(session, max_batch=3, prefill_chunk=CHUNK).start()
    out = [None] * len(ps)

    def client(i):
        out[i] = [ev.token_id for ev in eng.submit(ps[i], SamplingParams(max_tokens=6))]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert out == alone
    long = eng.submit([4, 5], SamplingParams(max_tokens=250))
    first = next(iter(long))
    assert first.finish_reason is None
    eng.stop("shutting down")
    res = long.result(timeout=30)
    assert res["finish_reason"] == "error" and res["error"] == "shutting down"
    assert eng.metrics()["running"] == 0
    with pytest.raises(EngineStopped):
        eng.submit([1])


def test_callback_delivery(session):
    got = []
    eng = Engine(session, max_batch=1, prefill_chunk=CHUNK)
    r = eng.submit([3, 4], SamplingParams(max_tokens=3), on_event=got.append)
    eng.run_until_idle()
    assert [e.token_id for e in got] == session.generate([3, 4], 3) and got[-1].finish_reason == "length"
    with pytest.raises(RuntimeError):
        next(iter(r))


# ---- detokenizer -----------------------------------------------------------------------------------------------

def byte_tokenizer():
    """Byte-level BPE without merges: one token per byte, so multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_detokenizer_never_splits_a_character():
    tok = byte_tokenizer()
    text = "héllo 世界 🙂!"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode())
    d = Detokenizer(tok)
    pieces = [d.add(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # a character's leading bytes were held back
    d = Detokenizer(tok)
    cut = [d.add(i) for i in tok.encode("世").ids[:2]]
    assert cut == ["", ""] and d.flush() == "\ufffd"  # an unfinished character at the end is flushed as U+FFFD
    assert Detokenizer(None).add(5) == "5"
