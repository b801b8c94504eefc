"""Conversation slots: a few `ChatSession`s on one model, each keeping the KV cache of the last prompt it ran.

A request takes the slot whose cache it continues (llama-server's rule: the longest common prefix, among slots
whose cache is more than `SIMILARITY` shared with the request), else the least recently used one, so that a
client's next turn finds its own prefix and pays only for its new tokens. Only the inference thread touches
slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.chat import ChatSession, common_prefix

if TYPE_CHECKING:
    from engine import Model

# llama-server's --slot-prompt-similarity: a slot is reused only when this share of its cache is the request's
# prefix; otherwise two conversations that share a system prompt would keep evicting each other.
SIMILARITY = 0.5


@dataclass
class Slot:
    id: int
    chat: ChatSession
    last_used: int = 0  # a tick of the pool's clock; 0 = never
    busy: bool = False
    last_request: str = ""  # the id of the last response it generated
    last_stop: str = ""  # the last turn's stop reason
    last_generated: int = 0  # tokens the last turn generated

    def info(self) -> dict[str, object]:
        return {
            "id": self.id,
            "n_ctx": self.chat.n_ctx,
            "is_processing": self.busy,
            "n_cached": len(self.chat.session.tokens),
            "last_request": self.last_request or None,
            "last_stop_reason": self.last_stop or None,
            "last_generated_tokens": self.last_generated,
        }


@dataclass
class SlotPool:
    slots: list[Slot]
    _clock: itertools.count = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def create(cls, model: Model, n_slots: int) -> SlotPool:
        slots = []
        for i in range(n_slots):
            slots.append(Slot(i, ChatSession(model)))
        return cls(slots)

    def choose(self, prompt: Sequence[int]) -> Slot:
        """The slot for `prompt`: the one whose cache it continues best, else the least recently used."""
        best, best_len = None, 0
        for slot in self.slots:
            cached = slot.chat.session.tokens
            n = common_prefix(cached, prompt)
            if n > best_len and n / len(cached) > SIMILARITY:
                best, best_len = slot, n
        return best or min(self.slots, key=lambda s: s.last_used)

    def touch(self, slot: Slot) -> None:
        slot.last_used = next(self._clock)
