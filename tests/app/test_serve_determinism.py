"""With `--deterministic`, a greedy reply from `chatapp serve` does not depend on what the slot's cache held
(SmolLM2, one slot).

The same question at temperature 0, before and after an unrelated chat, gives the same reply and the same
log-probs: the second time, the slot keeps the prompt's shared start (the chat template's opening) from the
unrelated chat and computes the rest in a shorter pass, which before gave log-probs ~0.01 apart and, at this
near-tie, another reply ("they're also incredibly quiet" -> "they're actually incredibly quiet").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.test_serve import Server, _start

QUESTION = "Say hello, and tell me one fact about owls."


@pytest.fixture(scope="module")
def one_slot(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("serve-determinism"), smollm2_path, "-np", "1", "--deterministic")


def _ask(server: Server, text: str) -> tuple[str, list[float]]:
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=60,
        logprobs=True,
    )
    choice = reply.choices[0]
    return choice.message.content or "", [t.logprob for t in choice.logprobs.content]


def test_the_same_question_after_another_chat_gets_the_same_reply(one_slot: Server) -> None:
    first, first_logprobs = _ask(one_slot, QUESTION)
    other, _ = _ask(one_slot, "Write a haiku about the sea in winter.")
    again, again_logprobs = _ask(one_slot, QUESTION)
    assert first.strip() and other.strip()
    assert again == first
    assert again_logprobs == first_logprobs  # bit for bit, not merely the same argmax
