"""The live sampling controls: one row per setting, adjustable by keyboard, mouse or typing a value.

Every change posts `SamplingPanel.Changed` with a complete new `SamplingSettings`; the App hands it to the
backend at once (the next sampled token uses it) and shows back the values in force. On a remote server
(`set_remote`) the settings travel with each request instead: the panel says which ones that server honours,
and that a change reaches it with the next reply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Button, Input, Label, Static

from engine.sampling import SAMPLER_SETTINGS, SamplerSetting, SamplingSettings

MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Knob:
    """One adjustable field of SamplingSettings."""

    name: str  # the SamplingSettings field
    label: str
    kind: type  # int or float
    lo: float
    hi: float
    step: float
    big_step: float  # shift+arrow
    help: str
    show: Callable[[float], str] = str  # how the value is shown
    off: float | None = None  # a value outside the range meaning "random" / "unlimited" (-1)
    off_high: bool = False  # `off` lies past `hi` (unlimited) rather than below `lo` (random)

    def clamp(self, value: float, hi: float | None = None) -> float:
        """The value in range (or `off`, which any value at or below it means), of the right type."""
        top = self.hi if hi is None else hi
        if self.off is not None and value <= self.off:
            return self.kind(self.off)
        value = min(max(value, self.lo), top)
        return int(round(value)) if self.kind is int else round(float(value), 4)

    def stepped(self, value: float, steps: int, big: bool = False, hi: float | None = None) -> float:
        """`value` moved by `steps` steps; past the end where `off` sits, the next step is `off`."""
        top = self.hi if hi is None else hi
        off = self.off
        if off is not None and value == off:  # leave "off" towards the range
            back = steps < 0 if self.off_high else steps > 0
            return self.clamp(top if self.off_high else self.lo, hi) if back else value
        new = value + steps * (self.big_step if big else self.step)
        if off is not None and self.off_high and new > top:
            return self.kind(off) if value >= top else self.clamp(top, hi)
        if new < self.lo:
            at_bottom = off is not None and not self.off_high and value <= self.lo
            return self.kind(off) if at_bottom else self.clamp(self.lo, hi)
        return self.clamp(new, hi)

    def parse(self, text: str) -> float:
        text = text.strip().lower()
        if self.off is not None and text in ("off", "random", "none", "inf", "∞", "unlimited"):
            return self.kind(self.off)
        value = float(text)
        if self.kind is int and value != int(value):
            raise ValueError(f"{self.label}: expected a whole number, got {text!r}")
        return value


def _f2(v: float) -> str:
    return f"{v:.2f}"


def _whole(v: float) -> str:
    return f"{v:.0f}"


def _grouped(v: float) -> str:
    return f"{v:,.0f}"


@dataclass(frozen=True)
class Look:
    """How the panel presents a setting; what its values are and mean comes from `SAMPLER_SETTINGS`."""

    label: str
    step: float
    big_step: float
    lo: float | None = None  # the slider's own end, inside the setting's range (None: the setting's)
    hi: float | None = None
    off_high: bool = False  # the setting's value below its range sits past the slider's top (-1 = unlimited)
    number: Callable[[float], str] = _whole  # how an ordinary value is shown


LOOKS: dict[str, Look] = {
    "temperature": Look("Temperature", 0.05, 0.5, hi=5.0, number=_f2),
    "top_k": Look("Top-k", 1, 10, hi=1000),
    "top_p": Look("Top-p", 0.01, 0.1, number=_f2),
    "min_p": Look("Min-p", 0.01, 0.1, number=_f2),
    "repeat_penalty": Look("Repeat penalty", 0.01, 0.1, lo=1.0, hi=3.0, number=_f2),
    "presence_penalty": Look("Presence penalty", 0.05, 0.5, lo=-2.0, hi=2.0, number=_f2),
    "frequency_penalty": Look("Freq. penalty", 0.05, 0.5, lo=-2.0, hi=2.0, number=_f2),
    "repeat_last_n": Look("Penalty window", 16, 256, hi=32768, off_high=True),
    "seed": Look("Seed", 1, 100, hi=MAX_SEED),
    "max_tokens": Look("Max tokens", 64, 512, hi=1_000_000, off_high=True, number=_grouped),
}


def knob_for(setting: SamplerSetting, look: Look) -> Knob:
    """A panel row for `setting`: its range, the value below it ("off") and the words for its special values;
    floats show their number, whole numbers the special value's meaning (0 → "off", -1 → "random")."""
    lo = setting.low if look.lo is None else look.lo
    hi = setting.high if look.hi is None else look.hi
    assert lo is not None and hi is not None, f"{setting.name}: the panel needs both ends of a range"
    off = next((v for v, _ in setting.special if setting.low is not None and v < setting.low), None)
    words = dict(setting.special) if setting.kind is int else {}

    def show(v: float) -> str:
        return words.get(v) or look.number(v)

    return Knob(
        setting.name, look.label, setting.kind, lo=lo, hi=hi, step=look.step, big_step=look.big_step,
        help=setting.help, show=show, off=off, off_high=look.off_high,
    )  # fmt: skip


KNOBS: tuple[Knob, ...] = tuple(knob_for(s, LOOKS[s.name]) for s in SAMPLER_SETTINGS)
KNOBS_BY_NAME = {k.name: k for k in KNOBS}


def apply_knob(
    settings: SamplingSettings, name: str, value: float, max_tokens_cap: int | None = None
) -> SamplingSettings:
    """A new SamplingSettings with `name` set to `value`, clamped to its range."""
    knob = KNOBS_BY_NAME[name]
    hi = max_tokens_cap if name == "max_tokens" and max_tokens_cap else None
    change: dict[str, Any] = {name: knob.clamp(value, hi)}  # an int for the int fields (Knob.clamp)
    return dataclasses.replace(settings, **change)


class Stepper(Static):
    """The clickable ◀ / ▶ of a row."""

    def __init__(self, symbol: str, steps: int, *, classes: str) -> None:
        super().__init__(symbol, classes=classes, markup=False)
        self.steps = steps

    def on_click(self, event: events.Click) -> None:
        event.stop()
        row = self.parent
        if isinstance(row, KnobRow):
            row.focus()
            row.adjust(self.steps, big=event.shift)


class KnobRow(Horizontal, can_focus=True):
    """One setting: ←/→ (or -/+) step it, shift for bigger steps, Enter or a digit to type a value."""

    BINDINGS = [
        Binding("left,minus", "step(-1)", "Less", show=False),
        Binding("right,plus,equals_sign", "step(1)", "More", show=False),
        Binding("shift+left", "step(-1, True)", show=False),
        Binding("shift+right", "step(1, True)", show=False),
        Binding("enter", "edit", "Type a value", show=False),
    ]

    class Changed(Message):
        def __init__(self, name: str, value: float) -> None:
            super().__init__()
            self.name = name
            self.value = value

    value: reactive[float] = reactive(0.0, init=False)
    """The value in force (set by the panel after the App applied it)."""

    def __init__(self, knob: Knob, value: float) -> None:
        super().__init__(id=f"knob-{knob.name}")
        self.knob = knob
        self.set_reactive(KnobRow.value, value)
        self.max_hi: float | None = None  # a tighter upper bound known at run time (max_tokens: n_ctx)
        self.support = ""  # on a remote server: how it treats this setting (shown under the help)

    def compose(self) -> ComposeResult:
        yield Label(self.knob.label, classes="knob-name")
        yield Stepper("◀", -1, classes="knob-dec")
        yield Label(self.knob.show(self.value), classes="knob-value")
        yield Stepper("▶", 1, classes="knob-inc")
        editor = Input(classes="knob-input", compact=True)
        editor.display = False
        yield editor

    def watch_value(self, value: float) -> None:
        self.query_one(".knob-value", Label).update(self.knob.show(value))

    def adjust(self, steps: int, big: bool = False) -> None:
        new = self.knob.stepped(self.value, steps, big, self.max_hi)
        if new != self.value:
            self.value = new  # at once, so a key repeat steps on from here; the panel confirms it
            self.post_message(self.Changed(self.knob.name, new))

    def action_step(self, steps: int, big: bool = False) -> None:
        self.adjust(steps, big)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        event.stop()
        self.adjust(1)

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        event.stop()
        self.adjust(-1)

    def on_click(self, event: events.Click) -> None:
        if event.chain >= 2 or (event.widget is not None and "knob-value" in event.widget.classes):
            self.action_edit()

    # ---- typing a value -------------------------------------------------------------------------------

    def action_edit(self, initial: str | None = None) -> None:
        editor = self.query_one(Input)
        editor.value = initial if initial is not None else self.knob.show(self.value).replace(",", "")
        self.query_one(".knob-value").display = False
        editor.display = True
        editor.focus()
        editor.cursor_position = len(editor.value)

    def on_key(self, event: events.Key) -> None:
        if self.query_one(Input).display:
            if event.key == "escape":
                event.stop()
                self._close_editor()
            return
        if event.character and (event.character.isdigit() or event.character == "."):
            event.stop()
            self.action_edit(event.character)

    def _close_editor(self) -> None:
        editor = self.query_one(Input)
        if editor.display:
            editor.display = False
            self.query_one(".knob-value").display = True
            self.focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            value = self.knob.parse(event.value)
        except ValueError:
            self.notify(f"{self.knob.label}: {event.value!r} is not a valid value", severity="warning")
            return
        self._close_editor()
        clamped = self.knob.clamp(value, self.max_hi)
        if clamped != value and value != self.knob.off:
            self.notify(f"{self.knob.label}: {value:g} is out of range; using {self.knob.show(clamped)}")
        if clamped != self.value:
            self.value = clamped
            self.post_message(self.Changed(self.knob.name, clamped))

    @on(Input.Blurred)
    def _blurred(self, event: Input.Blurred) -> None:
        self._close_editor()


class SamplingPanel(VerticalScroll, can_focus=False):
    """The side panel. `settings` shows the values in force; edits come out as `Changed`."""

    BINDINGS = [Binding("r", "reset", "Reset defaults")]

    class Changed(Message):
        def __init__(self, settings: SamplingSettings) -> None:
            super().__init__()
            self.settings = settings

    settings: reactive[SamplingSettings] = reactive(SamplingSettings, init=False)
    """The settings in force."""

    def __init__(self, settings: SamplingSettings, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.set_reactive(SamplingPanel.settings, settings)
        self.defaults = settings
        """What reset restores: the settings the app started with (the user's configuration)."""
        self.max_tokens_cap: int | None = None
        self.border_title = "Sampling"
        self.border_subtitle = "F2 closes"

    def compose(self) -> ComposeResult:
        server = Static("", id="knob-server", markup=False)
        server.display = False
        yield server
        for knob in KNOBS:
            yield KnobRow(knob, getattr(self.settings, knob.name))
        yield Static("", id="knob-help", markup=False)
        yield Static("←/→ adjust · shift faster · Enter or a digit types · r resets", id="knob-keys")
        yield Button("Reset to defaults", id="knob-reset", compact=True)

    def watch_settings(self, settings: SamplingSettings) -> None:
        for row in self.query(KnobRow):
            row.value = getattr(settings, row.knob.name)

    def set_max_tokens_cap(self, cap: int | None) -> None:
        self.max_tokens_cap = cap
        self.query_one("#knob-max_tokens", KnobRow).max_hi = cap

    def set_remote(self, server: str, honoured: frozenset[str], ignored: frozenset[str]) -> None:
        """Replies come from `server`: mark each setting honoured (✓), ignored (✕) or unknown (?)."""
        for row in self.query(KnobRow):
            name = row.knob.name
            if name in honoured:
                mark, row.support = "✓", f"{server} honours it."
            elif name in ignored:
                mark, row.support = "✕", f"{server} ignores it (not sent)."
            else:
                mark, row.support = "?", f"Sent; {server} may ignore it."
            row.query_one(".knob-name", Label).update(f"{row.knob.label} {mark}")
            row.set_class(name in ignored, "-ignored")
        box = self.query_one("#knob-server", Static)
        box.update(f"{server}: ✓ honoured · ✕ ignored · ? unknown. A change applies from the next reply.")
        box.display = True
        self.border_subtitle = "remote · F2 closes"

    def focus_first(self) -> None:
        self.query(KnobRow).first().focus()

    @on(KnobRow.Changed)
    def _knob_changed(self, event: KnobRow.Changed) -> None:
        event.stop()
        # Built on the newest settings, and kept at once, so quick changes to two rows both survive.
        self.settings = apply_knob(self.settings, event.name, event.value, self.max_tokens_cap)
        self.post_message(self.Changed(self.settings))

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        row = event.widget if isinstance(event.widget, KnobRow) else None
        if row is not None:
            help_text = f"{row.knob.help}\n{row.support}" if row.support else row.knob.help
            self.query_one("#knob-help", Static).update(help_text)

    def action_reset(self) -> None:
        self.post_message(self.Changed(self.defaults))

    @on(Button.Pressed, "#knob-reset")
    def _reset_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_reset()
