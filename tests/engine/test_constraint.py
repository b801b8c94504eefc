"""Constrained decoding (engine/constraint.py, and the chat layer's use of it) on the real vocabularies.

Masks allow exactly the tokens the grammar allows; rollback and valid_prefix leave the state as it was; a lazy
grammar switches on at its trigger, also when one token carries the trigger and text past it; greedy replies
under a JSON schema validate, repeat exactly, and are the same with a draft model or prompt lookup.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from engine.chat import ChatSession
from engine.constraint import GrammarSpec, compile_grammar
from engine.errors import GrammarError, SettingsError
from engine.events import STOP_EOS, Message, TokenEvent, TurnStats
from engine.sampling import SamplingSettings
from engine.speculative import LookupDrafter, ModelDrafter

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["python", "rust", "go"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [Message("user", "Describe a programmer named Ada as JSON with name, age and languages.")]


def allowed_ids(state, n_vocab: int) -> np.ndarray:
    logits = np.zeros(n_vocab, dtype=np.float32)
    state.mask_logits(logits)
    return np.flatnonzero(np.isfinite(logits))


def test_the_mask_allows_what_the_grammar_allows_and_nothing_else(smollm2_model) -> None:
    tok = smollm2_model.tokenizer
    state = compile_grammar(tok, GrammarSpec("regex", "(yes|no), [0-9]{2}")).start()
    first = allowed_ids(state, tok.n_vocab)
    texts = {tok.detokenize([int(i)]) for i in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) or t in ("yes,", "no,") for t in texts), texts
    assert tok.token_id("yes") in first and tok.token_id("maybe") not in first
    for t in tok.tokenize("no, 42", special=False):
        assert t in allowed_ids(state, tok.n_vocab)
        assert state.accept(t)
    assert state.is_finished()
    assert set(allowed_ids(state, tok.n_vocab)) <= set(tok.eot_ids)  # only the end may follow


def test_accept_refuses_a_token_outside_the_grammar_and_stays_usable(smollm2_model) -> None:
    tok = smollm2_model.tokenizer
    state = compile_grammar(tok, GrammarSpec("regex", "[0-9]+")).start()
    assert not state.accept(tok.token_id("hello"))
    one = tok.tokenize("7", special=False)[0]
    assert state.accept(one)


def test_rollback_and_valid_prefix_restore_the_state(qwen_model) -> None:
    tok = qwen_model.tokenizer
    grammar = compile_grammar(tok, GrammarSpec("json_schema", json.dumps(PERSON)))
    state = grammar.start()
    ids = tok.tokenize('{"name":"Ada","age":36,"languages":["rust"]}', special=False)
    masks = []
    for t in ids:
        masks.append(allowed_ids(state, tok.n_vocab))
        assert state.accept(t)
    assert state.is_finished()
    state.rollback(5)
    assert not state.is_finished()
    np.testing.assert_array_equal(allowed_ids(state, tok.n_vocab), masks[-5])
    assert state.valid_prefix(ids[-5:]) == 5
    bad = tok.tokenize('"x"', special=False)
    assert state.valid_prefix(ids[-5:-3] + bad) == 2  # cut at the first token the grammar refuses
    np.testing.assert_array_equal(allowed_ids(state, tok.n_vocab), masks[-5])  # valid_prefix changed nothing
    for t in ids[-5:]:
        assert state.accept(t)
    assert state.is_finished()


def test_a_lazy_grammar_starts_at_its_trigger(smollm2_model) -> None:
    tok = smollm2_model.tokenizer
    grammar = compile_grammar(tok, GrammarSpec("regex", " [0-9]+", trigger="ANSWER:"))
    state = grammar.start()
    free = tok.tokenize("Let me think. ANS", special=False)
    for t in free:
        assert not state.active and state.accept(t)
    assert len(allowed_ids(state, tok.n_vocab)) == tok.n_vocab  # still free
    wer = tok.tokenize("WER:", special=False)
    for t in wer:
        assert state.accept(t)
    assert state.active  # the trigger was split over tokens
    assert tok.token_id("hello") not in allowed_ids(state, tok.n_vocab)
    state.rollback(len(wer))
    assert not state.active and len(allowed_ids(state, tok.n_vocab)) == tok.n_vocab


def test_a_token_that_straddles_the_trigger_feeds_its_tail_to_the_grammar(smollm2_model) -> None:
    tok = smollm2_model.tokenizer
    # ":" + " 4" written by one token: "ANSWER" then a token holding ": 4"... built from two real tokens here,
    # the trigger ending inside the second one.
    grammar = compile_grammar(tok, GrammarSpec("regex", "[0-9]+", trigger="ANSWER: "))
    colon_space_digit = [t for t in tok.tokenize("ANSWER: 4", special=False)]
    state = grammar.start()
    for t in colon_space_digit:
        assert state.accept(t)
    assert state.active and not state.accept(tok.token_id("hello"))
    # A token whose text past the trigger breaks the grammar is refused, and the state is unchanged.
    state = grammar.start()
    head = tok.tokenize("ANSWER:", special=False)
    for t in head:
        assert state.accept(t)
    space_word = tok.token_id(" hello")
    assert space_word is not None and not state.accept(space_word)  # " " ends the trigger, "hello" breaks it
    assert not state.active
    assert state.valid_prefix([tok.token_id(" "), tok.tokenize("12", special=False)[0]]) == 2


@pytest.mark.parametrize(
    ("kind", "source", "what"),
    [
        ("json_schema", '{"type": "object", "properties": ', "not valid JSON"),
        ("json_schema", '{"type": "objekt"}', "objekt"),
        ("gbnf", 'root ::= "a" | undefined-rule', "undefined-rule"),
        ("lark", "start: /a(/", "regex"),
        ("regex", "a(b", "unclosed group"),
    ],
)
def test_a_bad_grammar_is_a_grammar_error_naming_the_fault(smollm2_model, kind, source, what) -> None:
    with pytest.raises(GrammarError, match=None) as info:
        compile_grammar(smollm2_model.tokenizer, GrammarSpec(kind, source))
    assert what in str(info.value)


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(GrammarError, match="unknown grammar kind 'yaml'"):
        GrammarSpec("yaml", "x")


def run(chat: ChatSession, constraint: GrammarSpec | None, **kw) -> tuple[list[TokenEvent], TurnStats]:
    events = list(chat.stream_reply(ASK, constraint=constraint, **kw))
    assert isinstance(events[-1], TurnStats)
    return events[:-1], events[-1]


@pytest.fixture(scope="module")
def person() -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(PERSON))


def test_greedy_replies_under_a_schema_validate_repeat_and_end_with_the_grammar(qwen_model, person) -> None:
    chat = ChatSession(qwen_model, SamplingSettings(temperature=0.0, max_tokens=80))
    events, stats = run(chat, person)
    reply = json.loads(stats.reply)
    jsonschema.validate(reply, PERSON)
    assert stats.stop_reason == STOP_EOS
    again, stats2 = run(chat, person)
    assert [e.token_id for e in again] == [e.token_id for e in events]


def test_sampled_replies_under_a_schema_validate(qwen_model, person) -> None:
    for seed in (1, 2, 3):
        chat = ChatSession(qwen_model, SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                                                        max_tokens=80))  # fmt: skip
        _, stats = run(chat, person)
        jsonschema.validate(json.loads(stats.reply), PERSON)


def test_json_object_gives_an_object(smollm2_model) -> None:
    chat = ChatSession(smollm2_model, SamplingSettings(temperature=0.0, max_tokens=60))
    _, stats = run(chat, GrammarSpec("json_object"))
    if stats.stop_reason == STOP_EOS:
        assert isinstance(json.loads(stats.reply), dict)
    else:  # cut by max_tokens: still the start of an object
        assert stats.reply.lstrip().startswith("{")


@pytest.mark.parametrize("drafter", ["draft-model", "lookup"])
def test_drafting_under_a_constraint_gives_plain_constrained_greedy(qwen_model, person, drafter) -> None:
    plain, _ = run(ChatSession(qwen_model, SamplingSettings(temperature=0.0, max_tokens=80)), person)
    # The draft model drafts without the grammar, so its guesses are cut by valid_prefix; lookup drafts from the
    # prompt. Either way the reply must be plain constrained greedy's, token for token.
    guesser = ModelDrafter(qwen_model, qwen_model, p_min=0.0) if drafter == "draft-model" else LookupDrafter()
    chat = ChatSession(qwen_model, SamplingSettings(temperature=0.0, max_tokens=80), drafter=guesser)
    ours, stats = run(chat, person)
    assert [e.token_id for e in ours] == [e.token_id for e in plain]
    if drafter == "draft-model":
        assert stats.draft_tokens > 0 and stats.draft_accepted > 0


def test_logit_bias_bans_a_token_and_bad_bias_is_refused(smollm2_model) -> None:
    chat = ChatSession(smollm2_model, SamplingSettings(temperature=0.0, max_tokens=3))
    events, _ = run(chat, None)
    first = events[0].token_id
    banned, _ = run(chat, None, logit_bias={first: -100})
    assert first not in [e.token_id for e in banned]
    boosted, _ = run(chat, None, logit_bias={tok: 100 for tok in smollm2_model.tokenizer.tokenize("Zebra")[:1]})
    assert boosted[0].token_id == smollm2_model.tokenizer.tokenize("Zebra")[0]
    with pytest.raises(SettingsError, match="outside the vocabulary"):
        run(chat, None, logit_bias={10**7: 1.0})


class _Refused:
    """A drafter whose every guess is a control token, which no JSON grammar allows."""

    name = "refused"

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def draft(self, context, limit):
        return [self.token_id] * min(limit, 4)

    def feedback(self, drafted, accepted, pass_ms):
        pass

    def follow(self, tokens):
        pass

    def prepare(self, prompt):
        return 0


def test_guesses_the_grammar_refuses_are_never_verified(qwen_model, person) -> None:
    im_start = qwen_model.tokenizer.token_id("<|im_start|>")
    chat = ChatSession(qwen_model, SamplingSettings(temperature=0.0, max_tokens=12), drafter=_Refused(im_start))
    events, stats = run(chat, person)
    assert stats.draft_tokens == 0 and stats.generated_tokens == 12  # cut before the pass, and the reply goes on


def test_the_constraint_holds_through_live_sampling_changes(qwen_model, person) -> None:
    chat = ChatSession(qwen_model, SamplingSettings(temperature=0.0, max_tokens=160))
    hot = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=160)
    stats = None
    for i, event in enumerate(chat.stream_reply(ASK, constraint=person)):
        if i == 4:
            chat.settings = hot  # as the sampling panel does mid-reply
        if isinstance(event, TurnStats):
            stats = event
    assert stats is not None and stats.stop_reason == STOP_EOS
    jsonschema.validate(json.loads(stats.reply), PERSON)
