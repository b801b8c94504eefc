"""The app end to end on the real engine: SmolLM2-135M through ChatSession, driven by Pilot.

Slow (loads the model; the first run also compiles the kernels), so it is marked `slow`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.widgets import DataTable

from chatapp.store import ConversationStore
from chatapp.tui.app import ChatApp
from chatapp.tui.widgets.chat_log import AssistantMessage
from chatapp.tui.widgets.inspector import InspectorScreen
from engine.events import STOP_EOS, STOP_LENGTH
from engine.sampling import SamplingSettings
from tests.app.fake_backend import finished, record_notices, send, wait_for

pytestmark = pytest.mark.slow


async def test_real_model_chat_end_to_end(smollm2_path: Path, tmp_path: Path):
    from engine import load_model
    from engine.chat import ChatSession

    progress_lines: list[str] = []

    def factory(progress):
        def say(line: str) -> None:
            progress_lines.append(line)
            progress(line)

        return ChatSession(load_model(smollm2_path, n_ctx=512, progress=say))

    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    greedy = SamplingSettings(temperature=0.0, max_tokens=8)
    app = ChatApp(factory, model_name="smollm2-135m-instruct", settings=greedy, store=store)
    record_notices(app)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None or app.service.load_error, timeout=600)
            assert app.backend is not None, app.service.load_error
            assert app.backend.settings == greedy
            await send(pilot, "What is the capital of France?", wait=False)
            await wait_for(pilot, lambda: not app.generating, timeout=300, what="the real reply")
            await finished(pilot)

            reply = app.state.turns[-1]
            assert reply.error is None and reply.content.strip()
            n = len(reply.tokens)
            assert reply.stats.generated_tokens == n and 1 <= n <= 8
            assert reply.stats.stop_reason in (STOP_EOS, STOP_LENGTH)
            assert app.query_one(AssistantMessage).body.source == reply.content
            saved = store.load(app.state.conv_id).messages[-1]
            assert saved.content == reply.content and saved.stats["generated_tokens"] == n

            await pilot.press("f3")
            assert isinstance(app.screen, InspectorScreen)
            assert app.screen.query_one(DataTable).row_count == n

            # Regenerating reuses the prompt from the KV cache. (Not compared token for token: the cached
            # path may break a near-tie differently from a fresh prefill.)
            await pilot.press("escape", "ctrl+r")
            await wait_for(pilot, lambda: len(app.state.turns) == 2 and app.state.turns[-1].stats, timeout=300)
            again = app.state.turns[-1]
            assert again.error is None and again.content.strip()
            assert again.stats.reused_tokens > 0
            assert [r.body.source for r in app.query(AssistantMessage)] == [again.content]
    finally:
        store.close()
    assert progress_lines, "the loader reported no progress"


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


async def test_a_reply_format_holds_the_real_models_replies(smollm2_model, tmp_path: Path):
    """/format json FILE holds the next reply to the schema, /format off frees it, and a mistake is one clear
    line that loses nothing typed: a missing file stays in the box, a bad schema in the reopened dialog."""
    import jsonschema
    from textual.widgets import Input

    from chatapp.tui.widgets.reply_format import ReplyFormatScreen
    from engine.chat import ChatSession

    (tmp_path / "city.json").write_text(json.dumps(CITY))
    settings = SamplingSettings(temperature=0.0, max_tokens=24)
    app = ChatApp(lambda progress: ChatSession(smollm2_model), model_name="smollm2", settings=settings)
    record_notices(app)
    status = lambda: str(app.query_one("#status-left").render())  # noqa: E731
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, timeout=300, what="the model")
        missing = f"/format json {tmp_path / 'nowhere.json'}"
        await send(pilot, missing, wait=False)
        assert "cannot read" in app.notices[-1] and app.prompt.text == missing and not app.state.turns

        await send(pilot, f"/format json {tmp_path / 'city.json'}", wait=False)
        assert app.prompt.text == "" and "json schema" in status()
        await send(pilot, "What is the capital of France?")
        reply = app.state.turns[-1]
        assert reply.error is None, reply.error
        jsonschema.validate(json.loads(reply.content), CITY)

        await send(pilot, "/format off", wait=False)
        assert "json schema" not in status()
        await send(pilot, "Say hello to me.")
        # Free again: the reply is not held to the schema. Not "not JSON": after a JSON turn the model may answer
        # in JSON of its own shape (SmolLM2 on a Zen 4 answered {"name": "Liam"}; on a Xeon, prose).
        free = app.state.turns[-1].content
        with pytest.raises((ValueError, jsonschema.ValidationError)):  # JSONDecodeError is a ValueError
            jsonschema.validate(json.loads(free), CITY)

        app.prompt.set_text("a draft")
        app.action_reply_format()
        await pilot.pause()
        bad = 'json {"type": "objekt"}'
        app.screen.query_one(Input).value = bad
        await pilot.press("enter")
        await pilot.pause()
        assert "objekt" in app.notices[-1] and app.notices[-1].startswith("Reply format not set")
        assert isinstance(app.screen, ReplyFormatScreen) and app.screen.query_one(Input).value == bad
        await pilot.press("escape")
        assert app.service.reply_format is None and app.prompt.text == "a draft"


def test_the_app_flag_reaches_the_app_and_a_bad_one_stops_in_one_line(isolated_dirs, tmp_path, monkeypatch, capsys):
    """`chatapp -j FILE` hands the app its starting format; `--grammar MISSING` exits 2 naming the flag."""
    import chatapp.tui.launch as tui_launch
    from chatapp.cli import main
    from engine.events import GrammarSpec

    (tmp_path / "city.json").write_text(json.dumps(CITY))
    started: list[dict] = []
    monkeypatch.setattr(tui_launch, "run_app", lambda factory, **kw: started.append(kw))
    assert main(["-j", str(tmp_path / "city.json")]) == 0
    assert started[0]["reply_format"] == GrammarSpec("json_schema", json.dumps(CITY))
    assert main(["--grammar", str(tmp_path / "nowhere.gbnf")]) == 2 and len(started) == 1
    assert "--grammar: cannot read" in capsys.readouterr().err


def test_a_starting_format_the_model_cannot_compile_is_cleared_with_a_reason(smollm2_model):
    from chatapp.chat_service import ChatService
    from chatapp.recorder import Recorder
    from engine.chat import ChatSession
    from engine.events import GrammarSpec

    bad = GrammarSpec("gbnf", 'root ::= "a" | nowhere')
    service = ChatService(Recorder(None, print), model_name="m", settings=SamplingSettings(), reply_format=bad)
    service.model_ready(ChatSession(smollm2_model))
    problem = service.check_reply_format()
    assert problem is not None and "nowhere" in problem and service.reply_format is None
