"""Splitting a streamed reply into content and tool-call deltas, OpenAI's way: a call's name once it is whole,
then its arguments as they are generated. The final reply is parsed again when it ends, and the deltas are
reconciled with that parse, so what a client assembles is what a non-streamed answer holds."""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import CallFormat, Parsed, hermes, parse_reply
from .scan import _ARGS, _NAME, new_id, value_end

_MAYBE_FENCE = re.compile(r'(?:j(?:s(?:on?)?)?)?\s*(?:\{\s*(?:"(?:n(?:a(?:me?)?)?)?)?)?\Z')


@dataclass(frozen=True)
class Delta:
    content: str = ""
    index: int = -1  # >= 0: a call's delta
    id: str = ""  # set on a call's first delta
    name: str = ""  # set on a call's first delta
    arguments: str = ""


class CallStream:
    def __init__(self, fmt: CallFormat, prefix: str = "") -> None:
        self.fmt = fmt
        self.text = prefix  # a forced call's opening, written into the prompt, belongs to the reply
        self.sent = 0  # content sent (an index into text)
        self.in_calls = False
        self.pos = 0  # where the search for the next call's parts resumes
        self.ids: list[str] = []
        self.args: list[str] = []  # arguments sent per call
        self.args_at: int | None = None  # the current call's arguments value start; None before it is seen
        self.open = False  # a call has started and its arguments are not finished

    def push(self, piece: str) -> list[Delta]:
        self.text += piece
        out: list[Delta] = []
        if not self.in_calls:
            at = self._trigger()
            if at is None:
                end = len(self.text) - self._held()
                if end > self.sent:
                    out.append(Delta(content=self.text[self.sent : end]))
                    self.sent = end
                return out
            if at > self.sent:
                out.append(Delta(content=self.text[self.sent : at]))
            self.sent, self.in_calls, self.pos = at, True, at
        while True:
            if not self.open:
                m = _NAME.search(self.text, self.pos)
                if m is None:
                    break
                self.ids.append(new_id())
                self.args.append("")
                self.open, self.args_at, self.pos = True, None, m.end()
                out.append(Delta(index=len(self.ids) - 1, id=self.ids[-1], name=m.group(1)))
            if self.args_at is None:
                m = _ARGS.search(self.text, self.pos)
                if m is None or m.end() >= len(self.text):
                    break
                self.args_at = m.end()
            value_at = value_end(self.text, self.args_at)
            if value_at is None and not self.text.startswith("{", self.args_at):
                break  # only an object is streamed as it grows
            upto = value_at if value_at is not None else len(self.text)
            new = self.text[self.args_at + len(self.args[-1]) : upto]
            if new:
                self.args[-1] += new
                out.append(Delta(index=len(self.ids) - 1, arguments=new))
            if value_at is None:
                break
            self.open, self.pos = False, value_at
        return out

    def finish(self, reply: str) -> tuple[list[Delta], Parsed]:
        """The deltas still owed once the reply is whole (`reply`: its full text, any forced prefix included)."""
        parsed = parse_reply(reply, self.fmt, tuple(self.ids))
        out: list[Delta] = []
        if not parsed.calls:  # no call after all (or a malformed one): what was held back is content
            if len(reply) > self.sent:
                out.append(Delta(content=reply[self.sent :]))
            return out, parsed
        shown = reply[: self.sent].strip()
        if parsed.content.startswith(shown) and len(parsed.content) > len(shown):
            out.append(Delta(content=parsed.content[len(shown) :]))
        for i, call in enumerate(parsed.calls):
            if i >= len(self.ids):
                out.append(Delta(index=i, id=call.id, name=call.name))
                out.append(Delta(index=i, arguments=call.arguments))
            elif call.arguments.startswith(self.args[i]) and len(call.arguments) > len(self.args[i]):
                out.append(Delta(index=i, arguments=call.arguments[len(self.args[i]) :]))
        return out, parsed

    def _trigger(self) -> int | None:
        found = [i for t in self.fmt.triggers if (i := self.text.find(t)) >= 0]
        if self.fmt.fenced and (m := hermes.FENCE.search(self.text)):
            found.append(m.start())
        head = len(self.text) - len(self.text.lstrip())
        if any(self.text.startswith(t, head) for t in self.fmt.at_start):
            found.append(head)
        return min(found) if found else None

    def _held(self) -> int:
        """How much of the text's tail might still become a trigger."""
        if not self.text.strip():
            return len(self.text) - self.sent if self.fmt.at_start else 0
        longest = 0
        for t in self.fmt.triggers:
            for n in range(min(len(t) - 1, len(self.text)), longest, -1):
                if self.text.endswith(t[:n]):
                    longest = n
                    break
        if self.fmt.fenced and self.text.endswith("`"):
            longest = max(longest, min(2, len(self.text) - len(self.text.rstrip("`"))))
        if self.fmt.fenced and (i := self.text.rfind("```")) >= 0 and _MAYBE_FENCE.match(self.text, i + 3):
            longest = max(longest, len(self.text) - i)  # maybe a fenced call, still arriving
        return longest
