"""Tools in the TUI (Pilot, fake backend scripting the model's calls, the tests' own stdio MCP server):
the tool count, the call's block, approval by key (y, a, n, Esc), Esc mid-loop, failures as one line,
turning a tool off, and the calls kept across resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chatapp.chat_state import ChatState
from chatapp.mcp.config import McpSettings, ServerSpec
from chatapp.mcp.loop import DENIED
from chatapp.store import ConversationStore
from chatapp.tui.widgets.chat_log import AssistantMessage, ToolNote
from chatapp.tui.widgets.status_bar import StatusBar
from chatapp.tui.widgets.tool_call import ApprovalPrompt, ToolCallBlock, ToolsScreen
from engine.events import STOP_CANCELLED, ToolCall
from tests.app.fake_backend import FakeBackend, finished, make_app, send, wait_for

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
TOOLS = McpSettings((ServerSpec("testtools", sys.executable, (SERVER,)),), timeout=20)


def call(name: str, args: dict, id: str = "c1") -> tuple[ToolCall, ...]:
    return (ToolCall(id, name, json.dumps(args)),)


@pytest.fixture
def store(tmp_path: Path):
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    yield store
    store.close()


async def tools_ready(pilot, count: str = "6 tools") -> None:
    await wait_for(pilot, lambda: pilot.app.backend is not None, what="the model")
    status = pilot.app.query_one(StatusBar)
    await wait_for(pilot, lambda: status.tools == count, timeout=60, what=f"{count} in the status line")
    await pilot.pause()


async def asked(pilot) -> ApprovalPrompt:
    await wait_for(pilot, lambda: pilot.app.query(ApprovalPrompt), timeout=20, what="the approval prompt")
    await pilot.pause()
    return pilot.app.query_one(ApprovalPrompt)


def blocks(app) -> list[ToolCallBlock]:
    return list(app.query(ToolCallBlock))


async def test_allow_once_then_always_then_deny_by_key(store):
    backend = FakeBackend([call("add", {"a": 2, "b": 3}), call("add", {"a": 1, "b": 1}, "c2"), "Sum is 5.",
                           call("long_text", {"lines": 9}), "Nine lines.",
                           call("add", {"a": 7, "b": 7}), "Again.",
                           call("long_text", {"lines": 1}), "Denied."])  # fmt: skip
    app = make_app(backend, store=store, mcp=TOOLS)
    async with app.run_test(size=(120, 50)) as pilot:
        await tools_ready(pilot)
        assert "⚙ 6 tools" in str(app.query_one("#status-left").render())
        await send(pilot, "add 2 and 3", wait=False)
        prompt = await asked(pilot)
        assert app.focused is prompt and blocks(app)[0].record.status == "asking"
        await pilot.press("a")  # always: the second add runs unasked
        await finished(pilot)
        assert [b.record.result for b in blocks(app)] == ["5", "2"]
        assert "2 tool rounds, 2 calls" in str(app.query(AssistantMessage).last().query_one(".meta").render())
        await send(pilot, "nine lines", wait=False)
        await asked(pilot)
        await pilot.press("y")
        await finished(pilot)
        long = blocks(app)[-1]
        shown = str(long.render())
        assert "line 6" in shown and "line 7" not in shown and "3 more lines" in shown  # collapsed
        long.focus()
        await pilot.press("enter")
        assert "line 9" in str(long.render())
        await send(pilot, "again", wait=False)
        await finished(pilot)  # add is allowed for the rest of this chat: no prompt
        assert not app.query(ApprovalPrompt) and blocks(app)[-1].record.result == "14"
        await send(pilot, "one line", wait=False)
        await asked(pilot)  # long_text was allowed once only
        await pilot.press("escape")  # Esc on the prompt denies
        await finished(pilot)
        assert blocks(app)[-1].record.status == "denied" and "denied" in str(blocks(app)[-1].render())
        assert [m.content for m in backend.calls[-1] if m.role == "tool"][-1] == DENIED
        conv_id = app.state.conv_id
    # saved: a resumed chat shows the same blocks and sends the same calls
    resumed = make_app(FakeBackend(["ok"]), store=store)
    async with resumed.run_test(size=(120, 50)) as pilot:
        await wait_for(pilot, lambda: resumed.backend is not None)
        await resumed._resume((conv_id, None))
        await pilot.pause()
        assert [b.record.status for b in blocks(resumed)] == ["ok", "ok", "ok", "ok", "denied"]
        assert ChatState.from_stored(store.load(conv_id)).backend_messages() == app.state.backend_messages()


async def test_n_denies_and_the_tool_never_runs():
    backend = FakeBackend([call("crash", {}), "It was denied."])
    app = make_app(backend, mcp=TOOLS)
    async with app.run_test(size=(120, 40)) as pilot:
        await tools_ready(pilot)
        await send(pilot, "crash it", wait=False)
        await asked(pilot)
        await pilot.press("n")
        await finished(pilot)
        assert blocks(app)[0].record.status == "denied"
        # had it run, the server would be gone; it still answers
        assert app.tool_client.call("add", {"a": 1, "b": 2}).text == "3"


async def test_escape_stops_the_loop_while_a_tool_runs():
    backend = FakeBackend([call("hang", {}), "never said"])
    app = make_app(backend, mcp=TOOLS)
    async with app.run_test(size=(120, 40)) as pilot:
        await tools_ready(pilot)
        await send(pilot, "hang", wait=False)
        await asked(pilot)
        await pilot.press("y")
        await wait_for(pilot, lambda: blocks(app)[0].record.status == "running", what="the call to run")
        app.prompt.focus()
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating, timeout=5, what="the stop (well before the 20 s timeout)")
        assert blocks(app)[0].record.status == "stopped"
        assert len(backend.calls) == 1  # the model was not asked again
        assert app.state.turns[-1].stats.stop_reason == STOP_CANCELLED


async def test_escape_while_the_approval_waits_stops_the_reply():
    backend = FakeBackend([call("add", {"a": 1, "b": 2}), "never said"])
    app = make_app(backend, mcp=TOOLS)
    async with app.run_test(size=(120, 40)) as pilot:
        await tools_ready(pilot)
        await send(pilot, "add", wait=False)
        await asked(pilot)
        app.prompt.focus()  # Esc outside the prompt is the app's stop
        await pilot.press("escape")
        await finished(pilot)
        assert not app.query(ApprovalPrompt) and blocks(app)[0].record.status == "stopped"
        assert len(backend.calls) == 1


async def test_failures_are_one_line_each_and_the_chat_goes_on():
    broken = ServerSpec("broken", sys.executable, (SERVER, "--fail-start"))
    settings = McpSettings((*TOOLS.servers, broken), timeout=20, allow=("boom", "picture", "crash", "add"))
    backend = FakeBackend([call("boom", {}), call("picture", {}, "c2"), call("nope", {}, "c3"),
                           call("crash", {}, "c4"), call("add", {"a": 1, "b": 1}, "c5"), "Still here."])  # fmt: skip
    app = make_app(backend, mcp=settings)
    async with app.run_test(size=(120, 60)) as pilot:
        await tools_ready(pilot)
        await wait_for(pilot, lambda: app.query(ToolNote), what="the note about the broken server")
        assert "MCP server 'broken' did not start" in str(app.query_one(ToolNote).render())
        await send(pilot, "try everything")
        lines = [str(b.render()).splitlines()[-1] for b in blocks(app)]
        assert [b.record.status for b in blocks(app)] == ["error"] * 5
        assert "boom raised" in lines[0] and "not text" in lines[1] and "no tool named 'nope'" in lines[2]
        assert "crashing on purpose" in lines[3] and "testtools" in lines[4]
        assert app.state.turns[-1].content == "Still here."


async def test_a_tool_turned_off_is_not_offered():
    backend = FakeBackend(["plain"])
    app = make_app(backend, mcp=TOOLS)
    async with app.run_test(size=(120, 40)) as pilot:
        await tools_ready(pilot)
        app.action_list_tools()
        await pilot.pause()
        assert isinstance(app.screen, ToolsScreen)
        await pilot.press("space", "escape")  # the first tool (add) off
        await tools_ready(pilot, "5 tools (1 off)")
        await send(pilot, "hi")
        offered = {t["function"]["name"] for t in backend.tools_seen[-1]}
        assert "add" not in offered and "long_text" in offered
        await app.action_new_chat()
        await tools_ready(pilot, "6 tools")  # per chat: a new chat offers them all again


async def test_the_tool_list_takes_keys_with_a_tool_already_off():
    """Reopened with one tool off, the list still turns it back on: the screen keeps the ticks in a field of
    its own, not in Widget.disabled (which a non-empty set would make true, disabling the whole screen)."""
    app = make_app(FakeBackend(["plain"]), mcp=TOOLS)
    async with app.run_test(size=(120, 40)) as pilot:
        await tools_ready(pilot)
        for expected in ("5 tools (1 off)", "6 tools"):  # the first tool (add) off, then on again
            app.action_list_tools()
            await pilot.pause()
            assert isinstance(app.screen, ToolsScreen) and not app.screen.disabled
            await pilot.press("space", "escape")
            await tools_ready(pilot, expected)


async def test_on_a_remote_model_the_server_s_call_runs_here_after_approval(tmp_path: Path):
    """`--api-base`: the MCP tools go to the server in `tools`, its streamed tool_calls come back, the app asks,
    runs the call on the MCP server here, and sends the call and its result back with the next request."""
    from chatapp.remote import connect
    from chatapp.tui.app import ChatApp
    from engine.sampling import SamplingSettings
    from tests.app.fake_backend import record_notices
    from tests.app.fake_openai_server import REPLY, fake_server

    with fake_server() as fake:
        fake.modes = ["call-add", "ok"]
        settings = SamplingSettings()
        app = ChatApp(
            lambda progress: connect(fake.url, settings=settings, progress=progress),
            model_name="remote", settings=settings, mcp=TOOLS,
        )  # fmt: skip
        record_notices(app)
        async with app.run_test(size=(120, 50)) as pilot:
            await tools_ready(pilot)
            await send(pilot, "What is 20 + 22?", wait=False)
            await asked(pilot)
            assert blocks(app)[0].record.arguments == '{"a": 20, "b": 22}'  # the pieces, joined
            await pilot.press("y")
            await finished(pilot)
            reply = app.state.turns[-1]
        first, second = fake.bodies
        assert {t["function"]["name"] for t in first["tools"]} >= {"add", "long_text"}
        (record,) = reply.rounds[0].calls
        assert (record.status, record.result, record.server) == ("ok", "42", "testtools")
        call, result = second["messages"][-2:]
        assert call == {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 20, "b": 22}'}}
            ],
        }
        assert result == {"role": "tool", "content": "42", "tool_call_id": "call_7", "name": "add"}
        assert reply.content == "".join(REPLY) and len(reply.rounds) == 1


async def test_a_reply_s_calls_are_kept_on_its_branch(store):
    """Regenerate a reply that called a tool: the new one did not; back on the first, its call block, result and
    the calls sent to the model are there again."""
    backend = FakeBackend([call("add", {"a": 2, "b": 3}), "Sum is 5.", "No tools this time."])
    app = make_app(backend, store=store, mcp=TOOLS)
    async with app.run_test(size=(120, 50)) as pilot:
        await tools_ready(pilot)
        await send(pilot, "add 2 and 3", wait=False)
        await asked(pilot)
        await pilot.press("y")
        await finished(pilot)
        with_call = app.state.backend_messages()
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.generating and app.state.turns[-1].content == "No tools this time.")
        await pilot.pause()
        assert blocks(app) == [] and app.state.turns[-1].rounds == []
        app.query(AssistantMessage).last().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.state.turns[-1].content == "Sum is 5.", what="the first branch")
        await pilot.pause()
        assert [(b.record.name, b.record.result) for b in blocks(app)] == [("add", "5")]
        assert app.state.backend_messages() == with_call
