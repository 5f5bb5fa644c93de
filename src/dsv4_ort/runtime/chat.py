"""Chat prompts in DeepSeek-V4's format, tool calls included.

DeepSeek-V4 ships its chat encoding as Python (``encoding/encoding_dsv4.py`` in the model repository), not as a
Jinja template. This is the conversation subset of it: a BOS token, an optional system text first (followed by the
tools section when the request has tools), ``<｜User｜>`` + text for user turns, ``<｜Assistant｜></think>`` + text
(+ a DSML tool-call block) + EOS for earlier assistant turns, and the final ``<｜Assistant｜>`` followed by
``</think>`` (answer directly) or ``<think>`` (reason first).

Tool calls use the model's DSML markup (:func:`render_tool_calls`); tool results have no role of their own: a run
of ``tool`` messages, and a user message right after them, make one user turn whose blocks (``<tool_result>``
blocks, the user's text) are joined by blank lines, the results in the order of the calls that asked for them.
With tools in thinking mode the encoder keeps every earlier turn's reasoning: such a turn is
``<｜Assistant｜><think>`` + ``reasoning_content`` (may be empty) + ``</think>`` + text; without tools, or
without thinking, earlier turns drop their reasoning as above.

Where this differs from the encoder: two user messages in a row stay two user turns (the encoder merges them
into one, blank-line separated; kept so that plain chats render as they always have). Not covered: the "max
effort" instruction, ``response_format`` and the encoder's internal task tokens.
"""

from __future__ import annotations

import json
from typing import Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
DSML = "｜DSML｜"
TOOL_CALLS_BEGIN = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

# The tools section the model was trained with (the encoder's text; one JSON schema per line goes in {schemas}).
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def render_tools(tools: Sequence[dict]) -> str:
    """tools: OpenAI's [{"type": "function", "function": {...}}] -> the tools section (the inner objects)."""
    return TOOLS_SECTION.replace("{schemas}", "\n".join(_json(t["function"]) for t in tools))


def render_tool_calls(calls: Sequence[dict]) -> str:
    """OpenAI tool calls [{"function": {"name", "arguments": JSON text}}] -> the DSML block.

    Each argument is a parameter: a string value as is with string="true", anything else as JSON with
    string="false"; arguments that are not a JSON object become one parameter named "arguments" (the raw text)."""
    invokes = []
    for c in calls:
        fn = c["function"]
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {"arguments": raw}
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return TOOL_CALLS_BEGIN + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _check_content(i: int, content) -> str:
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ValueError(f"message {i}: content must be a string")
    return content


def format_chat(messages: Sequence[dict], *, thinking: bool = False, tools: Sequence[dict] | None = None) -> str:
    """messages: [{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...] -> the prompt text.

    An assistant message may carry OpenAI ``tool_calls`` (and ``reasoning_content``, rendered only in thinking mode
    with tools); a tool message answers one of the calls by ``tool_call_id``. ``tools`` (OpenAI's list) is rendered
    after the system text, or first when there is no system message."""
    parts = [BOS]
    if messages and messages[0].get("role") == "system":
        system = _check_content(0, messages[0].get("content"))
        parts.append(system + ("\n\n" + render_tools(tools) if tools else ""))
        rest = list(enumerate(messages))[1:]
    else:
        # The encoder attaches tools to a system message. Without one, the tools section alone takes the system
        # text's place right after BOS (no leading blank lines: there is no system text to separate it from).
        if tools:
            parts.append(render_tools(tools))
        rest = list(enumerate(messages))
    keep_reasoning = bool(tools) and thinking  # the encoder stops dropping history reasoning when tools are given
    order: dict = {}   # tool_call_id -> position in the last assistant turn's calls
    blocks: list = []  # the user turn being built: (sort key, text)
    last_role = None

    def flush_user():
        if blocks:
            results = sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0])
            it = iter(results)
            texts = [next(it)[1] if key is not None else text for key, text in blocks]
            parts.append(USER + "\n\n".join(texts))
            blocks.clear()

    for i, m in rest:
        role = m.get("role")
        content = _check_content(i, m.get("content"))
        if role == "system":
            raise ValueError("a system message must come first")
        if role == "tool":
            if last_role not in ("assistant", "tool") or not order:
                raise ValueError(f"message {i}: a tool message must follow an assistant message with tool_calls")
            key = order.get(m.get("tool_call_id"), 0)  # an unknown id sorts with the first call, as in the encoder
            blocks.append((key, f"<tool_result>{content}</tool_result>"))
        elif role == "user":
            if last_role != "tool":
                flush_user()
            blocks.append((None, content))
        elif role == "assistant":
            flush_user()
            calls = m.get("tool_calls") or []
            order = {c.get("id"): n for n, c in enumerate(calls)}
            tail = "\n\n" + render_tool_calls(calls) if calls else ""
            if keep_reasoning:
                reasoning = m.get("reasoning_content") or ""
                if not isinstance(reasoning, str):
                    raise ValueError(f"message {i}: reasoning_content must be a string")
                head = "<think>" + reasoning + "</think>"
            else:
                head = "</think>"
            parts.append(ASSISTANT + head + content + tail + EOS)
        else:
            raise ValueError(f"message {i}: unknown role {role!r}")
        last_role = role
    if last_role not in ("user", "tool"):
        raise ValueError("the conversation must end with a user or tool message")
    flush_user()
    parts.append(ASSISTANT + ("<think>" if thinking else "</think>"))
    return "".join(parts)
