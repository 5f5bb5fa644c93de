"""dsv4_ort.runtime.chat: DeepSeek-V4 chat prompts as exact strings (plain chats, the tools section, DSML tool calls
in history, tool results merged into user turns). No model needed."""
# ruff: noqa: E501  (TOOLS_TEXT keeps the trained text's long lines as they are)

from __future__ import annotations

import pytest

from dsv4_ort.runtime.chat import ASSISTANT, BOS, EOS, USER, format_chat, render_tool_calls, render_tools

# The tools section as the model was trained on it, typed out in full (one schema line per tool goes in SCHEMAS).
TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

SCHEMAS

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Météo d'une ville",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
# the inner function objects, one JSON line each, non-ASCII kept
SCHEMA_LINES = ('{"name": "weather", "description": "Météo d\'une ville", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
                '{"name": "clock", "parameters": {"type": "object", "properties": {}}}')
SECTION = TOOLS_TEXT.replace("SCHEMAS", SCHEMA_LINES)

CALLS = [{"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Zürich"}'}},
         {"id": "call_b", "type": "function",
          "function": {"name": "plan", "arguments": '{"days": 3, "tags": ["x", "é"], "opt": {"k": null}, '
                                                    '"ok": false, "note": "3"}'}},
         {"id": "call_c", "type": "function", "function": {"name": "echo", "arguments": "[1, 2]"}}]
CALLS_BLOCK = ("<｜DSML｜tool_calls>\n"
               '<｜DSML｜invoke name="weather">\n'
               '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
               "</｜DSML｜invoke>\n"
               '<｜DSML｜invoke name="plan">\n'
               '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="tags" string="false">["x", "é"]</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="opt" string="false">{"k": null}</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="ok" string="false">false</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="note" string="true">3</｜DSML｜parameter>\n'
               "</｜DSML｜invoke>\n"
               '<｜DSML｜invoke name="echo">\n'
               '<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>\n'
               "</｜DSML｜invoke>\n"
               "</｜DSML｜tool_calls>")


def test_plain_chats_unchanged():
    """Without tools the prompt is what it has always been (these strings predate tool calls)."""
    b, u, a, e = BOS, USER, ASSISTANT, EOS
    assert format_chat([{"role": "user", "content": "hi"}]) == f"{b}{u}hi{a}</think>"
    assert format_chat([{"role": "user", "content": "hi"}], thinking=True) == f"{b}{u}hi{a}<think>"
    assert format_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "r1"}, {"role": "user", "content": "q2"},
                        {"role": "user", "content": "q3"}], thinking=True) == \
        f"{b}be brief{u}q1{a}</think>r1{e}{u}q2{u}q3{a}<think>"
    # reasoning in an earlier turn is dropped without tools, thinking or not
    hist = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r", "reasoning_content": "why"},
            {"role": "user", "content": "q2"}]
    assert format_chat(hist, thinking=True) == f"{b}{u}q{a}</think>r{e}{u}q2{a}<think>"
    assert format_chat(hist, tools=[]) == format_chat(hist) == f"{b}{u}q{a}</think>r{e}{u}q2{a}</think>"


def test_tools_section():
    assert render_tools([WEATHER, CLOCK]) == SECTION
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert format_chat(msgs, tools=[WEATHER, CLOCK]) == f"{BOS}be brief\n\n{SECTION}{USER}hi{ASSISTANT}</think>"
    # no system message: the section alone stands in the system text's place, right after BOS
    assert format_chat(msgs[1:], tools=[WEATHER, CLOCK], thinking=True) == \
        f"{BOS}{SECTION}{USER}hi{ASSISTANT}<think>"


def test_tool_calls_in_history():
    """String arguments as is (string="true"), anything else as JSON (string="false"), arguments that are not a
    JSON object as one "arguments" parameter; content, a blank line, the block, EOS."""
    assert render_tool_calls(CALLS) == CALLS_BLOCK
    text = format_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me look.",
                                                           "tool_calls": CALLS},
                        {"role": "user", "content": "never mind"}], tools=[WEATHER])
    assert text == (f"{BOS}{SECTION.replace(SCHEMA_LINES, SCHEMA_LINES.splitlines()[0])}{USER}q"
                    f"{ASSISTANT}</think>Let me look.\n\n{CALLS_BLOCK}{EOS}{USER}never mind{ASSISTANT}</think>")
    # content null: the blank line still separates the (empty) text from the block
    only = format_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                           "tool_calls": CALLS[:1]},
                        {"role": "user", "content": "x"}])
    assert f"{ASSISTANT}</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"weather\">\n" in only


def test_tool_results_merged_in_call_order():
    """Results (in whatever order they came) sorted by the calls' ids and merged with the user text that follows
    into one user turn, blocks separated by blank lines."""
    text = format_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "", "tool_calls": CALLS},
                        {"role": "tool", "tool_call_id": "call_c", "content": "C"},
                        {"role": "tool", "tool_call_id": "call_a", "content": "A"},
                        {"role": "tool", "tool_call_id": "call_b", "content": "B"},
                        {"role": "user", "content": "and?"}], tools=[WEATHER, CLOCK])
    assert text == (f"{BOS}s\n\n{SECTION}{USER}q{ASSISTANT}</think>\n\n{CALLS_BLOCK}{EOS}"
                    f"{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\n"
                    f"<tool_result>C</tool_result>\n\nand?{ASSISTANT}</think>")


def test_conversation_ending_with_tool_results():
    """The model answers after the results: the merged user turn, then the assistant tag and think token."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": CALLS[:2]},
            {"role": "tool", "tool_call_id": "call_b", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_a", "content": "{\"t\": 21}"}]
    head = f"{BOS}{USER}q{ASSISTANT}</think>\n\n{render_tool_calls(CALLS[:2])}{EOS}"
    results = f"{USER}<tool_result>{{\"t\": 21}}</tool_result>\n\n<tool_result>sunny</tool_result>"
    assert format_chat(msgs) == f"{head}{results}{ASSISTANT}</think>"
    # a second round: the next calls' ids decide the order of the next results
    more = msgs + [{"role": "assistant", "content": "again", "tool_calls": CALLS[2:]},
                   {"role": "tool", "tool_call_id": "call_c", "content": "C"}]
    assert format_chat(more).endswith(f"{results}{ASSISTANT}</think>again\n\n{render_tool_calls(CALLS[2:])}{EOS}"
                                      f"{USER}<tool_result>C</tool_result>{ASSISTANT}</think>")


def test_thinking_with_tools_keeps_reasoning():
    """With tools in thinking mode every earlier assistant turn keeps its reasoning inside <think>...</think>
    (empty when it has none); the final turn opens <think>."""
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "need weather", "tool_calls": CALLS[:1]},
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "thanks"}]
    assert format_chat(msgs, tools=[CLOCK], thinking=True) == (
        f"{BOS}{TOOLS_TEXT.replace('SCHEMAS', SCHEMA_LINES.splitlines()[1])}{USER}q"
        f"{ASSISTANT}<think>need weather</think>\n\n{render_tool_calls(CALLS[:1])}{EOS}"
        f"{USER}<tool_result>sunny</tool_result>{ASSISTANT}<think></think>It is sunny.{EOS}"
        f"{USER}thanks{ASSISTANT}<think>")
    # without thinking the reasoning is dropped as in plain chats
    assert f"{ASSISTANT}</think>\n\n<｜DSML｜tool_calls>" in format_chat(msgs, tools=[CLOCK])
    assert "need weather" not in format_chat(msgs, tools=[CLOCK])


@pytest.mark.parametrize("msgs, match", [
    ([{"role": "tool", "tool_call_id": "x", "content": "r"}], "must follow an assistant message with tool_calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "no calls"},
      {"role": "tool", "tool_call_id": "x", "content": "r"}], "must follow an assistant message with tool_calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": CALLS[:1]}],
     "must end with a user or tool message"),
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], "system message must come first"),
])
def test_errors(msgs, match):
    with pytest.raises(ValueError, match=match):
        format_chat(msgs, tools=[WEATHER])
