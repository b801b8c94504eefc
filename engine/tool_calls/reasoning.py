"""A reply's `<think>…</think>` block, kept apart from its answer (llama-server's and DeepSeek's
`reasoning_content`). The block opens the reply, or the prompt opened it (`opened`: the template's generation
prompt ends with `<think>`, as DeepSeek-R1 distills' does)."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(generation_prompt: str) -> bool:
    return generation_prompt.rstrip().endswith(OPEN)


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a finished reply; ("", text) when it has no thinking block."""
    body = text.lstrip()
    if body.startswith(OPEN):
        body = body[len(OPEN) :]
    elif not opened:
        return "", text
    i = body.find(CLOSE)
    if i < 0:  # stopped while thinking
        return body.strip(), ""
    return body[:i].strip(), body[i + len(CLOSE) :].lstrip()


class ReasoningStream:
    """Splits streamed text into reasoning and answer pieces; a tag split over tokens is held until whole."""

    def __init__(self, opened: bool = False) -> None:
        self.text = ""
        self.mode = "thinking" if opened else "start"  # start -> thinking -> answer, or start -> answer
        self.at = 0  # where the current mode's text begins
        self.sent = 0  # how much of it was sent
        self.strip = False  # the answer after a thinking block: its leading whitespace is still to drop

    def push(self, piece: str) -> tuple[str, str]:
        """(reasoning, answer) text to send now for `piece`."""
        self.text += piece
        reasoning = ""
        if self.mode == "start":
            head = self.text.lstrip()
            if head.startswith(OPEN):
                self.mode, self.at = "thinking", len(self.text) - len(head) + len(OPEN)
            elif OPEN.startswith(head):  # maybe the tag, still arriving
                return "", ""
            else:
                self.mode = "answer"
        if self.mode == "thinking":
            i = self.text.find(CLOSE, self.at)
            if i < 0:
                end = len(self.text) - _partial_tail(self.text, CLOSE)
                reasoning, self.sent = self.text[self.at + self.sent : end], max(self.sent, end - self.at)
                return reasoning, ""
            reasoning = self.text[self.at + self.sent : i]
            self.mode, self.at, self.sent, self.strip = "answer", i + len(CLOSE), 0, True
        rest = self.text[self.at :]
        if self.strip:  # as split_reasoning, whether it comes with the tag, alone, or with the first words
            skipped = len(rest) - len(rest.lstrip())
            self.at, rest = self.at + skipped, rest[skipped:]
            if not rest:
                return reasoning, ""
            self.strip = False
        answer, self.sent = rest[self.sent :], len(rest)
        return reasoning, answer


def _partial_tail(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
