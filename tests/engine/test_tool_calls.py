"""Tool-call formats: detection from real templates, each format's parser on recorded and written replies
(whole, cut short at every character, malformed), streamed deltas against the final parse, reasoning blocks,
the calls' grammar, and tools and tool messages through the real Qwen template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.constraint import compile_grammar
from engine.events import Message, ToolCall
from engine.template import ChatTemplate
from engine.tool_calls import FORMATS, detect_format, parse_reply
from engine.tool_calls import prompt as tool_prompt
from engine.tool_calls.grammar import tool_grammar
from engine.tool_calls.reasoning import ReasoningStream, split_reasoning
from engine.tool_calls.stream import CallStream

RECORDED = json.loads((Path(__file__).parent / "tool_outputs.json").read_text())["recorded"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# Replies in the formats we have no recorded model for, written as each family's template documents them.
WRITTEN = [
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})], ""),
    (
        "llama3",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        [("a", {"x": 1}), ("b", {})],
        "",
    ),
    ("llama3", 'Use {"name": "a", "parameters": {}} like this.', [], 'Use {"name": "a", "parameters": {}} like this.'),
    (
        "mistral",
        'Checking. [TOOL_CALLS][{"name": "a", "arguments": {"x": [1, "]"]}}, {"name": "b", "arguments": {}}]',
        [("a", {"x": [1, "]"]}), ("b", {})],
        "Checking.",
    ),
    ("generic", '{"tool_calls": [{"name": "a", "arguments": {"q": "{"}}]}', [("a", {"q": "{"})], ""),
    ("generic", "Plain words.", [], "Plain words."),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"s": "</tool_call>"}}\n</tool_call>', [("a", {"s": "</tool_call>"})], "Sure."),  # noqa: E501
]
CASES = [("hermes", r["reply"], [tuple(c) for c in r["calls"]], r["content"]) for r in RECORDED] + WRITTEN


def _calls(calls: tuple[ToolCall, ...]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "reply", "calls", "content"), CASES)
def test_each_reply_parses_to_its_calls_and_the_text_around_them(fmt, reply, calls, content) -> None:
    parsed = parse_reply(reply, FORMATS[fmt])
    assert _calls(parsed.calls) == calls
    assert parsed.content == content
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize(("fmt", "reply", "calls", "content"), CASES)
def test_a_reply_cut_short_anywhere_is_text_or_whole_calls_never_a_crash(fmt, reply, calls, content) -> None:
    for n in range(len(reply)):
        parsed = parse_reply(reply[:n], FORMATS[fmt])
        for call in parsed.calls:
            assert isinstance(json.loads(call.arguments), dict)  # a call is only ever a complete one
        assert len(parsed.calls) <= len(calls)
        if not parsed.calls:
            assert parsed.content == reply[:n]  # nothing is lost


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}',  # unclosed object
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # the name is not a string
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "a", "arguments": {"x": 01}}</tool_call>',  # not JSON
        '<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>',
        "<tool_call></tool_call>",
        '{"name": "a"',
    ],
)
def test_malformed_calls_stay_text(reply: str) -> None:
    for fmt in FORMATS.values():
        parsed = parse_reply(reply, fmt)
        assert parsed.calls == () and parsed.content == reply


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize(("fmt", "reply", "calls", "content"), CASES)
def test_streamed_deltas_assemble_into_the_final_parse(fmt, reply, calls, content, size: int) -> None:
    stream = CallStream(FORMATS[fmt])
    deltas = []
    for i in range(0, len(reply), size):
        deltas += stream.push(reply[i : i + size])
    owed, parsed = stream.finish(reply)
    deltas += owed
    text = "".join(d.content for d in deltas)
    assert text.strip() == parsed.content
    assembled: dict[int, list[str]] = {}
    for d in deltas:
        if d.index >= 0:
            entry = assembled.setdefault(d.index, ["", "", ""])
            entry[0] += d.id
            entry[1] += d.name
            entry[2] += d.arguments
    got = [(name, json.loads(args)) for _, name, args in (assembled[i] for i in sorted(assembled))]
    assert got == calls
    assert [assembled[i][0] for i in sorted(assembled)] == [c.id for c in parsed.calls]


def test_text_before_a_call_streams_before_the_call_is_complete() -> None:
    stream = CallStream(FORMATS["hermes"])
    out = stream.push("Let me check. <tool")
    assert "".join(d.content for d in out) == "Let me check. "  # "<tool" is held: it may open a call
    out = stream.push('_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.index, d.name, d.arguments) for d in out] == [(0, "get_weather", ""), (0, "", '{"ci')]


def test_formats_are_detected_from_real_templates(qwen_model, smollm2_model, gemma3_model) -> None:
    assert detect_format(qwen_model.file.metadata["tokenizer.chat_template"]).name == "hermes"
    assert detect_format(smollm2_model.file.metadata["tokenizer.chat_template"]).name == "generic"
    assert detect_format(gemma3_model.file.metadata.get("tokenizer.chat_template")).name == "generic"
    llama31 = "{%- if message.role == 'ipython' %}...{{- '<|python_tag|>' + tool_call.name }}"
    assert detect_format(llama31).name == "llama3"
    assert detect_format("{{- '[TOOL_CALLS][' }}").name == "mistral"


def test_tools_and_tool_messages_go_through_the_real_qwen_template(qwen_model) -> None:
    tok = qwen_model.tokenizer
    template = ChatTemplate(qwen_model.file.metadata["tokenizer.chat_template"], "", tok.detokenize([tok.eos_id]))
    messages = [
        Message("user", "Weather in Paris?"),
        Message("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", '{"temperature_c": 17}', tool_call_id="call_1", name="get_weather"),
    ]
    text = tool_prompt.render(template, messages, [WEATHER]).text
    assert template.warning is None
    assert json.dumps(WEATHER["function"]["parameters"]) in text  # the template listed the tool itself
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature_c": 17}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tool_syntax_gets_the_tools_in_its_system_prompt(smollm2_model) -> None:
    tok = smollm2_model.tokenizer
    template = ChatTemplate(smollm2_model.file.metadata["tokenizer.chat_template"], "", tok.detokenize([tok.eos_id]))
    text = tool_prompt.render(template, [Message("system", "Be brief."), Message("user", "Hi")], [WEATHER]).text
    system = text.split("<|im_end|>")[0]
    assert "Be brief." in system and '"name": "get_weather"' in system and '{"tool_calls": [' in system


def test_chat_template_kwargs_reach_the_template() -> None:
    src = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %}<no-think>{% endif %}"
    template = ChatTemplate(src, "", "")
    assert template.render([Message("user", "x")], True, kwargs={"enable_thinking": False}) == "x<no-think>"
    assert template.render([Message("user", "x")], True, kwargs={"messages": []}) == "x"  # never the conversation


def test_reasoning_is_split_from_the_answer_whole_and_streamed() -> None:
    reply = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
    assert split_reasoning(reply) == ("The user wants 2+2.", "It is 4.")
    assert split_reasoning("Only </think> an answer") == ("", "Only </think> an answer")
    assert split_reasoning("thinking</think>answer", opened=True) == ("thinking", "answer")
    for size in (1, 2, 5):
        stream = ReasoningStream()
        parts = [stream.push(reply[i : i + size]) for i in range(0, len(reply), size)]
        assert "".join(r for r, _ in parts).strip() == "The user wants 2+2."
        assert "".join(a for _, a in parts) == "It is 4."
    # as a tokenizer cuts it: the tag alone, then the first word with its space (recorded from Qwen2.5-Coder)
    for pieces in (["<think>", "yes", ".</think>", " This", " is"], ["<think>x</think>", "\n", "\n", "It"]):
        stream = ReasoningStream()
        answer = "".join(stream.push(p)[1] for p in pieces)
        assert answer == split_reasoning("".join(pieces))[1] and not answer[0].isspace()


def test_the_calls_grammar_compiles_for_every_format_and_holds_calls_to_the_schemas(qwen_model) -> None:
    tok = qwen_model.tokenizer
    for fmt in FORMATS:
        for lazy in (False, True):
            compile_grammar(tok, tool_grammar(fmt, [WEATHER, TIME], lazy=lazy))
    one = compile_grammar(tok, tool_grammar("hermes", [WEATHER, TIME], only="get_weather", parallel=False))
    several = compile_grammar(tok, tool_grammar("hermes", [WEATHER, TIME]))

    def accepts(text: str, grammar=one) -> bool:
        state = grammar.start()
        return all(state.accept(t) for t in tok.tokenize(text, special=True)) and state.is_finished()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(call)
    assert not accepts(call + "\n" + call)  # parallel_tool_calls false: one call
    state = several.start()
    both = call + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert all(state.accept(t) for t in tok.tokenize(both, special=True))
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": 1}}\n</tool_call>')
    assert not accepts("It is sunny.")
