"""`dsv4-ort serve` as a subprocess on 127.0.0.1, driven by the official openai client (chat, completions,
streaming, usage, stop strings, the reasoning split, 16 concurrent clients) and by raw HTTP (malformed input,
API key, queue full, disconnects)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

for _mod in ("starlette", "uvicorn", "openai", "httpx"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install 'dsv4-ort[serve,test]')")

import httpx  # noqa: E402
import openai  # noqa: E402
from model_fixtures import require_library  # noqa: E402
from serverutil import THINK_END, ServerProcess, save_tokenizer, vocabulary  # noqa: E402

from dsv4_ort.runtime import Session  # noqa: E402
from dsv4_ort.runtime.chat import format_chat  # noqa: E402

EOS = 1
THINK_MESSAGES = [{"role": "user", "content": "héllo w5 w7"}]
KEY = "sk-test"


@pytest.fixture(scope="module")
def chat_model(cache, tmp_path_factory):
    """The tiny model with a word-level tokenizer in which ``</think>`` is the token the model picks greedily a few
    tokens into its answer to THINK_MESSAGES in thinking mode, so that answer has a reasoning part and a content
    part. Returns (model dir, Session on it, that greedy answer's ids, index of ``</think>`` in them)."""
    require_library()
    dst = tmp_path_factory.mktemp("serve") / "tiny-chat"
    shutil.copytree(cache.export(("tiny",), logits="last", max_seq_len=256).parent, dst)
    tokens = vocabulary()
    save_tokenizer(dst / "tokenizer.json", tokens)
    sess = Session(dst, intra_op_threads=1)
    prompt = sess.encode(format_chat(THINK_MESSAGES, thinking=True), add_special_tokens=False)
    answer = sess.generate(prompt, 12, stop_ids=[EOS])
    j = next(j for j in range(1, len(answer) - 2)
             if answer[j] not in prompt and answer[j] > 8 and answer[j] not in answer[:j])
    tokens[THINK_END], tokens[answer[j]] = tokens[answer[j]], tokens[THINK_END]  # prompt ids are unchanged
    save_tokenizer(dst / "tokenizer.json", tokens)
    sess = Session(dst, intra_op_threads=1)
    assert sess.encode(format_chat(THINK_MESSAGES, thinking=True), add_special_tokens=False) == prompt
    return dst, sess, answer, j


@pytest.fixture(scope="module")
def server(chat_model):
    srv = ServerProcess(chat_model[0], "--max-batch", "16", "--prefill-chunk", "16")
    yield srv
    assert srv.stop() == 0, "".join(srv.stderr)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def long_model(cache, tmp_path_factory):
    """The tiny model with 1024 positions and no tokenizer (prompts and outputs are token ids): long streams."""
    require_library()
    return cache.export(("tiny",), logits="last", max_seq_len=1024).parent


@pytest.fixture(scope="module")
def one_row(long_model):
    """One state row, no waiting, an API key."""
    srv = ServerProcess(long_model, "--max-batch", "1", "--max-queue", "0", "--api-key", KEY)
    yield srv
    assert srv.stop() == 0, "".join(srv.stderr)


def text_of(sess: Session, ids) -> str:
    return sess.tokenizer.decode([t for t in ids if t != EOS], skip_special_tokens=False)


def greedy(sess: Session, prompt, n) -> list:
    return sess.generate(prompt, n, stop_ids=[EOS])


def health(url: str, **kw) -> dict:
    return httpx.get(url + "/health", timeout=30, **kw).json()


def wait_idle(url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if h["running"] == 0 and h["queue_depth"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


# ---- the openai client ------------------------------------------------------------------------------------------

def test_models_and_health(server, client, chat_model):
    models = client.models.list()
    assert [m.id for m in models.data] == [chat_model[0].name]
    h = health(server.url)
    assert h["status"] == "ok" and h["max_batch"] == 16


def test_chat_matches_the_session(client, chat_model):
    _, sess, _, _ = chat_model
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 héllo 世界"}]
    prompt = sess.encode(format_chat(msgs), add_special_tokens=False)
    want = greedy(sess, prompt, 7)
    r = client.chat.completions.create(model=chat_model[0].name, messages=msgs, max_tokens=7, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == text_of(sess, want)
    assert c.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(want))
    assert r.usage.total_tokens == len(prompt) + len(want) and r.object == "chat.completion"
    r2 = client.chat.completions.create(model=chat_model[0].name, messages=msgs, max_completion_tokens=3,
                                        temperature=0)
    assert r2.usage.completion_tokens == min(3, len(want))


def test_chat_stream_with_usage(client, chat_model):
    _, sess, _, _ = chat_model
    msgs = [{"role": "user", "content": "w9 w10 w11"}]
    want = text_of(sess, greedy(sess, sess.encode(format_chat(msgs), add_special_tokens=False), 9))
    chunks = list(client.chat.completions.create(model=chat_model[0].name, messages=msgs, max_tokens=9,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 9
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model=chat_model[0].name, messages=msgs, max_tokens=9,
                                                temperature=0, stream=True))
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == want


def test_completions_text_and_ids(client, chat_model):
    _, sess, _, _ = chat_model
    ids = sess.encode("w34 w35 w36")
    want = text_of(sess, greedy(sess, ids, 6))
    name = chat_model[0].name
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == want and by_ids.usage.prompt_tokens == 3
    by_text = client.completions.create(model=name, prompt="w34 w35 w36", max_tokens=6, temperature=0)
    assert by_text.choices[0].text == want
    streamed = list(client.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == by_ids.choices[0].finish_reason
    # one chunk per generated token, then the finish chunk
    assert sum(c.choices[0].finish_reason is None for c in streamed) == by_ids.usage.completion_tokens


def test_seeded_sampling_is_reproducible(client, chat_model):
    name = chat_model[0].name
    kw = dict(model=name, prompt=[3, 4, 5], max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    want = chat_model[1].generate([3, 4, 5], 8, temperature=0.9, top_p=0.95, seed=7, stop_ids=[EOS])
    assert a.choices[0].text == b.choices[0].text == text_of(chat_model[1], want)
    c = client.completions.create(**kw, extra_body={"top_k": 2})
    assert c.usage.completion_tokens >= 1


def test_stop_strings(client, chat_model):
    _, sess, _, _ = chat_model
    ids = [0, 50, 51]
    full = text_of(sess, greedy(sess, ids, 12))
    words = full.split(" ")
    assert len(words) >= 6, full
    stop = " " + words[4]
    want = full[:full.find(stop)]
    name = chat_model[0].name
    r = client.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    # text held back as a possible stop string still streams a chunk per token (empty text)
    per_token = [c.choices[0].text for c in chunks if c.choices[0].finish_reason is None]
    assert len(per_token) == r.usage.completion_tokens and "" in per_token


def test_reasoning_split(client, chat_model):
    _, sess, answer, j = chat_model
    reasoning, content = text_of(sess, answer[:j]), text_of(sess, answer[j + 1:])
    name = chat_model[0].name
    for extra in ({"chat_template_kwargs": {"thinking": True}}, {"thinking": True},
                  {"thinking": {"type": "enabled"}}):
        r = client.chat.completions.create(model=name, messages=THINK_MESSAGES, max_tokens=12, temperature=0,
                                           extra_body=extra)
        m = r.choices[0].message
        assert m.reasoning_content.strip() == reasoning and m.content.strip() == content
    chunks = list(client.chat.completions.create(model=name, messages=THINK_MESSAGES, max_tokens=12,
                                                 temperature=0, stream=True, extra_body={"thinking": True}))
    deltas = [c.choices[0].delta for c in chunks]
    got_r = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    got_c = "".join(d.content or "" for d in deltas)
    assert got_r.strip() == reasoning and got_c.strip() == content
    off = client.chat.completions.create(model=name, messages=THINK_MESSAGES, max_tokens=4, temperature=0)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_sixteen_concurrent_clients_equal_single_runs(server, client, chat_model):
    name = chat_model[0].name
    requests = [dict(messages=[{"role": "user", "content": f"w{3 * i} w{3 * i + 1} " * (1 + i % 5)}],
                     max_tokens=6 + 2 * (i % 7)) for i in range(16)]
    alone = [client.chat.completions.create(model=name, temperature=0, **r).choices[0].message.content
             for r in requests]
    together, errors = [None] * 16, []
    start = threading.Barrier(16)

    def run(i):
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            start.wait(timeout=60)
            if i % 2:
                together[i] = c.chat.completions.create(model=name, temperature=0, **requests[i]) \
                    .choices[0].message.content
            else:
                together[i] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                    model=name, temperature=0, stream=True, **requests[i]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors and time.monotonic() - t0 < 180
    assert together == alone
    assert wait_idle(server.url)["running"] == 0


# ---- raw HTTP ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', 400,
     "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400, "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400,
     "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', 400, "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', 400,
     "logprobs"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1.5]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [600]}', 400, None),
    ("/v1/completions", b'{"prompt": [7], "max_tokens": 300}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [' + b"7, " * 299 + b'7]}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"w1 " * 300 + b'"}]}', 400,
     "messages"),
    ("/v1/completions", b'{"prompt": [7], "seed": -1}', 400, "seed"),
])
def test_bad_requests(server, path, body, status, param):
    r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    if b"300" in body or b"7, 7" in body or b"w1 w1" in body:
        assert err["code"] == "context_length_exceeded"


def test_unknown_routes_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert wait_idle(server.url)["running"] == 0  # no request left anything behind


def test_metrics(server, client, chat_model):
    client.completions.create(model=chat_model[0].name, prompt=[5, 6], max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("dsv4_ort_requests_total", "dsv4_ort_prompt_tokens_total", "dsv4_ort_generation_tokens_total",
                 "dsv4_ort_queue_depth", "dsv4_ort_batch_occupancy", "dsv4_ort_running_requests",
                 'dsv4_ort_time_to_first_token_seconds_bucket{le="+Inf"}', "dsv4_ort_inter_token_latency_seconds_count",
                 'dsv4_ort_http_requests_total{path="/v1/completions",status="200"}'):
        assert name in text, name
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["dsv4_ort_generation_tokens_total"]) >= 3
    assert float(samples["dsv4_ort_batch_slots"]) == 16


# ---- one row, no queue, an API key ------------------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_key(one_row):
    url = one_row.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert c.completions.create(model=long_model_name(one_row), prompt=[3, 4], max_tokens=2).usage.total_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()


def long_model_name(srv) -> str:
    return httpx.get(srv.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]


def _open_stream(url: str, max_tokens: int = 1000):
    """Starts a long streamed completion; returns (client, response, line iterator) after its first token."""
    c = httpx.Client(timeout=60)
    req = c.build_request("POST", url + "/v1/completions", headers=AUTH,
                          json={"prompt": [3, 4, 5], "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": True})
    resp = c.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
    return c, resp, lines


def cancelled_count(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    line = next((ln for ln in text.splitlines() if ln.startswith('dsv4_ort_requests_total{finish_reason="cancelled"')),
                None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def wait_cancelled(url: str, count: float, timeout: float = 30) -> float:
    """The cancelled-requests counter once it reaches count (or at the deadline). The engine frees a cancelled
    request's row before it records the finish, so /health can show the row free a moment before /metrics counts it."""
    deadline = time.monotonic() + timeout
    while True:
        n = cancelled_count(url)
        if n >= count or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_queue_full_and_disconnect_frees_the_row(one_row):
    url = one_row.url
    before = cancelled_count(url)
    c, resp, _ = _open_stream(url)
    assert health(url)["running"] == 1
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": [3], "max_tokens": 2}, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    resp.close()  # the client goes away mid-stream
    c.close()
    assert wait_idle(url)["running"] == 0
    assert wait_cancelled(url, before + 1) == before + 1
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": [3], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnect_while_waiting_for_a_whole_answer(one_row):
    url = one_row.url
    before = cancelled_count(url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", headers=AUTH,
                   json={"prompt": [3, 4], "max_tokens": 1000, "ignore_eos": True},
                   timeout=httpx.Timeout(30, read=0.5))
    assert wait_idle(url)["running"] == 0
    assert wait_cancelled(url, before + 1) == before + 1


def test_chat_needs_a_tokenizer(one_row):
    r = httpx.post(one_row.url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    r = httpx.post(one_row.url + "/v1/completions", headers=AUTH, json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


# ---- tool calls ---------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_MESSAGES = [{"role": "user", "content": "w3 w9 weather?"}]
# one "word" of the word-level tokenizer: the whole DSML block the model is made to emit
TOOL_BLOCK = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="weather">\n'
              '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
              "</｜DSML｜tool_calls>")


@pytest.fixture(scope="module")
def tool_server(cache, tmp_path_factory):
    """The tiny model with a tokenizer in which the token the model picks greedily a few tokens into its answer
    to TOOL_MESSAGES (with TOOLS in the prompt) decodes to TOOL_BLOCK. Yields (server, the answer's other words:
    content before and after the block, a Session on that model)."""
    require_library()
    dst = tmp_path_factory.mktemp("serve") / "tiny-tools"
    shutil.copytree(cache.export(("tiny",), logits="last", max_seq_len=256).parent, dst)
    tokens = vocabulary()
    save_tokenizer(dst / "tokenizer.json", tokens)
    sess = Session(dst, intra_op_threads=1)
    prompt = sess.encode(format_chat(TOOL_MESSAGES, tools=TOOLS), add_special_tokens=False)
    answer = greedy(sess, prompt, 10)
    j = next(j for j in range(1, len(answer) - 1)
             if answer[j] not in prompt and answer[j] > 8 and answer[j] not in answer[:j])
    tokens[answer[j]] = TOOL_BLOCK  # a word the prompt does not hold: the prompt ids are unchanged
    save_tokenizer(dst / "tokenizer.json", tokens)
    sess = Session(dst, intra_op_threads=1)
    assert sess.encode(format_chat(TOOL_MESSAGES, tools=TOOLS), add_special_tokens=False) == prompt
    srv = ServerProcess(dst, "--max-batch", "2")
    yield srv, " ".join((text_of(sess, answer[:j]) + " " + text_of(sess, answer[j + 1:])).split()), sess
    assert srv.stop() == 0, "".join(srv.stderr)


def test_tool_calls(tool_server):
    """The DSML block the model writes comes back as OpenAI tool_calls (whole and streamed), finish 'tool_calls';
    without tools in the request, or with tool_choice 'none', the same text is plain content."""
    srv, other, sess = tool_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny-tools", messages=TOOL_MESSAGES, max_tokens=10, temperature=0, tools=TOOLS)
    r = client.chat.completions.create(**kw)
    # the tools section is in the prompt the server ran
    with_tools = len(sess.encode(format_chat(TOOL_MESSAGES, tools=TOOLS), add_special_tokens=False))
    assert r.usage.prompt_tokens == with_tools > len(sess.encode(format_chat(TOOL_MESSAGES),
                                                                 add_special_tokens=False))
    m, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and " ".join(m.content.split()) == other
    (call,) = m.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(streamed) == 1 and streamed[0].index == 0 and streamed[0].function.name == "weather"
    assert json.loads(streamed[0].function.arguments) == {"city": "Paris"}
    assert " ".join("".join(d.content or "" for d in deltas).split()) == other
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert all("DSML" not in (d.content or "") for d in deltas)
    off = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert off.choices[0].finish_reason == "length" and not off.choices[0].message.tool_calls
    assert TOOL_BLOCK in off.choices[0].message.content


def test_tool_history(tool_server):
    """A conversation carrying the model's calls and the tools' results goes through the openai client and is
    rendered as format_chat renders it (calls as DSML, results as one user turn)."""
    srv, _, sess = tool_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny-tools", messages=TOOL_MESSAGES, max_tokens=10, temperature=0, tools=TOOLS)
    first = client.chat.completions.create(**kw).choices[0].message
    calls = [c.model_dump() for c in first.tool_calls]
    messages = TOOL_MESSAGES + [{"role": "assistant", "content": first.content, "tool_calls": calls},
                                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "w4 sunny"}]
    # without the tools section this time: it and the history would not fit the tiny model's 256 positions
    want = sess.encode(format_chat(messages), add_special_tokens=False)
    assert len(want) > len(sess.encode(format_chat(TOOL_MESSAGES), add_special_tokens=False)) + 20
    r = client.chat.completions.create(model="tiny-tools", messages=messages, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens >= 1
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    bad = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                     json={"messages": messages, "tools": TOOLS, "tool_choice": "required"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_parameter"
    bad = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                     json={"messages": messages[:-1] + [{"role": "tool", "content": "r"}], "tools": TOOLS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
