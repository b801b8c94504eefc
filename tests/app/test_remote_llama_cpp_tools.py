"""The remote client's tools and structured output against a server we did not write: llama-cpp-python's
(built in its own venv, see tests/app/llama_cpp_server.py) on the real Qwen2.5-Coder-0.5B, its chat format taken
from the GGUF's template. Greedy, short replies.

What that server (0.3.36) does with each field, measured here, and what the client does about it:
- `response_format` `json_object` (with or without a `schema` inside): honoured, by a grammar.
- `response_format` `json_schema` (OpenAI's shape): answered 500 (its request model knows only text and
  json_object). The client sends the schema inside `json_object` instead.
- `json_schema` on /completions: dropped without a word. The client refuses it before sending.
- `grammar` (GBNF): honoured, chat and completion.
- `tools`: rendered into the template's prompt, but under `auto` the model's call is not read back: it comes as
  text (Qwen2.5-Coder writes a fenced ```json call) with finish_reason "stop". The client warns once.
- `tool_choice` naming a tool: honoured, by a grammar on the arguments; streamed, every delta repeats the id and
  name. With that, the whole MCP loop runs: the call goes to mcp-server-time here, the result back to the server.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import openai
import pytest

from chatapp.chat_service import ChatService
from chatapp.mcp.client import McpClient
from chatapp.mcp.config import McpSettings, ServerSpec
from chatapp.mcp.loop import ToolChat
from chatapp.recorder import Recorder
from chatapp.remote import RemoteBackend, RemoteError, connect
from engine.events import GrammarSpec, Message, TurnStats
from engine.sampling import SamplingSettings
from tests.app.llama_cpp_server import LlamaServer, ensure_server_python, llama_server

pytestmark = pytest.mark.slow

# llama-cpp-python applies a grammar to all 152k candidates per token (about a second a token on 2 shared
# cores): replies are kept short.
GREEDY = SamplingSettings(temperature=0.0, top_k=40, top_p=1.0, min_p=0.0, seed=0, max_tokens=24)
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_time",
        "description": "Current time in an IANA timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ASK_TIME = [Message("user", "What is the current time in Tokyo?")]
NAMED = {"tool_choice": {"type": "function", "function": {"name": "get_current_time"}}}
BOOK = {  # not a schema the server has seen in its own tests: nested, an enum, an integer range
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2100},
        "genre": {"enum": ["novel", "poetry", "essay"]},
        "author": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
    "required": ["title", "year", "genre", "author"],
}


@pytest.fixture(scope="module")
def server(qwen_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama-server-tools") / "server.log"
    with llama_server(ensure_server_python(), qwen_path, log, alias="qwen") as running:
        yield running


@pytest.fixture
def backend(server: LlamaServer) -> RemoteBackend:
    return connect(f"{server.url}/v1", settings=GREEDY, logprobs=False)


def reply(events: list) -> TurnStats:
    stats = events[-1]
    assert isinstance(stats, TurnStats)
    return stats


# ---- structured output ----------------------------------------------------------------------------------------


def test_a_json_schema_goes_in_the_shape_the_server_takes(server: LlamaServer, backend: RemoteBackend) -> None:
    assert backend.remote.server == "llama-cpp-python"
    spec = GrammarSpec("json_schema", json.dumps(BOOK))
    backend.settings = replace(GREEDY, max_tokens=60)
    ask = [Message("user", "Describe a famous book as JSON.")]
    stats = reply(list(backend.stream_reply(ask, constraint=spec)))
    jsonschema.validate(json.loads(stats.reply), BOOK)
    # OpenAI's own shape, which the client does not send to this server: measured, a 500.
    raw = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.InternalServerError):
        raw.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": BOOK}},
        )  # fmt: skip


def test_json_object_and_a_gbnf_grammar_are_honoured(backend: RemoteBackend) -> None:
    stats = reply(list(backend.stream_reply([Message("user", "Name a city as JSON.")],
                                            constraint=GrammarSpec("json_object"))))  # fmt: skip
    assert isinstance(json.loads(stats.reply), dict)
    yes_no = GrammarSpec("gbnf", 'root ::= ("yes" | "no") "."')
    stats = reply(list(backend.stream_reply([Message("user", "Is Paris in France?")], constraint=yes_no)))
    assert stats.reply in ("yes.", "no.")
    stats = reply(list(backend.stream_completion("Is the sky green? Answer:", constraint=yes_no)))
    assert stats.reply in ("yes.", "no.")


def test_a_schema_on_a_raw_completion_is_refused_not_dropped(backend: RemoteBackend) -> None:
    for spec in (GrammarSpec("json_schema", json.dumps(BOOK)), GrammarSpec("json_object")):
        with pytest.raises(RemoteError, match="llama-cpp-python's server has no JSON schema field .* add --chat"):
            list(backend.stream_completion("A book:", constraint=spec))


# ---- tools ------------------------------------------------------------------------------------------------


def test_a_named_tool_call_streams_back_as_one_call(backend: RemoteBackend) -> None:
    backend.extra = dict(NAMED)
    stats = reply(list(backend.stream_reply(ASK_TIME, [TIME_TOOL])))
    (call,) = stats.tool_calls  # each delta repeats the id and name: still one call, arguments joined
    assert call.name == "get_current_time" and call.id
    assert json.loads(call.arguments)["timezone"] == "Asia/Tokyo"
    assert backend.warnings() == []


def test_under_auto_the_call_stays_text_and_the_client_says_so(backend: RemoteBackend) -> None:
    stats = reply(list(backend.stream_reply(ASK_TIME, [TIME_TOOL])))
    assert stats.tool_calls == () and '"name": "get_current_time"' in stats.reply  # written, not read back
    (warning,) = backend.warnings()
    assert "returns tool calls only when tool_choice names a tool" in warning
    backend.settings = replace(GREEDY, max_tokens=1)
    list(backend.stream_reply(ASK_TIME, [TIME_TOOL]))
    assert len(backend.warnings()) == 1  # said once


def test_the_mcp_loop_runs_mcp_server_time_for_the_remote_model(backend: RemoteBackend) -> None:
    """Issue 45 on llama-cpp-python: the MCP tools go to the server, its call runs here on the real
    mcp-server-time after approval, the result goes back, and the model answers with it (one round, then the
    reply without tools)."""
    time_server = ServerSpec("time", shutil.which("mcp-server-time") or "mcp-server-time", ("--local-timezone", "UTC"))
    mcp = McpClient(McpSettings((time_server,), timeout=20))
    try:
        assert mcp.start() == []
        backend.extra = dict(NAMED)
        backend.settings = replace(GREEDY, max_tokens=80)
        service = ChatService(Recorder(None, print), model_name="qwen", settings=backend.settings, backend=backend)
        asked: list[str] = []

        def approve(record) -> str:
            asked.append(record.name)
            return "once"

        chat = ToolChat(mcp.tools, mcp.call, set(), max_rounds=1)
        turn = service.ask("What is the current time in Tokyo?", lambda _t: None, chat, None, approve)
    finally:
        mcp.close()
    (record,) = [c for r in turn.rounds for c in r.calls]
    assert asked == ["get_current_time"] and record.status == "ok" and record.server == "time"
    result = json.loads(record.result)
    assert result["timezone"] == "Asia/Tokyo" and result["datetime"].endswith("+09:00")
    assert result["datetime"][11:16] in turn.content, (turn.content, record.result)
