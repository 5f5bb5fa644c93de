"""MTP speculative decoding (runtime/speculative.py): exact state rollback after any accept / reject pattern, greedy
outputs identical to plain decoding over long generations (batch 1 and rows at different positions), speculative
sampling's output distribution, acceptance of a fitted MTP block, and the argument / model checks."""

from __future__ import annotations

import numpy as np
import pytest
from model_fixtures import random_ids, require_library

from dsv4_ort.runtime import Session
from dsv4_ort.runtime.speculative import MAX_DRAFT, Rollback, SpeculativeError, accept

MAX_SEQ = 640  # room for 520 new tokens: crosses the 16-slot window, CSA (4) and HCA (128) boundaries many times


@pytest.fixture(scope="module")
def fitted_weights(tmp_path_factory):
    from dsv4_ort.models.config import DeepseekV4Config
    from dsv4_ort.models.mtp_fit import cached_fit

    return cached_fit(DeepseekV4Config.from_preset("tiny"))[0]


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    from dsv4_ort.export import export_model

    require_library()
    return export_model(None, tmp_path_factory.mktemp("spec") / "random", preset="tiny", max_seq_len=MAX_SEQ,
                        mtp=True, progress=False).parent


@pytest.fixture(scope="module")
def fitted_mtp(tmp_path_factory, fitted_weights):
    from dsv4_ort.export import export_model

    require_library()
    return export_model(None, tmp_path_factory.mktemp("spec") / "fitted", preset="tiny", max_seq_len=MAX_SEQ,
                        mtp=True, mtp_weights=fitted_weights, progress=False).parent


def session(model, **kw):
    # batch invariance over the rows of a verify step: its logits are bitwise those of one-row decode steps
    return Session(model, intra_op_threads=1, batch_invariant=16, **kw)


# ---- rollback -------------------------------------------------------------------------------------------------

def test_rollback_leaves_the_state_of_a_plain_run_bitwise(random_mtp):
    """Verify steps of 2-4 tokens with random accept counts per row (rows at different positions, 300 positions:
    window, CSA and HCA boundaries crossed, entries completed by rejected tokens): every state buffer then equals,
    bit for bit, a plain run over the accepted tokens only (fed in the same steps: the kernels' results for a
    position do not depend on the tokens after it in a call, but not every kernel gives a 1-token call the bits
    of a row of a longer call, see test_generation_state_equals_plain_run)."""
    sess = session(random_mtp)
    spec = sess.speculator()
    rng = np.random.default_rng(0)
    B = 2
    state = sess.new_state(B)
    rb = Rollback(state, spec.main_ratios)
    plain = [sess.new_state(1) for _ in range(B)]
    prompts = [random_ids(sess.vocab_size, (1, n), seed=n) for n in (5, 12)]
    for b in range(B):  # different prompt lengths: the rows sit at different positions from the start
        sess.forward(prompts[b], state.rows(b, b + 1))
        sess.forward(prompts[b], plain[b])
    patterns = set()
    while state.positions.min() < 300:
        k = int(rng.integers(1, MAX_DRAFT + 1))
        ids = rng.integers(0, sess.vocab_size, (B, k + 1))
        pos = state.positions.copy()
        snap = rb.snapshot(pos, k + 1)
        spec.main_step(state, ids, k + 1)
        keep = rng.integers(1, k + 2, size=B)
        Rollback.restore(snap, keep)
        state.positions[:] = pos + keep
        patterns.update((k, int(x)) for x in keep)
        for b in range(B):
            sess.forward(ids[b:b + 1, :keep[b]], plain[b])
    assert len(patterns) == 9  # every (k, kept) pair
    for b in range(B):
        assert state.positions[b] == plain[b].positions[0]
        for (name, _, buf, _), (_, _, want, _) in zip(state.tensors, plain[b].tensors):
            np.testing.assert_array_equal(buf[b], want[0], err_msg=f"row {b}: {name}")


def test_generation_state_equals_plain_run(fitted_mtp):
    """After a speculative generation the main state is that of plain decoding of the same tokens, token by token
    (to float32 rounding: a verify step's rows and a one-token step's may differ in the last bits; a row left by a
    rejected token would differ everywhere)."""
    sess = session(fitted_mtp)
    prompt = random_ids(sess.vocab_size, (1, 9), seed=4)
    st = sess.new_state(1)
    toks = list(sess.stream(prompt[0], 150, speculative="mtp", num_draft=3, state=st))
    ref = sess.new_state(1)
    sess.forward(prompt, ref)
    for t in toks[:-1]:  # the last token is chosen, not yet run
        sess.forward(np.array([[t]]), ref)
    np.testing.assert_array_equal(st.positions, ref.positions)
    for (name, _, buf, _), (_, _, want, _) in zip(st.tensors, ref.tensors):
        np.testing.assert_allclose(buf, want, rtol=1e-4, atol=1e-4, err_msg=name)


# ---- greedy ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_is_plain_greedy_over_520_tokens(fitted_mtp, k):
    sess = session(fitted_mtp)
    prompt = random_ids(sess.vocab_size, (1, 30), seed=11)[0]
    want = sess.generate(prompt, 520)
    stats = {}
    got = list(sess.stream(prompt, 520, speculative="mtp", num_draft=k, stats=stats))
    assert got == want
    assert stats["accepted"] > 0 and stats["cycles"] < 520  # drafts were accepted: fewer main steps than tokens


def test_greedy_batch_rows_at_different_positions(fitted_mtp):
    """Three rows accept different numbers of drafts per step, so they decode at different positions; each row's
    tokens are those of plain batched greedy decoding (also stop ids: a row that stops early is frozen)."""
    sess = session(fitted_mtp)
    prompts = random_ids(sess.vocab_size, (3, 17), seed=12)
    want = sess.generate(prompts, 300)
    spec = sess.speculator()
    state = sess.new_state(3)
    got = [[] for _ in range(3)]
    spread = 0
    for step in spec.generate(prompts, 300, num_draft=3, temperature=0.0, top_k=0, top_p=1.0,
                              rng=np.random.default_rng(0), stops=set(), state=state):
        for b, toks in enumerate(step):
            got[b].extend(toks)
        spread = max(spread, int(np.ptp(state.positions)))
    assert got == want and spread >= 2
    stop = want[1][40]
    assert sess.generate(prompts, 300, stop_ids=[stop], speculative="mtp", num_draft=2) == \
        sess.generate(prompts, 300, stop_ids=[stop])


# ---- sampling -------------------------------------------------------------------------------------------------

def test_accept_keeps_the_target_distribution():
    """accept() on fixed p / q: the token it emits first follows p exactly (Monte Carlo, 200k draws)."""
    rng = np.random.default_rng(1)
    V, N = 6, 200_000
    p = rng.dirichlet(np.ones(V), size=2)  # p[0] at the draft's position, p[1] after it
    q = rng.dirichlet(np.ones(V))
    d = rng.choice(V, size=N, p=q)
    counts = np.zeros(V)
    for i in range(0, N, 5000):
        drafts = d[i:i + 5000, None]
        B = drafts.shape[0]
        pp = np.broadcast_to(p, (B, 2, V))
        qq = np.broadcast_to(q, (B, 1, V))
        a, nxt = accept(drafts, pp, qq, np.zeros((B, 2, V), np.float32), 1.0, rng)
        first = np.where(a == 1, drafts[:, 0], nxt)
        counts += np.bincount(first, minlength=V)
    freq = counts / N
    assert np.abs(freq - p[0]).max() < 4 * np.sqrt(p[0] * (1 - p[0]) / N).max()


def test_speculative_sampling_matches_the_main_distribution(fitted_mtp):
    """Tokens 2 and 3 of sampled generations (top_k 3, temperature 1; k = 2 drafts) against the exact joint
    distribution of the main model: chi-square over the 27 (t1, t2, t3) cells."""
    from dsv4_ort.runtime.sampling import probabilities

    sess = session(fitted_mtp, prefill_chunk=None)
    prompt = random_ids(sess.vocab_size, (1, 6), seed=21)
    kw = dict(temperature=1.0, top_k=3, top_p=1.0)
    R, n_batch = 250, 8
    samples = []
    stats = {}
    for i in range(n_batch):
        got = sess.speculator().generate(np.repeat(prompt, R, 0), 3, num_draft=2, rng=np.random.default_rng(i),
                                         stops=set(), stats=stats, **kw)
        rows = [[] for _ in range(R)]
        for step in got:
            for b, t in enumerate(step):
                rows[b].extend(t)
        samples += [tuple(r[:3]) for r in rows]
    assert 0 < stats["accepted"] < stats["drafted"]  # both branches of the acceptance test ran
    # exact joint: p(t1) p(t2 | t1) p(t3 | t1, t2) from plain forwards (logits="last" of each prefix)
    def dist(prefix):
        st = sess.new_state(1)
        return probabilities(sess.forward(np.array([prefix]), st)[:, -1], **kw)[0]

    exact = {}
    p1 = dist(prompt[0].tolist())
    for t1 in np.flatnonzero(p1):
        p2 = dist(prompt[0].tolist() + [int(t1)])
        for t2 in np.flatnonzero(p2):
            p3 = dist(prompt[0].tolist() + [int(t1), int(t2)])
            for t3 in np.flatnonzero(p3):
                exact[(int(t1), int(t2), int(t3))] = p1[t1] * p2[t2] * p3[t3]
    assert set(samples) <= set(exact)
    N = len(samples)
    cells = sorted(exact)
    obs = np.array([samples.count(c) for c in cells], float)
    exp = np.array([exact[c] for c in cells]) * N
    big = exp >= 5  # pool the rare cells into one
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    # the chi-square quantile at 1 - 1e-3 (Wilson-Hilferty: z = 3.09), i.e. a p-value above 1e-3
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, dof, limit)


# ---- acceptance and checks ------------------------------------------------------------------------------------

def test_fitted_mtp_block_is_accepted_where_random_is_not(fitted_mtp, random_mtp):
    prompt = random_ids(512, (1, 20), seed=31)[0]
    rates = {}
    for name, model in (("fitted", fitted_mtp), ("random", random_mtp)):
        stats = {}
        list(session(model).stream(prompt, 200, speculative="mtp", num_draft=1, stats=stats))
        rates[name] = stats["accepted"] / stats["drafted"]
    assert rates["fitted"] > 0.1 and rates["fitted"] > 3 * rates["random"], rates


def test_arguments_and_models_without_mtp(cache, random_mtp):
    require_library()
    sess = session(random_mtp)
    with pytest.raises(ValueError, match="num_draft must be <= 3"):
        sess.generate([1, 2], 4, speculative="mtp", num_draft=4)
    with pytest.raises(ValueError, match="speculative must be None or one of"):
        sess.generate([1, 2], 4, speculative="eagle")
    assert sess.generate([1, 2], 0, speculative="mtp") == []
    plain = Session(cache.export(("tiny",), logits="last", max_seq_len=256).parent, intra_op_threads=1)
    with pytest.raises(SpeculativeError, match="no MTP graph"):
        plain.generate([1, 2], 4, speculative="mtp")



def test_both_sessions_stop_spinning_when_a_run_returns(random_mtp):
    # session_options: a pool spinning on after its run takes the cores from the other session's next run (a draft
    # step after a main step measured 17.2 against 9.2 ms on the bench preset)
    from dsv4_ort.runtime.session import SPIN_STOP_KEY

    require_library()
    sess = session(random_mtp)
    for ort_session in (sess.session, sess.speculator().mtp_session):
        assert ort_session.get_session_options().get_session_config_entry(SPIN_STOP_KEY) == "1"

# ---- the engine (continuous batching) -------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_engine_speculative_greedy_equals_plain(fitted_mtp, k):
    """Continuous batching with speculative cycles: 6 greedy requests of different prompt lengths over 3 rows
    (queueing, rows reused and moved, chunked prefill with the MTP catch-up per chunk, rows at different positions
    accepting different numbers of drafts) each get the tokens of plain greedy decoding alone, to the token count."""
    from dsv4_ort.runtime.engine import Engine, SamplingParams

    sess = session(fitted_mtp)
    prompts = [random_ids(sess.vocab_size, (n,), seed=40 + n) for n in (3, 9, 14, 23, 30, 41)]
    lengths = [150, 37, 90, 121, 64, 200]
    want = [sess.generate(p, n) for p, n in zip(prompts, lengths)]
    eng = Engine(sess, max_batch=3, prefill_chunk=8, speculative="mtp", num_draft=k)
    assert eng.batch_invariant and eng.rows_per_call == 3 * (k + 1)
    reqs = [eng.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths)]
    eng.run_until_idle()
    got = [r.result(timeout=0) for r in reqs]
    assert [g["tokens"] for g in got] == want
    assert all(g["finish_reason"] == "length" for g in got)
    m = eng.metrics()
    assert m["speculative"] == "mtp" and m["drafted"] > 0 and 0 < m["accepted"] <= m["drafted"]
    assert m["completion_tokens"] == sum(lengths)
    base = Engine(sess, max_batch=3, prefill_chunk=8)  # the same requests without drafts: every step one token
    for p, n in zip(prompts, lengths):
        base.submit(p, SamplingParams(max_tokens=n))
    base.run_until_idle()
    assert eng.stats["steps"] < base.stats["steps"]


def test_engine_speculative_warmup(fitted_mtp, monkeypatch):
    """Engine.warmup with MTP runs a full cycle (num_draft drafts) over every row and leaves both pools at position
    0: greedy requests afterwards still get plain decoding's tokens."""
    from dsv4_ort.runtime.engine import Engine, SamplingParams

    sess = session(fitted_mtp)
    eng = Engine(sess, max_batch=3, prefill_chunk=8, speculative="mtp", num_draft=2)
    drafts = []
    cycle = eng.spec.cycle

    def counting(view, mview, pending, catch, k, *a):
        drafts.append((view.batch_size, k))
        return cycle(view, mview, pending, catch, k, *a)

    monkeypatch.setattr(eng.spec, "cycle", counting)
    assert eng.warmup() > 0
    assert (3, 2) in drafts
    assert eng.metrics()["drafted"] == 0 and eng.metrics()["completion_tokens"] == 0
    np.testing.assert_array_equal(eng.state.positions, 0)
    np.testing.assert_array_equal(eng.mstate.positions, 0)
    prompts = [random_ids(sess.vocab_size, (n,), seed=60 + n) for n in (5, 11, 17)]
    want = [sess.generate(p, 40) for p in prompts]
    reqs = [eng.submit(p, SamplingParams(max_tokens=40)) for p in prompts]
    eng.run_until_idle()
    assert [r.result(timeout=0)["tokens"] for r in reqs] == want


def test_engine_speculative_stop_ids_and_sampling(fitted_mtp):
    """A stop id inside a cycle's accepted tokens ends the request at it; sampled requests beside greedy ones run
    to their length with their own seeds (reproducibly: the same seeds give the same tokens)."""
    from dsv4_ort.runtime.engine import Engine, SamplingParams

    sess = session(fitted_mtp)
    prompt = random_ids(sess.vocab_size, (12,), seed=50)
    plain = sess.generate(prompt, 120)
    stop = plain[70]
    cut = plain[:plain.index(stop) + 1]

    def run():
        eng = Engine(sess, max_batch=4, speculative="mtp", num_draft=2)
        reqs = [eng.submit(prompt, SamplingParams(max_tokens=120, stop_ids=(stop,))),
                eng.submit(prompt, SamplingParams(max_tokens=50, temperature=0.8, seed=1)),
                eng.submit(prompt, SamplingParams(max_tokens=50, temperature=1.0, top_k=20, seed=2))]
        eng.run_until_idle()
        return [r.result(timeout=0) for r in reqs]

    first, again = run(), run()
    assert first[0]["tokens"] == cut and first[0]["finish_reason"] == "stop"
    assert [len(r["tokens"]) for r in first[1:]] == [50, 50]
    assert first[1]["tokens"] != first[2]["tokens"]
    assert [r["tokens"] for r in first] == [r["tokens"] for r in again]


def test_engine_speculative_needs_an_mtp_export(cache):
    from dsv4_ort.runtime.engine import Engine

    require_library()
    plain = Session(cache.export(("tiny",), logits="last", max_seq_len=256).parent, intra_op_threads=1)
    with pytest.raises(SpeculativeError, match="no MTP graph"):
        Engine(plain, speculative="mtp")
    with pytest.raises(ValueError, match="num_draft must be <= 3"):
        Engine(plain, speculative="mtp", num_draft=4)
