"""Speculative decoding (engine/speculative.py, the chat layer's verification): prompt lookup and a draft model.

Greedy replies equal plain decoding's token for token; sampled replies follow the target's distribution (a
chi-square test on a tiny model); the cache holds exactly the accepted tokens after rejections, cancels and
context shifts, and a draft model's cache follows the target's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine import load_model
from engine.chat import ChatSession
from engine.errors import SettingsError
from engine.events import STOP_CANCELLED, STOP_EOS, STOP_LENGTH, Message, TokenEvent, TurnStats
from engine.kernels import float_products
from engine.sampling import Sampler, SamplingSettings, distribution
from engine.sequences import common_prefix
from engine.speculative import PACE_FIRST_PAUSE, CombinedDrafter, LookupDrafter, ModelDrafter, Pace, check_same_vocab

from .compare import assert_cache_exactly_fresh
from .synthetic import write_tiny_model

GREEDY = SamplingSettings(temperature=0.0, max_tokens=48)
CODE = (
    "def add_numbers(a, b):\n    result = a + b\n    print('the result is', result)\n    return result\n\n"
    "def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n"
)
REWRITE = [Message("user", "Rewrite this code with the function scale renamed to multiply_all:\n\n" + CODE)]
STORY = [Message("user", "Tell me a short story about a lighthouse keeper.")]


def run(chat: ChatSession, messages: list[Message]) -> tuple[list[TokenEvent], TurnStats]:
    events = list(chat.stream_reply(messages))
    stats = events[-1]
    assert isinstance(stats, TurnStats)
    return events[:-1], stats


def ids_of(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


def assert_same_greedy(plain: list[int], ours: list[int]) -> None:
    """Token for token the same, near-ties included: a draft check's rows are plain decode's bit for bit
    (tests/engine/test_decode_path.py), so nothing may differ."""
    if ours != plain:
        at = next((i for i, (a, b) in enumerate(zip(plain, ours, strict=False)) if a != b), min(len(plain), len(ours)))
        raise AssertionError(
            f"greedy replies differ from token {at} on: plain {plain[at : at + 5]}, drafted {ours[at : at + 5]}"
        )


class FixedDrafter:
    """Always guesses the same tokens: every guess is checked, most are rejected."""

    name = "fixed"

    def __init__(self, guesses: list[int]) -> None:
        self.guesses = guesses

    def draft(self, context, limit):
        return self.guesses[:limit]

    def feedback(self, drafted, accepted, pass_ms):
        pass

    def follow(self, tokens):
        pass

    def prepare(self, prompt):
        return 0


# -- the acceptance rule -----------------------------------------------------------------------------------


def drafter_of(kind: str, model, n_ctx: int | None = None):
    """A drafter of one of the kinds the app makes: lookup, a draft model (the model itself), or both."""
    if kind == "lookup":
        return LookupDrafter()
    if kind == "draft-model":
        return ModelDrafter(model, model, n_ctx=n_ctx)
    return CombinedDrafter(LookupDrafter(), ModelDrafter(model, model, n_ctx=n_ctx))


def chi_square_bound(df: int, z: float = 4.0) -> float:
    """The chi-square quantile at a normal z (Wilson-Hilferty): z=4 is a false alarm once in ~30,000 runs."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sample_draft_follows_the_target_distribution() -> None:
    """For one logits vector and each kind of guess (likely, unlikely, filtered out), the accepted-or-redrawn
    token has the distribution plain sampling draws from."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(12).astype(np.float32) * 2
    settings = SamplingSettings(temperature=0.9, top_k=6, top_p=1.0, min_p=0.0, seed=0)
    ids, probs = distribution(logits, settings.validated()[0])
    p = np.zeros(12)
    p[ids] = probs
    n = 20000
    for guess in (int(ids[0]), int(ids[3]), int(np.argmin(logits))):
        sampler = Sampler(11)
        counts = Counter()
        accepted = 0
        for _ in range(n):
            res, ok = sampler.sample_draft(logits, settings, (), guess)
            counts[res.token_id] += 1
            accepted += ok
            assert ok == (res.token_id == guess)
        observed = np.array([counts[i] for i in ids])
        assert sum(observed) == n  # nothing outside the filtered set
        chi2 = float(((observed - n * probs) ** 2 / (n * probs)).sum())
        assert chi2 < chi_square_bound(len(ids) - 1), f"guess {guess}: chi-square {chi2:.1f}"
        assert abs(accepted / n - p[guess]) < 4 * math.sqrt(max(p[guess], 1e-9) / n) + 1e-9


def test_sample_draft_greedy_accepts_exactly_the_argmax() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    sampler = Sampler(0)
    assert sampler.sample_draft(logits, GREEDY, (), 1) == (sampler.sample(logits, GREEDY, ()), True)
    res, ok = sampler.sample_draft(logits, GREEDY, (), 2)
    assert (res.token_id, ok) == (1, False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_model(path, "llama", seed=3)
    return load_model(path, n_ctx=128)


@pytest.mark.parametrize("kind", ["draft-model", "fixed-guesses"])
def test_sampled_replies_follow_the_target_distribution(tiny, kind: str) -> None:
    """Three sampled tokens after a prompt, 3000 seeds, with every token after the first checked against a
    draft: the joint frequencies match the target's own probabilities (chi-square over the 27 outcomes)."""
    settings = SamplingSettings(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, max_tokens=3)
    prompt = [40, 41, 42, 43, 40, 41]
    valid = settings.validated()[0]

    def dist(ids: list[int]) -> dict[int, float]:
        top, probs = distribution(tiny.logits(ids)[-1], valid)
        return dict(zip((int(t) for t in top), probs, strict=True))

    exact: dict[tuple[int, ...], float] = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist([*prompt, a]).items():
            for c, pc in dist([*prompt, a, b]).items():
                exact[(a, b, c)] = pa * pb * pc

    if kind == "draft-model":
        drafter = ModelDrafter(tiny, tiny, p_min=0.0)
    else:  # the same two guesses whatever came before: the likeliest path's second and third tokens
        a = max(dist(prompt).items(), key=lambda kv: kv[1])[0]
        b = max(dist([*prompt, a]).items(), key=lambda kv: kv[1])[0]
        c = max(dist([*prompt, a, b]).items(), key=lambda kv: kv[1])[0]
        drafter = FixedDrafter([b, c])
    chat = ChatSession(tiny, settings, drafter=drafter, stop_ids=())  # outcomes are exactly three tokens
    seen: Counter = Counter()
    drafted = accepted = 0
    n = 3000
    for seed in range(n):
        chat.settings = replace(settings, seed=seed)
        events = list(chat.stream_completion(prompt))
        seen[tuple(e.token_id for e in events[:-1])] += 1
        drafted += events[-1].draft_tokens
        accepted += events[-1].draft_accepted
    assert drafted > n // 2 and 0 < accepted < drafted  # the rule was exercised both ways
    assert set(seen) <= set(exact)
    cells = [k for k in exact if exact[k] * n >= 5]  # chi-square needs expected counts of 5 or more
    rest = n * (1 - sum(exact[k] for k in cells))
    observed = [seen[k] for k in cells] + [n - sum(seen[k] for k in cells)]
    expected = [exact[k] * n for k in cells] + [rest]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    assert chi2 < chi_square_bound(len(cells)), f"chi-square {chi2:.1f} over {len(cells) + 1} cells"


# -- greedy on the real models -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lookup", "draft-model", "both"])
@pytest.mark.parametrize("messages", [REWRITE, STORY], ids=["rewrite", "story"])
def test_greedy_equals_plain_decoding(smollm2_model, kind: str, messages) -> None:
    plain_chat = ChatSession(smollm2_model, GREEDY)
    plain_events, plain_stats = run(plain_chat, messages)
    drafter = drafter_of(kind, smollm2_model)
    chat = ChatSession(smollm2_model, GREEDY, drafter=drafter)
    events, stats = run(chat, messages)
    prompt = chat.prompt_tokens(messages)
    assert_same_greedy(ids_of(plain_events), ids_of(events))
    assert stats.reply == plain_stats.reply
    assert chat.cached_tokens == (prompt + ids_of(events))[: len(chat.cached_tokens)]
    if kind != "lookup":  # its own draft: every confident guess is right
        assert stats.draft_accepted > 0 and stats.tokens_per_pass > 1
        assert drafter.cached_tokens == chat.cached_tokens[: len(drafter.cached_tokens)]
    if messages is REWRITE and kind != "draft-model":
        assert stats.draft_accepted > 0
    assert sum(e.drafted for e in events) == stats.draft_accepted


def test_greedy_equals_plain_decoding_on_qwen(qwen_model) -> None:
    plain = ids_of(run(ChatSession(qwen_model, GREEDY), REWRITE)[0])
    chat = ChatSession(qwen_model, GREEDY, drafter=LookupDrafter())
    events, stats = run(chat, REWRITE)
    assert_same_greedy(plain, ids_of(events))
    assert stats.draft_accepted > 0


# -- the cache -----------------------------------------------------------------------------------------------


def test_rejected_guesses_leave_the_cache(smollm2_model) -> None:
    """A drafter that guesses wrong at every step: each rejection truncates, the output is plain decoding's,
    and the cache is exactly fresh (float products, so the comparison is exact)."""
    with float_products():
        settings = replace(GREEDY, max_tokens=12)
        plain = ids_of(run(ChatSession(smollm2_model, settings), STORY)[0])
        chat = ChatSession(smollm2_model, settings, drafter=FixedDrafter([13, 13, 13]))
        events, stats = run(chat, STORY)
        assert stats.draft_tokens > 0 and stats.draft_accepted < stats.draft_tokens
        assert_same_greedy(plain, ids_of(events))
        prompt = chat.prompt_tokens(STORY)
        visible = prompt + ids_of(events)
        assert chat.cached_tokens == visible[: len(chat.cached_tokens)]
        assert len(chat.cached_tokens) >= len(visible) - 1
        assert_cache_exactly_fresh(chat)


@pytest.mark.parametrize("kind", ["lookup", "draft-model", "both"])
def test_cancel_with_guesses_in_flight(smollm2_model, kind: str) -> None:
    """Cancel while accepted and unchecked guesses are in the cache: it keeps exactly the shown tokens, the
    draft model's cache follows, and the next turn is exact."""
    with float_products():
        drafter = drafter_of(kind, smollm2_model)
        chat = ChatSession(smollm2_model, replace(GREEDY, max_tokens=64), drafter=drafter)
        prompt = chat.prompt_tokens(REWRITE)
        shown: list[TokenEvent] = []
        for event in chat.stream_reply(REWRITE):
            if isinstance(event, TokenEvent):
                shown.append(event)
                if len(shown) == 6:
                    chat.cancel()
            else:
                stats = event
        assert stats.stop_reason == STOP_CANCELLED and len(shown) == 6
        assert chat.cached_tokens == prompt + ids_of(shown)
        if kind != "lookup":
            assert chat.cached_tokens[: len(drafter.cached_tokens)] == drafter.cached_tokens
        chat.settings = replace(GREEDY, max_tokens=1)
        follow = [*REWRITE, Message("assistant", stats.reply), Message("user", "Go on.")]
        run(chat, follow)
        assert chat.cached_tokens == chat.prompt_tokens(follow)
        assert_cache_exactly_fresh(chat)


@pytest.mark.parametrize("kind", ["draft-model", "lookup", "both"])
def test_context_shift_with_a_drafter(smollm2_model, kind: str) -> None:
    """Turns that overflow a 256-token context: shifts happen, the system prompt stays, the draft model's cache
    is always a prefix of the target's, the cache holds only shown tokens, and replies end normally."""
    lookup = kind == "lookup"
    drafter = drafter_of(kind, smollm2_model, n_ctx=256)
    chat = ChatSession(smollm2_model, replace(GREEDY, max_tokens=40), n_ctx=256, drafter=drafter)
    system = Message("system", "You are a pirate. Always answer like a pirate.")
    system_ids = chat.prompt_tokens([system], add_generation_prompt=False)
    messages = [system]
    shifted = 0
    for turn in range(12):
        messages.append(Message("user", f"Question {turn}: what is {turn} plus {turn}? Explain briefly."))
        events, stats = run(chat, messages)
        assert stats.stop_reason in (STOP_EOS, STOP_LENGTH)
        assert chat.cached_tokens[: len(system_ids)] == system_ids
        # The cache ends with the shown reply and nothing unchecked (at max_tokens its last token is not in yet).
        ids, cached = ids_of(events), chat.cached_tokens
        assert cached[len(cached) - len(ids) :] == ids or cached[len(cached) - len(ids) + 1 :] == ids[:-1]
        if not lookup:
            assert chat.cached_tokens[: len(drafter.cached_tokens)] == drafter.cached_tokens
            assert stats.draft_accepted > 0
        shifted += stats.context_shifts
        messages.append(Message("assistant", stats.reply))
    assert shifted > 0


def test_settings_change_mid_reply_applies_with_guesses_pending(smollm2_model) -> None:
    wild = SamplingSettings(temperature=3.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=40)
    chat = ChatSession(smollm2_model, wild, drafter=ModelDrafter(smollm2_model, smollm2_model, p_min=0.0))
    events = []
    for event in chat.stream_reply(REWRITE):
        if isinstance(event, TokenEvent):
            events.append(event)
            if event.index == 4:
                chat.settings = replace(wild, temperature=0.0, max_tokens=14)
        else:
            stats = event
    if stats.stop_reason == STOP_LENGTH:
        assert len(events) == 14
    greedy_part = events[5:]
    assert greedy_part and all(e.token_id == e.top[0].token_id for e in greedy_part)


def test_the_draft_model_evaluates_the_prompt_before_the_reply(smollm2_model) -> None:
    """The draft's prefill of a turn's prompt happens with the target's, before the reply's timing starts, and
    each later evaluation is a guess, or a fully accepted draft's last guess with the target's next token; the
    next turn's prompt costs it only the tokens it lacks."""
    drafter = ModelDrafter(smollm2_model, smollm2_model)
    widths: list[int] = []
    evaluate = drafter.session.eval
    drafter.session.eval = lambda ids: widths.append(len(ids)) or evaluate(ids)
    chat = ChatSession(smollm2_model, replace(GREEDY, max_tokens=16), drafter=drafter)
    prompt = chat.prompt_tokens(REWRITE)
    events, stats = run(chat, REWRITE)
    assert widths[0] == len(prompt) and max(widths[1:]) <= 2
    assert stats.draft_prefill_ms > 0 and stats.draft_accepted > 0
    follow = [*REWRITE, Message("assistant", stats.reply), Message("user", "Go on.")]
    held = drafter.cached_tokens
    widths.clear()
    run(chat, follow)
    next_prompt = chat.prompt_tokens(follow)
    assert widths[0] == len(next_prompt) - common_prefix(held, next_prompt) < len(next_prompt) // 2
    assert max(widths[1:]) <= 2


# -- the draft model's vocabulary ------------------------------------------------------------------------------


def test_a_draft_of_another_vocabulary_is_refused(smollm2_model, tiny) -> None:
    with pytest.raises(SettingsError) as err:
        ModelDrafter(tiny, smollm2_model)
    message = str(err.value)
    assert "\n" not in message and "does not share the vocabulary" in message
    check_same_vocab(smollm2_model, smollm2_model)  # the same file is its own valid draft


def test_lookup_finds_the_latest_longest_match() -> None:
    d = LookupDrafter(draft_max=4, ngram=3, ngram_min=2)
    d.length.now = 4
    ctx = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 6, 6, 1, 2, 3]  # "1 2 3" once before: then 9 9 5 2
    assert d.draft(ctx, 8) == [9, 9, 5, 2]
    assert d.draft([5, 6, 7, 6, 7], 8) == [6, 7]  # bigram "6 7" at 1, followed by 6 7
    assert d.draft([1, 2, 3, 4], 8) == []  # no repeat, no guess
    assert d.draft(ctx, 2) == [9, 9]
    assert d.draft([4, 4, 4, 4], 8) == [4]  # the latest match: the one that ends just before the key


def test_lookup_goes_on_past_a_replaced_token() -> None:
    """A reply copying the prompt with one token changed (a rename): once no n-gram matches, the guesses go on
    from the source past the replaced token, but only after a copy that had run on."""
    source = list(range(100, 140))
    drafter = LookupDrafter(draft_max=8)
    drafter.length.now = 7
    reply = source[:6]  # copied so far
    guesses = drafter.draft([*source, 1, *reply], 7)
    assert guesses == source[6:13]
    replaced = [*source, 1, *reply, *guesses[:2], 999]  # two guesses taken, then the target's own token
    drafter.feedback(7, 2, 10.0)
    assert drafter.draft(replaced, 7) == source[9:12]  # past source[8], which 999 replaced; three guesses again
    assert LookupDrafter(realign=False).draft(replaced, 7) == []
    # A match that never went on (its first guess rejected) is not followed.
    drafter = LookupDrafter(draft_max=8)
    assert drafter.draft([*source, 1, *reply], 7) == source[6:9]
    drafter.feedback(3, 0, 10.0)
    assert drafter.draft([*source, 1, *reply, 999], 7) == []


def test_lookup_follows_the_copy_over_a_later_occurrence() -> None:
    """An n-gram that occurs twice in the prompt: while the reply copies the first, its continuation is
    guessed, not the latest occurrence's (as prompt lookup alone would)."""
    prompt = [20, 12, 13, 14, 15, 16, 17, 30, 12, 13, 14, 99, 98, 97, 1]
    drafter = LookupDrafter(draft_max=8, ngram=3, ngram_min=2)
    drafter.length.now = 1
    assert drafter.draft([*prompt, 20, 12], 3) == [13]  # "20 12" occurs once: the first copy, one guess
    drafter.feedback(1, 1, 10.0)
    copied = [*prompt, 20, 12, 13, 14]  # the guess taken, and the target's own token goes on the copy
    assert drafter.draft(copied, 3) == [15, 16, 17]
    plain = LookupDrafter(draft_max=8, ngram=3, ngram_min=2, realign=False)
    plain.length.now = 3
    assert plain.draft(copied, 3) == [99, 98, 97]  # "12 13 14" latest


def test_draft_length_starts_at_a_tile_and_grows_on_full_accepts() -> None:
    """3, 7, 15 guesses (4, 8, 16 rows per pass: whole tiles), capped by draft_max; any rejection starts over
    at three."""
    d = LookupDrafter(draft_max=10)
    ctx = list(range(40)) + list(range(20))  # "17 18 19" matched at 17: guesses 20, 21, ...
    lengths = []
    for accepted_all in (True, True, True, True, False, True):
        guess = d.draft(ctx, 100)
        lengths.append(len(guess))
        d.feedback(len(guess), len(guess) if accepted_all else 0, 1.0)
    assert lengths == [3, 7, 10, 10, 10, 3]
    d.feedback(0, 0, 1.0)  # a plain pass says nothing of guessing
    assert len(d.draft(ctx, 100)) == 7


def test_guesses_that_always_miss_are_checked_rarely() -> None:
    """Where nothing matches, the pauses double (4, 8, 16, 32, 64): over 96 steps only 6 passes check guesses,
    each a three-guess pass, so a reply pays ~6 x 0.4 of a token (4 rows, one tile: ~1.4x a plain pass)."""
    d = LookupDrafter(paced=True)
    ctx = list(range(40)) + list(range(20))  # always a match: every step may guess
    guessed = []
    for step in range(96):
        guess = d.draft(ctx, 100)
        if guess:
            guessed.append((step, len(guess)))
            d.feedback(len(guess), 0, 14.0)  # rejected: 1 token for 1.4x a plain pass's time
        else:
            d.feedback(0, 0, 10.0)
    assert [n for _, n in guessed] == [3] * 6
    assert [s for s, _ in guessed] == [0, 2, 7, 16, 33, 66]
    later = 0
    for _ in range(650):  # from here on, one guess per 65 steps (PACE_MAX_PAUSE): ~0.5% of a reply's time
        guess = d.draft(ctx, 100)
        later += bool(guess)
        d.feedback(len(guess), 0, 14.0 if guess else 10.0)
    assert later <= 10, later
    pace = Pace()
    pace.record(0, 0, 10.0)
    pace.record(1, 0, 1.0)  # a rejected pass that a noisy clock says was cheap still pauses guessing
    assert not pace.allow()


def test_pace_pauses_guessing_that_does_not_pay() -> None:
    """Given pass times (no clock involved): guesses that yield fewer tokens per millisecond than a plain pass
    pause guessing for a doubling number of steps; guesses that pay keep it on."""
    pace = Pace()
    assert pace.allow()
    pace.record(4, 0, 30.0)  # a verification pass before any plain one: measure a plain pass next
    assert not pace.allow() and pace.allow()
    pace = Pace()
    pace.record(0, 0, 10.0)  # plain: 0.1 token/ms
    pace.record(4, 4, 20.0)  # 5 tokens in 20 ms: pays
    assert pace.pause == 0 and pace.allow()
    for _ in range(5):
        pace.record(4, 0, 30.0)  # 1 token in 30 ms
    assert pace.pause > 0
    paused = [pace.allow() for _ in range(pace.pause + 1)]
    assert paused[-1] and not any(paused[:-1])
    assert pace.next_pause > PACE_FIRST_PAUSE  # the next pause is longer


def test_lookup_and_a_draft_model_take_turns(smollm2_model) -> None:
    """Both: where the context has a match, lookup's guesses, and the draft model is not run; elsewhere the
    model's, its cache catching up on the context. Lookup's pacing sets its passes against the model's steps,
    per token they yielded."""
    model = ModelDrafter(smollm2_model, smollm2_model)
    both = CombinedDrafter(LookupDrafter(), model)
    assert both.name == f"lookup + {smollm2_model.name}"
    story = smollm2_model.tokenize("The cat sat on the mat. The dog ran in the park. The cat sat on the")
    both.prepare(story[:-1])
    before = list(model.session.tokens)
    expected = LookupDrafter().draft(story, 8)
    assert expected and both.draft(story, 8) == expected
    assert model.session.tokens == before  # lookup's turn: the model did not run
    fresh = smollm2_model.tokenize("Once upon a time, in a land far away, there lived")
    assert LookupDrafter().draft(fresh, 4) == []  # nothing repeats
    guesses = both.draft(fresh, 4)
    assert guesses and guesses == ModelDrafter(smollm2_model, smollm2_model).draft(fresh, 4)
    assert model.session.tokens[: len(fresh)] == fresh
    paced = CombinedDrafter(LookupDrafter(paced=True), ModelDrafter(smollm2_model, smollm2_model))
    assert paced.draft(fresh, 4)
    paced.feedback(3, 3, 100.0)  # the model's step: 4 tokens in 100 ms
    assert paced.lookup.pace.plain_ms == pytest.approx(25.0)
    assert paced.lookup.draft(story, 8)  # a lookup pass of 3 guesses, 1 taken: 2 tokens in 60 ms
    paced.lookup.feedback(3, 1, 60.0)
    assert paced.lookup.pace.pause > 0  # 30 ms a token: worse than the model's 25, so lookup pauses


def test_pace_counts_a_draft_pass_without_a_confident_guess() -> None:
    """A draft model's pass that offers no guess (its top token under p_min: most steps of a prose reply) is a
    try at guessing that yielded one token for the draft's time on top of a plain pass: tries like that pause
    guessing, and are never taken for the plain pass time they would inflate."""
    pace = Pace()
    pace.record(0, 0, 10.0)  # plain: 10 ms
    for _ in range(3):
        pace.record(0, 0, 14.0, attempted=True)  # a draft pass of 4 ms, then the plain pass
    assert pace.plain_ms == 10.0 and pace.pause > 0
    pace = Pace()
    pace.record(0, 0, 10.0)
    pace.record(4, 4, 20.0)  # 5 tokens in 20 ms
    pace.record(0, 0, 14.0, attempted=True)  # one fruitless try among paying passes: guessing goes on
    assert pace.pause == 0


def test_a_draft_model_tells_its_pace_of_fruitless_passes(smollm2_model) -> None:
    """With p_min above any probability no guess is ever offered, yet each step runs the draft: the pace hears
    of it as a try, pauses, and the paused steps run the draft no more."""
    drafter = ModelDrafter(smollm2_model, smollm2_model, paced=True, p_min=1.01)
    ids = smollm2_model.tokenize("Once upon a time")
    # Given times (a step 1000 s plain, 1200 s with the draft's pass), far above the real catch-up that a draft
    # after a pause subtracts from them: that catch-up is timed, and on a loaded machine it took more than the
    # 0.2 s margin that 1 s against 1.2 s left (the draft then looked as paying and the count came out 4).
    drafter.feedback(0, 0, 1_000_000.0)  # a plain step first: something to compare with
    tried = 0
    for step in range(12):
        before = drafter.session.n_past
        assert drafter.draft([*ids, *range(100, 100 + step)], 4) == []
        tried += drafter.session.n_past != before
        drafter.feedback(0, 0, 1_200_000.0)
    assert tried == 2  # steps 0 and 5: pauses of 4, then 8


def test_the_real_pair_qwen_1_5b_with_the_0_5b_draft(qwen15_model, qwen_path) -> None:
    """Qwen2.5-Coder-1.5B checked against its 0.5B sibling as the draft, re-encoded to Q4_0 (`--draft-type
    q4_0`, whose guesses differ most from the target's): the same vocabulary, and the greedy reply is plain
    decoding's."""
    settings = replace(GREEDY, max_tokens=32)
    plain = ids_of(run(ChatSession(qwen15_model, settings), REWRITE)[0])
    draft = load_model(qwen_path, n_ctx=qwen15_model.n_ctx, requantize=GGMLQuantizationType.Q4_0)
    assert draft.requantized == "Q4_0, 392 -> 278 MB a token"
    drafter = ModelDrafter(draft, qwen15_model)
    chat = ChatSession(qwen15_model, settings, drafter=drafter)
    events, stats = run(chat, REWRITE)
    assert_same_greedy(plain, ids_of(events))
    assert stats.draft_accepted > 0 and stats.tokens_per_pass > 1
    assert chat.cached_tokens[: len(drafter.cached_tokens)] == drafter.cached_tokens
