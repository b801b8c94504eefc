"""A scripted ChatBackend for the app tests: fixed replies, fixed timings, recorded settings, honoured cancel.

Every number it reports is a function of the script, never of the clock, so snapshots are stable.
Run it to try the app by hand:  .venv/bin/python -m tests.app.fake_backend [--slow] [--fail-load] [--tools]
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.events import (
    STOP_CANCELLED,
    STOP_EOS,
    STOP_LENGTH,
    Alternative,
    Message,
    TokenEvent,
    ToolCall,
    ToolSpec,
    TurnStats,
)
from engine.sampling import SamplingSettings

if TYPE_CHECKING:
    from textual.app import App
    from textual.pilot import Pilot

    from chatapp.tui.app import ChatApp

DEMO_REPLY = """Here is a small function that reverses a string in **Python**:

```python
def reverse(text: str) -> str:
    return text[::-1]
```

It uses a *slice* with a step of `-1`. Two more ways:

1. `"".join(reversed(text))`
2. a loop that prepends each character
"""

PROBS = (0.97, 0.81, 0.55, 0.93, 0.32, 0.99, 0.12, 0.88, 0.67, 0.74)


def split_tokens(text: str) -> list[str]:
    """Word-sized pieces that join back to `text` exactly."""
    return re.findall(r"\s*\S+|\s+", text)


def prompt_size(messages: Sequence[Message]) -> int:
    return sum(len(split_tokens(m.content)) + 4 for m in messages)


class FakeBackend:
    """Replies with `replies[i]` to the i-th call (cycling), else an echo of the last user message.

    A reply may be a tuple of `ToolCall`s: when the call offers tools, the reply is those calls (one token per
    call, as a model writes its call), else the text "(no tools offered)".

    gated=True: each token waits for `release()`; tests then decide exactly when tokens happen.
    fail_calls: 1-based call numbers that raise after `fail_after` tokens.
    """

    model_name = "fake-7b-q4_0"
    remote = None  # a model in this process, as far as the app can tell
    n_ctx = 2048

    def __init__(
        self,
        replies: Sequence[str | tuple[ToolCall, ...]] = (),
        *,
        token_delay: float = 0.0,
        gated: bool = False,
        fail_calls: Sequence[int] = (),
        fail_after: int = 2,
        warnings: Sequence[str] = (),
        turn_warnings: Sequence[str] = (),
    ) -> None:
        self.replies = list(replies)
        self.token_delay = token_delay
        self.fail_calls = set(fail_calls)
        self.fail_after = fail_after
        self._warnings = list(warnings)
        self.turn_warnings = tuple(turn_warnings)
        self.settings = SamplingSettings()
        self.calls: list[list[Message]] = []
        self.tools_seen: list[list[ToolSpec] | None] = []  # the tools offered to each call
        self.seen_settings: list[SamplingSettings] = []
        """The settings in force just before each token was produced, across all calls."""
        self.cancel_calls = 0
        self._cancel = threading.Event()
        self._gate = threading.Semaphore(0) if gated else None
        self._cached = 0  # prompt + reply tokens of the previous call, as a KV cache would hold

    def release(self, n: int = 1) -> None:
        """Gated mode: let `n` more tokens through."""
        assert self._gate is not None
        for _ in range(n):
            self._gate.release()

    def reply_for(self, call: int, messages: Sequence[Message]) -> str | tuple[ToolCall, ...]:
        if self.replies:
            return self.replies[(call - 1) % len(self.replies)]
        last = next((m.content for m in reversed(messages) if m.role == "user"), "")
        return f"You said: {last}"

    def stream_reply(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None
    ) -> Iterator[TokenEvent | TurnStats]:
        self._cancel.clear()
        self.calls.append(list(messages))
        self.tools_seen.append(list(tools) if tools is not None else None)
        call = len(self.calls)
        script = self.reply_for(call, messages)
        tool_calls: tuple[ToolCall, ...] = ()
        if isinstance(script, tuple):
            tool_calls, script = (script, "") if tools else ((), "(no tools offered)")
        pieces = split_tokens(script) or ["<call>"] * len(tool_calls)
        prompt = prompt_size(messages)
        reused = min(self._cached, prompt - 1) if prompt else 0
        stop, text, decode_ms = STOP_EOS, "", 0.0
        limit = self.settings.max_tokens
        for i, piece in enumerate(pieces):
            if self._gate is not None and not self._gate.acquire(timeout=10):
                raise TimeoutError("fake backend: the test never released the next token")
            if self._cancel.is_set():
                stop = STOP_CANCELLED
                break
            if call in self.fail_calls and i == self.fail_after:
                raise RuntimeError("scripted failure in the fake engine")
            self.seen_settings.append(self.settings)
            if self.token_delay:
                time.sleep(self.token_delay)
            forward_ms = 150.0 if i == 0 else 20.0 + (i % 5) * 2.5
            if i:
                decode_ms += forward_ms + 0.5
            p = PROBS[i % len(PROBS)]
            top = (
                Alternative(1000 + i, piece, p),
                Alternative(7, " the", round((1 - p) * 0.6, 4)),
                Alternative(8, ",", round((1 - p) * 0.3, 4)),
            )
            text += piece
            yield TokenEvent(1000 + i, piece, forward_ms, 0.5, p, top, i)
            if 0 < limit <= i + 1:
                stop = STOP_LENGTH
                break
        generated = len(split_tokens(text)) or (len(tool_calls) if stop != STOP_CANCELLED else 0)
        text = "" if tool_calls else text
        self._cached = prompt + generated
        yield TurnStats(
            prompt_tokens=prompt,
            reused_tokens=reused,
            evaluated_tokens=prompt - reused,
            prefill_ms=150.0,
            ttft_ms=152.0,
            decode_ms=decode_ms,
            generated_tokens=generated,
            stop_reason=stop,
            n_ctx_used=prompt + generated,
            n_ctx=self.n_ctx,
            reply=text,
            warnings=self.turn_warnings,
            tool_calls=tool_calls if stop != STOP_CANCELLED else (),
        )

    def cancel(self) -> None:
        self.cancel_calls += 1
        self._cancel.set()

    def warnings(self) -> list[str]:
        return list(self._warnings)


def factory_for(
    backend: FakeBackend, *, fail: str | None = None, steps: Sequence[str] = ()
) -> Callable[[Callable[[str], None]], FakeBackend]:
    """A backend factory as run_app takes: reports `steps` as progress, then returns `backend` or raises."""

    def factory(progress: Callable[[str], None]) -> FakeBackend:
        for step in steps:
            progress(step)
        if fail is not None:
            raise RuntimeError(fail)
        return backend

    return factory


# ---- helpers for the Pilot tests --------------------------------------------------------------------------


def make_app(
    backend: FakeBackend | None = None,
    *,
    store: object | None = None,
    export_dir: Path | None = None,
    system_prompt: str = "",
    fail_load: str | None = None,
    settings: SamplingSettings | None = None,
    mcp: object | None = None,
) -> ChatApp:
    """The app on a fake backend (a fresh one unless given); `mcp`: a `chatapp.mcp.config.McpSettings`."""
    from chatapp.tui.app import ChatApp

    backend = backend or FakeBackend()
    app = ChatApp(
        factory_for(backend, fail=fail_load),
        model_name=backend.model_name,
        settings=settings or SamplingSettings(),
        system_prompt=system_prompt,
        store=store,
        export_dir=export_dir,
        mcp=mcp,
    )
    record_notices(app)
    return app


def record_notices(app: App) -> None:
    """Keep every notification's text in `app.notices` (run_test hides the toasts themselves)."""
    app.notices = []
    show = app.notify

    def notify(message: object, *args: object, **kwargs: object) -> None:
        app.notices.append(str(message))
        show(message, *args, **kwargs)

    app.notify = notify


async def wait_for(pilot: Pilot, predicate: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Let the app run until `predicate()` holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await pilot.pause(0.01)


async def ready(pilot: Pilot) -> None:
    """Wait for the model to load."""
    await wait_for(pilot, lambda: pilot.app.backend is not None, what="the model to load")
    await pilot.pause()


async def send(pilot: Pilot, text: str, *, wait: bool = True) -> None:
    """Type `text` into the message box and press Enter; by default wait for the whole reply."""
    from chatapp.tui.widgets.prompt_input import PromptInput

    prompt = pilot.app.query_one(PromptInput)
    prompt.focus()
    prompt.set_text(text)
    await pilot.press("enter")
    if wait:
        await finished(pilot)


async def finished(pilot: Pilot) -> None:
    # A generous bound: a real model's first reply in a process may include compiling kernels (CI's cold cache).
    await wait_for(pilot, lambda: not pilot.app.generating, timeout=180, what="the reply to finish")
    await pilot.pause()


def _demo() -> None:
    import argparse
    import tempfile

    from chatapp.tui.launch import run_app

    parser = argparse.ArgumentParser(description="Run the chat app against the fake backend.")
    parser.add_argument("--slow", action="store_true", help="load slowly and stream at ~12 tokens/s")
    parser.add_argument("--fail-load", action="store_true", help="make the model load fail")
    parser.add_argument("--tools", action="store_true", help="the model calls `add` of tests/app/mcp_test_server.py")
    parser.add_argument("--store", type=Path, default=Path(tempfile.gettempdir()) / "chatapp-demo.sqlite")
    args = parser.parse_args()
    replies: list = [DEMO_REPLY]
    mcp = None
    if args.tools:
        import sys

        from chatapp.mcp.config import McpSettings, ServerSpec

        replies = [(ToolCall("call_1", "add", '{"a": 20, "b": 22}'),), "The tool says 20 + 22 = **42**."]
        server = str(Path(__file__).with_name("mcp_test_server.py"))
        mcp = McpSettings((ServerSpec("testtools", sys.executable, (server,)),))
    backend = FakeBackend(replies, token_delay=0.08 if args.slow else 0.02)

    def factory(progress: Callable[[str], None]) -> FakeBackend:
        for step in ("compiling kernels (first start only)…", "loading weights 40%", "loading weights 100%"):
            progress(step)
            time.sleep(0.6 if args.slow else 0.1)
        if args.fail_load:
            raise RuntimeError("fake.gguf: tensor blk.3.attn_q.weight: expected 896×896, file has 896×128")
        return backend

    run_app(
        factory,
        model_name="fake-7b-q4_0",
        settings=SamplingSettings(),
        system_prompt="",
        store_path=args.store,
        mcp=mcp,
    )


if __name__ == "__main__":
    _demo()
