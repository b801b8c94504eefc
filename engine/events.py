"""The values that cross the engine/app boundary: messages in, token events and turn stats out.

These are plain frozen dataclasses so a worker thread can hand them to the UI thread as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import GrammarError

STOP_EOS = "eos"  # the model ended its turn (EOS / EOT / <|im_end|>-style token)
STOP_LENGTH = "length"  # max_tokens reached
STOP_STRING = "stop-string"  # one of the caller's stop strings appeared
STOP_CANCELLED = "cancelled"  # the caller asked to stop
STOP_CONTEXT = "context"  # the context is full and nothing more can be dropped


GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex")


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must match: `kind` names the language of `source`.

    kind: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; source ignored),
    "lark", "gbnf" (llama.cpp's grammar format), "regex". trigger: None, the grammar holds from the first
    token; else the text is free until it contains `trigger`, and the grammar holds for what follows.
    """

    kind: str
    source: str = ""
    trigger: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
        if self.trigger == "":
            raise GrammarError("a lazy grammar's trigger must not be empty")


ToolSpec = Mapping[str, Any]
"""A tool offered to the model, in OpenAI's shape: {"type": "function", "function": {"name", "description",
"parameters" (a JSON schema)}}. The model's own chat template receives the list as `tools`."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for (OpenAI's shape): the arguments are the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls, answered by the "tool" messages after it
    tool_call_id: str = ""  # a "tool" message: the call it answers
    name: str = ""  # a "tool" message: the tool that answered
    reasoning: str = ""  # an assistant's thinking, kept apart from its content


@dataclass(frozen=True)
class Alternative:
    token_id: int
    text: str
    prob: float  # probability under the final (post-sampling-transform) distribution


@dataclass(frozen=True)
class TokenEvent:
    """One generated token."""

    token_id: int
    text: str  # the printable piece; "" while a UTF-8 sequence is incomplete
    forward_ms: float  # model forward pass that produced the logits for this token
    sample_ms: float  # sampling time for this token
    prob: float  # probability of the chosen token
    top: tuple[Alternative, ...] = ()  # top-5 candidates, most likely first
    index: int = 0  # 0 for the first generated token of the turn
    drafted: bool = False  # a drafter's guess that the target accepted (speculative decoding)


@dataclass(frozen=True)
class TurnStats:
    """What one reply cost; the final event of a turn."""

    prompt_tokens: int  # tokens in the templated prompt for this turn
    reused_tokens: int  # of those, already in the KV cache
    evaluated_tokens: int  # of those, evaluated this turn (prompt_tokens - reused_tokens, after any shift)
    prefill_ms: float
    ttft_ms: float  # from the call to the first token's text
    decode_ms: float
    generated_tokens: int
    stop_reason: str  # one of the STOP_* values
    n_ctx_used: int  # KV cache positions in use after the turn
    n_ctx: int
    context_shifts: int = 0  # how many times old turns were dropped to make room
    dropped_messages: int = 0  # messages left out of the prompt to fit the context
    reply: str = ""  # the reply text as generated (also what the caller should store)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    device: str = ""  # where the model ran, e.g. "cpu" or "cuda:0 (NVIDIA H200), 30/30 layers + output"
    drafter: str = ""  # "lookup" or the draft model's name; "" without speculative decoding
    draft_prefill_ms: float = 0.0  # the draft model's own evaluation of the prompt (after the target's)
    draft_tokens: int = 0  # tokens the drafter proposed this turn
    draft_accepted: int = 0  # of those, accepted by the target
    target_passes: int = 0  # target forward passes while decoding (one per token without a drafter)
    restored_tokens: int = 0  # of reused_tokens, read from a saved KV cache instead of evaluated
    tool_calls: tuple[ToolCall, ...] = ()  # calls parsed out of the reply (then `reply` is the text around them)
    reasoning: str = ""  # the reply's thinking block, when the model's format keeps it apart

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target accepted (0 without drafts)."""
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per target forward pass while decoding (1.0 without a drafter)."""
        steps = self.generated_tokens - 1  # the first token comes from the prefill
        return steps / self.target_passes if self.target_passes and steps > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.evaluated_tokens / (self.prefill_ms / 1000) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes from the prefill logits; decode speed counts the steps after it.
        steps = self.generated_tokens - 1
        return steps / (self.decode_ms / 1000) if self.decode_ms > 0 and steps > 0 else 0.0
