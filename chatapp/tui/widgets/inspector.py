"""The reply inspector: where the time went (prefill vs decode), per-token latency, and every token."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static
from textual.widgets import Sparkline as _Sparkline

from chatapp.chat_state import Turn, decode_latencies, fmt_ms, fmt_rate, latency_summary
from engine.events import TokenEvent, TurnStats

BAR_WIDTH = 40
# Probability → colour, for the table and the coloured text (most likely first).
PROB_COLOURS = ((0.9, "#5fd787"), (0.6, "#afd75f"), (0.3, "#ffd75f"), (0.1, "#ffaf5f"), (0.0, "#ff5f5f"))


UNKNOWN_COLOUR = "#8a8a8a"  # a token whose probability the server did not send (prob < 0)


def prob_colour(p: float) -> str:
    return next((colour for floor, colour in PROB_COLOURS if p >= floor), UNKNOWN_COLOUR)


def fmt_prob(p: float) -> str:
    return f"{p:.3f}" if p >= 0 else "—"


def prob_legend() -> str:
    """Markup for a border subtitle: one swatch per colour band."""
    bands = [f"[{colour}]■[/] ≥{floor:g}" for floor, colour in PROB_COLOURS[:-1]]
    return "  ".join([*bands, f"[{PROB_COLOURS[-1][1]}]■[/] <{PROB_COLOURS[-2][0]:g}"])


def token_repr(text: str) -> str:
    """The token as a Python string literal, so spaces, newlines and empty pieces are visible."""
    return repr(text)


def alternatives(event: TokenEvent, n: int = 4) -> str:
    return "  ".join(f"{a.text!r} {a.prob:.2f}" for a in event.top[:n])


def phase_bars(stats: TurnStats | None, tokens: list[TokenEvent]) -> Content:
    """Prefill and decode as two bars on one time scale, each with its own rate."""
    if stats is None:
        decode_ms = sum(decode_latencies(tokens))
        return Content.assemble(
            ("no turn statistics for this reply", "italic"),
            f"  ·  {len(tokens)} tokens, {fmt_ms(decode_ms)} decoding",
        )
    total = max(stats.prefill_ms + stats.decode_ms, 1e-9)

    def bar(ms: float, style: str) -> tuple[str, str]:
        n = max(1, round(BAR_WIDTH * ms / total)) if ms > 0 else 0
        return ("█" * n + "░" * (BAR_WIDTH - n), style)

    return Content.assemble(
        ("Prefill ", "bold"),
        bar(stats.prefill_ms, "$warning"),
        f"  {fmt_ms(stats.prefill_ms):>8}  {stats.evaluated_tokens:,} tokens evaluated, "
        f"{stats.reused_tokens:,} reused from cache  ·  {fmt_rate(stats.prefill_tok_s)} tok/s\n",
        ("Decode  ", "bold"),
        bar(stats.decode_ms, "$accent"),
        f"  {fmt_ms(stats.decode_ms):>8}  {max(stats.generated_tokens - 1, 0):,} steps after the first "
        f"token  ·  {fmt_rate(stats.decode_tok_s)} tok/s\n",
        *draft_line(stats),
        ("        ", ""),
        (
            f"TTFT {fmt_ms(stats.ttft_ms)}  ·  prompt {stats.prompt_tokens:,} tokens  ·  "
            f"context {stats.n_ctx_used:,}/{stats.n_ctx:,}  ·  stop: {stats.stop_reason}",
            "$text-muted",
        ),
    )


def draft_line(stats: TurnStats) -> tuple[tuple[str, str], ...]:
    """Speculative decoding's share of the reply: guesses accepted and tokens per target pass (or nothing)."""
    if not stats.drafter:
        return ()
    return (
        ("Draft   ", "bold"),
        (
            f"{stats.drafter}: {stats.draft_accepted:,}/{stats.draft_tokens:,} guesses accepted "
            f"({stats.acceptance_rate:.0%})  ·  {stats.tokens_per_pass:.2f} tokens per target pass  ·  "
            f"{stats.target_passes:,} passes"
            + (f"  ·  its prompt {fmt_ms(stats.draft_prefill_ms)}" if stats.draft_prefill_ms else "")
            + "\n",
            "",
        ),
    )


def coloured_reply(tokens: list[TokenEvent]) -> Text:
    """The reply's text with each token coloured by the probability it was sampled with."""
    text = Text()
    for t in tokens:
        text.append(t.text, style=prob_colour(t.prob))
    return text


class Sparkline(_Sparkline):
    """Per-token decode latency."""


class InspectorScreen(Screen[None]):
    """Opened on a reply with `i` (or the command palette). Esc closes."""

    BINDINGS = [
        Binding("escape,q", "app.pop_screen", "Close"),
        Binding("p", "toggle_probability", "Colour by probability"),
    ]

    def __init__(self, turn: Turn, *, title: str) -> None:
        super().__init__()
        self.turn = turn
        self.heading = title

    def compose(self) -> ComposeResult:
        turn, stats = self.turn, self.turn.stats
        latencies = decode_latencies(turn.tokens)
        with Vertical(id="inspector"):
            yield Static(Content.styled(self.heading, "bold"), id="inspector-title")
            yield Static(phase_bars(stats, turn.tokens), id="phase-bars")
            with Horizontal(id="latency-head"):
                yield Static("Decode latency per token (ms)", id="latency-label")
                yield Static(latency_summary(latencies), id="latency-summary")
            yield Sparkline(latencies, summary_function=max, id="latency")
            with VerticalScroll(id="prob-box") as box:
                box.border_title = "Reply coloured by token probability  (p toggles)"
                box.border_subtitle = prob_legend()
                box.display = False
                yield Static(coloured_reply(turn.tokens), id="prob-text")
            yield DataTable(id="tokens", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#tokens", DataTable)
        table.add_column("#", key="index")
        table.add_column("token", key="text")
        table.add_column("id", key="id")
        table.add_column("ms", key="ms")
        table.add_column("prob", key="prob")
        table.add_column("top alternatives", key="top")
        for t in self.turn.tokens:
            colour = prob_colour(t.prob)
            ms = t.forward_ms + t.sample_ms
            table.add_row(
                Text(str(t.index), style="dim"),
                Text(token_repr(t.text), style=colour),
                Text(str(t.token_id) if t.token_id >= 0 else "—", justify="right"),
                Text(f"{ms:.1f}" + (" prefill" if t.index == 0 else " draft" if t.drafted else ""), justify="right"),
                Text(fmt_prob(t.prob), style=colour, justify="right"),
                Text(alternatives(t), style="dim"),
            )
        if not self.turn.tokens:
            self.query_one("#latency-summary", Static).update("no token data for this reply")
        table.focus()

    def action_toggle_probability(self) -> None:
        panel = self.query_one("#prob-box")
        panel.display = not panel.display
