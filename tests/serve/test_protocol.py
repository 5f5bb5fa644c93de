"""dsv4_ort.serve.protocol and .metrics without a server: request checks, the reasoning split, Prometheus text."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("starlette", reason="dsv4_ort.serve needs starlette (pip install 'dsv4-ort[serve]')")
pytest.importorskip("uvicorn", reason="dsv4_ort.serve needs uvicorn (pip install 'dsv4-ort[serve]')")

from dsv4_ort.runtime.chat import ASSISTANT, USER  # noqa: E402
from dsv4_ort.runtime.engine import Histogram  # noqa: E402
from dsv4_ort.serve import metrics  # noqa: E402
from dsv4_ort.serve.protocol import (APIError, ReasoningSplitter, ToolCallParser, parse_chat,  # noqa: E402
                                     parse_completion)


def test_parse_chat():
    p = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                              {"type": "text", "text": "there"}]}],
                    "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0.5, "top_k": -1, "stop": "x",
                    "stream": True, "stream_options": {"include_usage": True},
                    "chat_template_kwargs": {"thinking": True}}, eos=1)
    assert p.prompt_text.endswith(f"be brief{USER}hi there{ASSISTANT}<think>") and p.thinking
    assert p.params.max_tokens == 5 and p.params.temperature == 0.5 and p.params.top_k == 0
    assert p.params.stop == ("x",) and p.params.stop_ids == (1,) and p.stream and p.include_usage
    q = parse_chat({"messages": [{"role": "user", "content": "a"}], "ignore_eos": True,
                    "stop_token_ids": [7], "thinking": {"type": "disabled"}}, eos=1)
    assert q.params.stop_ids == (7,) and not q.thinking and q.params.temperature == 1.0


@pytest.mark.parametrize("body, param", [({"messages": "x"}, "messages"),
                                         ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
                                         ({"messages": [{"role": "user", "content": "x"}], "tools": [1]}, "tools"),
                                         ({"messages": [{"role": "user", "content": "x"}], "thinking": "yes"},
                                          "thinking"),
                                         ({"messages": [{"role": "user", "content": "x"}], "top_k": 1.5}, "top_k"),
                                         ({"messages": [{"role": "user", "content": "x"}],
                                           "stream_options": {"include_usage": 1}}, "stream_options"),
                                         ({"messages": [{"role": "user", "content": "x"}],
                                           "presence_penalty": 0.5}, "presence_penalty")])
def test_parse_chat_errors(body, param):
    with pytest.raises(APIError) as e:
        parse_chat(body, eos=1)
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["message"]


def test_parse_completion():
    assert parse_completion({"prompt": ["text"]}, eos=None).prompt_text == "text"
    assert parse_completion({"prompt": [[1, 2]]}, eos=None).prompt_ids == [1, 2]
    assert parse_completion({"prompt": [1, 2], "presence_penalty": 0}, eos=None).params.stop_ids == ()
    with pytest.raises(APIError, match="one prompt"):
        parse_completion({"prompt": [[1], [2]]}, eos=None)
    with pytest.raises(APIError, match="only n=1"):
        parse_completion({"prompt": [1], "n": 3}, eos=None)


def test_reasoning_splitter():
    s = ReasoningSplitter(True)
    pieces = [s.feed(t) for t in ["let me ", "think </", "thi", "nk> the ", "answer"]]
    assert "".join(r for r, _ in pieces) == "let me think "
    assert "".join(c for _, c in pieces) == " the answer"
    assert pieces[1] == ("think ", "")  # "</" held back until decided
    s = ReasoningSplitter(True)
    assert s.feed("no end <") == ("no end ", "") and s.feed("", final=True) == ("<", "")
    assert ReasoningSplitter(False).feed("</think> x") == ("", "</think> x")


def test_metrics_text():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = metrics.render({"requests": {"stop": 2, "length": 1}, "prompt_tokens": 10, "completion_tokens": 20,
                           "steps": 7, "queue_depth": 3, "running": 2, "max_batch": 4, "ttft": h.snapshot(),
                           "itl": Histogram((0.1,)).snapshot()}, {("/v1/completions", 200): 3})
    lines = text.splitlines()
    assert 'dsv4_ort_requests_total{finish_reason="length"} 1' in lines
    assert 'dsv4_ort_time_to_first_token_seconds_bucket{le="0.1"} 1' in lines
    assert 'dsv4_ort_time_to_first_token_seconds_bucket{le="1.0"} 2' in lines
    assert 'dsv4_ort_time_to_first_token_seconds_bucket{le="+Inf"} 3' in lines
    assert "dsv4_ort_time_to_first_token_seconds_count 3" in lines
    assert "dsv4_ort_batch_occupancy 0.5" in lines and "dsv4_ort_queue_depth 3" in lines
    assert 'dsv4_ort_http_requests_total{path="/v1/completions",status="200"} 3' in lines
    assert "# TYPE dsv4_ort_inter_token_latency_seconds histogram" in lines


# ---- tool calls ------------------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
BLOCK = ("<｜DSML｜tool_calls>\n"
         '<｜DSML｜invoke name="weather">\n<｜DSML｜parameter name="city" string="true">Pa"ris</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="at" string="false">noon</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="r" string="false">NaN</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
         '<｜DSML｜invoke name="sum">\n<｜DSML｜parameter name="xs" string="false">[1, {"a": null}]'
         "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
# string="false" values that are not JSON (noon, NaN) come back as strings, so the arguments stay strict JSON
WANT_CALLS = [("weather", {"city": 'Pa"ris', "days": 3, "at": "noon", "r": "NaN"}),
              ("sum", {"xs": [1, {"a": None}]})]


def _feed_all(pieces, enabled=True):
    p = ToolCallParser(enabled)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, k = p.feed(piece, final=i == len(pieces) - 1)
        content += c
        calls += k
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"], parse_constant=_strict))
                     for c in calls], calls


def _strict(name):
    raise AssertionError(f"{name} in arguments")


def _splits(text: str, seed: int = 0) -> list:
    """text whole, char by char, and cut at 20 random sets of 1-9 boundaries."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 9)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("text, want_content", [
    ("Checking, ｜<｜ then " + BLOCK, "Checking, ｜<｜ then "),
    ("Checking.\n\n" + BLOCK, "Checking."),         # the blank line before the block belongs to it
    ("a\n\n\n" + BLOCK + "\n", "a\n"),             # only two newlines do; blank text after the block is dropped
    ("\n<｜DSML｜\n\n" + BLOCK + " after", "\n<｜DSML｜after"),  # text after the block: content, lstripped
    (BLOCK, ""),
])
def test_tool_call_parser_any_split(text, want_content):
    """Text before the block is content, the block becomes calls, whatever the feed boundaries."""
    for pieces in _splits(text):
        content, calls, raw = _feed_all(pieces)
        assert (content, calls) == (want_content, WANT_CALLS), pieces
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in raw)
        assert len({c["id"] for c in raw}) == 2


def test_tool_call_parser_holds_back_only_what_may_be_the_marker():
    p = ToolCallParser(True)
    assert p.feed("x <｜DS") == ("x ", [])  # could be the marker: held back
    assert p.feed("ML tail", final=True) == ("<｜DSML tail", [])
    p = ToolCallParser(True)
    assert p.feed("a\n") == ("a", []) and p.feed("\n") == ("", []) and p.feed("\n") == ("\n", [])
    assert p.feed("b") == ("\n\nb", []) and p.feed("<", final=True) == ("<", [])


@pytest.mark.parametrize("text", [
    "a <｜DSML｜tool_calls>\n<｜DSML｜invoke oops</｜DSML｜tool_calls> b",
    "a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=",  # cut by max_tokens: given back as text, newlines included
    # complete invokes but the block never closes
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n",
    # one good invoke, then text that is no invoke
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\nand more\n</｜DSML｜tool_calls>",
    # a parameter named twice
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
     '<｜DSML｜parameter name="k" string="true">1</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="k" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
    # a parameter without its string flag, an invoke without a name, no invoke at all
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k">1</｜DSML｜parameter>\n'
     "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    "x\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",
])
def test_tool_call_parser_malformed_is_content(text):
    for pieces in _splits(text, seed=1):
        assert _feed_all(pieces)[:2] == (text, []), pieces


def test_tool_call_parser_disabled():
    text = "a\n\n" + BLOCK
    for pieces in ([text], list(text)):
        assert _feed_all(pieces, enabled=False)[:2] == (text, [])
    p = parse_chat({"messages": [{"role": "user", "content": "q"}]}, eos=1)
    assert not p.tools and "## Tools" not in p.prompt_text


def test_parse_chat_tools():
    p = parse_chat({"messages": [{"role": "user", "content": "q"}], "tools": [TOOL], "tool_choice": "auto"}, eos=1)
    assert p.tools and "## Tools" in p.prompt_text and '"name": "weather"' in p.prompt_text
    off = parse_chat({"messages": [{"role": "user", "content": "q"}], "tools": [TOOL], "tool_choice": "none"}, eos=1)
    assert not off.tools and "## Tools" in off.prompt_text
    hist = parse_chat({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": None, "tool_calls": [
                                        {"id": "x", "type": "function",
                                         "function": {"name": "weather", "arguments": "{}"}}]},
                                    {"role": "tool", "tool_call_id": "x", "content": "sunny"}],
                       "tools": [TOOL]}, eos=1)
    assert hist.prompt_text.endswith(f"{USER}<tool_result>sunny</tool_result>{ASSISTANT}</think>")
    # thinking with tools keeps an earlier turn's reasoning; a tool result's text parts are blank-line separated
    think = parse_chat({"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "", "reasoning_content": "hmm",
                                      "tool_calls": [{"id": "x", "type": "function",
                                                      "function": {"name": "weather", "arguments": "{}"}}]},
                                     {"role": "tool", "tool_call_id": "x",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                        "tools": [TOOL], "thinking": True}, eos=1)
    assert f"{USER}q{ASSISTANT}<think>hmm</think>\n\n<｜DSML｜tool_calls>" in think.prompt_text
    assert think.prompt_text.endswith(f"{USER}<tool_result>a\n\nb</tool_result>{ASSISTANT}<think>")
    call = {"id": "x", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    for body, param, code in (
            ({"tools": [{"type": "function"}]}, "tools", None), ({"tools": "x"}, "tools", None),
            ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools", None),
            ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
            ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice",
             "unsupported_parameter"),
            ({"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "tool_calls": [{"function": {"name": 3}}]},
                           {"role": "tool", "tool_call_id": "x", "content": "r"}]}, "messages", None),
            ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]},
                           {"role": "tool", "content": "r"}]}, "messages", None),  # no tool_call_id
            ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "tool_calls": [call]}]}, "messages",
             None),
            ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "x", "content": "r"}]},
             "messages", None)):  # a result without a call before it
        with pytest.raises(APIError) as e:
            parse_chat({"messages": [{"role": "user", "content": "q"}], **body}, eos=1)
        assert e.value.status == 400 and e.value.param == param and e.value.code == code
        if param == "tool_choice":
            assert "'required' or a named function" in e.value.message
