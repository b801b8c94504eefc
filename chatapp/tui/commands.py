"""The chat's entries in the command palette (ctrl+p), each naming its key."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from textual.app import SystemCommand

from chatapp.chat_state import code_blocks

if TYPE_CHECKING:
    from chatapp.tui.app import ChatApp


def chat_commands(app: ChatApp) -> Iterator[SystemCommand]:
    yield SystemCommand("New chat", "Start an empty conversation (ctrl+n)", app.action_new_chat)
    yield SystemCommand("Stop generating", "Stop the reply in progress; keep what came (Esc)", app.action_stop)
    yield SystemCommand("Regenerate reply", "Replace the last reply with a new one (ctrl+r)", app.action_regenerate)
    yield SystemCommand("Edit last message", "Change your last message and resend it (ctrl+g)", app.action_edit_last)
    yield SystemCommand("Copy reply", "Copy the selected or last reply (ctrl+o)", app.action_copy_reply)
    turn = app.target_reply()
    for n, block in enumerate(code_blocks(turn.content) if turn else [], 1):
        yield SystemCommand(f"Copy code block {n}", f"{block.label}, from the last reply", _copier(app, n))
    yield SystemCommand("Sampling settings", "Show or hide the sampling panel (F2)", app.action_toggle_sampling)
    yield SystemCommand("Inspect reply", "Tokens, probabilities and timings of a reply (F3)", app.action_inspect)
    yield SystemCommand("Saved chats", "List, resume, export or delete saved chats (ctrl+l)", app.action_conversations)
    yield SystemCommand("System prompt", "Edit the system prompt (ctrl+t)", app.action_system_prompt)
    yield SystemCommand("Switch model", "Load another model; the chat carries over (F10)", app.action_switch_model)
    yield SystemCommand("Attach a file", "Put a text file into the message (F9, or /read PATH)", app.action_attach)
    yield SystemCommand("Tools", "The MCP tools: turn one off or on for this chat", app.action_list_tools)
    yield SystemCommand("Reply format", "Hold replies to a JSON schema or grammar (/format)", app.action_reply_format)
    if app.service.reply_format is not None:
        yield SystemCommand("Clear reply format", "Replies are free text again (/format off)", app.clear_reply_format)
    yield SystemCommand("Start MCP servers", "Start the configured servers not running", app.action_start_tools)
    yield SystemCommand("Export chat as Markdown", f"Write it into {app.export_dir} (F8)", app.action_export)


def _copier(app: ChatApp, n: int) -> Callable[[], None]:
    return lambda: app.action_copy_code(n)
