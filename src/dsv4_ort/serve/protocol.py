"""OpenAI request bodies -> engine inputs, and the response / SSE chunk bodies the OpenAI clients expect.

Only plain Python here (no web framework): :func:`parse_chat` and :func:`parse_completion` check a decoded JSON
body and raise :class:`APIError` (an OpenAI error body with its HTTP status) for anything the engine cannot take.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import time
import uuid
from dataclasses import dataclass

from ..runtime.chat import DSML, TOOL_CALLS_BEGIN, TOOL_CALLS_END
from ..runtime.engine import SamplingParams, _held_back


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Parsed:
    """A checked request: the prompt (token ids, or text to encode), sampling, streaming and chat options."""

    prompt_ids: list | None
    prompt_text: str | None
    add_special_tokens: bool
    params: SamplingParams
    stream: bool
    include_usage: bool
    thinking: bool = False
    tools: bool = False  # the request has tools (and tool_choice is not "none"): parse DSML tool calls


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _opt(body: dict, name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad(f"'{name}' must be {what}, got {v!r}", param=name)
    return v


# Fields the OpenAI API defines that change the output and that this server does not implement: a request that
# sets them to anything but their neutral value is refused rather than silently answered differently.
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
                "response_format": (None, {"type": "text"}), "best_of": (None, 1), "echo": (None, False),
                "suffix": (None, ""), "functions": (None, [])}


def _sampling(body: dict, eos: int | None) -> tuple:
    for name, neutral in _UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise bad(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    n = _opt(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad("only n=1 is supported", param="n")
    mt = _opt(body, "max_completion_tokens", _is_int, "an integer")
    if mt is None:
        mt = _opt(body, "max_tokens", _is_int, "an integer")
    if mt is not None and mt < 1:
        raise bad(f"max_tokens must be >= 1, got {mt}", param="max_tokens")
    temperature = _opt(body, "temperature", lambda v: _is_num(v) and math.isfinite(v) and 0 <= v <= 2,
                       "a number in [0, 2]", 1.0)
    top_p = _opt(body, "top_p", lambda v: _is_num(v) and math.isfinite(v) and 0 < v <= 1, "a number in (0, 1]",
                 1.0)
    top_k = _opt(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1 or 0: no limit)", 0)
    seed = _opt(body, "seed", lambda v: _is_int(v) and 0 <= v < 2 ** 63, "an integer >= 0")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", param="stop")
    if any(not s for s in stop):
        raise bad("stop strings must not be empty", param="stop")
    stop_ids = _opt(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
                    "a list of token ids", [])
    ignore_eos = _opt(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    ids = tuple(stop_ids) + (() if ignore_eos or eos is None else (eos,))
    params = SamplingParams(max_tokens=mt, temperature=float(temperature), top_p=float(top_p), top_k=max(0, top_k),
                            seed=seed, stop_ids=ids, stop=stop)
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    opts = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", param="stream_options")
    return params, stream, include_usage


def _text_of(content, i: int, sep: str = "") -> str:
    """A message's content: a string, null, or a list of {"type": "text", "text": ...} parts (joined by sep)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content: only text parts are supported", param="messages")
            out.append(part["text"])
        return sep.join(out)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _thinking(body: dict) -> bool:
    """``thinking``: a boolean or DeepSeek's {"type": "enabled" | "disabled"}; or chat_template_kwargs
    {"thinking": bool} (also spelled "enable_thinking")."""
    v = body.get("thinking")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        for key in ("thinking", "enable_thinking"):
            if kwargs.get(key) is not None:
                v = kwargs[key]
    if v is None:
        return False
    if isinstance(v, dict) and v.get("type") in ("enabled", "disabled"):
        return v["type"] == "enabled"
    if not isinstance(v, bool):
        raise bad(f"'thinking' must be a boolean or {{\"type\": \"enabled\"}}, got {v!r}", param="thinking")
    return v


def _tools(body: dict) -> tuple:
    """``tools`` (OpenAI function tools) and ``tool_choice`` -> (tools or None, whether calls are parsed)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad("only tool_choice 'auto' and 'none' are supported (not 'required' or a named function)",
                  param="tool_choice", code="unsupported_parameter")
    if tools is None or tools == []:
        return None, False
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                      param="tools")
    return tools, choice != "none"


def _message(m, i: int) -> dict:
    """One request message -> format_chat's form (roles, text, tool calls checked)."""
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object", param="messages")
    role = m.get("role")
    if role == "developer":  # the newer name of the system role
        role = "system"
    # a tool result's text parts are blank-line separated, as the encoder joins them
    out = {"role": role, "content": _text_of(m.get("content"), i, "\n\n" if role == "tool" else "")}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be a list on an assistant message", param="messages")
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments", ""), str)):
                raise bad(f"messages[{i}].tool_calls: each call needs function.name and function.arguments "
                          "(a JSON string)", param="messages")
        out["tool_calls"] = calls
    if role == "assistant" and m.get("reasoning_content") is not None:  # kept in thinking mode with tools
        if not isinstance(m["reasoning_content"], str):
            raise bad(f"messages[{i}].reasoning_content must be a string", param="messages")
        out["reasoning_content"] = m["reasoning_content"]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}]: a tool message needs tool_call_id (a string)", param="messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def parse_chat(body: dict, eos: int | None) -> Parsed:
    from ..runtime.chat import format_chat

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", param="messages")
    plain = [_message(m, i) for i, m in enumerate(messages)]
    params, stream, include_usage = _sampling(body, eos)
    thinking = _thinking(body)
    tools, parse_calls = _tools(body)
    try:
        text = format_chat(plain, thinking=thinking, tools=tools)
    except ValueError as e:
        raise bad(str(e), param="messages") from None
    return Parsed(None, text, False, params, stream, include_usage, thinking, parse_calls)


def parse_completion(body: dict, eos: int | None) -> Parsed:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    params, stream, include_usage = _sampling(body, eos)
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", param="prompt")
        return Parsed(None, prompt, True, params, stream, include_usage)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return Parsed([int(t) for t in prompt], None, False, params, stream, include_usage)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("only one prompt per request is supported", param="prompt")
    raise bad("'prompt' must be a non-empty string or a list of token ids", param="prompt")


class ReasoningSplitter:
    """Splits DeepSeek-V4 thinking-mode output into reasoning (before ``</think>``) and the answer (after it).

    :meth:`feed` takes text pieces and returns (reasoning, content) pieces; text that could be the start of
    ``</think>`` is held back until it is decided (``final`` releases it). Without thinking all text is content."""

    END = "</think>"

    def __init__(self, thinking: bool):
        self.reasoning = thinking
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple:
        if not self.reasoning:
            return "", text
        self.buf += text
        i = self.buf.find(self.END)
        if i >= 0:
            r, c = self.buf[:i], self.buf[i + len(self.END):]
            self.reasoning, self.buf = False, ""
            return r, c
        keep = 0 if final else _held_back(self.buf, [self.END])
        r, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return r, ""


class ToolCallParser:
    """Splits answer text into content and DSML tool calls (runtime/chat.py shows the markup).

    :meth:`feed` takes content pieces and returns (content, calls): text before ``<｜DSML｜tool_calls>`` is content;
    the block itself is buffered until ``</｜DSML｜tool_calls>`` and then parsed into OpenAI tool calls. The model
    writes a blank line between its text and the block (the prompt's turns have one): up to two newlines right
    before the marker belong to it and are dropped. While streaming, a tail that could begin the marker (those
    newlines included) is held back until decided, so the content is the same however the text is cut into pieces.
    A block that does not parse, or is still open at ``final``, is given back as content, newlines and all; never an
    error. Disabled (no tools in the request, or tool_choice "none"), all text is content."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buf = ""
        self.sep = ""          # the newlines dropped before the marker (given back if the block does not parse)
        self.in_block = False
        self.done = False      # one block per answer; text after it is content
        self.after = False     # a block was parsed: blank text right after it is dropped
        self.calls: list = []

    def _tail(self, text: str) -> str:
        if self.after:
            text = text.lstrip()
            self.after = not text
        return text

    def feed(self, text: str, final: bool = False) -> tuple:
        if not self.enabled:
            return text, []
        if self.done:
            return self._tail(text), []
        self.buf += text
        content = ""
        if not self.in_block:
            i = self.buf.find(TOOL_CALLS_BEGIN)
            if i < 0:
                n = len(self.buf)
                if not final:  # hold back a possible start of the marker and the newlines before it
                    n -= _held_back(self.buf, [TOOL_CALLS_BEGIN])
                    n -= len(_split_sep(self.buf[:n])[1])
                content, self.buf = self.buf[:n], self.buf[n:]
                return content, []
            (content, self.sep), self.buf, self.in_block = _split_sep(self.buf[:i]), self.buf[i:], True
        j = self.buf.find(TOOL_CALLS_END)
        if j < 0 and not final:
            return content, []
        block = self.buf if j < 0 else self.buf[:j + len(TOOL_CALLS_END)]
        rest = "" if j < 0 else self.buf[j + len(TOOL_CALLS_END):]
        self.buf, self.in_block, self.done = "", False, True
        calls = parse_tool_calls(block) if j >= 0 else []
        if not calls:
            return content + self.sep + block + rest, []
        self.calls, self.after = calls, True
        return content + self._tail(rest), calls


def _split_sep(text: str) -> tuple:
    """text -> (text without its last two newlines at most, those newlines)."""
    n = min(2, len(text) - len(text.rstrip("\n")))
    return text[:len(text) - n], text[len(text) - n:]


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


_D = re.escape(DSML)
_INVOKE_OPEN = re.compile(rf'<{_D}invoke name="([^"]+)">')
_INVOKE_CLOSE = f"</{DSML}invoke>"
_PARAM = re.compile(rf'<{_D}parameter name="([^"]*)" string="(true|false)">(.*?)</{_D}parameter>', re.S)
_SPACE = re.compile(r"\s*")


def parse_tool_calls(block: str) -> list:
    """A whole DSML block (``<｜DSML｜tool_calls>`` ... ``</｜DSML｜tool_calls>``) -> OpenAI tool calls, or [] when
    it does not parse: anything but whitespace outside the invoke / parameter tags, a repeated parameter name, an
    invoke without a name, or no invoke at all. string="true" parameters become JSON strings; string="false"
    values are JSON and are kept as written (a value that is not JSON becomes a string)."""
    if not (block.startswith(TOOL_CALLS_BEGIN) and block.endswith(TOOL_CALLS_END)):
        return []
    pos, end = len(TOOL_CALLS_BEGIN), len(block) - len(TOOL_CALLS_END)
    calls = []
    while True:
        pos = _SPACE.match(block, pos, end).end()
        if pos == end:
            break
        m = _INVOKE_OPEN.match(block, pos, end)
        if m is None:
            return []
        pos, args = m.end(), {}
        while True:
            pos = _SPACE.match(block, pos, end).end()
            if block.startswith(_INVOKE_CLOSE, pos):
                pos += len(_INVOKE_CLOSE)
                break
            p = _PARAM.match(block, pos, end)
            if p is None:
                return []
            key, is_str, value = p.groups()
            if key in args:
                return []
            if is_str == "false":
                try:
                    json.loads(value, parse_constant=_not_json)  # NaN / Infinity would make the arguments invalid
                except ValueError:
                    is_str = "true"
            args[key] = value if is_str == "false" else json.dumps(value, ensure_ascii=False)
            pos = p.end()
        arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in args.items()) + "}"
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": m.group(1), "arguments": arguments}})
    return calls


# ---- response bodies -------------------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, reasoning: str, content: str, thinking: bool, finish: str,
                  prompt_tokens: int, completion_tokens: int, tool_calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["content"] = content or None
        message["tool_calls"] = tool_calls
        finish = "tool_calls"
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None, include_usage: bool) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if include_usage:
        out["usage"] = None
    return out


def completion_response(rid: str, model: str, text: str, finish: str, prompt_tokens: int,
                        completion_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None,
                     include_usage: bool) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, created: int, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
