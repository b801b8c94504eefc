"""The chat layer on the real SmolLM2: cache reuse across turns, regenerate/edit, cancel, live settings, overflow."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.chat import ChatSession, common_prefix
from engine.events import STOP_CANCELLED, STOP_CONTEXT, STOP_EOS, STOP_LENGTH, Message, TokenEvent, TurnStats
from engine.kernels import float_products
from engine.sampling import SamplingSettings
from engine.template import ChatTemplate

from .compare import INT8_SHORT_BOUND, assert_cache_exactly_fresh, assert_cache_matches_fresh

GREEDY = SamplingSettings(temperature=0.0, max_tokens=16)
SYSTEM = Message("system", "You are a concise assistant.")


def run(chat: ChatSession, messages: list[Message]) -> tuple[list[TokenEvent], TurnStats]:
    events = list(chat.stream_reply(messages))
    stats = events[-1]
    assert isinstance(stats, TurnStats)
    return events[:-1], stats


@pytest.fixture
def chat(smollm2_model) -> ChatSession:
    return ChatSession(smollm2_model, GREEDY)


@pytest.fixture(params=["exact", "int8"])
def cache_check(request):
    """How a test holds the chat's cache against a fresh evaluation. "exact": the whole test runs with float
    products (no int8 rounding, the per-op path), compared at 1e-3 of the spread. "int8": the default numerics
    and the one-call decode path, at compare.INT8_SHORT_BOUND."""
    if request.param == "exact":
        with float_products():
            yield assert_cache_exactly_fresh
    else:
        yield lambda chat: assert_cache_matches_fresh(chat, INT8_SHORT_BOUND)


def test_follow_up_turn_evaluates_only_new_tokens(chat: ChatSession, cache_check) -> None:
    messages = [SYSTEM, Message("user", "Name a primary colour.")]
    _, first = run(chat, messages)
    assert first.reused_tokens == 0
    assert first.evaluated_tokens == first.prompt_tokens == len(chat.prompt_tokens(messages))

    cached = chat.cached_tokens
    messages += [Message("assistant", first.reply), Message("user", "And another one?")]
    prompt = chat.prompt_tokens(messages)
    _, second = run(chat, messages)
    reusable = common_prefix(cached, prompt)
    assert reusable >= first.prompt_tokens  # at least the whole first prompt
    assert second.reused_tokens == reusable
    assert second.evaluated_tokens == len(prompt) - reusable
    # What is new: the end of the reply, the new user message and the template around it.
    new_user = len(chat.model.tokenize("And another one?"))
    assert second.evaluated_tokens <= new_user + 12

    # Third turn, max_tokens 1 so the cache holds exactly the prompt: compare with a fresh session.
    messages += [Message("assistant", second.reply), Message("user", "Thanks!")]
    chat.settings = replace(GREEDY, max_tokens=1)
    _, third = run(chat, messages)
    assert third.reused_tokens >= second.prompt_tokens
    assert chat.cached_tokens == chat.prompt_tokens(messages)
    cache_check(chat)


def test_regenerate_and_edit_reuse_the_prefix(chat: ChatSession, cache_check) -> None:
    history = [SYSTEM, Message("user", "Say hello."), Message("assistant", "Hello!")]
    messages = [*history, Message("user", "Now say goodbye.")]
    _, first = run(chat, messages)
    prompt = chat.prompt_tokens(messages)
    first_ids = chat.cached_tokens

    _, regen = run(chat, messages)  # regenerate: same conversation again
    assert regen.reused_tokens == len(prompt) - 1  # everything but the last token, whose logits start the reply
    assert regen.evaluated_tokens == 1
    assert regen.reply == first.reply and chat.cached_tokens == first_ids  # greedy: the same reply again
    cache_check(chat)

    edited = [*history, Message("user", "Now say good night.")]
    edited_prompt = chat.prompt_tokens(edited)
    _, edit = run(chat, edited)
    history_len = len(chat.prompt_tokens(history, add_generation_prompt=False))
    assert edit.reused_tokens >= history_len
    assert edit.reused_tokens == common_prefix(prompt, edited_prompt)
    assert edit.evaluated_tokens == len(edited_prompt) - edit.reused_tokens
    assert chat.cached_tokens[: len(edited_prompt)] == edited_prompt
    cache_check(chat)


def check_cancel_keeps_the_reply(chat: ChatSession, cache_check) -> None:
    """Cancelled after 5 shown tokens: the cache holds the prompt and exactly those tokens' ids, and the next
    turn continues from it, its cache held to a fresh evaluation by `cache_check`."""
    chat.settings = replace(GREEDY, max_tokens=64)
    messages = [SYSTEM, Message("user", "Write a long story about a dragon.")]
    prompt = chat.prompt_tokens(messages)
    shown: list[TokenEvent] = []
    stats = None
    for event in chat.stream_reply(messages):
        if isinstance(event, TokenEvent):
            shown.append(event)
            if len(shown) == 5:
                chat.cancel()
        else:
            stats = event
    assert stats is not None and stats.stop_reason == STOP_CANCELLED
    assert len(shown) == 5
    ids = [e.token_id for e in shown]
    assert chat.cached_tokens == prompt + ids
    assert "".join(e.text for e in shown) == stats.reply == chat.model.detokenize(ids)

    # The partial reply becomes the assistant message; the next turn starts from the cache and stays exact.
    chat.settings = replace(GREEDY, max_tokens=1)
    follow = [*messages, Message("assistant", stats.reply), Message("user", "Go on.")]
    _, next_stats = run(chat, follow)
    assert next_stats.reused_tokens >= len(prompt)
    assert chat.cached_tokens == chat.prompt_tokens(follow)
    cache_check(chat)


def test_cancel_keeps_the_visible_conversation_in_the_cache(chat: ChatSession, cache_check) -> None:
    check_cancel_keeps_the_reply(chat, cache_check)


def test_settings_change_mid_reply_applies_to_the_next_token(chat: ChatSession) -> None:
    wild = SamplingSettings(temperature=3.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=40)
    chat.settings = wild
    events = []
    for event in chat.stream_reply([Message("user", "Tell me about the sea.")]):
        if isinstance(event, TokenEvent):
            events.append(event)
            if event.index == 4:
                chat.settings = replace(wild, temperature=0.0, max_tokens=12)
        else:
            stats = event
    assert stats.stop_reason in (STOP_LENGTH, STOP_EOS)
    if stats.stop_reason == STOP_LENGTH:
        assert len(events) == 12  # the new max_tokens took effect
    greedy_part = events[5:]
    assert greedy_part, "the reply ended before the switch"
    assert all(e.token_id == e.top[0].token_id for e in greedy_part)


def test_same_seed_same_reply(smollm2_model) -> None:
    settings = SamplingSettings(temperature=1.0, seed=1234, max_tokens=20)
    messages = [Message("user", "Invent a word.")]
    a = run(ChatSession(smollm2_model, settings), messages)[1].reply
    b = run(ChatSession(smollm2_model, settings), messages)[1].reply
    c = run(ChatSession(smollm2_model, replace(settings, seed=99)), messages)[1].reply
    assert a == b
    assert a != c


def test_token_events_carry_timing_and_alternatives(chat: ChatSession) -> None:
    events, stats = run(chat, [Message("user", "Count to five.")])
    assert events and stats.generated_tokens == len(events)
    for e in events:
        assert e.forward_ms > 0 and e.sample_ms >= 0
        assert 0 < e.prob <= 1
        assert len(e.top) == 5 and e.top[0].prob >= e.top[-1].prob
    assert stats.prefill_ms > 0 and stats.ttft_ms >= stats.prefill_ms
    assert stats.prefill_tok_s > 0
    assert stats.n_ctx_used == len(chat.cached_tokens)


def test_hostile_template_falls_back_to_chatml(smollm2_model, tmp_path) -> None:
    chat = ChatSession(smollm2_model, GREEDY)
    marker = tmp_path / "pwned"
    evil = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    chat.template = ChatTemplate.from_metadata(evil, "<|im_start|>", "<|im_end|>")
    _, stats = run(chat, [Message("user", "Hi")])
    assert not marker.exists()
    assert stats.generated_tokens > 0
    assert any("ChatML" in w for w in chat.warnings())


def test_overflow_keeps_the_system_prompt(smollm2_model) -> None:
    chat = ChatSession(smollm2_model, replace(GREEDY, max_tokens=24), n_ctx=256)
    system = Message("system", "You are a pirate. Always answer like a pirate.")
    system_ids = chat.prompt_tokens([system], add_generation_prompt=False)
    messages = [system]
    shifted = 0
    for turn in range(20):
        messages.append(Message("user", f"Question number {turn}: what is {turn} plus {turn}? Explain briefly."))
        _, stats = run(chat, messages)
        assert stats.stop_reason in (STOP_EOS, STOP_LENGTH)
        assert stats.n_ctx_used <= 256
        assert chat.cached_tokens[: len(system_ids)] == system_ids
        shifted += stats.context_shifts
        messages.append(Message("assistant", stats.reply))
    assert shifted > 0
    assert stats.dropped_messages > 0


def test_repeat_last_n_minus_one_penalises_the_whole_context(smollm2_model) -> None:
    """-1 looks at every token in the context (prompt and reply), as llama.cpp's; 0 turns penalties off."""
    messages = [Message("user", "Say 'the cat' ten times: the cat the cat the cat")]

    def reply_ids(last_n: int) -> tuple[list[int], list[int]]:
        settings = replace(GREEDY, max_tokens=24, presence_penalty=1e6, repeat_last_n=last_n)
        chat = ChatSession(smollm2_model, settings)
        events, _ = run(chat, messages)
        return chat.prompt_tokens(messages), [e.token_id for e in events]

    prompt, off = reply_ids(0)
    assert set(off) & set(prompt) or len(set(off)) < len(off), "the check below could not fail on this prompt"
    prompt, whole = reply_ids(-1)
    assert not set(whole) & set(prompt) and len(set(whole)) == len(whole)


def test_a_reply_that_fills_the_context_stops_with_context(smollm2_model) -> None:
    """One message and no end-of-turn token: nothing can be dropped, so the reply runs until the cache is full and
    ends with STOP_CONTEXT (not STOP_LENGTH: max_tokens is far beyond the context)."""
    n_ctx = 64
    chat = ChatSession(smollm2_model, replace(GREEDY, max_tokens=10_000), n_ctx=n_ctx, stop_ids=())  # as ignore_eos
    events, stats = run(chat, [Message("user", "Count from one upwards.")])
    assert stats.stop_reason == STOP_CONTEXT
    assert stats.context_shifts == 0 and stats.dropped_messages == 0
    # The last token needs no place in the cache: prompt and reply come to one more than the context.
    assert stats.prompt_tokens + stats.generated_tokens == n_ctx + 1
    assert len(events) == stats.generated_tokens
    assert stats.n_ctx_used <= n_ctx


def test_a_message_longer_than_the_context_yields_only_context_stats(smollm2_model) -> None:
    """A message the context cannot hold, even alone: no tokens, one TurnStats saying so, and the cache untouched."""
    n_ctx = 64
    chat = ChatSession(smollm2_model, GREEDY, n_ctx=n_ctx)
    run(chat, [Message("user", "Hi.")])
    cached = list(chat.cached_tokens)
    long = Message("user", "apple " * 200)
    assert len(chat.prompt_tokens([long])) > n_ctx
    events, stats = run(chat, [long])
    assert events == []
    assert stats.stop_reason == STOP_CONTEXT
    assert (stats.prompt_tokens, stats.generated_tokens, stats.reply) == (0, 0, "")
    assert chat.cached_tokens == cached
