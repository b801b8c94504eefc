"""Reasoning models' <think> blocks: shown collapsed and dimmed while they stream, counted apart in the stats,
and sent back as the model's template says."""

from __future__ import annotations

import pytest
from textual.widgets import Collapsible, Static

from chatapp.tui.thinking import split_thinking, thinking_token_count
from chatapp.tui.widgets.chat_log import AssistantMessage
from engine.events import Message
from engine.template import ChatTemplate
from tests.app.fake_backend import FakeBackend, make_app, ready, send, split_tokens, wait_for

REPLY = "<think>\nThe user asks 2+2. Adding gives four.\n</think>\n\nIt is **4**."


@pytest.mark.parametrize(
    ("text", "streaming", "thinking", "answer", "open", "pending"),
    [
        ("Just an answer.", False, "", "Just an answer.", False, 0),
        (REPLY, False, "The user asks 2+2. Adding gives four.", "It is **4**.", False, 0),
        ("Hmm, four.\n</think>\n\n4", False, "Hmm, four.", "4", False, 0),  # the template opened the block
        ("<think>\nStill going", True, "Still going", "", True, 0),
        ("<thi", True, "", "", False, 4),  # maybe a block opening: held back
        ("The answer is <", True, "", "The answer is <", False, 1),
        ("a < b", True, "", "a < b", False, 0),
    ],
)
def test_split(text: str, streaming: bool, thinking: str, answer: str, open: bool, pending: int) -> None:
    split = split_thinking(text, streaming=streaming)
    assert (split.thinking, split.answer, split.open, split.pending) == (thinking, answer, open, pending)


def test_thinking_tokens_are_counted_apart() -> None:
    pieces = split_tokens(REPLY)
    n = thinking_token_count(pieces)
    assert "".join(pieces[:n]).endswith("</think>") and "</think>" not in "".join(pieces[n:])
    assert thinking_token_count(split_tokens("No thinking here.")) == 0


def shown(app) -> tuple[AssistantMessage, Collapsible, str]:
    reply = app.query(AssistantMessage).last()
    box = reply.query_one(".thinking", Collapsible)
    return reply, box, str(box.query_one(".thinking-text", Static).render())


async def test_thinking_streams_collapsed_and_the_answer_stands_alone() -> None:
    backend = FakeBackend([REPLY], gated=True)
    app = make_app(backend)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "What is 2+2?", wait=False)
        backend.release(6)  # into the thinking, before its end
        await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) == 6, what="six tokens")
        # the screen shows a streaming reply REPLY_REFRESH_S apart, not token by token
        await wait_for(pilot, lambda: shown(app)[1].display, what="the thinking box")
        reply, box, text = shown(app)
        assert box.display and box.collapsed and box.title.startswith("Thinking…")
        assert text.startswith("The user asks") and "<think>" not in text
        assert reply.body.source == ""  # nothing of the thinking in the answer
        backend.release(100)
        await wait_for(pilot, lambda: not app.generating, what="the end")
        await pilot.pause()
        reply, box, text = shown(app)
        assert reply.body.source == "It is **4**." and text == "The user asks 2+2. Adding gives four."
        assert box.collapsed and box.title.startswith("Thought")
        meta = str(reply.query_one(".meta", Static).render())
        thinking = thinking_token_count([t.text for t in app.state.turns[-1].tokens])
        assert f"thinking {thinking} tokens · answer {len(app.state.turns[-1].tokens) - thinking} tokens" in meta
        reply.focus()
        await pilot.press("t")  # the key to look inside
        assert not box.collapsed
        await pilot.press("t")
        assert box.collapsed

        # What goes back is the reply as the model wrote it: the template decides what of it the model sees.
        backend.release(100)
        await send(pilot, "And 3+3?")
    assert backend.calls[-1][-2] == Message("assistant", REPLY)


async def test_a_block_the_template_opened_moves_out_of_the_answer_when_it_closes() -> None:
    backend = FakeBackend(["Two and two... four.\n</think>\n\nFour."])
    app = make_app(backend)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "What is 2+2?")
        reply, box, text = shown(app)
        assert reply.body.source == "Four." and text == "Two and two... four." and box.display


QWEN3_LIKE = (  # the part of Qwen3's template that keeps earlier thinking out of the context
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_template_decides_what_of_the_thinking_goes_back() -> None:
    history = [Message("user", "What is 2+2?"), Message("assistant", REPLY), Message("user", "And 3+3?")]
    stripping = ChatTemplate.from_metadata(QWEN3_LIKE, "", "<|im_end|>").render(history, True)
    assert "Adding gives four" not in stripping and "It is **4**." in stripping
    keeping = ChatTemplate.from_metadata(None, "", "<|im_end|>").render(history, True)  # ChatML keeps it
    assert "Adding gives four" in keeping
