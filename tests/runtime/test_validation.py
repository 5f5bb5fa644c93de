"""Argument validation of the Python API: sampling parameters, non-finite logits, token ids, chunk sizes.

Each bad value is a TypeError or ValueError naming the argument; none may silently become token 0 or a truncated id.
"""

import numpy as np
import pytest
from model_fixtures import require_library

from dsv4_ort.runtime import Session, sample
from dsv4_ort.runtime.sampling import MIN_TEMPERATURE

LOGITS = np.array([[0.5, 3.0, -1.0, 2.0], [1.0, -2.0, 4.0, 0.0]], np.float32)  # argmax 1 and 2, never 0


@pytest.fixture(scope="module")
def session(cache):
    require_library()
    return Session(cache.export(("tiny",), logits="last", max_seq_len=256).parent, intra_op_threads=1)


# ---- runtime.sample -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"temperature": -0.5}, ValueError, "temperature"),
    ({"temperature": "0.7"}, TypeError, "temperature"),
    ({"temperature": True}, TypeError, "temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_p": 1.5}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_p": float("nan")}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_k": -1}, ValueError, "top_k"),
    ({"temperature": 1.0, "top_k": 2.5}, TypeError, "top_k"),
    ({"temperature": 1.0, "top_k": 2.0}, TypeError, "top_k"),
    ({"temperature": 1.0, "top_k": True}, TypeError, "top_k"),
])
def test_sample_rejects_bad_parameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        sample(LOGITS, rng=np.random.default_rng(0), **kwargs)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, MIN_TEMPERATURE / 2])
def test_tiny_and_denormal_temperature_is_greedy(temperature):
    """Below MIN_TEMPERATURE sampling is its limit, greedy (dividing would overflow the logits to inf -> NaN)."""
    for seed in range(5):
        got = sample(LOGITS, temperature=temperature, rng=np.random.default_rng(seed))
        np.testing.assert_array_equal(got, [1, 2])
    # just above the threshold it still samples normally, and almost surely the argmax
    np.testing.assert_array_equal(sample(LOGITS, temperature=MIN_TEMPERATURE, rng=np.random.default_rng(0)), [1, 2])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_rejects_nan_and_inf_logits(bad, temperature):
    logits = LOGITS.copy()
    logits[1, 3] = bad
    with pytest.raises(ValueError, match=r"non-finite logits: row 1, token 3"):
        sample(logits, temperature=temperature, rng=np.random.default_rng(0))


def test_minus_inf_masks_a_token_but_a_row_needs_one_finite_logit():
    logits = LOGITS.copy()
    logits[0, 1] = -np.inf  # masked: the next best is token 3
    assert sample(logits)[0] == 3
    assert all(sample(logits, temperature=1.0, rng=np.random.default_rng(s))[0] != 1 for s in range(20))
    logits[0] = -np.inf
    with pytest.raises(ValueError, match="row 0 has no finite logit"):
        sample(logits)


# ---- Session.generate / Session.stream ------------------------------------------------------------------------------

BAD_GENERATION = [
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_k": -3}, ValueError, "top_k"),
    ({"top_k": False}, TypeError, "top_k"),
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"seed": "7"}, TypeError, "seed"),
    ({"stop_ids": 3}, TypeError, "stop_ids"),
    ({"stop_ids": [1.5]}, TypeError, "stop_ids"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_GENERATION)
def test_generation_arguments_are_checked(session, kwargs, error, match):
    kw = dict(kwargs)
    n = kw.pop("max_new_tokens", 4)
    with pytest.raises(error, match=match):
        session.generate([0, 5, 7], n, **kw)
    with pytest.raises(error, match=match):
        session.generate([[0, 5, 7], [1, 2, 3]], n, **kw)  # the batch path
    with pytest.raises(error, match=match):
        session.stream([0, 5, 7], n, **kw)  # at the call, before anything is iterated or run


def test_max_new_tokens_zero_generates_nothing(session):
    assert session.generate([0, 5, 7], 0) == []
    assert session.generate([[0, 5], [1, 2]], 0) == [[], []]


def _poison(session, monkeypatch, at_call: int, value=np.nan):
    """Session.forward whose ``at_call``-th call (1 = the prompt) returns logits holding ``value``."""
    real, calls = session.forward, []

    def forward(ids, state, **kw):
        out = real(ids, state, **kw)
        calls.append(1)
        if len(calls) == at_call:
            out = out.copy()
            out[..., 7] = value
        return out

    monkeypatch.setattr(session, "forward", forward)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_non_finite_logits_name_the_step(session, monkeypatch, temperature):
    free = session.generate([0, 5, 7], 6, temperature=temperature, seed=1)
    _poison(session, monkeypatch, at_call=4)  # the prompt gives step 0, the 3rd decode call step 3
    got = []
    with pytest.raises(ValueError, match=r"non-finite logits at step 3\b"):
        for tok in session.stream([0, 5, 7], 6, temperature=temperature, seed=1):
            got.append(tok)  # noqa: PERF402 - the tokens before the error
    assert got == free[:3]  # the tokens before the bad step are the ones a clean run gives
    monkeypatch.undo()
    _poison(session, monkeypatch, at_call=1, value=np.inf)
    with pytest.raises(ValueError, match=r"non-finite logits at step 0\b"):
        session.generate([[0, 5, 7], [1, 2, 3]], 4, temperature=temperature, seed=1)


# ---- Session.forward ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids", [[[1.5, 2.0]], [[1.0, 2.0]], np.array([[1, 2]], np.float32), [[True, False]],
                                 [["1", "2"]], "12"])
def test_forward_rejects_non_integer_ids(session, ids):
    """Float ids are never truncated or rounded, not even whole-valued ones: the caller converts explicitly."""
    st = session.new_state(1)
    with pytest.raises(TypeError, match="integer"):
        session.forward(ids, st)
    assert st.positions[0] == 0
    with pytest.raises(TypeError, match="integer"):
        session.generate(ids[0] if isinstance(ids, list) else ids, 2)


@pytest.mark.parametrize("ids,shown", [([[1, 10**23]], "input_ids\\[0, 1\\]=100000000000000000000000"),
                                       (np.array([[2**63 + 1]], np.uint64), "=9223372036854775809"),
                                       ([[3, -1]], "input_ids\\[0, 1\\]=-1")])
def test_forward_out_of_range_ids_are_named(session, ids, shown):
    with pytest.raises(ValueError, match=shown + " is outside the vocabulary"):
        session.forward(ids, session.new_state(1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        session.generate(list(np.asarray(ids, dtype=object)[0]), 2)


def test_forward_accepts_every_integer_dtype(session):
    ids = np.array([[0, 5, 7, 100]], np.int64)
    want = session.forward(ids, session.new_state(1))
    for dtype in (np.int32, np.uint16, np.uint64, object):
        np.testing.assert_array_equal(session.forward(ids.astype(dtype), session.new_state(1)), want)


@pytest.mark.parametrize("chunk,error", [(0, ValueError), (-1, ValueError), (-4, ValueError), (2.0, TypeError),
                                         (True, TypeError), ("3", TypeError)])
def test_forward_rejects_bad_chunk_size(session, chunk, error):
    st = session.new_state(1)
    with pytest.raises(error, match="chunk_size"):
        session.forward([[0, 5, 7, 9]], st, chunk_size=chunk)
    assert st.positions[0] == 0


def test_text_arguments_are_checked(session):
    with pytest.raises(TypeError, match="text must be a str"):
        session.encode(123)
    with pytest.raises(TypeError, match="integer"):
        session.decode([1.5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        session.decode([-1])
    assert session.decode(np.array([3, 4], np.int32)) == "3 4"  # no tokenizer: the ids


# ---- Session construction ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    ({"intra_op_threads": 0}, ValueError, "intra_op_threads"),
    ({"intra_op_threads": -1}, ValueError, "intra_op_threads"),
    ({"intra_op_threads": 5000}, ValueError, "intra_op_threads"),
    ({"intra_op_threads": True}, TypeError, "intra_op_threads"),
    ({"intra_op_threads": 2.0}, TypeError, "intra_op_threads"),
    ({"intra_op_threads": "2"}, TypeError, "intra_op_threads"),
    ({"prefill_chunk": 0}, ValueError, "prefill_chunk"),
    ({"prefill_chunk": -4}, ValueError, "prefill_chunk"),
    ({"prefill_chunk": 1.5}, TypeError, "prefill_chunk"),
    ({"prefill_chunk": False}, TypeError, "prefill_chunk"),
])
def test_session_rejects_bad_options(session, kwargs, error, match):
    with pytest.raises(error, match=match):
        Session(session.model_dir, **kwargs)


def test_damaged_tokenizer_is_a_model_error_naming_the_file_on_use(session, tmp_path):
    """A model whose tokenizer.json does not parse loads and runs on ids; text I/O is a ModelError naming it."""
    import shutil

    from dsv4_ort.runtime import ModelError

    pytest.importorskip("tokenizers")
    d = tmp_path / "m"
    shutil.copytree(session.model_dir, d)
    (d / "tokenizer.json").write_text("{not a tokenizer")
    s = Session(d, intra_op_threads=1)
    assert s.generate([1, 2, 3], 2) == session.generate([1, 2, 3], 2)
    for use in (lambda: s.tokenizer, lambda: s.encode("hi"), lambda: s.decode([1])):
        with pytest.raises(ModelError, match="tokenizer.json"):
            use()
    s.tokenizer = None  # ids only, by choice
    assert s.decode([1, 2]) == "1 2"


def test_load_error_with_an_empty_message_names_the_model(session, tmp_path, monkeypatch):
    """onnxruntime raising with an empty message still gives a ModelError naming model.onnx (no IndexError)."""
    import onnxruntime as ort

    from dsv4_ort.runtime import ModelError

    class Quiet(Exception):
        def __str__(self):
            return ""

    real = ort.InferenceSession

    def fail(model, *a, **k):
        if isinstance(model, str) and model.endswith("model.onnx"):
            raise Quiet()
        return real(model, *a, **k)

    monkeypatch.setattr(ort, "InferenceSession", fail)
    with pytest.raises(ModelError, match=r"model\.onnx: Quiet"):
        Session(session.model_dir, intra_op_threads=1)
