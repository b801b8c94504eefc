"""The chat service without a screen: sending, a reply from start to stop, saving, branches, export.

Everything here runs on the test's thread against the scripted fake backend and a real store in tmp_path;
`run_reply` plays the part of the TUI's inference worker.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chatapp.chat_service import ActiveReply, ChatService, Refused, ReplyError, generate_reply
from chatapp.recorder import Recorder
from chatapp.store import ConversationStore
from engine.events import STOP_CANCELLED, STOP_EOS
from engine.sampling import SamplingSettings
from tests.app.fake_backend import FakeBackend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path):
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    yield store
    store.close()


def service_on(backend: FakeBackend | None, store: ConversationStore | None = None) -> ChatService:
    reports: list[str] = []
    service = ChatService(Recorder(store, reports.append), model_name="fake", settings=SamplingSettings())
    service.reports = reports  # type: ignore[attr-defined]
    if backend is not None:
        service.model_ready(backend)
    return service


def run_reply(service: ChatService, active: ActiveReply) -> None:
    """What the TUI's worker and message handlers do, on one thread."""
    assert service.backend is not None
    try:
        stats = generate_reply(
            service.backend, active.messages, lambda e, ms: service.token(active.turn, e, ms), active.stop
        )
    except ReplyError as exc:
        service.failed(active.turn, str(exc))
    else:
        service.finished(active.turn, stats)


def say(service: ChatService, text: str) -> ActiveReply:
    service.send(text)
    active = service.start_reply()
    run_reply(service, active)
    return active


def saved(store: ConversationStore, conv_id: int) -> list[str]:
    return [m.content for m in store.load(conv_id).messages]


def test_a_reply_is_streamed_saved_and_its_stats_kept(store) -> None:
    service = service_on(FakeBackend(["Paris is the capital."]), store)
    reply = service.ask("Capital of France?", on_text=(pieces := []).append)
    assert "".join(pieces) == "Paris is the capital." == reply.content
    assert reply.stats is not None and reply.stats.stop_reason == STOP_EOS and service.last_stats() is reply.stats
    assert not service.generating and service.state.title == "Capital of France?"
    conv = service.state.conv_id
    assert conv is not None and saved(store, conv) == ["Capital of France?", "Paris is the capital."]
    assert store.load(conv).messages[1].stats["generated_tokens"] == reply.stats.generated_tokens


def test_refusals_say_why() -> None:
    service = service_on(None)
    with pytest.raises(Refused, match="still loading"):
        service.send("hi")
    assert service.model_failed("bad.gguf: not a GGUF file") is None
    with pytest.raises(Refused, match="No model: bad.gguf") as refused:
        service.send("hi")
    assert refused.value.severity == "error" and service.state.turns == []

    service = service_on(FakeBackend(["a b"]))
    service.send("one")
    service.start_reply()
    with pytest.raises(Refused, match="A reply is being generated"):
        service.send("two")
    with pytest.raises(Refused, match="Esc stops it first"):
        service.other_version(service.state.turns[0], 1)


def test_stop_before_the_stream_starts_still_stops_it() -> None:
    backend = FakeBackend(["one two three four five six"])
    service = service_on(backend)
    service.send("count")
    active = service.start_reply()
    assert service.stop() and active.stop.is_set() and backend.cancel_calls == 1
    run_reply(service, active)  # the fake forgets a cancel made before stream_reply; the next token repeats it
    assert active.reply.stats.stop_reason == STOP_CANCELLED and backend.cancel_calls == 2
    assert active.reply.content == "one" and not service.generating
    assert service.stop() is False  # nothing left to stop


def test_a_failed_reply_keeps_its_text_and_error(store) -> None:
    service = service_on(FakeBackend(["a b c d"], fail_calls=[1], fail_after=2), store)
    active = say(service, "go")
    assert active.reply.error == "RuntimeError: scripted failure in the fake engine" and active.reply.content == "a b"
    assert saved(store, service.state.conv_id) == ["go", "a b"]


def test_leaving_a_chat_mid_reply_saves_the_reply_in_the_chat_it_belongs_to(store) -> None:
    service = service_on(FakeBackend(["first reply here"]), store)
    service.send("first chat")
    active = service.start_reply()
    first = service.state.conv_id
    service.new_chat()
    assert not active.shown and active.stop.is_set() and service.state.turns == []
    run_reply(service, active)  # the worker's last reports arrive after the switch
    assert saved(store, first)[0] == "first chat" and len(saved(store, first)) == 2
    assert service.state.turns == [] and not service.generating


def test_quitting_mid_reply_saves_what_came(store) -> None:
    service = service_on(FakeBackend(["one two three"]), store)
    service.send("q")
    active = service.start_reply()
    event = next(e for e in FakeBackend(["one two"]).stream_reply([]))
    service.token(active.turn, event, 1.0)
    service.shutdown()
    assert saved(store, service.state.conv_id) == ["q", "one"]


def test_regenerate_and_edit_start_branches_and_the_old_ones_stay(store) -> None:
    service = service_on(FakeBackend(["A1", "A2", "B"]), store)
    say(service, "Q")
    doomed, active = service.regenerate(0)
    assert [t.content for t in doomed] == ["A1"]
    run_reply(service, active)
    conv = service.state.conv_id
    assert saved(store, conv) == ["Q", "A2"]
    marks = [mark for _, mark in service.branch_marks()]
    assert marks == ["", "‹ 2/2 ›"]

    state = service.other_version(service.state.turns[1], -1)
    assert state is service.state and [t.content for t in state.turns] == ["Q", "A1"]

    doomed, turn = service.edit(0, "Q2")
    assert [t.content for t in doomed] == ["Q", "A1"] and turn.content == "Q2"
    run_reply(service, service.start_reply())
    assert [t.content for t in service.state.turns] == ["Q2", "B"]
    assert [m for _, m in service.branch_marks()] == ["‹ 2/2 ›", ""]
    with pytest.raises(Refused, match="no other version"):
        service.other_version(service.state.turns[1], 1)


def test_export_keeps_the_tree_or_writes_the_chat_as_it_stands(store, tmp_path: Path) -> None:
    service = service_on(FakeBackend(["A1", "A2"]), store)
    with pytest.raises(Refused, match="Nothing to export"):
        service.export(tmp_path)
    say(service, "Q")
    run_reply(service, service.regenerate(0)[1])
    text = service.export(tmp_path / "out").read_text()
    assert text.index("A2") < text.index("## Branch 1, from message 2") < text.index("A1")
    assert "*prefill" in text  # the chat's stats line under each finished reply

    unsaved = service_on(FakeBackend(["fine"]))
    say(unsaved, "no history")
    path = unsaved.export(tmp_path)
    assert path.name == "chat-unsaved-no-history.md" and "fine" in path.read_text()


def test_resume_delete_and_system_prompt(store) -> None:
    service = service_on(FakeBackend(["r1"]), store)
    say(service, "m1")
    conv = service.state.conv_id
    assert service.set_system_prompt("Be brief.") and not service.set_system_prompt("Be brief.")
    service.new_chat()
    assert service.state.system_prompt == "Be brief." and service.state.turns == []
    state = service.resume(conv)
    assert [t.content for t in state.turns] == ["m1", "r1"] and state.turns[1].stats is not None
    assert store.load(conv).system_prompt == "Be brief."
    service.delete(conv)
    assert service.state.conv_id is None and all(t.msg_id is None for t in service.state.turns)
    assert service.resume(conv) is None and service.reports  # the store said the chat is gone


def test_settings_reach_the_backend_and_warnings_are_told_once() -> None:
    backend = FakeBackend(warnings=["template fell back to ChatML"])
    service = service_on(backend)
    assert service.apply_settings(SamplingSettings(temperature=0.0)) is None
    assert backend.settings.temperature == 0.0 == service.settings.temperature
    assert service.new_warnings(["slow disk"]) == ["slow disk", "template fell back to ChatML"]
    assert service.new_warnings(["slow disk"]) == []


def test_a_model_switch_keeps_the_chat_and_a_failed_one_keeps_the_old_model() -> None:
    first = FakeBackend(["x"])
    service = service_on(first)
    say(service, "hello")
    service.begin_switch("other.gguf")
    with pytest.raises(Refused, match="Loading other.gguf"):
        service.send("now")
    assert service.model_failed("other.gguf: file not found") == "other.gguf"
    assert service.backend is first and service.load_error is None
    second = FakeBackend(["y"])
    second.model_name = "second-model"
    service.begin_switch("second")
    assert service.model_ready(second) == "second"
    assert service.model_name == "second-model" == service.state.model and len(service.state.turns) == 2


def test_the_service_runs_without_textual() -> None:
    code = "import sys, chatapp.chat_service, chatapp.cli; assert 'textual' not in sys.modules, 'textual imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
