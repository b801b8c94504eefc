"""Reasoning models' `<think>…</think>` blocks: where the thinking ends and the answer starts.

Qwen3 and the DeepSeek-R1 distills open the block themselves (`<think>` first in the reply), or their template
opens it in the generation prompt, so the reply holds only the closing tag. Either way the text before
`</think>` is thinking. Replies stream token by token, so a tag can arrive in pieces: `pending` holds back
a tail that may be the start of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    thinking: str  # the reasoning, without the tags ("" when there is none)
    answer: str  # what follows it (the whole reply when there is no thinking)
    open: bool  # still inside the thinking block (no closing tag yet)
    pending: int = 0  # characters at the end of `answer` held back: perhaps the start of a tag


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin OPEN or CLOSE."""
    for n in range(min(len(CLOSE), len(text)), 0, -1):
        tail = text[-n:]
        if OPEN.startswith(tail) or CLOSE.startswith(tail):
            return n
    return 0


def split_thinking(text: str, streaming: bool = False) -> Split:
    """`text` (a reply, or its beginning while `streaming`) split into its thinking and its answer."""
    body = text.lstrip()
    if body.startswith(OPEN):
        inner = body[len(OPEN) :]
        thought, closed, answer = inner.partition(CLOSE)
        if not closed:  # still thinking
            return Split(thought.strip("\n"), "", open=True)
        return Split(thought.strip("\n"), answer.lstrip("\n"), open=False)
    if CLOSE in text:  # the template opened the block in the prompt
        thought, _, answer = text.partition(CLOSE)
        return Split(thought.strip("\n"), answer.lstrip("\n"), open=False)
    if streaming and (OPEN.startswith(body) and body):  # "<thi…": a block may be opening
        return Split("", "", open=False, pending=len(text))
    return Split("", text, open=False, pending=_partial_tag(text) if streaming else 0)


def thinking_token_count(pieces: Sequence[str]) -> int:
    """How many of a reply's token texts, in order, belong to its thinking (the closing tag's tokens count as
    thinking); 0 when the reply has none."""
    text = "".join(pieces)
    split = split_thinking(text)
    if not split.thinking and CLOSE not in text:
        return 0
    end = text.find(CLOSE)
    end = len(text) if end < 0 else end + len(CLOSE)
    count = position = 0
    for piece in pieces:
        if position >= end:
            break
        count += 1
        position += len(piece)
    return count
