"""Constrained decoding: a grammar that decides, token by token, which tokens the sampler may pick.

Built on llguidance (JSON schema, Lark, GBNF, regex), as llama.cpp's `common/llguidance.cpp` and vLLM do:
the vocabulary goes in as each token's bytes, and a matcher per reply gives a bitmask of the allowed next
tokens, consumes the chosen one, and rolls back.

    grammar = compile_grammar(tokenizer, GrammarSpec("json_schema", schema_text))  # cached
    state = grammar.start()                  # one per reply
    state.mask_logits(logits)                # disallowed ids -> -inf, in place
    state.accept(token_id)                   # after sampling
    state.is_finished()                      # nothing but the end may follow: the reply stops

A lazy grammar (`trigger`) leaves the text free until the generated text contains the trigger; the grammar
then holds for what follows it (llama.cpp's grammar triggers). The tokens that complete the trigger may carry
text past it: that text is fed to the grammar, and refused when the grammar does not allow it.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .errors import GrammarError
from .events import GRAMMAR_KINDS as KINDS
from .events import GrammarSpec

__all__ = ["KINDS", "ConstraintState", "Grammar", "GrammarSpec", "compile_grammar"]

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

_CACHE_SIZE = 32  # compiled grammars kept per tokenizer (a server sees the same schema again and again)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar text; GrammarError naming what is wrong."""
    import llguidance  # noqa: PLC0415 (loaded with the first constraint, not with the engine)
    from llguidance.gbnf_to_lark import any_to_lark  # noqa: PLC0415

    m = llguidance.LLMatcher
    if spec.kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}')
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return m.grammar_from_json_schema(json.dumps(schema))
        except ValueError as e:
            raise GrammarError(f"bad JSON schema: {e}") from None
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.source)
    source = spec.source
    if spec.kind == "gbnf":
        try:
            source = any_to_lark(source)
        except Exception as e:  # the converter raises plain Exceptions for syntax errors
            raise GrammarError(f"bad GBNF grammar: {e}") from None
    return m.grammar_from_lark(source)


class _Vocabulary:
    """One tokenizer's llguidance view (LLTokenizer) plus what masking needs; built once per tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance  # noqa: PLC0415

        self._pieces = tokenizer.all_token_bytes()
        # Control tokens (<|im_end|>, </s>) are not text: llguidance marks such "special" tokens with 0xFF, as
        # llama.cpp's integration does, so a grammar matches them only by name. User-defined tokens such as
        # Qwen's <tool_call> stay text, so a grammar or a trigger can spell them.
        texts = [b"\xff" + t if tokenizer.is_control(i) else t for i, t in enumerate(self._pieces)]
        eos = sorted(tokenizer.eot_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        self.end_ids = eos
        self.n_vocab = tokenizer.n_vocab

        class _Source:  # the shape llguidance.TokenizerWrapper reads
            eos_token_id = eos[0] if eos else 0
            bos_token_id = tokenizer.bos_id
            tokens = texts
            special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.is_control(i)]

            def __call__(self, text: str) -> list[int]:
                return tokenizer.tokenize(text, special=False)

        wrapper = llguidance.TokenizerWrapper(_Source())
        self.ll = llguidance.LLTokenizer(wrapper, n_vocab=tokenizer.n_vocab, eos_token=eos or None)
        self.grammars: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self.lock = threading.Lock()

    def piece(self, token_id: int) -> bytes:
        return self._pieces[token_id] if 0 <= token_id < self.n_vocab else b""


_VOCABS: weakref.WeakKeyDictionary[Tokenizer, _Vocabulary] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def _vocabulary(tokenizer: Tokenizer) -> _Vocabulary:
    with _VOCABS_LOCK:
        vocab = _VOCABS.get(tokenizer)
        if vocab is None:
            vocab = _VOCABS[tokenizer] = _Vocabulary(tokenizer)
        return vocab


def compile_grammar(tokenizer: Tokenizer, spec: GrammarSpec) -> Grammar:
    """The compiled grammar for `spec` over `tokenizer`'s vocabulary; cached. GrammarError when it is bad."""
    vocab = _vocabulary(tokenizer)
    with vocab.lock:
        grammar = vocab.grammars.get(spec)
        if grammar is not None:
            vocab.grammars.move_to_end(spec)
            return grammar
    grammar = Grammar(vocab, spec)
    with vocab.lock:
        vocab.grammars[spec] = grammar
        while len(vocab.grammars) > _CACHE_SIZE:
            vocab.grammars.popitem(last=False)
    return grammar


class Grammar:
    """A checked grammar over one vocabulary; `start()` gives each reply its own state. Thread-safe."""

    def __init__(self, vocab: _Vocabulary, spec: GrammarSpec) -> None:
        import llguidance  # noqa: PLC0415

        self.spec = spec
        self._vocab = vocab
        self._text = _llguidance_grammar(spec)
        # A matcher in its initial state; each reply starts from a copy (cheaper than compiling again). A bad
        # grammar leaves it in its error state, with llguidance's message.
        self._initial = llguidance.LLMatcher(vocab.ll, self._text, log_level=0)
        if self._initial.is_error():
            raise GrammarError(f"bad {_NAMES[spec.kind]}: {self._initial.get_error().strip()}")

    def start(self) -> ConstraintState:
        """A fresh state for one reply."""
        return ConstraintState(self._vocab, self._initial.deep_copy(), self.spec.trigger)


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "lark": "Lark grammar",
    "gbnf": "GBNF grammar",
    "regex": "regex",
}


@dataclass
class _Step:
    """What accepting one token did, so that `rollback` can undo it."""

    consumed: int  # tokens the matcher consumed (0 before the trigger; the trigger token may feed several)
    text_before: int  # length of the free text before this token (lazy grammars)
    active_before: bool  # whether the grammar held before this token


class _Matcher(Protocol):
    """What this module calls of llguidance's Matcher (which ships no type information)."""

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None: ...
    def try_consume_tokens(self, tokens: list[int]) -> int: ...
    def validate_tokens(self, tokens: list[int]) -> int: ...
    def rollback(self, n: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def get_error(self) -> str: ...


class ConstraintState:
    """One reply's position in a grammar. Not thread-safe: the token loop owns it."""

    def __init__(self, vocab: _Vocabulary, matcher: _Matcher, trigger: str | None) -> None:
        self._vocab = vocab
        self._m = matcher
        self._trigger = trigger.encode() if trigger is not None else b""  # read only while inactive: with one
        self._active = trigger is None
        self._free = b""  # generated bytes while waiting for the trigger
        self._steps: list[_Step] = []
        self._bits = np.full((vocab.n_vocab + 31) // 32, -1, dtype=np.int32)

    @property
    def active(self) -> bool:
        """Whether the grammar holds now (always, unless a lazy grammar still waits for its trigger)."""
        return self._active

    def mask_logits(self, logits: np.ndarray) -> None:
        """Set the logits of every token the grammar does not allow next to -inf, in place."""
        if not self._active:
            return
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._vocab.n_vocab)
        n = min(logits.shape[0], allowed.shape[0])
        np.putmask(logits[:n], allowed[:n] == 0, -np.inf)
        if logits.shape[0] > n:  # the output head may have rows past the vocabulary: never text
            logits[n:] = -np.inf

    def allowed(self, token_id: int) -> bool:
        """Whether `token_id` may come next (no state change)."""
        return self.valid_prefix([token_id]) == 1

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) when the grammar does not allow it."""
        if self._active:
            if self._m.try_consume_tokens([token_id]) != 1:
                return False
            self._steps.append(_Step(1, len(self._free), True))
            return True
        before = len(self._free)
        text = self._free + self._vocab.piece(token_id)
        at = text.find(self._trigger, max(0, before - len(self._trigger) + 1))
        if at < 0:
            self._free = text
            self._steps.append(_Step(0, before, False))
            return True
        rest = text[at + len(self._trigger) :]  # what this token wrote past the trigger: the grammar's first text
        ids = self._vocab.ll.tokenize_bytes(rest) if rest else []
        consumed = self._m.try_consume_tokens(ids) if ids else 0
        if consumed != len(ids):
            self._m.rollback(consumed)
            return False
        self._free, self._active = text, True
        self._steps.append(_Step(consumed, before, False))
        return True

    def rollback(self, n_tokens: int) -> None:
        """Undo the last `n_tokens` accepted tokens."""
        if n_tokens > len(self._steps):
            raise ValueError(f"cannot roll back {n_tokens} tokens: only {len(self._steps)} accepted")
        undo = 0
        for _ in range(n_tokens):
            step = self._steps.pop()
            undo += step.consumed
            self._free = self._free[: step.text_before]
            self._active = step.active_before
        if undo:
            self._m.rollback(undo)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows in turn, without changing the state."""
        if self._active:
            return self._m.validate_tokens(list(token_ids))
        n = 0
        for t in token_ids:  # the trigger may come inside the draft: walk it, then undo the walk
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more: the reply must end here."""
        return self._active and self._m.is_stopped()

    def error(self) -> str:
        """The matcher's error, if it entered one (empty when none)."""
        return self._m.get_error()
