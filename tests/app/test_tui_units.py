"""The app's pure parts: the worker bodies, the saved stats format, the recorder, the sampling knobs."""

from __future__ import annotations

import threading

import pytest

from chatapp.chat_state import (
    ChatState,
    LiveMetrics,
    Turn,
    code_blocks,
    latency_summary,
    stats_from_dict,
    stats_line,
    stats_to_dict,
)
from chatapp.errors import describe_error
from chatapp.recorder import Recorder
from chatapp.tui.messages import ModelFailed, ModelLoading, ModelReady, ReplyFailed, ReplyFinished, TokenReceived
from chatapp.tui.widgets.sampling_panel import KNOBS_BY_NAME, apply_knob
from chatapp.tui.worker import load_backend, stream_turn
from engine.errors import ModelFileError
from engine.events import STOP_CANCELLED, STOP_EOS, Alternative, Message, TokenEvent, TurnStats
from engine.sampling import SamplingSettings
from tests.app.fake_backend import FakeBackend, factory_for


def token(i: int, text: str, ms: float = 20.0) -> TokenEvent:
    return TokenEvent(100 + i, text, ms, 0.5, 0.5, (Alternative(100 + i, text, 0.5), Alternative(1, "x", 0.2)), i)


STATS = TurnStats(
    prompt_tokens=30,
    reused_tokens=20,
    evaluated_tokens=10,
    prefill_ms=50.0,
    ttft_ms=55.0,
    decode_ms=100.0,
    generated_tokens=3,
    stop_reason=STOP_EOS,
    n_ctx_used=33,
    n_ctx=512,
    reply="a b c",
    warnings=("w",),
)


# ---- worker bodies -----------------------------------------------------------------------------------------


def test_stream_turn_posts_tokens_then_stats():
    posted = []
    stream_turn(FakeBackend(["x y"]), [Message("user", "hi")], 7, posted.append)
    assert [type(m) for m in posted] == [TokenReceived, TokenReceived, ReplyFinished]
    assert all(m.turn == 7 for m in posted)
    assert [m.event.text for m in posted[:2]] == ["x", " y"]
    assert posted[-1].stats.reply == "x y"
    assert posted[0].elapsed_ms >= 0


def test_stream_turn_turns_exceptions_and_missing_stats_into_failures():
    posted = []
    stream_turn(FakeBackend(["a b c d"], fail_calls=[1], fail_after=1), [], 1, posted.append)
    assert [type(m) for m in posted] == [TokenReceived, ReplyFailed]
    assert posted[-1].error == "RuntimeError: scripted failure in the fake engine"

    class NoStats:
        def stream_reply(self, messages):
            yield token(0, "a")

    posted.clear()
    stream_turn(NoStats(), [], 2, posted.append)
    assert isinstance(posted[-1], ReplyFailed) and "without its statistics" in posted[-1].error


def test_stream_turn_repeats_a_cancel_that_came_before_the_stream_started():
    backend = FakeBackend(["a b c d e"])
    stop = threading.Event()
    stop.set()
    backend.cancel()  # forgotten: stream_reply clears it when it starts
    posted = []
    stream_turn(backend, [], 1, posted.append, stop)
    assert [m.event.text for m in posted if isinstance(m, TokenReceived)] == ["a"]
    assert posted[-1].stats.stop_reason == STOP_CANCELLED


def test_load_backend_reports_progress_then_ready_or_failed():
    backend = FakeBackend()
    posted = []
    load_backend(factory_for(backend, steps=["compiling", "weights 50%"]), posted.append)
    assert [m.text for m in posted if isinstance(m, ModelLoading)] == ["compiling", "weights 50%"]
    assert isinstance(posted[-1], ModelReady) and posted[-1].backend is backend

    def broken(progress):
        raise ModelFileError("m.gguf: tensor token_embd.weight: expected 2 dims, file has 3")

    posted.clear()
    load_backend(broken, posted.append)
    assert posted == [posted[0]] and isinstance(posted[0], ModelFailed)
    assert posted[0].error == "m.gguf: tensor token_embd.weight: expected 2 dims, file has 3"


def test_describe_error_is_one_line():
    assert describe_error(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert describe_error(MemoryError()) == "MemoryError"


# ---- state ------------------------------------------------------------------------------------------------


def test_stats_round_trip_through_the_store_format():
    tokens = [token(0, "a", 50.0), token(1, " b"), token(2, " c")]
    data = stats_to_dict(STATS, tokens)
    assert data["decode_tok_s"] == STATS.decode_tok_s and data["stop_reason"] == STOP_EOS
    stats, back, error = stats_from_dict(data)
    assert stats == STATS and back == tokens and error is None

    data = stats_to_dict(None, tokens[:1], "boom")
    stats, back, error = stats_from_dict(data)
    assert stats is None and back == tokens[:1] and error == "boom"
    assert stats_to_dict(None, [], None) is None


@pytest.mark.parametrize(
    "data", [None, "text", [], {"tokens": "nope"}, {"stop_reason": "eos"}, {"tokens": [{"text": "a"}]}]
)
def test_malformed_saved_stats_read_as_missing(data):
    stats, tokens, error = stats_from_dict(data)
    assert stats is None and tokens == [] and error is None


def test_backend_messages_skip_empty_replies_and_add_the_system_prompt():
    state = ChatState(system_prompt="sys")
    state.turns = [Turn("user", "a"), Turn("assistant", ""), Turn("user", "b"), Turn("assistant", "c")]
    assert state.backend_messages() == [
        Message("system", "sys"),
        Message("user", "a"),
        Message("user", "b"),
        Message("assistant", "c"),
    ]
    state.turns[0].msg_id, state.turns[2].msg_id = 11, None
    assert state.saved_id_before(3) == 11 and state.saved_id_before(0) is None


def test_live_metrics_count_decode_speed_after_the_first_token():
    m = LiveMetrics()
    assert m.tok_s == 0.0
    m.add(TokenEvent(1, "a", 500.0, 0.5, 1.0), elapsed_ms=510.0)  # the prefill token
    m.add(TokenEvent(2, "b", 19.5, 0.5, 1.0), elapsed_ms=530.0)
    m.add(TokenEvent(3, "c", 19.5, 0.5, 1.0), elapsed_ms=550.0)
    assert m.ttft_ms == 510.0 and m.tokens == 3 and m.tok_s == pytest.approx(50.0)


def test_stats_line_and_latency_summary():
    assert stats_line(STATS) == "prefill 200.0 tok/s · decode 20.0 tok/s · TTFT 55 ms · 3 tokens · stop: eos"
    assert latency_summary([]) == "no decode steps"
    assert latency_summary([1.0, 2.0, 3.0, 10.0]).startswith("median 2.5 ms · p95 10.0 ms")


def test_code_blocks():
    md = "text\n\n```python\nprint(1)\n```\n\n    indented\n\n```\nplain\nlines\n```\n"
    blocks = code_blocks(md)
    assert [(b.language, b.code) for b in blocks] == [
        ("python", "print(1)\n"),
        ("", "indented\n"),
        ("", "plain\nlines\n"),
    ]
    assert blocks[2].label == "text, 2 lines"


# ---- recorder ---------------------------------------------------------------------------------------------


class SpyStore:
    def __init__(self):
        self.calls = []
        self.next_id = 0

    def _id(self):
        self.next_id += 1
        return self.next_id

    def create(self, title, model, system_prompt=""):
        self.calls.append(("create", title, model, system_prompt))
        return self._id()

    def add_message(self, conv_id, role, content, stats=None):
        self.calls.append(("add", conv_id, role, content, stats is not None))
        return self._id()

    def update_message(self, msg_id, content, stats=None):
        self.calls.append(("update", msg_id, content, stats is not None))


def test_recorder_saves_at_first_token_then_every_half_second_then_with_stats():
    now = [0.0]
    store = SpyStore()
    rec = Recorder(store, report=pytest.fail, clock=lambda: now[0])
    state = ChatState(model="m", system_prompt="s")
    user = Turn("user", "Hello there\nmore")
    rec.add_user(state, user)
    assert state.conv_id == 1 and user.msg_id == 2 and state.title == "Hello there"
    reply = Turn("assistant", "a")
    for t, text in [(0.0, "a"), (0.2, "ab"), (0.4, "abc"), (0.6, "abcd"), (0.7, "abcde")]:
        now[0] = t
        reply.content = text
        rec.reply_progress(state.conv_id, reply)
    reply.stats = STATS
    rec.reply_done(state.conv_id, reply)
    assert store.calls == [
        ("create", "Hello there", "m", "s"),
        ("add", 1, "user", "Hello there\nmore", False),
        ("add", 1, "assistant", "a", False),
        ("update", 3, "abcd", False),
        ("update", 3, "abcde", True),
    ]


def test_recorder_reports_each_store_problem_once_and_carries_on():
    class Broken(SpyStore):
        def add_message(self, *args, **kwargs):
            raise OSError("disk full")

    reports = []
    rec = Recorder(Broken(), report=reports.append)
    state = ChatState()
    for text in ("one", "two"):
        rec.add_user(state, Turn("user", text))
    assert reports == ["Couldn't save the message: disk full"]
    assert Recorder(None, report=pytest.fail).conversations() == []


# ---- sampling knobs ---------------------------------------------------------------------------------------


def test_knobs_clamp_and_step():
    temp, top_k = KNOBS_BY_NAME["temperature"], KNOBS_BY_NAME["top_k"]
    assert temp.stepped(0.0, -1) == 0.0 and temp.stepped(0.8, 1) == 0.85 and temp.stepped(0.8, 1, big=True) == 1.3
    assert temp.clamp(99) == 5.0 and top_k.clamp(40.4) == 40 and isinstance(top_k.clamp(3.0), int)
    seed = KNOBS_BY_NAME["seed"]
    assert seed.stepped(-1, 1) == 0 and seed.stepped(0, -1) == -1 and seed.stepped(-1, -1) == -1
    assert seed.show(-1) == "random" and seed.parse("random") == -1
    max_tokens = KNOBS_BY_NAME["max_tokens"]
    assert max_tokens.stepped(512, 1, hi=2048) == 576
    assert max_tokens.stepped(2000, 1, hi=2048) == 2048
    assert max_tokens.stepped(2048, 1, hi=2048) == -1
    assert max_tokens.stepped(-1, -1, hi=2048) == 2048 and max_tokens.stepped(-1, 1, hi=2048) == -1
    assert max_tokens.stepped(1, -1) == 1
    assert max_tokens.show(-1) == "unlimited" and max_tokens.show(2048) == "2,048"
    with pytest.raises(ValueError):
        top_k.parse("2.5")
    with pytest.raises(ValueError):
        temp.parse("warm")


def test_apply_knob_builds_new_settings():
    before = SamplingSettings()
    after = apply_knob(before, "top_p", 1.7)
    assert after.top_p == 1.0 and before.top_p == 0.95 and after.temperature == before.temperature
    assert apply_knob(before, "max_tokens", 10_000, max_tokens_cap=4096).max_tokens == 4096


def test_the_panel_offers_every_sampler_the_cli_and_engine_have_with_the_same_meaning() -> None:
    """The config, the CLI, the panel and the engine read one declaration; check they agree on every value."""
    import dataclasses

    from chatapp.cli import build_parser
    from chatapp.settings import ConfigError, defaults_file, load_settings
    from chatapp.tui.widgets.sampling_panel import KNOBS
    from engine.sampling import SAMPLER_SETTINGS_BY_NAME, SamplingSettings

    engine_fields = [f.name for f in dataclasses.fields(SamplingSettings)]
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    cli = {a.dest: a for a in run._actions if a.dest in engine_fields}
    assert [k.name for k in KNOBS] == list(SAMPLER_SETTINGS_BY_NAME)
    assert set(SAMPLER_SETTINGS_BY_NAME) == set(engine_fields) == set(cli)

    def config_takes(name: str, value: float) -> bool:
        try:
            load_settings({name: value}, config_file=defaults_file(), environ={})
            return True
        except ConfigError:
            return False

    for knob in KNOBS:
        setting = SAMPLER_SETTINGS_BY_NAME[knob.name]
        assert knob.kind is setting.kind is cli[knob.name].type and knob.help == setting.help
        if setting.expected:
            assert setting.expected in cli[knob.name].help
        specials = [v for v, _ in setting.special]
        probes = {knob.lo, knob.hi, *specials, *([] if knob.off is None else [knob.off])}
        probes |= {v + d for v in list(probes) for d in (-1, -0.5, 0.5, 1)}
        for value in sorted(probes):  # the engine, the config and the panel agree on what each value means
            if knob.kind is int and value != int(value):
                continue  # a fraction is a type error for a whole-number setting, not a question of range
            value = knob.kind(value)
            clean = SamplingSettings(**{knob.name: value}).validated()[1] == []
            assert clean == setting.accepts(value) == config_takes(knob.name, value), (knob.name, value)
            in_panel = knob.clamp(value) == value and (value == knob.off or knob.lo <= value <= knob.hi)
            if in_panel:  # every value the panel can set is one the engine and the config take as it is
                assert clean, (knob.name, value)
        for value, meaning in setting.special:
            if knob.kind is int:
                assert knob.show(value) == meaning
            assert f"{value:g} = {meaning}" in setting.expected
