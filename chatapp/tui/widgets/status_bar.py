"""The status line: the model and what it is doing, and the live numbers of the reply in progress."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Static

from chatapp.chat_state import LiveMetrics, fmt_ms, fmt_rate
from engine.events import TurnStats

STATE_STYLES = {
    "loading": ("◌", "$warning"),
    "ready": ("●", "$success"),
    "generating": ("●", "$accent"),
    "stopping": ("●", "$warning"),
    "failed": ("✕", "$error"),
}


class StatusBar(Horizontal):
    """One line under the input. `set_state` for the left side; `show_live` / `show_stats` for the right."""

    def __init__(self, model_name: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model_name = model_name
        self.remote = ""
        """Where a remote model runs ("remote · vLLM"); "" for the local engine."""
        self.n_ctx: int | None = None
        self.tools = ""
        """The MCP tools offered ("3 tools"); "" without servers."""
        self.reply_format = ""
        """What replies must match ("json schema", "grammar"); "" for free text."""
        self._last: TurnStats | None = None
        self._state = ("loading", "")

    def compose(self) -> ComposeResult:
        yield Static("", id="status-left", markup=False)
        yield Static("", id="status-right", markup=False)

    def set_state(self, state: str, detail: str = "") -> None:
        """`state`: loading | ready | generating | stopping | failed; `detail`: e.g. a progress line."""
        self._state = (state, detail)
        dot, style = STATE_STYLES.get(state, ("●", "$text-muted"))
        self.set_classes(f"-{state}")
        parts = [(f"{dot} {state}  ", style)]
        if self.remote:
            parts.append((f"{self.remote}  ", "$accent"))
        parts.append((self.model_name, "bold"))
        if self.tools:
            parts += [("  ", ""), (f"⚙ {self.tools}", "$text-accent")]
        if self.reply_format:
            parts += [("  ", ""), (f"{{}} {self.reply_format}", "$text-accent")]
        if detail:
            parts += [("  ", ""), (detail, "$text-muted")]
        self.query_one("#status-left", Static).update(Content.assemble(*parts))

    def refresh_state(self) -> None:
        """Show the left side again (after `tools` or `reply_format` changed)."""
        self.set_state(*self._state)

    def _ctx(self) -> str:
        if self._last is not None and not self._last.n_ctx:  # a server that does not say its context size
            return f"ctx {self._last.n_ctx_used:,}"
        if self._last is not None:
            return f"ctx {self._last.n_ctx_used:,}/{self._last.n_ctx:,}"
        return f"ctx 0/{self.n_ctx:,}" if self.n_ctx else ""

    def _right(self, fields: list[str]) -> None:
        text = " │ ".join(f for f in fields if f)
        self.query_one("#status-right", Static).update(Content(text))

    def show_live(self, metrics: LiveMetrics) -> None:
        """While generating: speed from the token timings, tokens so far, time to first token."""
        ttft = f"TTFT {fmt_ms(metrics.ttft_ms)}" if metrics.ttft_ms is not None else "waiting for first token"
        rate = f"{fmt_rate(metrics.tok_s)} tok/s" if metrics.tok_s else ""
        self._right([rate, f"{metrics.tokens} tokens", ttft, self._ctx()])

    def show_stats(self, stats: TurnStats | None) -> None:
        """After a reply: its final numbers, context use and how much of the prompt came from the cache."""
        self._last = stats
        if stats is None:
            self._right([self._ctx()])
            return
        self._right(
            [
                f"{fmt_rate(stats.decode_tok_s)} tok/s",
                f"{stats.generated_tokens} tokens",
                f"TTFT {fmt_ms(stats.ttft_ms)}",
                self._ctx(),
                # A server that sends no usage leaves the prompt unknown (0): say nothing rather than 0/0.
                f"cache {stats.reused_tokens:,}/{stats.prompt_tokens:,} reused" if stats.prompt_tokens else "",
            ]
        )
