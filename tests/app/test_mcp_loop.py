"""The tool loop outside the UI: real MCP servers over stdio (the tests' own `mcp_test_server.py`, written with
the `mcp` SDK, and `mcp-server-time` from PyPI), the fake backend scripting the model's calls, the chat service
saving and exporting what happened."""

from __future__ import annotations

import io
import json
import shutil
import sys
import threading
from pathlib import Path

import pytest

from chatapp.chat_service import ChatService
from chatapp.chat_state import ChatState
from chatapp.export import stored_transcript
from chatapp.mcp.client import McpClient
from chatapp.mcp.config import McpConfigError, McpSettings, ServerSpec, read_mcp_json
from chatapp.mcp.loop import DENIED, ToolChat
from chatapp.mcp.terminal import TerminalTools
from chatapp.recorder import Recorder
from chatapp.settings import ConfigError, load_settings
from chatapp.store import ConversationStore
from engine.events import ToolCall
from tests.app.fake_backend import FakeBackend

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
TEST_TOOLS = ServerSpec("testtools", sys.executable, (SERVER,))
TIME = ServerSpec("time", shutil.which("mcp-server-time") or "mcp-server-time", ("--local-timezone", "UTC"))


def call(name: str, args: dict | str, id: str = "c1") -> tuple[ToolCall, ...]:
    return (ToolCall(id, name, args if isinstance(args, str) else json.dumps(args)),)


@pytest.fixture(scope="module")
def client():
    """Both servers, started once for the module (the crash test has its own)."""
    c = McpClient(McpSettings((TEST_TOOLS, TIME), timeout=3))
    assert c.start() == []
    yield c
    c.close()


@pytest.fixture
def store(tmp_path: Path):
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    yield store
    store.close()


class Counting:
    """The client's `call`, counting what actually ran (a denied call must not reach the server)."""

    def __init__(self, client: McpClient) -> None:
        self.client, self.ran = client, []

    def __call__(self, name: str, arguments: dict, stop: threading.Event):
        self.ran.append(name)
        return self.client.call(name, arguments, stop)


def ask(backend, client, answers=(), *, store=None, max_rounds=8, allowed=()):
    service = ChatService(Recorder(store, print), model_name="fake", settings=backend.settings, backend=backend)
    runner = Counting(client)
    chat = ToolChat(client.tools, runner, set(allowed), max_rounds)
    asked, pending = [], list(answers)

    def approve(record):
        asked.append(record.name)
        return pending.pop(0)

    turn = service.ask("question", lambda _t: None, chat, None, approve)
    return service, turn, runner, asked


def tool_messages(backend, n: int):
    return [m for m in backend.calls[n] if m.role == "tool"]


# ---- configuration --------------------------------------------------------------------------------------


def test_mcp_config_json_and_config_toml_are_merged(tmp_path: Path):
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {
        "time": {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"]},
        "web": {"url": "http://localhost:8000/mcp"},
    }}))  # fmt: skip
    (tmp_path / "config.toml").write_text(
        '[mcp]\ntimeout = 5\nallow = ["add"]\n[mcp.servers.git]\ncommand = "mcp-server-git"\nenv = {A = "1"}\n'
    )
    settings = load_settings({"mcp_config": str(tmp_path / "mcp.json")}, config_file=tmp_path / "config.toml")
    assert [(s.name, s.transport) for s in settings.mcp.servers] == [("git", "stdio"), ("time", "stdio"),
                                                                      ("web", "http")]  # fmt: skip
    assert settings.mcp.servers[0].env == {"A": "1"} and settings.mcp.servers[1].args == ("--local-timezone", "UTC")
    assert settings.mcp.timeout == 5.0 and settings.mcp.allow == ("add",) and settings.mcp.max_rounds == 8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "not valid JSON"),
        ('{"servers": {}}', "expected {\"mcpServers\""),
        ('{"mcpServers": {"x": {"args": []}}}', "needs either a command"),
        ('{"mcpServers": {"x": {"command": "a", "args": "b"}}}', "args must be a list"),
        ('{"mcpServers": {"x": {"url": "ftp://h"}}}', "url must start with http"),
    ],
)
def test_a_bad_mcp_config_names_the_problem(tmp_path: Path, text: str, expected: str):
    path = tmp_path / "mcp.json"
    path.write_text(text)
    with pytest.raises(McpConfigError, match=expected.replace("{", r"\{")):
        read_mcp_json(path)
    (tmp_path / "config.toml").write_text("")
    with pytest.raises(ConfigError, match="mcp.json"):
        load_settings({"mcp_config": str(path)}, config_file=tmp_path / "config.toml")


def test_an_unknown_mcp_key_in_config_toml_is_refused(tmp_path: Path):
    (tmp_path / "config.toml").write_text("[mcp]\ntimeot = 5\n")
    with pytest.raises(ConfigError, match="unknown key in \\[mcp\\]: 'timeot'"):
        load_settings(config_file=tmp_path / "config.toml")


# ---- approval and the loop ------------------------------------------------------------------------------


def test_allow_once_runs_the_call_and_the_model_gets_the_result(client, store):
    backend = FakeBackend([call("add", {"a": 2, "b": 3}), "The sum is 5."])
    service, turn, runner, asked = ask(backend, client, ["once"], store=store)
    assert asked == ["add"] and runner.ran == ["add"]
    assert backend.tools_seen[0] and {t["function"]["name"] for t in backend.tools_seen[0]} >= {"add", "hang"}
    [result] = tool_messages(backend, 1)
    assert (result.content, result.tool_call_id, result.name) == ("5", "c1", "add")
    assert turn.content == "The sum is 5." and turn.rounds[0].calls[0].status == "ok"
    # saved with the chat: a resumed chat sends the same calls and results to the model
    resumed = ChatState.from_stored(store.load(service.state.conv_id))
    assert resumed.turns[1].rounds == turn.rounds
    sent = resumed.backend_messages()
    assert [m.role for m in sent] == ["user", "assistant", "tool", "assistant"]
    assert sent[1].tool_calls == call("add", {"a": 2, "b": 3}) and sent[2].content == "5"
    text = stored_transcript(store, service.state.conv_id)
    assert "**Tool call** `add` on `testtools` (ok)" in text and '"a": 2' in text and "1 tool round" in text


def test_allow_always_stops_asking_for_that_tool_in_the_chat(client):
    backend = FakeBackend([call("add", {"a": 1, "b": 1}), call("add", {"a": 2, "b": 2}, "c2"),
                           call("long_text", {"lines": 2}, "c3"), "done"])  # fmt: skip
    _, turn, runner, asked = ask(backend, client, ["always", "once"])
    assert asked == ["add", "long_text"]  # the second add ran unasked
    assert runner.ran == ["add", "add", "long_text"]
    assert [c.result for r in turn.rounds for c in r.calls] == ["2", "4", "line 1\nline 2"]


def test_deny_does_not_run_the_call_and_tells_the_model(client):
    backend = FakeBackend([call("add", {"a": 1, "b": 1}), "I could not add them."])
    _, turn, runner, asked = ask(backend, client, ["deny"])
    assert asked == ["add"] and runner.ran == []
    assert tool_messages(backend, 1)[0].content == DENIED
    assert turn.rounds[0].calls[0].status == "denied" and turn.content == "I could not add them."


def test_config_allowed_tools_run_unasked(client):
    backend = FakeBackend([call("add", {"a": 4, "b": 4}), "8"])
    _, _, runner, asked = ask(backend, client, [], allowed=["add"])
    assert asked == [] and runner.ran == ["add"]


def test_the_round_limit_ends_with_a_reply_without_tools(client):
    backend = FakeBackend([call("add", {"a": 1, "b": 1})])  # the model would call forever
    _, turn, runner, _ = ask(backend, client, [], max_rounds=3, allowed=["add"])
    assert len(runner.ran) == 3 and len(turn.rounds) == 3
    assert [t is not None for t in backend.tools_seen] == [True, True, True, False]
    assert turn.content == "(no tools offered)"


# ---- failures: one line each, and the chat goes on --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("no_such_tool", {}, "there is no tool named 'no_such_tool'"),
        ("boom", {}, "boom raised"),
        ("picture", {}, "picture returned image, not text"),
        ("add", "not json", "the arguments are not a JSON object"),
    ],
)
def test_a_failed_call_is_one_line_and_the_reply_goes_on(client, name, args, expected):
    backend = FakeBackend([call(name, args), "Answer anyway."])
    _, turn, _, _ = ask(backend, client, ["once"])
    record = turn.rounds[0].calls[0]
    assert record.status == "error" and expected in record.result and "\n" not in record.result
    assert tool_messages(backend, 1)[0].content == record.result
    assert turn.content == "Answer anyway."


def test_a_hanging_tool_times_out(client):
    backend = FakeBackend([call("hang", {}), "It timed out."])
    _, turn, _, _ = ask(backend, client, ["once"])
    record = turn.rounds[0].calls[0]
    assert record.status == "error" and "no answer in 3 s" in record.result
    assert 2900 < record.ms < 6000  # the 3 s timeout, plus the loop's polling
    assert turn.content == "It timed out."


def test_a_server_that_crashes_mid_call_and_one_that_does_not_start():
    broken = ServerSpec("broken", sys.executable, (SERVER, "--fail-start"))
    missing = ServerSpec("missing", "/nonexistent/mcp-server")
    own = McpClient(McpSettings((TEST_TOOLS, broken, missing), timeout=5))
    try:
        failures = own.start()
        assert len(failures) == 2
        assert "'broken' did not start" in failures[0] and "'missing' did not start: command not found" in failures[1]
        backend = FakeBackend([call("crash", {}), call("add", {"a": 1, "b": 2}, "c2"), "Carry on."])
        _, turn, _, _ = ask(backend, own, ["once", "once"])
        crashed, after = turn.rounds[0].calls[0], turn.rounds[1].calls[0]
        assert crashed.status == "error" and "crashing on purpose" in crashed.result
        assert after.status == "error" and "testtools" in after.result  # the server is gone; said, not hung
        assert turn.content == "Carry on."
    finally:
        own.close()


def test_a_streamable_http_server_from_the_url_key(tmp_path: Path):
    """The `{"url": ...}` shape: the same SDK server over streamable HTTP, a process of its own."""
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=out, stderr=subprocess.STDOUT)
    own = McpClient(McpSettings((ServerSpec("web", url=f"http://127.0.0.1:{port}/mcp"),), timeout=20))
    try:
        deadline = time.monotonic() + 60
        while b"Uvicorn running" not in log.read_bytes():  # the SDK serves with uvicorn
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        assert own.start() == []
        assert {t.name for t in own.tools} >= {"add", "long_text"} and {t.server for t in own.tools} == {"web"}
        backend = FakeBackend([call("add", {"a": 19, "b": 23}), "42"])
        _, turn, runner, _ = ask(backend, own, ["once"])
        record = turn.rounds[0].calls[0]
        assert runner.ran == ["add"] and (record.status, record.result, record.server) == ("ok", "42", "web")
    finally:
        own.close()
        process.terminate()
        process.wait(timeout=30)


# ---- a real server from PyPI ------------------------------------------------------------------------------


def test_mcp_server_time_is_listed_and_called(client):
    tools = {t.name: t for t in client.tools}
    assert tools["get_current_time"].server == "time" and "timezone" in tools["get_current_time"].description.lower()
    backend = FakeBackend([call("get_current_time", {"timezone": "Asia/Tokyo"}), "Here it is."])
    _, turn, _, _ = ask(backend, client, ["once"])
    data = json.loads(turn.rounds[0].calls[0].result)
    assert data["timezone"] == "Asia/Tokyo" and data["datetime"].endswith("+09:00")


# ---- chatapp run --chat -----------------------------------------------------------------------------------


def test_terminal_tools_print_calls_and_ask_on_the_terminal():
    settings = McpSettings((TEST_TOOLS,), timeout=5)
    err = io.StringIO()
    with TerminalTools(settings, stdin=io.StringIO("y\nn\n"), stderr=err) as tools:
        backend = FakeBackend([call("add", {"a": 20, "b": 22}), call("add", {"a": 1, "b": 1}, "c2"), "42"])
        service = ChatService(Recorder(None, print), model_name="f", settings=backend.settings, backend=backend)
        turn = service.ask("q", lambda _t: None, tools.chat, tools.show, tools.approve)
    out = err.getvalue()
    assert "6 tools: add (testtools)" in out
    assert 'run add on testtools { "a": 20, "b": 22 }? [y]es once' in out
    assert "tool result: add" in out and ": 42" in out and "tool denied: add" in out
    assert [c.status for r in turn.rounds for c in r.calls] == ["ok", "denied"]


def test_mcp_server_git_on_a_repository_of_its_own(tmp_path: Path):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "notes.txt").write_text("hello\n")
    git = ServerSpec("git", shutil.which("mcp-server-git") or "mcp-server-git", ("--repository", str(repo)))
    own = McpClient(McpSettings((git,), timeout=20))
    try:
        assert own.start() == []
        assert {"git_status", "git_log"} <= {t.name for t in own.tools}
        backend = FakeBackend([call("git_status", {"repo_path": str(repo)}), "One untracked file."])
        _, turn, _, _ = ask(backend, own, ["once"])
        record = turn.rounds[0].calls[0]
        assert record.status == "ok" and "notes.txt" in record.result and record.server == "git"
    finally:
        own.close()


def test_a_backend_without_tools_is_offered_none(client):
    class Old(FakeBackend):
        def stream_reply(self, messages):  # the interface before tool calling
            return super().stream_reply(messages)

    backend = Old([call("add", {"a": 1, "b": 1})])
    _, turn, runner, _ = ask(backend, client, [])
    assert backend.tools_seen == [None] and turn.content == "(no tools offered)" and runner.ran == []


def test_the_cli_names_a_bad_mcp_config_and_needs_chat(tmp_path: Path, capsys, monkeypatch):
    from chatapp.cli import main

    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(tmp_path))
    (tmp_path / "bad.json").write_text('{"mcpServers": {"t": {}}}')
    assert main(["run", "--chat", "-p", "hi", "--mcp-config", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: server 't' needs either a command" in capsys.readouterr().err
    (tmp_path / "ok.json").write_text('{"mcpServers": {"t": {"command": "x"}}}')
    assert main(["run", "-p", "hi", "--mcp-config", str(tmp_path / "ok.json")]) == 2
    assert "--mcp-config needs --chat" in capsys.readouterr().err
