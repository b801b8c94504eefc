"""The remote backend against a scripted OpenAI-compatible server (tests/app/fake_openai_server.py): what it
sends, what it reads, each failure as one line, cancel at any moment; the settings and command-line plumbing;
the TUI on it with Pilot.

Nothing waits on the machine's speed: a reply that must be in flight streams until the client leaves, and a
timeout is a server that never answers.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from chatapp.remote import KINDS, UNKNOWN_KIND, Malformed, RemoteError, connect, parse_chunk, request_fields
from chatapp.settings import ConfigError, RemoteSettings, load_settings
from chatapp.store import ConversationStore
from engine.events import STOP_CANCELLED, STOP_EOS, STOP_LENGTH, Message, TokenEvent, TurnStats
from engine.sampling import SamplingSettings
from tests.app.fake_openai_server import LOGPROBS, MODELS, REPLY, fake_server

HI = [Message("user", "hi")]


@pytest.fixture
def fake():
    with fake_server() as server:
        yield server


def reply_of(events: list) -> tuple[list[TokenEvent], TurnStats]:
    assert isinstance(events[-1], TurnStats) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


# ---- connecting and streaming -------------------------------------------------------------------------------


def test_connect_picks_the_first_model_and_reads_the_server(fake):
    lines: list[str] = []
    backend = connect(fake.url, progress=lines.append)
    assert backend.model_id == MODELS[0]
    assert backend.model_name == f"{MODELS[0]} @ {backend.remote.host}" and backend.remote.host.startswith("127.0.0.1:")
    assert backend.remote.server == "llama.cpp" and "top_k" in backend.remote.honoured
    assert backend.n_ctx == 4096  # from the listing's meta.n_ctx
    assert lines[0].startswith("connecting to 127.0.0.1:") and MODELS[0] in lines[-1]
    assert connect(fake.url, model=MODELS[1]).model_id == MODELS[1]


def test_an_unknown_model_names_what_the_server_has(fake):
    with pytest.raises(RemoteError, match=r"has no model 'nope'; it serves: fake-a, fake-b"):
        connect(fake.url, model="nope")


def test_a_reply_streams_with_probabilities_and_usage(fake):
    settings = SamplingSettings(temperature=0.3, top_k=7, top_p=0.8, min_p=0.1, repeat_penalty=1.2, seed=42)
    backend = connect(fake.url, settings=settings)
    tokens, stats = reply_of(list(backend.stream_reply(HI)))
    assert [t.text for t in tokens] == REPLY and [t.index for t in tokens] == [0, 1, 2, 3]
    assert [t.prob for t in tokens] == pytest.approx([math.exp(lp) for lp in LOGPROBS])
    assert tokens[2].top[0].text == " world" and tokens[2].top[1].prob == pytest.approx(math.exp(LOGPROBS[2] - 2))
    assert all(t.forward_ms >= 0 for t in tokens)
    assert stats.reply == "".join(REPLY) and stats.stop_reason == STOP_EOS
    assert (stats.prompt_tokens, stats.reused_tokens, stats.evaluated_tokens) == (20, 12, 8)
    assert stats.generated_tokens == 4 and stats.n_ctx_used == 24 and stats.n_ctx == 4096
    assert stats.ttft_ms == tokens[0].forward_ms
    assert stats.decode_ms == pytest.approx(sum(t.forward_ms for t in tokens[1:]))
    assert "remote" in stats.device and backend.remote.host in stats.device
    body = fake.bodies[-1]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["model"] == MODELS[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["logprobs"] is True and body["top_logprobs"] == 5
    expected = {"temperature": 0.3, "top_p": 0.8, "seed": 42, "top_k": 7, "min_p": 0.1, "repeat_penalty": 1.2}
    assert {k: body[k] for k in expected} == expected


def test_llama_server_timings_stand_in_for_usage(fake):
    backend = connect(fake.url)
    fake.modes = ["timings"]
    _, stats = reply_of(list(backend.stream_reply(HI)))
    assert (stats.prompt_tokens, stats.reused_tokens, stats.evaluated_tokens) == (12, 5, 7)
    assert stats.prefill_ms == 12.5  # the server's own prompt time, not our TTFT
    assert stats.generated_tokens == 4  # counted here: no usage


def test_settings_changed_between_replies_go_with_the_next_request(fake):
    backend = connect(fake.url)
    list(backend.stream_reply(HI))
    backend.settings = SamplingSettings(temperature=0.0, seed=-1, max_tokens=-1)
    list(backend.stream_reply(HI))
    body = fake.bodies[-1]
    assert body["temperature"] == 0.0 and "seed" not in body and "max_tokens" not in body  # random, unlimited


def test_a_raw_completion(fake):
    backend = connect(fake.url)
    tokens, stats = reply_of(list(backend.stream_completion("Once", extra={"ignore_eos": True})))
    assert "".join(t.text for t in tokens) == "".join(REPLY) and stats.stop_reason == STOP_LENGTH
    assert fake.bodies[-1]["prompt"] == "Once" and fake.bodies[-1]["ignore_eos"] is True
    assert fake.bodies[-1]["logprobs"] == 5  # the legacy endpoint's form


def test_request_fields_per_server():
    s = SamplingSettings(repeat_penalty=1.3)
    assert request_fields(s, KINDS["vllm"])["repetition_penalty"] == 1.3
    assert "repeat_penalty" not in request_fields(s, KINDS["vllm"])
    ollama = request_fields(s, KINDS["ollama"])
    assert not {"top_k", "min_p", "repeat_penalty", "repetition_penalty"} & set(ollama)
    assert request_fields(s, KINDS["llamacpp"])["repeat_last_n"] == s.repeat_last_n
    assert "repeat_last_n" not in request_fields(s, KINDS["me"])  # llama-cpp-python has no such field
    unknown = request_fields(s, UNKNOWN_KIND)  # both spellings: one of them may mean something
    assert unknown["repeat_penalty"] == unknown["repetition_penalty"] == 1.3


# ---- failures: one line each, and the next request works -----------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("401", r"refused the API key \(401 Unauthorized: Invalid API Key\); set --api-key"),
        ("404", r"has no model 'fake-a' \(404"),
        ("429", r"is busy \(429 Too Many Requests, retry after 7 s\): too many requests; send again to retry"),
        ("503", r"is unavailable \(503 Service Unavailable, retry after 3 s\): Loading model; send again"),
        ("bad-json", r"sent a malformed stream: an event is not JSON \('\{not json'\)"),
        ("bad-shape", r"sent a malformed stream: event 2\.choices\[0\]\.delta\.content is 5, expected str"),
        ("no-finish", r"sent a malformed stream: it ended before the reply finished"),
        ("not-sse", r"did not stream \(content-type 'text/html"),
    ],
)
def test_each_failure_is_one_line_and_the_next_request_works(fake, mode, expected):
    backend = connect(fake.url)
    fake.modes = [mode]
    with pytest.raises(RemoteError, match=r"^the server at 127\.0\.0\.1:\d+ " + expected) as caught:
        list(backend.stream_reply(HI))
    assert "\n" not in str(caught.value)
    assert reply_of(list(backend.stream_reply(HI)))[1].reply == "".join(REPLY)


def test_a_server_that_never_answers_times_out(fake):
    backend = connect(fake.url, timeout=0.5)
    fake.modes = ["hang"]
    with pytest.raises(RemoteError, match=r"sent nothing for 0\.5 s \(timeout\); send again to retry"):
        list(backend.stream_reply(HI))
    assert reply_of(list(backend.stream_reply(HI)))[1].stop_reason == STOP_EOS


def test_a_refused_connection(fake):
    port = fake.url.rsplit(":", 1)[1]
    with fake_server() as other:
        dead = other.url
    with pytest.raises(RemoteError, match=r"^cannot reach the server at 127\.0\.0\.1:\d+: connection refused"):
        connect(dead)
    assert port  # the live one is untouched


def test_a_server_gone_after_connecting():
    with fake_server() as server:
        backend = connect(server.url)
    with pytest.raises(RemoteError, match="connection refused"):
        list(backend.stream_reply(HI))


def test_a_wrong_api_key_at_connect():
    with fake_server(api_key="right") as server:
        with pytest.raises(RemoteError, match=r"refused the API key \(401"):
            connect(server.url, api_key="wrong")
        assert connect(server.url, api_key="right").model_id == MODELS[0]


def test_a_server_that_refuses_logprobs_is_asked_again_without(fake):
    backend = connect(fake.url)
    fake.modes = ["no-logprobs-400"]
    tokens, stats = reply_of(list(backend.stream_reply(HI)))
    assert stats.reply == "".join(REPLY) and all(t.prob == -1.0 for t in tokens)
    assert "logprobs" not in fake.bodies[-1] and any("refused logprobs" in w for w in backend.warnings())


@pytest.mark.parametrize(
    "chunk",
    [
        [],
        {"choices": "x"},
        {"choices": [5]},
        {"choices": [{"delta": "x"}]},
        {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{"token": "a", "logprob": 3}]}}]},
        {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{"token": 1, "logprob": -1}]}}]},
        {"choices": [], "usage": "lots"},
        {"choices": [{"delta": {}, "finish_reason": 7}]},
    ],
)
def test_malformed_chunks_name_the_field(chunk):
    with pytest.raises(Malformed, match=r"^event 3"):
        parse_chunk(chunk, True, 3)


def test_nonsense_counts_in_usage_become_a_warning(fake):
    backend = connect(fake.url)
    events = backend._stats(0.0, [], "", "stop", {"prompt_tokens": -5}, None, cancelled=False)
    assert events.prompt_tokens == 0 and any("unusable token counts" in w for w in backend.warnings())


# ---- cancel --------------------------------------------------------------------------------------------------


def test_cancel_mid_stream_keeps_the_tokens_and_leaves_the_server(fake):
    backend = connect(fake.url)
    fake.modes = ["forever"]
    seen = []
    for event in backend.stream_reply(HI):
        seen.append(event)
        if len(seen) == 3:
            threading.Thread(target=backend.cancel).start()  # as the UI thread does
    tokens, stats = reply_of(seen)
    assert stats.stop_reason == STOP_CANCELLED and stats.generated_tokens == len(tokens) >= 3
    assert stats.reply == " x" * len(tokens)
    assert fake.disconnected.wait(10), "the server never saw the client leave"
    assert reply_of(list(backend.stream_reply(HI)))[1].stop_reason == STOP_EOS


def test_cancel_before_the_server_answers_returns_at_once(fake):
    backend = connect(fake.url)  # the default 120 s timeout: only the cancel can end this
    fake.modes = ["hang"]
    fake.arrived.clear()
    threading.Thread(target=lambda: (fake.arrived.wait(), backend.cancel())).start()
    tokens, stats = reply_of(list(backend.stream_reply(HI)))
    assert tokens == [] and stats.stop_reason == STOP_CANCELLED
    assert fake.disconnected.wait(10)


# ---- settings and the command line ---------------------------------------------------------------------------


def test_remote_settings_layer_config_then_environment_then_flags(isolated_dirs):
    config = isolated_dirs["config"] / "config.toml"
    config.write_text('[remote]\nbase_url = "http://from-config:1/v1"\nmodel = "m1"\ntimeout = 5\n')
    assert load_settings({}, environ={}).remote == RemoteSettings("http://from-config:1/v1", "", "m1", 5.0, True)
    env = {"OPENAI_BASE_URL": "http://from-env:2/v1", "OPENAI_API_KEY": "k-env"}
    from_env = load_settings({}, environ=env)
    assert (from_env.remote.base_url, from_env.remote.api_key) == ("http://from-env:2/v1", "k-env")
    assert from_env.sources[-1] == "environment"
    flags = load_settings({"remote.base_url": "http://flag:3/v1", "remote.api_key": "k-flag"}, environ=env)
    assert (flags.remote.base_url, flags.remote.api_key, flags.remote.model) == ("http://flag:3/v1", "k-flag", "m1")
    assert not load_settings({"remote.base_url": ""}, environ=env).remote.enabled  # '' = the local engine


def test_bad_remote_settings_name_the_key(isolated_dirs):
    config = isolated_dirs["config"] / "config.toml"
    config.write_text('[remote]\ntimeout = -1\n')
    with pytest.raises(ConfigError, match=r"line 2: remote\.timeout: expected a number > 0 seconds"):
        load_settings({}, environ={})
    config.write_text('[remote]\nbase_uri = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown key in \[remote\]; did you mean 'base_url'"):
        load_settings({}, environ={})
    config.write_text("")
    with pytest.raises(ConfigError, match=r"^OPENAI_BASE_URL: expected a string starting with http://"):
        load_settings({}, environ={"OPENAI_BASE_URL": "gpu-box:8000"})


def test_run_streams_from_the_server_and_sums_up(fake, capsys, isolated_dirs, monkeypatch):
    from chatapp.cli import main

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert main(["run", "--api-base", fake.url, "-m", MODELS[1], "--chat", "-p", "hi", "--temp", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(REPLY) + "\n"
    assert f"{MODELS[1]} on llama.cpp at 127.0.0.1:" in err and "12 cached on the server" in err
    assert fake.bodies[-1]["model"] == MODELS[1] and fake.bodies[-1]["temperature"] == 0.0


def test_run_takes_the_server_from_the_environment(fake, capsys, isolated_dirs, monkeypatch):
    from chatapp.cli import main

    monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
    assert main(["run", "-p", "Once"]) == 0
    out, _ = capsys.readouterr()
    assert out == "Once" + "".join(REPLY) + "\n" and fake.bodies[-1]["model"] == MODELS[0]


@pytest.mark.parametrize("mode", ["401", "503", "bad-json"])
def test_run_fails_in_one_line_with_exit_2(fake, capsys, isolated_dirs, monkeypatch, mode):
    from chatapp.cli import main

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    fake.modes = [mode]
    assert main(["run", "--api-base", fake.url, "--chat", "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]
    assert err.splitlines()[-1].startswith("chatapp: error: the server at 127.0.0.1:")
    assert "Traceback" not in err


def test_run_on_a_dead_server_and_an_unknown_model(fake, capsys, isolated_dirs, monkeypatch):
    from chatapp.cli import main

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert main(["run", "--api-base", fake.url, "-m", "nope", "-p", "hi"]) == 2
    assert "has no model 'nope'; it serves: fake-a, fake-b" in capsys.readouterr().err
    assert main(["run", "--api-base", "http://127.0.0.1:9/v1", "-p", "hi"]) == 2
    assert "cannot reach the server at 127.0.0.1:9: connection refused" in capsys.readouterr().err


def test_bench_measures_the_server(fake, capsys, isolated_dirs, monkeypatch):
    import json

    from chatapp.cli import main

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert main(["bench", "--api-base", fake.url, "-p", "16", "-n", "4", "-r", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == MODELS[0] and result["repetitions"] == 2 and result["decode_tok_s"] > 0
    assert result["device"].startswith("remote llama.cpp at 127.0.0.1:")
    assert fake.bodies[-1]["ignore_eos"] is True and fake.bodies[-1]["max_tokens"] == 4


# ---- the TUI on the remote backend ---------------------------------------------------------------------------


def remote_app(url: str, tmp_path: Path, store=None, settings: SamplingSettings | None = None):
    from chatapp.tui.app import ChatApp
    from tests.app.fake_backend import record_notices

    settings = settings or SamplingSettings()
    app = ChatApp(
        lambda progress: connect(url, settings=settings, progress=progress),
        model_name="remote",
        settings=settings,
        store=store,
        export_dir=tmp_path / "exports",
    )
    record_notices(app)
    return app


async def test_tui_streams_shows_the_server_and_survives_failures(fake, tmp_path):
    from chatapp.tui.widgets.chat_log import AssistantMessage
    from chatapp.tui.widgets.sampling_panel import KnobRow
    from tests.app.fake_backend import finished, send, wait_for
    from tests.app.test_tui import status_text, text_of

    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    app = remote_app(fake.url, tmp_path, store)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None or app.service.load_error, timeout=30)
            assert app.backend is not None, app.service.load_error
            assert "remote · llama.cpp" in status_text(app) and "fake-a @ 127.0.0.1:" in status_text(app)
            assert text_of(app.query_one("#knob-top_k", KnobRow).query_one(".knob-name")) == "Top-k ✓"
            assert "applies from the next reply" in text_of(app.query_one("#knob-server"))

            await send(pilot, "hi")
            reply = app.state.turns[-1]
            assert reply.content == "".join(REPLY) and reply.stats.reused_tokens == 12
            assert app.query(AssistantMessage).last().body.source == reply.content
            assert "cache 12/20 reused" in status_text(app)

            fake.modes = ["503"]
            await send(pilot, "again")
            failed = app.state.turns[-1]
            assert failed.error and "503 Service Unavailable" in failed.error
            assert any("503" in n for n in app.notices)
            assert [t.content for t in app.state.turns if t.role == "user"] == ["hi", "again"]

            await pilot.press("ctrl+r")  # the next try works, on the same conversation
            await finished(pilot)
            assert app.state.turns[-1].content == "".join(REPLY) and app.state.turns[-1].error is None
            sent = fake.bodies[-1]["messages"]
            assert [m["content"] for m in sent] == ["hi", "".join(REPLY), "again"]

            # Mid-reply: a settings change waits for the next reply and says so; Esc keeps the partial reply.
            fake.modes = ["forever"]
            await send(pilot, "go on", wait=False)
            await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) >= 3, timeout=30, what="tokens")
            app.panel.post_message(app.panel.Changed(SamplingSettings(temperature=0.1)))
            await wait_for(pilot, lambda: any("next reply" in n for n in app.notices), what="the notice")
            await pilot.press("escape")
            await finished(pilot)
            partial = app.state.turns[-1]
            assert partial.stats.stop_reason == STOP_CANCELLED and partial.content.startswith(" x x x")
            assert app.query(AssistantMessage).last().body.source == partial.content
            assert fake.disconnected.wait(10)
            await send(pilot, "next")
            assert fake.bodies[-1]["temperature"] == 0.1

            saved = store.load(app.state.conv_id).messages
            assert [m.content for m in saved] == [t.content for t in app.state.turns]
            await pilot.press("f8")
            exported = list((tmp_path / "exports").glob("*.md"))
            assert len(exported) == 1 and " x x x" in exported[0].read_text()
    finally:
        store.close()


async def test_tui_load_failure_is_one_line(tmp_path):
    from tests.app.fake_backend import wait_for

    app = remote_app("http://127.0.0.1:9/v1", tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.service.load_error is not None, timeout=30)
        assert app.service.load_error.startswith("cannot reach the server at 127.0.0.1:9: connection refused")


def test_the_remote_side_needs_none_of_the_engine_s_compute():
    from tests.app.test_boundaries import ROOT, TUI_FORBIDDEN, imported_modules

    for name in ("remote.py", "remote_cli.py"):
        path = ROOT / "chatapp" / name
        names = imported_modules(path.read_text(encoding="utf-8"), "chatapp")
        engine = {n for n in names if n == "engine" or n.startswith("engine.")}
        allowed = ("engine.events", "engine.sampling", "engine.errors")
        assert all(n.startswith(allowed) for n in engine), f"{name} imports {sorted(engine)}"
        assert not [n for n in names if n.startswith(TUI_FORBIDDEN)]
