"""OpenAI's response shapes built from the engine's events: usage, finish reasons, logprobs, streamed text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.events import STOP_CONTEXT, STOP_LENGTH, TurnStats

from .scheduler import Token


def finish_reason(stats: TurnStats) -> str:
    return "length" if stats.stop_reason in (STOP_LENGTH, STOP_CONTEXT) else "stop"


def usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


def timings(stats: TurnStats) -> dict[str, Any]:
    """llama-server's `timings` object."""
    steps = max(stats.generated_tokens - 1, 0)
    return {
        "cache_n": stats.reused_tokens,
        "prompt_n": stats.evaluated_tokens,
        "prompt_ms": stats.prefill_ms,
        "prompt_per_second": stats.prefill_tok_s,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": stats.decode_ms,
        "predicted_per_second": stats.decode_tok_s,
        "predicted_per_token_ms": stats.decode_ms / steps if steps else 0.0,
    }


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0  # -9999: OpenAI's value for "not in the distribution"


def chat_logprob(token: Token, n_top: int) -> dict[str, Any]:
    """One entry of a chat choice's `logprobs.content`."""
    return {
        "token": token.piece,
        "logprob": _logprob(token.event.prob),
        "bytes": list(token.piece.encode("utf-8")),
        "top_logprobs": [
            {"token": alt.text, "logprob": _logprob(alt.prob), "bytes": list(alt.text.encode("utf-8"))}
            for alt in token.event.top[:n_top]
        ],
    }


def completion_logprobs(tokens: Sequence[Token], n_top: int, start: int) -> dict[str, Any]:
    """A completion choice's `logprobs` (the legacy shape); `start` is the text offset of the first token."""
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t.event.text)
    return {
        "tokens": [t.piece for t in tokens],
        "token_logprobs": [_logprob(t.event.prob) for t in tokens],
        "top_logprobs": [{alt.text: _logprob(alt.prob) for alt in t.event.top[:n_top]} for t in tokens],
        "text_offset": offsets,
    }


class HeldText:
    """Streamed text that never shows the start of a stop string before it is known not to be one.

    The engine cuts the reply where a stop string begins, but only once the whole string has appeared; a
    stop string spread over several tokens would otherwise have its first part streamed already.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.text = ""  # everything received
        self.sent = 0  # how much of it has been released

    def push(self, piece: str) -> str:
        """Add a token's text; return what can be sent now."""
        self.text += piece
        end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, reply: str) -> str:
        """The rest of the final reply (the engine's, with any stop string cut off)."""
        rest, self.sent = reply[self.sent :], len(reply)
        return rest

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
