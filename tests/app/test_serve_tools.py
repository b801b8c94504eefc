"""Tool calls through `chatapp serve` on the real Qwen2.5-Coder-1.5B, driven by the official `openai` client, and
by our remote client (`RemoteBackend`, `chatapp run --api-base`). One server for the module; requests are few and
short (temperature 0, small max_tokens)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from chatapp.remote import connect
from engine.events import Message, TurnStats
from engine.sampling import SamplingSettings
from tests.app.test_serve import Server, _start
from tests.reliability.support import PYTHON, REPO, child_env

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
LOCAL_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = (  # Qwen's default system prompt, and when to call; without the second sentence the 1.5B repeats its call
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. "
    "Call a tool when one can answer; once a tool's result arrives, answer the user with it in plain words."
)
GREEDY = {"temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def server(qwen15_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("serve-tools"), qwen15_path)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def first_call(server: Server, client: openai.OpenAI):
    """The model's reply to ASK with the weather tool offered (tool_choice auto)."""
    messages = [{"role": "system", "content": SYSTEM}, *ASK]
    reply = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], max_tokens=60, **GREEDY
    )
    return messages, reply.choices[0]


def test_a_full_round_trip_call_then_result_then_an_answer_that_uses_it(server, client, first_call) -> None:
    messages, choice = first_call
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # only a call
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"].lower() == "paris"
    result = {"city": "Paris", "temperature_celsius": 17, "sky": "cloudy"}
    messages = [
        *messages,
        choice.message.model_dump(exclude_none=True),  # the assistant message carrying tool_calls, as clients send it
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], max_tokens=40, **GREEDY
    ).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "17" in answer.message.content  # it used the result


def test_the_same_call_streamed_assembles_into_valid_json(server, client, first_call) -> None:
    _, choice = first_call
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60,
            stream=True,
            **GREEDY,
        )
    )
    pieces = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in pieces for tc in (d.tool_calls or [])]
    assert len([tc for tc in calls if tc.id]) == 1  # the id and name come once
    assert calls[0].function.name == "get_weather"
    argument_pieces = [tc.function.arguments for tc in calls[1:] if tc.function.arguments]
    assert len(argument_pieces) > 1  # sent as generated, not in one piece at the end
    arguments = json.loads("".join(argument_pieces))
    assert arguments == json.loads(choice.message.tool_calls[0].function.arguments)
    assert not "".join(d.content or "" for d in pieces)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_calls_two_tools_in_parallel_and_parallel_false_keeps_one(server, client) -> None:
    ask = [{"role": "user", "content": "What are the weather and the local time in Tokyo?"}]
    reply = client.chat.completions.create(
        model=server.model, messages=ask, tools=[WEATHER, LOCAL_TIME], tool_choice="required", max_tokens=80, **GREEDY
    ).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert sorted(c.function.name for c in reply.message.tool_calls) == ["get_time", "get_weather"]
    for call in reply.message.tool_calls:
        assert json.loads(call.function.arguments) == {"city": "Tokyo"}
    single = client.chat.completions.create(
        model=server.model, messages=ask, tools=[WEATHER, LOCAL_TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, **GREEDY,
    ).choices[0]  # fmt: skip
    assert len(single.message.tool_calls) == 1


def test_tool_choice_none_answers_in_words(server, client) -> None:
    reply = client.chat.completions.create(
        model=server.model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12, **GREEDY
    ).choices[0]
    assert reply.message.tool_calls is None and reply.message.content
    assert reply.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ],
)
def test_bad_tool_fields_get_400s_that_name_them(server, fields: dict, param: str) -> None:
    response = server.http("POST", "/v1/chat/completions", json={"model": server.model, "messages": ASK, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_the_remote_client_sends_tools_and_reads_the_calls(server) -> None:
    backend = connect(f"{server.url}/v1", settings=SamplingSettings(temperature=0, seed=1, max_tokens=60))
    stats = [e for e in backend.stream_reply([Message("system", SYSTEM), Message(**ASK[0])], [WEATHER])][-1]
    assert isinstance(stats, TurnStats)
    (call,) = stats.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments)["city"].lower() == "paris"
    assert stats.reply == ""


def test_run_with_api_base_prints_the_calls(server, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    done = subprocess.run(
        [PYTHON, "-m", "chatapp", "run", "--api-base", f"{server.url}/v1", "--chat", "-p", ASK[0]["content"],
         "--system", SYSTEM, "--tools", str(tools), "--temp", "0", "--seed", "1", "-n", "60"],
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [c["name"] for c in lines] == ["get_weather"]
    assert json.loads(lines[0]["arguments"])["city"].lower() == "paris"


def test_run_with_api_base_runs_mcp_server_time_calls_here(server, tmp_path: Path) -> None:
    """Issue 45 on a remote model: `chatapp run --api-base` sends the MCP tools to the server, runs the server's
    tool_calls here (the real mcp-server-time from PyPI), sends the results back and prints the answer."""
    from tests.app.test_tools_real_model import QUESTION, assert_the_tool_told_the_time, time_config
    from tests.app.test_tools_real_model import SYSTEM as PLAIN_ANSWER

    config = time_config(tmp_path)
    done = subprocess.run(
        [PYTHON, "-m", "chatapp", "run", "--api-base", f"{server.url}/v1", "--chat", "-p", QUESTION,
         "--system", PLAIN_ANSWER, "--mcp-config", str(config), "--yes", "--temp", "0", "--seed", "1", "-n", "200"],
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert_the_tool_told_the_time(done)
    assert f"on chatapp serve at {server.url.removeprefix('http://')}" in done.stderr  # it was the server's reply
