"""The chat as data: turns, their stats and tokens, and the helpers that read them. No widgets here.

The chat service (`chatapp.chat_service`) owns one `ChatState`; widgets render it. A stored reply keeps its
statistics and per-token list in the store's `stats` JSON (`stats_to_dict` / `stats_from_dict`), so the
inspector also works on resumed chats.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from markdown_it import MarkdownIt

from chatapp.store import stats_to_dict as store_stats_to_dict
from engine.events import Alternative, Message, TokenEvent, ToolCall, TurnStats

if TYPE_CHECKING:
    from chatapp.store import Conversation, StoredMessage


@dataclass
class ToolRecord:
    """One tool call in a reply, as shown in the chat and saved with it."""

    id: str
    name: str
    server: str  # "" when no server offers the tool
    arguments: str  # the JSON text the model wrote
    status: str = "asking"  # asking | running | ok | denied | error | stopped
    result: str = ""  # what the model was told: the tool's text, or why there is none
    ms: float = 0.0  # time the tool took


@dataclass
class ToolRound:
    """What the model said before its calls in one round, and the calls."""

    text: str
    calls: list[ToolRecord] = field(default_factory=list)


@dataclass
class Turn:
    """One message of the chat as the UI knows it."""

    role: str  # "user" | "assistant"
    content: str
    msg_id: int | None = None  # row id in the store, once saved
    stats: TurnStats | None = None  # assistant only, once the reply has finished
    tokens: list[TokenEvent] = field(default_factory=list)  # assistant only: the tokens as generated
    error: str | None = None  # assistant only: why generation failed, if it did
    rounds: list[ToolRound] = field(default_factory=list)  # assistant only: tool rounds before `content`
    gen_ms: float = 0.0  # with rounds: generation time of all rounds (prefill to last token)

    @property
    def tool_ms(self) -> float:
        return sum(c.ms for r in self.rounds for c in r.calls)


@dataclass
class ChatState:
    """The conversation on screen."""

    conv_id: int | None = None  # store id; None until the first message is saved (or with no store)
    title: str = ""
    model: str = ""
    system_prompt: str = ""
    turns: list[Turn] = field(default_factory=list)

    @classmethod
    def from_stored(cls, conv: Conversation) -> ChatState:
        """A saved conversation's branch on screen as a chat (a stored system message becomes the prompt)."""
        state = cls(conv_id=conv.id, title=conv.title, model=conv.model, system_prompt=conv.system_prompt)
        for m in conv.messages:
            if m.role == "system":
                state.system_prompt = state.system_prompt or m.content
            else:
                state.turns.append(turn_from_stored(m))
        return state

    def backend_messages(self) -> list[Message]:
        """What `stream_reply` gets: the system prompt (if any) then every turn with text."""
        out = [Message("system", self.system_prompt)] if self.system_prompt.strip() else []
        for t in self.turns:
            for r in t.rounds:
                out.append(Message("assistant", r.text, tuple(ToolCall(c.id, c.name, c.arguments) for c in r.calls)))
                out += [Message("tool", c.result, tool_call_id=c.id, name=c.name) for c in r.calls]
            if t.content or t.role == "user":
                out.append(Message(t.role, t.content))
        return out

    def last(self, role: str) -> tuple[int, Turn] | None:
        """The index and turn of the last message with `role`."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i].role == role:
                return i, self.turns[i]
        return None

    def saved_id_before(self, index: int) -> int | None:
        """The store id of the last saved turn before `index` (None: keep nothing)."""
        for turn in reversed(self.turns[:index]):
            if turn.msg_id is not None:
                return turn.msg_id
        return None


def turn_from_stored(m: StoredMessage) -> Turn:
    stats, tokens, error = stats_from_dict(m.stats)
    rounds, gen_ms = rounds_from_dict(m.stats)
    return Turn(m.role, m.content, m.id, stats, tokens, error, rounds, gen_ms)


# ---- stats <-> JSON -------------------------------------------------------------------------------------


def stats_to_dict(
    stats: TurnStats | None,
    tokens: list[TokenEvent],
    error: str | None = None,
    rounds: list[ToolRound] | None = None,
    gen_ms: float = 0.0,
) -> dict | None:
    """The `stats` saved with a reply: the store's format (TurnStats fields + `tokens`), plus `error`, plus
    the tool rounds (`tool_rounds`: each round's text and calls) and `gen_ms`."""
    if stats is not None:
        data = store_stats_to_dict(stats, tokens)
    elif tokens or error or rounds:
        data = {"tokens": [asdict(t) for t in tokens]}
    else:
        return None
    if error:
        data["error"] = error
    if rounds:
        data["tool_rounds"] = [{"text": r.text, "calls": [asdict(c) for c in r.calls]} for r in rounds]
        data["gen_ms"] = gen_ms
    return data


def rounds_from_dict(data: Any) -> tuple[list[ToolRound], float]:
    """The tool rounds saved by `stats_to_dict` (none for an older or malformed record)."""
    if not isinstance(data, dict) or not isinstance(data.get("tool_rounds"), list):
        return [], 0.0
    try:
        names = {f.name for f in fields(ToolRecord)}
        rounds = [
            ToolRound(str(r["text"]), [ToolRecord(**{k: v for k, v in c.items() if k in names}) for c in r["calls"]])
            for r in data["tool_rounds"]
        ]
        return rounds, float(data.get("gen_ms") or 0.0)
    except (TypeError, ValueError, KeyError, AttributeError):
        return [], 0.0


def stats_from_dict(data: Any) -> tuple[TurnStats | None, list[TokenEvent], str | None]:
    """Inverse of `stats_to_dict`; a malformed part (an older or foreign record) reads as missing."""
    if not isinstance(data, dict):
        return None, [], None
    known = {f.name for f in fields(TurnStats)}
    stats = None
    if "stop_reason" in data:
        try:
            values = {k: v for k, v in data.items() if k in known}
            values["warnings"] = tuple(values.get("warnings") or ())
            values["tool_calls"] = tuple(ToolCall(**c) for c in values.get("tool_calls") or ())
            stats = TurnStats(**values)
        except (TypeError, ValueError):
            stats = None
    tokens: list[TokenEvent] = []
    try:
        for i, t in enumerate(data.get("tokens") or []):
            top = tuple(Alternative(int(a["token_id"]), str(a["text"]), float(a["prob"])) for a in t.get("top", ()))
            tokens.append(
                TokenEvent(
                    token_id=int(t["token_id"]),
                    text=str(t["text"]),
                    forward_ms=float(t["forward_ms"]),
                    sample_ms=float(t.get("sample_ms", 0.0)),
                    prob=float(t["prob"]),
                    top=top,
                    index=int(t.get("index", i)),
                    drafted=bool(t.get("drafted", False)),
                )
            )
    except (TypeError, ValueError, KeyError, AttributeError):
        tokens = []
    error = data.get("error")
    return stats, tokens, error if isinstance(error, str) else None


# ---- live numbers while a reply streams -----------------------------------------------------------------


@dataclass
class LiveMetrics:
    """Speed of the reply in progress, from the token events' own timings."""

    tokens: int = 0
    ttft_ms: float | None = None  # wall time to the first token, measured by the worker
    decode_ms: float = 0.0  # forward + sampling time of the tokens after the first

    def add(self, event: TokenEvent, elapsed_ms: float) -> None:
        self.tokens += 1
        if self.ttft_ms is None:
            self.ttft_ms = elapsed_ms
        else:
            self.decode_ms += event.forward_ms + event.sample_ms

    @property
    def tok_s(self) -> float:
        steps = self.tokens - 1
        return steps / (self.decode_ms / 1000.0) if steps > 0 and self.decode_ms > 0 else 0.0


# ---- formatting -----------------------------------------------------------------------------------------


def fmt_ms(ms: float) -> str:
    """230 ms, 1.24 s."""
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def fmt_rate(tok_s: float) -> str:
    return f"{tok_s:,.1f}" if tok_s < 1000 else f"{tok_s:,.0f}"


def stats_line(stats: TurnStats) -> str:
    """The line under a finished reply."""
    parts = [
        f"prefill {fmt_rate(stats.prefill_tok_s)} tok/s",
        f"decode {fmt_rate(stats.decode_tok_s)} tok/s",
        f"TTFT {fmt_ms(stats.ttft_ms)}",
        f"{stats.generated_tokens} tokens",
        f"stop: {stats.stop_reason}",
    ]
    if stats.drafter:
        parts.insert(2, f"{stats.drafter}: {stats.acceptance_rate:.0%} accepted, {stats.tokens_per_pass:.2f}/pass")
    if stats.restored_tokens:
        parts.append(f"{stats.restored_tokens:,} tokens from the saved cache")
    if stats.device:
        parts.append(stats.device)
    if stats.dropped_messages:
        parts.append(f"{stats.dropped_messages} old message(s) left out to fit the context")
    elif stats.context_shifts:
        parts.append(f"context shifted {stats.context_shifts}×")
    return " · ".join(parts)


def tools_line(turn: Turn) -> str:
    """Under a reply that used tools: its rounds, and the tools' time apart from generation's."""
    if not turn.rounds:
        return ""
    calls = sum(len(r.calls) for r in turn.rounds)
    rounds = len(turn.rounds)
    return (f"{rounds} tool round{'s' if rounds != 1 else ''}, {calls} call{'s' if calls != 1 else ''} · "
            f"tools {fmt_ms(turn.tool_ms)} · generation {fmt_ms(turn.gen_ms)}")  # fmt: skip


def decode_latencies(tokens: list[TokenEvent]) -> list[float]:
    """Per-token decode time (forward + sampling) of every token after the first (which came from prefill)."""
    return [t.forward_ms + t.sample_ms for t in tokens[1:]]


def latency_summary(values: list[float]) -> str:
    if not values:
        return "no decode steps"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return (
        f"median {statistics.median(ordered):.1f} ms · p95 {p95:.1f} ms · "
        f"min {ordered[0]:.1f} ms · max {ordered[-1]:.1f} ms"
    )


# ---- markdown helpers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeBlock:
    language: str
    code: str

    @property
    def label(self) -> str:
        lines = self.code.count("\n") + (0 if self.code.endswith("\n") else 1)
        return f"{self.language or 'text'}, {lines} line{'s' if lines != 1 else ''}"


def code_blocks(markdown: str) -> list[CodeBlock]:
    """The fenced and indented code blocks of a reply, in order."""
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [
        CodeBlock((t.info or "").strip().split(" ")[0], t.content) for t in tokens if t.type in ("fence", "code_block")
    ]
