"""The one Markdown exporter: a chat, saved or not, as a readable transcript that keeps its branch tree.

The branch on screen comes first, one section per message with the reply's stats line under it (the same line
the chat shows); then every other branch from the message where it leaves the one above.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chatapp.chat_state import ChatState, Turn, stats_line, tools_line, turn_from_stored


def transcript(state: ChatState, branches: Sequence[Sequence[Turn]] = (), started: float | None = None) -> str:
    """`state` as Markdown, then each of `branches` (root-to-leaf paths of the other branches)."""
    out = [f"# {' '.join(state.title.split()) or 'Untitled'}", "", f"- Model: `{state.model}`"]
    if started:
        out.append(f"- Started: {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}")
    out.append("")
    if state.system_prompt.strip():
        out += ["## System prompt", "", state.system_prompt.strip(), ""]
    for turn in state.turns:
        out += _section(turn)
    shown = [t.msg_id for t in state.turns]
    for n, path in enumerate(branches, start=1):
        fork = next(i for i, t in enumerate(path) if i >= len(shown) or t.msg_id != shown[i])
        out += [f"## Branch {n}, from message {fork + 1}", ""]
        for turn in path[fork:]:
            out += _section(turn, "###")
    return "\n".join(out)


def _section(turn: Turn, level: str = "##") -> list[str]:
    lines = [f"{level} {turn.role.capitalize()}", ""]
    for r in turn.rounds:
        lines += [r.text.strip(), ""] if r.text.strip() else []
        for call in r.calls:
            where = f" on `{call.server}`" if call.server else ""
            lines += [f"**Tool call** `{call.name}`{where} ({call.status}):", "", "```json",
                      pretty_arguments(call.arguments), "```", "", "Result:", "", _fence(call.result), ""]  # fmt: skip
    lines += [turn.content.strip(), ""]
    if turn.role == "assistant" and turn.stats is not None:
        lines += [f"*{stats_line(turn.stats)}*", ""]
    if turn.role == "assistant" and turn.rounds:
        lines += [f"*{tools_line(turn)}*", ""]
    return lines


def pretty_arguments(arguments: str) -> str:
    """The model's arguments as indented JSON (as written, when they are not JSON)."""
    try:
        return json.dumps(json.loads(arguments or "{}"), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


def _fence(text: str) -> str:
    """`text` in a code fence longer than any backtick run inside it (a tool's text cannot end the fence)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def stored_transcript(store: Any, conv_id: int) -> str:
    """A saved conversation (`chatapp.store.ConversationStore`) as Markdown, with all of its branches."""
    conv = store.load(conv_id)
    state = ChatState.from_stored(conv)
    others = store.other_branches(conv_id, {m.id for m in conv.messages})
    branches = [[turn_from_stored(m) for m in path if m.role != "system"] for path in others]
    return transcript(state, branches, conv.created)


def write_export(directory: Path, conv_id: int | None, title: str, text: str) -> Path:
    """Write an exported chat as `chat-<id>-<title-slug>.md` in `directory` (made if missing); the path."""
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "chat"
    path = Path(directory) / f"chat-{conv_id if conv_id is not None else 'unsaved'}-{slug}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
