"""Chat prompts in DeepSeek-V4's format.

DeepSeek-V4 ships its chat encoding as Python (``encoding/encoding_dsv4.py`` in the model repository), not as a
Jinja template. This is the plain-conversation subset of it: a BOS token, then ``<｜User｜>`` + text for user
turns and ``<｜Assistant｜>`` + text + EOS for earlier assistant turns, an optional system text first, and the
final ``<｜Assistant｜>`` followed by ``</think>`` (answer directly) or ``<think>`` (reason first). Tool calls and
the "max effort" instruction are not covered.
"""

from __future__ import annotations

from typing import Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"


def format_chat(messages: Sequence[dict], *, thinking: bool = False) -> str:
    """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...] -> the prompt text."""
    parts = [BOS]
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content", "")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string")
        if role == "system":
            if i != 0:
                raise ValueError("a system message must come first")
            parts.append(content)
        elif role == "user":
            parts.append(USER + content)
        elif role == "assistant":
            parts.append(ASSISTANT + "</think>" + content + EOS)
        else:
            raise ValueError(f"message {i}: unknown role {role!r}")
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("the conversation must end with a user message")
    parts.append(ASSISTANT + ("<think>" if thinking else "</think>"))
    return "".join(parts)
