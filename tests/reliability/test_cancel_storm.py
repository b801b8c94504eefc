"""Esc at random moments on the real SmolLM2 through the real TUI, 50 rounds.

Each round starts a reply (a new message, a regenerate or an edit), presses Esc at a random moment (at once,
at the first token, or after a random number of tokens) and checks that the KV cache holds exactly the
conversation on screen followed by the partial reply's ids. Some rounds add an Esc while idle, which must change
nothing. Every tenth round starts a new chat. At the end the next turn, sent through the app, must leave a cache
whose logits match a fresh evaluation.
"""

from __future__ import annotations

import random
import time

import pytest

from chatapp.chat_state import Turn
from chatapp.tui.app import ChatApp
from chatapp.tui.widgets.prompt_input import PromptInput
from chatapp.tui.widgets.sampling_panel import KnobRow
from engine.chat import ChatSession
from engine.events import STOP_CANCELLED, STOP_EOS, STOP_LENGTH, Message
from engine.sampling import SamplingSettings
from tests.app.fake_backend import record_notices, send, wait_for
from tests.engine.compare import assert_cache_matches_fresh
from tests.reliability.support import pilot_waits_briefly

pytestmark = pytest.mark.slow

ROUNDS = 50
SEED = 20240611
SYSTEM = "You are a storyteller. Your answers are long and detailed."
PROMPTS = (
    "Tell me a long story about a dragon who learns to bake bread.",
    "Describe, in great detail, a journey across a desert.",
    "Write a long letter from a sailor to his family.",
    "Explain at length how a steam engine works.",
    "Write the first chapter of a mystery novel set in a lighthouse.",
    "List twenty things to pack for a mountain hike and say why.",
)


def messages_before_reply(app: ChatApp) -> list[Message]:
    """The conversation the last reply answers, as the app sent it: system prompt, then every turn before."""
    state = app.state
    out = [Message("system", state.system_prompt)] if state.system_prompt.strip() else []
    return out + [Message(t.role, t.content) for t in state.turns[:-1] if t.content or t.role == "user"]


def check_cache(chat: ChatSession, app: ChatApp, where: str) -> str:
    """The cache is the prompt of the conversation on screen, then the reply's ids; returns the stop reason."""
    reply = app.state.turns[-1]
    assert reply.role == "assistant" and reply.error is None, f"{where}: {reply.error}"
    stats = reply.stats
    assert stats is not None and stats.stop_reason in (STOP_CANCELLED, STOP_EOS, STOP_LENGTH), where
    assert stats.dropped_messages == 0 and stats.context_shifts == 0, f"{where}: the test outgrew the context"
    prompt = chat.prompt_tokens(messages_before_reply(app))
    ids = [e.token_id for e in reply.tokens]
    assert stats.generated_tokens == len(ids), where
    cached = chat.cached_tokens
    assert cached[: len(prompt)] == prompt, f"{where}: the cache does not start with the visible conversation"
    # A reply cut by max_tokens never evaluates its last token; cancelled and eos replies evaluated them all.
    assert cached[len(prompt) :] == (ids[:-1] if stats.stop_reason == STOP_LENGTH else ids), where
    assert reply.content == stats.reply == chat.model.detokenize(ids), where
    return stats.stop_reason


async def reply_started(pilot, previous: Turn | None, what: str) -> None:
    """Wait until a new reply is under way (or already over: a reply can end before the first look)."""
    app = pilot.app

    def started() -> bool:
        turns = app.state.turns
        new = bool(turns) and turns[-1] is not previous and turns[-1].role == "assistant"
        return new and (app.generating or turns[-1].stats is not None or turns[-1].error is not None)

    await wait_for(pilot, started, timeout=30, what=f"{what} to start a reply (notices: {app.notices[-3:]})")


async def reply_over(pilot, what: str) -> None:
    """Wait until the last reply has its outcome and the app is idle."""
    app = pilot.app
    reply = app.state.turns[-1]
    await wait_for(
        pilot, lambda: not app.generating and (reply.stats or reply.error), timeout=120, what=f"{what}: the end"
    )
    await pilot.pause()


async def test_fifty_stops_at_random_moments_keep_the_cache_exact(smollm2_model, monkeypatch) -> None:
    pilot_waits_briefly(monkeypatch)
    rng = random.Random(SEED)
    settings = SamplingSettings(temperature=0.8, seed=SEED, max_tokens=512)
    chat = ChatSession(smollm2_model, settings)
    app = ChatApp(lambda _progress: chat, model_name="smollm2", settings=settings, system_prompt=SYSTEM)
    record_notices(app)
    presses = {"generating": 0, "idle": 0}
    stops: dict[str, int] = {}
    t0 = time.perf_counter()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.backend is chat, timeout=60, what="the backend")
        for round_no in range(1, ROUNDS + 1):
            where = f"round {round_no} (seed {SEED})"
            if round_no % 10 == 1 and round_no > 1:
                await pilot.press("ctrl+n")
            has_turns = bool(app.state.turns)
            last = app.state.turns[-1] if has_turns else None
            action = rng.choices(["send", "regenerate", "edit"], [6, 2, 2])[0] if has_turns else "send"
            if action == "send":
                await send(pilot, rng.choice(PROMPTS), wait=False)
            elif action == "regenerate":
                await pilot.press("ctrl+r")
            else:
                await pilot.press("ctrl+g")
                app.query_one(PromptInput).set_text(rng.choice(PROMPTS))
                await pilot.press("enter")
            await reply_started(pilot, last, f"{where}: {action}")

            moment = rng.choices(["at once", "first token", "later"], [1, 1, 4])[0]
            if moment == "first token":
                await wait_for(pilot, lambda: app.state.turns[-1].tokens or not app.generating, timeout=120)
            elif moment == "later":  # counted in tokens, not seconds, so a fast machine gets the same moments
                after, reply = rng.randint(2, 150), app.state.turns[-1]
                await wait_for(pilot, lambda r=reply, n=after: len(r.tokens) >= n or not app.generating, timeout=120)
                await pilot.pause(rng.uniform(0, 0.02))  # and anywhere within the next token's forward pass
            presses["generating" if app.generating else "idle"] += 1
            await pilot.press("escape")
            await reply_over(pilot, f"{where}: the stop")
            reason = check_cache(chat, app, f"{where}, {action}, Esc {moment}")
            stops[reason] = stops.get(reason, 0) + 1

            if rng.random() < 0.3:  # Esc with nothing to stop changes nothing
                before = (chat.cached_tokens, [(t.role, t.content) for t in app.state.turns])
                await pilot.press("escape")
                await pilot.pause()
                presses["idle"] += 1
                assert not app.generating
                assert (chat.cached_tokens, [(t.role, t.content) for t in app.state.turns]) == before, where

        storm_s = time.perf_counter() - t0
        # The cache after the last stop, partial reply included, matches a fresh evaluation.
        assert_cache_matches_fresh(chat)

        # The next turn goes through the app as usual: greedy, one token, so the cache is exactly its prompt.
        await pilot.press("f2")
        app.query_one("#knob-temperature", KnobRow).focus()
        await pilot.press("0", "enter")
        app.query_one("#knob-max_tokens", KnobRow).focus()
        await pilot.press("1", "enter")
        await pilot.press("f2")
        await wait_for(pilot, lambda: (chat.settings.temperature, chat.settings.max_tokens) == (0.0, 1))
        last = app.state.turns[-1]
        await send(pilot, "Go on.", wait=False)
        await reply_started(pilot, last, "the turn after the storm")
        await reply_over(pilot, "the turn after the storm")
        assert check_cache(chat, app, "the turn after the storm") in (STOP_LENGTH, STOP_EOS)
        assert chat.cached_tokens == chat.prompt_tokens(messages_before_reply(app))
        assert_cache_matches_fresh(chat)
        assert not [n for n in app.notices if "fail" in n.lower() or "couldn't" in n.lower()], app.notices

    print(f"\ncancel storm: {ROUNDS} rounds in {storm_s:.0f} s; presses {presses}; stops {stops}")
    assert presses["generating"] >= ROUNDS * 3 // 4 and presses["idle"] >= 5, presses
    assert stops.get(STOP_CANCELLED, 0) >= ROUNDS // 2, stops
