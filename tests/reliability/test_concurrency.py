"""The engine is entered by one thread at a time, and never by the UI thread.

`Model.forward` holds the model's lock around `_forward`; two threads driving sessions of the same model must
see the forward pass run strictly one at a time and get exactly what they get alone. In the app, the only
thread that runs the engine is the inference worker: the UI thread may only replace `settings`, call
`cancel()` and read `warnings()`, `n_ctx` and `model_name` (chatapp/backend.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from chatapp.store import ConversationStore
from chatapp.tui.app import ChatApp
from engine.chat import ChatSession
from engine.events import STOP_CANCELLED, Message, TokenEvent, TurnStats
from engine.sampling import SamplingSettings
from tests.app.fake_backend import finished, record_notices, send, wait_for
from tests.reliability.support import pilot_waits_briefly

pytestmark = pytest.mark.slow


class ForwardMonitor:
    """Wraps a model's `_forward` (inside its lock) and records who ran it and how many ran at once."""

    def __init__(self, model) -> None:
        self._real = model._forward
        self._guard = threading.Lock()
        self.inside = 0
        self.peak = 0
        self.entries: list[int] = []  # thread idents, in order of entry

    def __call__(self, ids, cache, start, last_only, rowwise):
        with self._guard:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            self.entries.append(threading.get_ident())
        try:
            time.sleep(0.0005)  # widen the window: without the lock, overlapping entries would be near certain
            return self._real(ids, cache, start, last_only, rowwise)
        finally:
            with self._guard:
                self.inside -= 1


def _decode_job(model, prompt: list[int], steps: int) -> list[np.ndarray]:
    """A session: prefill `prompt`, then greedy single-token evals; every logits vector returned."""
    session = model.session(256)
    out = [session.eval(prompt)]
    for _ in range(steps):
        out.append(session.eval([int(out[-1].argmax())]))
    return out


def _logits_job(model, sequences: Sequence[list[int]]) -> list[np.ndarray]:
    """Fresh-context logits (each call builds its own cache) for several sequences."""
    return [model.logits(ids) for ids in sequences]


def _chat_job(model) -> list[int]:
    chat = ChatSession(model, SamplingSettings(temperature=0.0, max_tokens=8), n_ctx=256)
    return [e.token_id for e in chat.stream_reply([Message("user", "Name three fruits.")]) if isinstance(e, TokenEvent)]


def test_two_threads_never_overlap_in_the_forward_pass_and_match_serial_results(smollm2_model, monkeypatch) -> None:
    model = smollm2_model
    prompt_a = model.tokenize("The quick brown fox jumps over the lazy dog because")
    sequences = [model.tokenize(f"Counting sheep: {n} sheep, {n + 1} sheep,") for n in range(4)]
    jobs = {
        "decode": lambda: _decode_job(model, prompt_a, 20),
        "logits": lambda: _logits_job(model, sequences),
        "chat": lambda: _chat_job(model),
    }
    serial = {name: job() for name, job in jobs.items()}

    monitor = ForwardMonitor(model)
    monkeypatch.setattr(model, "_forward", monitor)
    results: dict[str, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def runner(name: str) -> None:
        try:
            start.wait()
            results[name] = jobs[name]()
        except BaseException as exc:  # reported below, with the thread's name
            errors.append(exc)

    threads = [threading.Thread(target=runner, args=(name,), name=name) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a job hung"
    assert not errors, errors

    assert monitor.peak == 1, f"{monitor.peak} threads were inside the forward pass at once"
    switches = sum(a != b for a, b in zip(monitor.entries, monitor.entries[1:], strict=False))
    assert len(set(monitor.entries)) == len(jobs) and switches >= 5, "the threads did not interleave"
    for got, want in zip(results["decode"], serial["decode"], strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(results["logits"], serial["logits"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert results["chat"] == serial["chat"]


# ---- the app: the UI thread never runs the engine ---------------------------------------------------------


UI_SAFE = {"settings", "settings=", "cancel", "warnings", "n_ctx", "model_name"}


class ThreadLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, threading.Thread]] = []
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self.calls.append((what, threading.current_thread()))

    def on(self, thread: threading.Thread) -> set[str]:
        return {what for what, t in self.calls if t is thread}


class TokenGate:
    """Lets a reply's tokens through only as far as the test allows, so that a reply is still in flight when the
    test acts on it, on a machine of any speed. A cancel opens it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._limit = 0
        self._open = False

    def allow(self, n: int) -> None:
        """The reply in flight (or the next one) may stream its first n tokens."""
        with self._cond:
            self._limit = n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False

    def wait(self, index: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._open or index < self._limit, timeout=120), "gate never opened"


class RecordingBackend:
    """A ChatSession behind the ChatBackend interface, noting which thread makes every call; its replies stream
    through `gate`."""

    remote = None  # a model in this process

    def __init__(self, chat: ChatSession, log: ThreadLog) -> None:
        self._chat = chat
        self._log = log
        self.gate = TokenGate()

    @property
    def model_name(self) -> str:
        self._log.add("model_name")
        return self._chat.model_name

    @property
    def n_ctx(self) -> int:
        self._log.add("n_ctx")
        return self._chat.n_ctx

    @property
    def settings(self) -> SamplingSettings:
        self._log.add("settings")
        return self._chat.settings

    @settings.setter
    def settings(self, value: SamplingSettings) -> None:
        self._log.add("settings=")
        self._chat.settings = value

    def cancel(self) -> None:
        self._log.add("cancel")
        self._chat.cancel()
        self.gate.open()

    def warnings(self) -> list[str]:
        self._log.add("warnings")
        return self._chat.warnings()

    def stream_reply(self, messages: Sequence[Message]) -> Iterator[TokenEvent | TurnStats]:
        self._log.add("stream_reply")
        self.gate.close()
        shown = 0
        for event in self._chat.stream_reply(messages):  # each step of the generator runs on the caller's thread
            self._log.add("stream_reply:step")
            if isinstance(event, TokenEvent):
                self.gate.wait(shown)
                shown += 1
            yield event


async def test_the_ui_thread_never_runs_the_engine(smollm2_model, tmp_path: Path, monkeypatch) -> None:
    pilot_waits_briefly(monkeypatch)
    model = smollm2_model
    log = ThreadLog()
    real_forward = model._forward
    real_tokenize = model.tokenizer.tokenize

    def forward(*args, **kwargs):
        log.add("forward")
        return real_forward(*args, **kwargs)

    def tokenize(*args, **kwargs):
        log.add("tokenize")
        return real_tokenize(*args, **kwargs)

    monkeypatch.setattr(model, "_forward", forward)
    monkeypatch.setattr(model.tokenizer, "tokenize", tokenize)

    settings = SamplingSettings(temperature=0.8, seed=3, max_tokens=200)

    def factory(progress):
        progress("using the loaded SmolLM2")
        return RecordingBackend(ChatSession(model, settings), log)  # made on the worker thread, as the app does

    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    app = ChatApp(factory, model_name="smollm2", settings=settings, store=store)
    record_notices(app)
    ui = threading.current_thread()  # run_test runs the app's event loop here
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None, timeout=60, what="the backend")
            app.backend.gate.allow(3)
            await send(pilot, "Tell me a long story about a lighthouse keeper.", wait=False)
            await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) >= 3, timeout=120, what="three tokens")
            await pilot.press("f2", "right", "right")  # temperature up, twice, mid-reply
            await wait_for(pilot, lambda: app.backend._chat.settings.temperature == pytest.approx(0.9))
            app.backend.gate.allow(6)
            await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) >= 6, timeout=120, what="more tokens")
            assert app.generating  # held at the gate: the Esc below stops a reply in flight
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating, timeout=60, what="the stop")
            await finished(pilot)
            assert app.state.turns[-1].stats.stop_reason == STOP_CANCELLED
            await pilot.press("f2")  # back to the message box
            app.backend.gate.allow(2)
            await send(pilot, "And then?", wait=False)
            await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) >= 2, timeout=120, what="a second reply")
            assert app.generating
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating, timeout=60, what="the second stop")
            assert not [n for n in app.notices if "fail" in n.lower() or "couldn't" in n.lower()], app.notices
    finally:
        store.close()

    on_ui = log.on(ui)
    assert on_ui, "nothing was recorded on the UI thread: the check would prove nothing"
    assert {"settings=", "cancel"} <= on_ui, on_ui  # the UI did change settings and cancel, from its own thread
    assert on_ui <= UI_SAFE, f"the UI thread called into the engine: {sorted(on_ui - UI_SAFE)}"
    workers = {t for what, t in log.calls if what == "forward"}
    assert workers and ui not in workers
    assert {what for what, t in log.calls if t in workers} >= {"stream_reply", "stream_reply:step", "tokenize"}
