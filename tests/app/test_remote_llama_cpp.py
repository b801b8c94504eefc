"""The remote backend against servers we did not write the client side of: llama-cpp-python's OpenAI-compatible
server (built once per machine into the user cache, see tests/app/llama_cpp_server.py) and our own
`chatapp serve`, both on the real SmolLM2 on 127.0.0.1. Driven through `chatapp run` as a subprocess and through
the Textual app with Pilot.

Greedy replies are compared with what the official `openai` client gets without streaming from the same
server, so the streamed pieces must add up to the server's own text. A reply that must be in flight cannot end
on its own (the end-of-turn tokens are banned with logit_bias and max_tokens is long) and is cancelled.

llama-cpp-python computes logprobs in Python over the whole vocabulary (seconds per token on 2 shared cores), so
only one short test asks for them; the others run with `[remote] logprobs = false`.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from chatapp.remote import RemoteBackend, connect
from chatapp.store import ConversationStore
from engine.events import STOP_CANCELLED, STOP_EOS, STOP_LENGTH, Message, TurnStats
from engine.sampling import SamplingSettings
from tests.app.llama_cpp_server import LlamaServer, ensure_server_python, llama_server
from tests.reliability.support import PYTHON, REPO, child_env, pilot_waits_briefly

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
GREEDY = SamplingSettings(temperature=0.0, top_k=40, top_p=1.0, min_p=0.0, seed=0, max_tokens=24)
NO_END = {"logit_bias": {"0": -100, "2": -100}}  # SmolLM2's <|endoftext|> and <|im_end|>
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def llama_cpp_python() -> Path:
    """The interpreter of llama-cpp-python[server]'s own venv: built on first use (minutes), reused after."""
    return ensure_server_python()


@pytest.fixture(scope="module")
def server(
    llama_cpp_python: Path, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with llama_server(llama_cpp_python, smollm2_path, log) as running:
        yield running


def direct_reply(server_url: str, messages: list[dict[str, str]], max_tokens: int = 24) -> str:
    """The server's greedy reply through the official client, not streamed."""
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=RUN_TIMEOUT_S)
    done = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0.0, top_p=1.0, seed=0, max_tokens=max_tokens,
        extra_body={"top_k": 40, "min_p": 0.0, "repeat_penalty": 1.0},
    )  # fmt: skip
    return done.choices[0].message.content or ""


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = child_env(tmp_path)
    (tmp_path / "child-config" / "config.toml").write_text("[remote]\nlogprobs = false\n")
    env.pop("OPENAI_BASE_URL", None)
    env.pop("OPENAI_API_KEY", None)
    return subprocess.run(
        [PYTHON, "-m", "chatapp", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


# ---- chatapp run --------------------------------------------------------------------------------------------


def test_run_chats_with_llama_cpp_python(server: LlamaServer, tmp_path: Path):
    done = run_cli(
        tmp_path, "run", "--api-base", f"{server.url}/v1", "--chat", "-p", QUESTION, "-n", "24",
        "--temp", "0", "--top-p", "1", "--min-p", "0", "--seed", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = direct_reply(server.url, [{"role": "user", "content": QUESTION}])
    assert expected.strip() and done.stdout == expected + "\n"
    assert f"smollm2 on llama-cpp-python at {server.url.removeprefix('http://')}" in done.stderr
    assert "time to first" in done.stderr and "Traceback" not in done.stderr


def test_run_continues_a_raw_prompt(server: LlamaServer, tmp_path: Path):
    url = f"{server.url}/v1"
    done = run_cli(tmp_path, "run", "--api-base", url, "-p", "Once upon a time", "-n", "8", "--temp", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Once upon a time") and len(done.stdout) > len("Once upon a time\n")
    assert re.search(r"stop = length; 8 tokens generated$", done.stderr, re.MULTILINE), done.stderr


def test_run_with_an_unknown_model_fails_in_one_line(server: LlamaServer, tmp_path: Path):
    done = run_cli(tmp_path, "run", "--api-base", f"{server.url}/v1", "-m", "gpt-9", "-p", "hi")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"chatapp: error: the server at {server.url.removeprefix('http://')} has no model 'gpt-9'; it serves: smollm2"
    )


# ---- the backend on llama-cpp-python -------------------------------------------------------------------------


def test_backend_streams_what_the_server_answers(server: LlamaServer):
    backend = connect(f"{server.url}/v1", settings=replace(GREEDY, max_tokens=6))
    assert backend.remote.server == "llama-cpp-python" and backend.model_id == "smollm2"
    events = list(backend.stream_reply([Message("user", QUESTION)]))
    stats = events[-1]
    assert isinstance(stats, TurnStats) and stats.stop_reason in (STOP_EOS, STOP_LENGTH)
    assert stats.reply == direct_reply(server.url, [{"role": "user", "content": QUESTION}], max_tokens=6)
    tokens = events[:-1]
    # llama-cpp-python 0.3.36 sends logprobs on streams but no usage (stream_options is ignored): the tokens
    # are counted here and the prompt is unknown (0), which the summary and the status line say.
    assert all(0 < t.prob <= 1 and t.top and t.top[0].prob >= t.prob - 1e-6 for t in tokens)
    assert stats.generated_tokens == len(tokens) and stats.prompt_tokens == 0
    assert stats.ttft_ms > 0 and all(t.forward_ms >= 0 for t in tokens)


def test_esc_on_llama_cpp_python_closes_the_stream(server: LlamaServer):
    import threading

    backend = connect(f"{server.url}/v1", settings=SamplingSettings(temperature=0.0, max_tokens=1500), logprobs=False)
    backend.extra = dict(NO_END)
    seen = []
    for event in backend.stream_reply([Message("user", "Tell me a long story.")]):
        seen.append(event)
        if len(seen) == 3:
            threading.Thread(target=backend.cancel).start()
    assert seen[-1].stop_reason == STOP_CANCELLED and seen[-1].generated_tokens >= 3
    backend.extra, backend.settings = {}, GREEDY
    again = list(backend.stream_reply([Message("user", QUESTION)]))[-1]
    assert again.stop_reason in (STOP_EOS, STOP_LENGTH) and again.reply.strip()


# ---- the TUI on llama-cpp-python -----------------------------------------------------------------------------


async def test_tui_on_llama_cpp_python(server: LlamaServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from textual.widgets import DataTable

    from chatapp.tui.app import ChatApp
    from chatapp.tui.widgets.chat_log import AssistantMessage
    from chatapp.tui.widgets.inspector import InspectorScreen
    from tests.app.fake_backend import finished, record_notices, send, wait_for
    from tests.app.test_tui import status_text

    pilot_waits_briefly(monkeypatch)
    made: list[RemoteBackend] = []

    def factory(progress):
        made.append(connect(f"{server.url}/v1", settings=GREEDY, logprobs=False, progress=progress))
        return made[-1]

    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    app = ChatApp(factory, model_name="remote", settings=GREEDY, store=store, export_dir=tmp_path / "exports")
    record_notices(app)
    host = server.url.removeprefix("http://")
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None or app.service.load_error, timeout=60)
            assert app.backend is not None, app.service.load_error
            assert "remote · llama-cpp-python" in status_text(app) and f"smollm2 @ {host}" in status_text(app)

            await send(pilot, QUESTION, wait=False)
            await wait_for(pilot, lambda: not app.generating, timeout=RUN_TIMEOUT_S, what="the reply")
            await finished(pilot)
            reply = app.state.turns[-1]
            first = direct_reply(server.url, [{"role": "user", "content": QUESTION}])
            assert reply.error is None and reply.content == first
            assert app.query(AssistantMessage).last().body.source == first

            await pilot.press("f3")
            assert isinstance(app.screen, InspectorScreen)
            assert app.screen.query_one(DataTable).row_count == len(reply.tokens) > 0
            assert all(t.prob == -1.0 for t in reply.tokens)  # asked without logprobs: shown as "—"
            await pilot.press("escape")

            await pilot.press("ctrl+r")  # regenerate: greedy, so the same reply again
            await wait_for(
                pilot, lambda: not app.generating and app.state.turns[-1] is not reply, timeout=RUN_TIMEOUT_S
            )
            await finished(pilot)
            assert app.state.turns[-1].content == first and len(app.state.turns) == 2

            await pilot.press("ctrl+g")  # edit the last message and resend
            await send(pilot, "Name a colour.", wait=False)
            await wait_for(pilot, lambda: not app.generating, timeout=RUN_TIMEOUT_S, what="the edited reply")
            await finished(pilot)
            edited = direct_reply(server.url, [{"role": "user", "content": "Name a colour."}])
            assert [t.content for t in app.state.turns] == ["Name a colour.", edited]

            # Esc mid-reply: the partial reply stays, on screen and saved; the next send works.
            made[-1].extra = dict(NO_END)
            app.backend.settings = app.settings = SamplingSettings(temperature=0.0, max_tokens=1500)
            await send(pilot, "Tell me a long story.", wait=False)
            await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) >= 3, timeout=RUN_TIMEOUT_S, what="tokens")
            await pilot.press("escape")
            await finished(pilot)
            partial = app.state.turns[-1]
            assert partial.stats.stop_reason == STOP_CANCELLED and partial.content.strip()
            assert app.query(AssistantMessage).last().body.source == partial.content
            made[-1].extra = {}
            app.backend.settings = app.settings = GREEDY
            await send(pilot, QUESTION, wait=False)
            await wait_for(pilot, lambda: not app.generating, timeout=RUN_TIMEOUT_S, what="the next reply")
            await finished(pilot)
            assert app.state.turns[-1].error is None and app.state.turns[-1].content.strip()

            saved = store.load(app.state.conv_id)
            assert [m.content for m in saved.messages] == [t.content for t in app.state.turns]
            assert saved.model == f"smollm2 @ {host}"
            await pilot.press("f8")
            exported = list((tmp_path / "exports").glob("*.md"))
            assert len(exported) == 1 and partial.content.strip()[:20] in exported[0].read_text()
    finally:
        store.close()


# ---- against our own chatapp serve ---------------------------------------------------------------------------


def test_backend_on_chatapp_serve_reads_cached_tokens_and_logprobs(smollm2_path: Path, tmp_path: Path):
    from tests.app.test_serve import _start

    servers = _start(tmp_path, smollm2_path, "-a", "smollm2", model_id="smollm2")
    ours = next(servers)
    try:
        backend = connect(f"{ours.url}/v1", settings=GREEDY)
        assert backend.remote.server == "chatapp serve" and backend.n_ctx > 0
        first = list(backend.stream_reply([Message("user", QUESTION)]))
        stats = first[-1]
        assert stats.prompt_tokens > 0 and stats.generated_tokens == len(first) - 1
        assert all(0 < t.prob <= 1 and t.top for t in first[:-1]), "chatapp serve sends logprobs"
        follow = [Message("user", QUESTION), Message("assistant", stats.reply), Message("user", "And of Spain?")]
        second = list(backend.stream_reply(follow))[-1]
        assert second.reused_tokens > 0, "the second turn reuses the first's KV prefix"
    finally:
        # Run the generator to its end, not close() it: closing raises GeneratorExit at its yield, which skips
        # its "no Traceback in the server log" check after the server stops.
        next(servers, None)
