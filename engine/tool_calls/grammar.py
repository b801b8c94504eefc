"""The grammar a reply with tool calls must follow, built from the tools' parameter schemas (a Lark grammar with
llguidance's `%json` embedding, one alternative per tool): with `auto` it is lazy and holds from the format's
trigger text on; with `required` or a named tool it holds from the first token."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from engine.constraint import GrammarSpec
from engine.events import ToolSpec


@dataclass(frozen=True)
class Envelope:
    head: str  # before the first call
    open: str  # each call's opening, up to the name's value
    close: str  # each call's end
    sep: str  # between calls
    tail: str  # after the last call
    trigger: str  # where a lazy grammar switches on: a prefix of head + open
    args_key: str = "arguments"


ENVELOPES = {
    "hermes": Envelope("", '<tool_call>\n{"name": ', "}\n</tool_call>", "\n", "", "<tool_call>"),
    "llama3": Envelope("", '{"name": ', "}", "; ", "", '{"name": ', "parameters"),
    "mistral": Envelope("[TOOL_CALLS][", '{"name": ', "}", ", ", "]", "[TOOL_CALLS]"),
    "generic": Envelope('{"tool_calls": [', '{"name": ', "}", ", ", "]}", '{"tool_calls": ['),
}


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def tool_grammar(
    fmt_name: str, tools: Sequence[ToolSpec], only: str | None = None, lazy: bool = False, parallel: bool = True
) -> GrammarSpec:
    """The calls' grammar for the format named `fmt_name`; `only`: the one tool allowed (a named tool_choice)."""
    env = ENVELOPES[fmt_name]
    rules, alts = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object"}
        alts.append(f"fn{i}")
        rules.append(f"fn{i}: {_lit(json.dumps(fn['name']) + f', {json.dumps(env.args_key)}: ')} args{i}")
        rules.append(f"args{i}: %json {json.dumps(params)}")
    first = env.head + env.open
    if lazy:
        assert first.startswith(env.trigger)
        first = first[len(env.trigger) :]
    more = f" ({_lit(env.close + env.sep + env.open)} call)*" if parallel else ""
    start = f"start: {_lit(first)} call{more} {_lit(env.close + env.tail)}" if first else ""
    if not first:  # the trigger is the whole opening: the grammar starts at the name's value
        start = f"start: call{more} {_lit(env.close + env.tail)}"
    lines = [start, f"call: {' | '.join(alts)}", *rules]
    return GrammarSpec("lark", "\n".join(lines) + "\n", trigger=env.trigger if lazy else None)
