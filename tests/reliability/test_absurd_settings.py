"""Absurd settings are refused or clamped, with a message that names them, before anything big is allocated."""

from __future__ import annotations

import subprocess
import tracemalloc
from pathlib import Path

import numba
import pytest

from chatapp import cli
from engine import SettingsError, load_model
from engine import loader as engine_loader
from engine.chat import ChatSession
from engine.events import STOP_EOS, STOP_LENGTH, Message, TokenEvent, TurnStats
from engine.runtime import configure_threads
from engine.sampling import SamplingSettings
from tests.reliability.support import PYTHON, REPO, child_env

pytestmark = pytest.mark.slow

MISSING = "/nonexistent/model.gguf"  # checks that must come before the file is even opened use this path


@pytest.fixture
def all_threads_after():
    """Tests here change Numba's process-wide thread count; put it back to all cores."""
    yield
    configure_threads(None)


def _peak_mb(fn) -> float:
    """Peak traced allocation (Python and NumPy) while `fn` runs, in MiB."""
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


# ---- the model: context size and threads ----------------------------------------------------------------


@pytest.mark.parametrize("n_ctx", [0, -1, -(10**9), 2.5, "2048", None])
def test_a_context_size_that_is_not_a_positive_integer_is_refused_before_the_file_is_read(n_ctx) -> None:
    with pytest.raises(SettingsError, match="context size must be a positive number of tokens"):
        load_model(MISSING, n_ctx=n_ctx)


def test_negative_threads_are_refused_before_the_file_is_read(all_threads_after) -> None:
    with pytest.raises(SettingsError, match=r"threads must be positive \(got -3\)"):
        load_model(MISSING, threads=-3)


def test_a_huge_context_is_clamped_to_the_trained_one_and_zero_threads_means_all_cores(
    smollm2_path: Path, all_threads_after
) -> None:
    configure_threads(1)  # so that "all cores" below is a change, not the state we started in
    models = []
    peak = _peak_mb(lambda: models.append(load_model(smollm2_path, n_ctx=10**9, threads=0)))
    model = models[0]
    trained = model.cfg.n_ctx_train
    assert model.n_ctx == trained == 8192
    assert f"context 1000000000 exceeds the model's trained {trained}; using {trained}" in model.warnings
    assert model.threads == numba.config.NUMBA_NUM_THREADS == numba.get_num_threads()
    assert peak < 200, f"loading allocated {peak:.0f} MiB: something sized by the requested context?"

    chat = ChatSession(model, SamplingSettings(temperature=0.0, max_tokens=3), n_ctx=128)
    assert any("exceeds the model's trained" in w for w in chat.warnings())
    events = list(chat.stream_reply([Message("user", "Hi")]))
    assert isinstance(events[-1], TurnStats) and events[-1].stop_reason in (STOP_EOS, STOP_LENGTH)


def test_a_kv_cache_over_half_the_memory_is_refused_before_the_weights_are_touched(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_loader, "_physical_memory", lambda: 256 * 2**20)  # a 256 MiB machine

    def no_binding(*_args, **_kwargs):
        raise AssertionError("the weights were bound although the context was going to be refused")

    monkeypatch.setattr(engine_loader, "bind_weights", no_binding)
    errors = []

    def load() -> None:
        with pytest.raises(SettingsError) as caught:
            load_model(smollm2_path, n_ctx=10**9)  # clamped to 8192 first: 0.18 GiB of float16 cache
        errors.append(str(caught.value))

    peak = _peak_mb(load)
    assert errors == ["a context of 8192 tokens needs 0.2 GiB of KV cache, more than half of this machine's memory"]
    assert peak < 50, f"{peak:.0f} MiB allocated before the refusal"


@pytest.mark.parametrize("n_ctx", [0, -5, 4096, 10**9])
def test_a_session_context_outside_the_models_is_refused(smollm2_model, n_ctx: int) -> None:
    with pytest.raises(SettingsError, match=rf"session context {n_ctx} must be between 1 and the model's 2048"):
        ChatSession(smollm2_model, n_ctx=n_ctx)


# ---- sampling -------------------------------------------------------------------------------------------


def test_absurd_sampling_values_are_clamped_with_one_message_each() -> None:
    valid, notes = SamplingSettings(top_p=7, temperature=-1, top_k=-5).validated()
    assert (valid.top_p, valid.temperature, valid.top_k) == (1.0, 0.0, 0)
    assert notes == [
        "temperature -1 is below 0 (0 = greedy); using 0.0",  # the meanings come from SAMPLER_SETTINGS
        "top_k -5 is below 0 (0 = off); using 0",
        "top_p 7 is above 1; using 1.0",
    ]
    valid, notes = SamplingSettings(
        min_p=float("nan"), repeat_penalty=0.0, seed=-7, max_tokens=0, repeat_last_n=-9, temperature=float("inf")
    ).validated()
    assert valid == SamplingSettings(repeat_last_n=0)
    assert len(notes) == 6 and all(" using " in n for n in notes)


def test_a_reply_with_absurd_settings_runs_clamped_and_reports_them(smollm2_model) -> None:
    chat = ChatSession(smollm2_model, SamplingSettings(top_p=7, temperature=-1, top_k=-5, max_tokens=4))
    events = list(chat.stream_reply([Message("user", "Name a colour.")]))
    stats = events[-1]
    assert isinstance(stats, TurnStats) and stats.stop_reason in (STOP_EOS, STOP_LENGTH)
    assert [w.split(" ")[0] for w in stats.warnings] == ["temperature", "top_k", "top_p"]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert tokens and all(e.token_id == e.top[0].token_id for e in tokens)  # temperature -1 ran as greedy


# ---- the command line -----------------------------------------------------------------------------------


TEMPERATURE = "between 0 and 100 (0 = greedy)"
REPEAT = "between 0.001 and 1000 (1 = off)"
PENALTY = "between -1000 and 1000"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--top-p", "7", "--temp", "-1"], f"sampling.temperature: expected a number {TEMPERATURE}, got -1.0"),
        (["--top-p", "7"], "sampling.top_p: expected a number between 0 and 1, got 7.0"),
        (["--top-k", "-5"], "sampling.top_k: expected an integer ≥ 0 (0 = off), got -5"),
        (["--presence-penalty=-1e308"], f"sampling.presence_penalty: expected a number {PENALTY}, got -1e+308"),
        (["--repeat-penalty", "5e-324"], f"sampling.repeat_penalty: expected a number {REPEAT}, got 5e-324"),
        (["--temp", "nan"], f"sampling.temperature: expected a number {TEMPERATURE}, got nan"),
        (["-c", "0"], "n_ctx: expected an integer ≥ 1, got 0"),
        (["-t", "-1"], "threads: expected an integer ≥ 0 (0 = all cores), got -1"),
    ],
    ids=["top-p-and-temp", "top-p", "top-k", "presence-penalty", "repeat-penalty", "temp-nan", "ctx-size", "threads"],
)
def test_the_cli_refuses_out_of_range_values_in_one_line(tmp_path: Path, args: list[str], named: str) -> None:
    """`chatapp run` checks options against the settings schema before loading anything: one line, status 2."""
    done = subprocess.run(
        [PYTHON, "-m", "chatapp", "run", "-m", MISSING, "-p", "hi", *args],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [f"chatapp: error: command line: {named}"]


def test_the_cli_clamps_a_huge_context_with_a_warning_and_runs(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str], all_threads_after
) -> None:
    status = cli.main(
        ["run", "-m", str(smollm2_path), "-c", str(10**9), "-t", "0", "-n", "3", "--temp", "0", "-p", "Hello"]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "chatapp: warning: context 1000000000 exceeds the model's trained 8192; using 8192" in err.splitlines()
    assert "prompt eval time" in err and "context " in err and "/8192" in err
    assert out.startswith("Hello") and len(out.strip()) > len("Hello")
