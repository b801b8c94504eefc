"""A conversation with a model: templated prompts, a KV cache kept across turns, live sampling, timed tokens.

`ChatSession.stream_reply(messages)` is the whole interface: give it the conversation so far (the caller
owns the messages), iterate the TokenEvents, get a TurnStats last. Each call evaluates only the tokens the
cache does not already hold, so follow-ups, regenerations and edits of the last message cost their tail.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .constraint import ConstraintState, Grammar, GrammarSpec, compile_grammar
from .errors import GrammarError, SettingsError
from .events import (
    STOP_CANCELLED,
    STOP_CONTEXT,
    STOP_EOS,
    STOP_LENGTH,
    STOP_STRING,
    Alternative,
    Message,
    TokenEvent,
    ToolSpec,
    TurnStats,
)
from .kv_store import KVStore, template_sha256
from .model import Model
from .sampling import Sampler, SampleResult, SamplingSettings
from .sequences import common_prefix
from .speculative import Drafter
from .template import ChatTemplate
from .tokenizer import Tokenizer
from .tool_calls import parse_reply
from .tool_calls import prompt as tool_prompt
from .tool_calls.grammar import tool_grammar
from .tool_calls.reasoning import split_reasoning
from .untrusted_text import RenderedPrompt

RESTORE_MIN = 32  # a saved cache is read only when it spares at least this many tokens of prefill


@dataclass(frozen=True)
class _Prefill:
    """What bringing the cache to a prompt did."""

    reused: int  # prompt tokens the cache already held (restored ones included)
    restored: int  # tokens read from a saved cache
    prefill_ms: float
    draft_prefill_ms: float  # the drafter's own prefill; 0 without one or when it had nothing to do


@dataclass
class _Turn:
    """One reply's running state, shared by `_step` and `_verify`."""

    prompt: list[int]  # changes when a context shift drops old turns
    sampler: Sampler
    settings: SamplingSettings  # the settings in force, re-read each token
    valid: SamplingSettings  # `settings`, validated
    shaper: _LogitShaper | None
    state: ConstraintState | None  # the grammar's position, when there is a grammar
    stop_ids: Collection[int]  # tokens that end the reply
    stop_strings: tuple[str, ...]  # texts that end the reply (cut before them)
    generated: list[int] = field(default_factory=list)
    # Drafted tokens already in the cache, each with the target's logits after it, oldest first: the next
    # token is checked against queue[0][0], and on acceptance the logits become queue[0][1] (`after`).
    queue: list[tuple[int, np.ndarray]] = field(default_factory=list)
    after: np.ndarray | None = None
    drafted: int = 0  # guesses made
    accepted: int = 0  # guesses accepted
    passes: int = 0  # target passes after the prefill


def _stop_string_at(stop_strings: tuple[str, ...], reply: str, new: int) -> int | None:
    """Where a stop string starts in `reply`, looking only where the newest text could complete one."""
    for s in stop_strings:
        at = reply.find(s, max(0, len(reply) - new - len(s) + 1))
        if at >= 0:
            return at
    return None


class ChatSession:
    """One model, one KV cache, many turns. Not thread-safe except `settings` and `cancel()`."""

    remote = None  # the app's ChatBackend: a model in this process is on no server

    def __init__(
        self,
        model: Model,
        settings: SamplingSettings | None = None,
        stop: Sequence[str] = (),
        n_ctx: int | None = None,
        drafter: Drafter | None = None,
        *,
        display_name: str | None = None,
        kv_store: KVStore | None = None,
        autosave: bool = False,
        stop_ids: Collection[int] | None = None,
    ):
        self.model = model
        self.display_name = display_name  # see model_name
        self.session = model.session(n_ctx)
        self.drafter = drafter
        """Speculative decoding's guesser (engine.speculative), or None for one target pass per token."""
        self.kv_store = kv_store
        """Saved caches (engine.kv_store): `stream_reply` restores the best match into an empty-ish cache, and
        `save_cache` writes the current one. None: nothing is read or written."""
        self.autosave = autosave
        """With a kv_store: write the cache after every finished turn (what a saved chat resumes from)."""
        self._model_sha: str | None = None
        self._last_draft = 0  # guesses in the latest verification pass
        self._last_pass_ms = 0.0  # that pass's time, drafting included
        tok = model.tokenizer
        meta = model.file.metadata
        self.template = ChatTemplate.from_metadata(
            meta.get("tokenizer.chat_template"),
            bos_token=tok.detokenize([tok.bos_id]) if tok.bos_id is not None else "",
            eos_token=tok.detokenize([tok.eos_id]) if tok.eos_id is not None else "",
            special_tokens=tok.special_texts,
            control_tokens=tok.control_texts,
        )
        self.settings = settings or SamplingSettings()
        """Replaced (never mutated) from any thread; read before every sampled token."""
        self.stop_strings = tuple(s for s in stop if s)
        self._cancel = threading.Event()
        self._dropped = 0  # oldest non-system messages left out last turn; kept out so the prefix stays stable
        self._dropped_now = False
        self._warned: set[str] = set()
        self._tools: tuple[ToolSpec, ...] = ()  # the current turn's tools (the prompt is refitted with them)
        self.stop_ids = set(tok.eot_ids) if stop_ids is None else set(stop_ids)
        """Tokens that end a reply: by default the model's end-of-turn ones (empty: always up to max_tokens)."""
        for text in self.template.end_of_turn_strings() if stop_ids is None else ():
            ids = tok.tokenize(text, special=True)
            if len(ids) == 1:
                self.stop_ids.add(ids[0])

    # -- the narrow interface ------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.session.n_ctx

    @property
    def cached_tokens(self) -> list[int]:
        """The ids whose keys and values the cache holds, in order."""
        return list(self.session.tokens)

    def cancel(self) -> None:
        """Stop the running reply after the current token."""
        self._cancel.set()

    def warnings(self) -> list[str]:
        """Warnings not yet reported (template fallback, clamped settings, model load notes); each once."""
        found = list(self.model.warnings)
        if self.template.warning:
            found.append(self.template.warning)
        fresh = [w for w in found if w not in self._warned]
        self._warned.update(fresh)
        return fresh

    def prompt_tokens(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[ToolSpec] | None = None,
    ) -> list[int]:
        """The conversation rendered through the model's template: its markers are control tokens, the messages'
        and tools' own text is text (see engine.untrusted_text)."""
        prompt = tool_prompt.render(self.template, messages, tools, None, add_generation_prompt)
        return prompt_ids(self.model.tokenizer, prompt)

    def save_cache(self) -> Path | None:
        """Write the KV cache to `kv_store` (keyed to the model file, the template and the ids); its path."""
        if self.kv_store is None:
            return None
        return self.kv_store.save(self.session, self._model_key(), self._template_key())

    def _model_key(self) -> str:
        if self._model_sha is None:
            assert self.kv_store is not None
            self._model_sha = self.kv_store.model_sha256(self.model.file.path)
        return self._model_sha

    def _template_key(self) -> str:
        t = self.template
        return template_sha256(f"{t.source}\0{t.warning}\0{t.bos_token}\0{t.eos_token}")

    @property
    def model_name(self) -> str:
        """What the app calls the model: `display_name` when the caller set one, else the file's own name."""
        return self.display_name or self.model.name

    def stream_reply(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        constraint: GrammarSpec | None = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> Iterator[TokenEvent | TurnStats]:
        """Generate the assistant's reply to `messages`; TokenEvents, then one TurnStats.

        With `tools` the template is given them, and the finished reply is read for calls in the model's own
        format: TurnStats.tool_calls holds them, `reasoning` any thinking block, and `reply` the text around them.
        constraint: a grammar the reply must match (engine.constraint); the reply ends when it is complete.
        logit_bias: token id -> value added to its logit before sampling; -100 or less bans the token.
        Raises GrammarError (bad constraint) or SettingsError (bad logit_bias) before any token.
        With tools and no constraint, calls are held to the tools' schemas from the format's trigger text on.
        """
        if tools and constraint is None:
            constraint = self._calls_grammar(tools)
        shaper = _LogitShaper.build(self.model.tokenizer, constraint, logit_bias)
        t_start = time.perf_counter()
        valid, notes = self.settings.validated()
        reserve = self._reply_reserve(valid)
        self._tools = tuple(tools or ())
        prompt, _ = self._fit(list(messages), reserve)
        if prompt is None:
            self._cancel.clear()
            yield self._stats(0, 0, 0, 0.0, 0.0, 0.0, 0, STOP_CONTEXT, "", 0, notes)
            return
        turn = self._generate(prompt, list(messages), reserve, int(self._dropped_now), t_start, notes, shaper)
        for event in turn:
            if isinstance(event, TurnStats) and self._tools:
                reasoning, answer = split_reasoning(event.reply)
                parsed = parse_reply(answer, tool_prompt.call_format(self.template))
                event = replace(event, reply=parsed.content, tool_calls=parsed.calls, reasoning=reasoning)
            yield event

    def _calls_grammar(self, tools: Sequence[ToolSpec]) -> GrammarSpec | None:
        """The lazy grammar for calls to `tools`; None (and a warning) when their schemas cannot be compiled."""
        spec = tool_grammar(tool_prompt.call_format(self.template).name, tools, lazy=True)
        try:
            compile_grammar(self.model.tokenizer, spec)  # cached: the turn compiles it again for free
        except GrammarError as e:
            self.model.warnings.append(f"tool calls are not constrained: {e}")
            return None
        return spec

    def stream_completion(
        self,
        prompt: Sequence[int],
        *,
        constraint: GrammarSpec | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: Sequence[str] | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> Iterator[TokenEvent | TurnStats]:
        """Continue raw token ids (no template); stops with 'context' when the cache is full.

        `constraint` and `logit_bias` as in `stream_reply`. `stop` and `stop_ids`: this call's stop strings and
        tokens in place of the session's (`stop_ids=()`: always up to max_tokens)."""
        stops = (self.stop_ids if stop_ids is None else stop_ids,
                 self.stop_strings if stop is None else tuple(s for s in stop if s))  # fmt: skip
        shaper = _LogitShaper.build(self.model.tokenizer, constraint, logit_bias)
        t_start = time.perf_counter()
        valid, notes = self.settings.validated()
        if len(prompt) >= self.n_ctx:
            self._cancel.clear()
            yield self._stats(len(prompt), 0, 0, 0.0, 0.0, 0.0, 0, STOP_CONTEXT, "", 0, notes)
            return
        yield from self._generate(list(prompt), None, 0, 0, t_start, notes, shaper, stops)

    def _generate(
        self,
        prompt: list[int],
        messages: list[Message] | None,
        reserve: int,
        shifts: int,
        t_start: float,
        notes: list[str],
        shaper: _LogitShaper | None = None,
        stops: tuple[Collection[int], tuple[str, ...]] | None = None,
    ) -> Iterator[TokenEvent | TurnStats]:
        """Prefill what the cache lacks of `prompt`, then step until a stop (`messages`: for shifts).

        The turn in three parts, as gpt-fast's prefill / decode_one_token / speculative_decode: `_prefill` runs
        the prompt, `_step` samples one token from the latest logits (checking a drafted guess when one waits),
        and `_verify` runs the target over the new token and the drafter's next guesses in one pass.
        """
        self._cancel.clear()
        logits, pre = self._prefill(prompt)
        settings = self.settings
        valid = settings.validated()[0]
        seed = valid.seed if valid.seed >= 0 else int.from_bytes(os.urandom(4), "little")
        stop_ids, stop_strings = stops if stops is not None else (self.stop_ids, self.stop_strings)
        state = shaper.start() if shaper is not None else None
        turn = _Turn(prompt, Sampler(seed), settings, valid, shaper, state, stop_ids, stop_strings)
        detokenizer = self.model.stream_detokenizer()
        reply = ""
        forward_ms = pre.prefill_ms
        ttft_ms = 0.0
        t_decode = time.perf_counter()
        stop = STOP_LENGTH
        while True:
            if self._cancel.is_set():
                stop = STOP_CANCELLED
                break
            t1 = time.perf_counter()
            res, drafted = self._step(turn, logits)
            sample_ms = (time.perf_counter() - t1) * 1000
            if res.token_id in turn.stop_ids:
                stop = STOP_EOS
                break
            turn.generated.append(res.token_id)
            piece = detokenizer.push(res.token_id)
            reply += piece
            cut = _stop_string_at(turn.stop_strings, reply, len(piece))
            if cut is not None:
                piece = piece[: max(0, len(piece) - (len(reply) - cut))]
                reply = reply[:cut]
            if not ttft_ms:
                ttft_ms = (time.perf_counter() - t_start) * 1000
            yield TokenEvent(
                token_id=res.token_id,
                text=piece,
                forward_ms=0.0 if drafted else forward_ms,
                sample_ms=sample_ms,
                prob=res.prob,
                top=tuple(Alternative(i, self.model.detokenize([i]), p) for i, p in res.top),
                index=len(turn.generated) - 1,
                drafted=drafted,
            )
            if cut is not None:
                stop = STOP_STRING
                break
            if turn.state is not None and turn.state.is_finished():  # the grammar allows nothing more
                stop = STOP_EOS
                break
            if 0 < turn.valid.max_tokens <= len(turn.generated):
                stop = STOP_LENGTH
                break
            if drafted:  # the verification pass already gave the logits after this token
                assert turn.after is not None  # set by _step with the accepted guess
                logits = turn.after
                continue
            position = len(turn.prompt) + len(turn.generated) - 1  # where the newest token goes in the cache
            if position >= self.n_ctx:
                shifted = self._shift(messages, turn.prompt, turn.generated, reserve) if messages else None
                if shifted is None:
                    stop = STOP_CONTEXT
                    break
                turn.prompt, logits = shifted
                shifts += 1
                forward_ms = 0.0
                continue
            t2 = time.perf_counter()
            logits = self._verify(turn, res.token_id, position)
            forward_ms = (time.perf_counter() - t2) * 1000
            self._last_pass_ms = forward_ms  # drafting included: what the guesses cost against a plain pass
            if self.drafter is not None and not turn.queue:
                self.drafter.feedback(0, 0, forward_ms)
        yield from self._finish(
            turn,
            pre,
            stop,
            reply + (detokenizer.flush() if stop != STOP_STRING else ""),
            shifts,
            ttft_ms,
            (time.perf_counter() - t_decode) * 1000,
            notes,
        )

    def _prefill(self, prompt: list[int]) -> tuple[np.ndarray, _Prefill]:
        """Bring the cache to `prompt` (a saved cache, then what the session already holds, then evaluation) and
        let the drafter read it too. Returns the logits after the prompt's last token (n_vocab,)."""
        restored = 0
        # A saved cache beats evaluating what it holds; not worth a look when the session holds nearly all of it.
        if self.kv_store is not None and common_prefix(self.session.tokens, prompt) < len(prompt) - RESTORE_MIN:
            restored = self.kv_store.restore(
                self.session, self._model_key(), self._template_key(), prompt[:-1], RESTORE_MIN
            )
        reused = common_prefix(self.session.tokens, prompt)
        reused = min(reused, len(prompt) - 1)  # the last prompt token is always run: its logits start the reply
        self.session.truncate(reused)
        t0 = time.perf_counter()
        logits = self.session.eval(prompt[reused:])
        prefill_ms = (time.perf_counter() - t0) * 1000
        draft_prefill_ms = 0.0
        if self.drafter is not None:
            t0 = time.perf_counter()
            if self.drafter.prepare(prompt):
                draft_prefill_ms = (time.perf_counter() - t0) * 1000
        return logits, _Prefill(reused, restored, prefill_ms, draft_prefill_ms)

    def _step(self, turn: _Turn, logits: np.ndarray) -> tuple[SampleResult, bool]:
        """Sample the next token from `logits` (n_vocab,): checked against the oldest drafted guess when one is
        queued, held to the grammar. Returns it and whether it was an accepted guess (then `turn.after` holds the
        logits after it)."""
        current = self.settings  # re-read every token: the caller may have replaced it
        if current is not turn.settings:
            if current.seed != turn.settings.seed and current.seed >= 0:
                turn.sampler.reseed(current.seed)
            turn.settings, turn.valid = current, current.validated()[0]
        settings, sampler = turn.settings, turn.sampler
        last_n = turn.valid.repeat_last_n
        seen = turn.prompt + turn.generated
        recent = () if last_n == 0 else seen[-last_n:] if last_n > 0 else seen
        drafted = False
        if turn.shaper is not None:
            turn.shaper.shape(logits, turn.state)
        drafter = self.drafter
        if turn.queue:
            guess, turn.after = turn.queue[0]
            res, drafted = sampler.sample_draft(logits, settings, recent, guess)
            if drafted:
                turn.queue.pop(0)
                turn.accepted += 1
                if not turn.queue and drafter is not None:
                    drafter.feedback(self._last_draft, self._last_draft, self._last_pass_ms)
            else:  # the cache must hold only accepted tokens: drop the rejected guess and those after it
                if drafter is not None:
                    drafter.feedback(self._last_draft, self._last_draft - len(turn.queue), self._last_pass_ms)
                self.session.truncate(len(turn.prompt) + len(turn.generated))
                turn.queue.clear()
        else:
            res = sampler.sample(logits, settings, recent)
        if turn.state is not None and res.token_id not in turn.stop_ids:
            while not turn.state.accept(res.token_id):  # only a lazy grammar's trigger token can be refused here
                logits[res.token_id] = -np.inf
                res = sampler.sample(logits, settings, recent)
        return res, drafted

    def _verify(self, turn: _Turn, token: int, position: int) -> np.ndarray:
        """One target pass over `token` (at `position`) and the drafter's guesses after it, which wait in
        `turn.queue` with the logits after each for `_step` to check. Returns the logits after `token`."""
        guesses = self._draft(self.drafter, turn.prompt + turn.generated, turn.valid, len(turn.generated), position)
        if guesses and turn.state is not None:  # a guess the grammar refuses could never be accepted: cut there
            guesses = guesses[: turn.state.valid_prefix(guesses)]
        turn.passes += 1
        if not guesses:
            return self.session.eval([token])
        rows = self.session.eval_all([token, *guesses])  # (1 + len(guesses), n_vocab)
        turn.queue = [(g, rows[i + 1]) for i, g in enumerate(guesses)]
        turn.drafted += len(guesses)
        return rows[0]

    def _finish(
        self,
        turn: _Turn,
        pre: _Prefill,
        stop: str,
        reply: str,
        shifts: int,
        ttft_ms: float,
        decode_ms: float,
        notes: list[str],
    ) -> Iterator[TurnStats]:
        """Leave the cache holding only shown tokens, report the turn, then autosave."""
        # Whatever the stop, the cache holds a prefix of the visible tokens and no unchecked guess.
        self.session.truncate(min(self.session.n_past, len(turn.prompt) + len(turn.generated)))
        drafter = self.drafter
        if drafter is not None:
            drafter.follow(self.session.tokens)
        n_prompt = len(turn.prompt)
        stats = self._stats(
            n_prompt,
            pre.reused,
            n_prompt - pre.reused,
            pre.prefill_ms,
            ttft_ms,
            decode_ms,
            len(turn.generated),
            stop,
            reply,
            shifts,
            notes,
        )
        yield replace(
            stats,
            drafter=drafter.name if drafter is not None else "",
            draft_prefill_ms=pre.draft_prefill_ms,
            draft_tokens=turn.drafted,
            draft_accepted=turn.accepted,
            target_passes=turn.passes,
            restored_tokens=min(pre.restored, pre.reused),
        )
        if self.autosave and self.kv_store is not None:  # after the stats: the reply is not held up by the write
            try:
                self.save_cache()
            except OSError as e:  # a full or read-only disk costs the saved cache, never the chat
                self.model.warnings.append(f"could not save the KV cache: {e}")

    def _draft(
        self, drafter: Drafter | None, context: list[int], valid: SamplingSettings, n_gen: int, position: int
    ) -> list[int]:
        """The drafter's guesses after `context`, as many as the context and max_tokens leave room for."""
        if drafter is None:
            return []
        limit = self.n_ctx - position - 1  # the newest token and the guesses must fit the cache
        if valid.max_tokens > 0:
            limit = min(limit, valid.max_tokens - n_gen)  # guesses past max_tokens would never be shown
        guesses = drafter.draft(context, limit) if limit > 0 else []
        self._last_draft = len(guesses)
        return guesses

    # -- helpers -------------------------------------------------------------------------------------------

    def _stats(
        self,
        n_prompt: int,
        reused: int,
        evaluated: int,
        prefill_ms: float,
        ttft_ms: float,
        decode_ms: float,
        n_gen: int,
        stop: str,
        reply: str,
        shifts: int,
        notes: list[str],
    ) -> TurnStats:
        return TurnStats(
            prompt_tokens=n_prompt,
            reused_tokens=reused,
            evaluated_tokens=evaluated,
            prefill_ms=prefill_ms,
            ttft_ms=ttft_ms,
            decode_ms=decode_ms,
            generated_tokens=n_gen,
            stop_reason=stop,
            n_ctx_used=self.session.n_past,
            n_ctx=self.n_ctx,
            context_shifts=shifts,
            dropped_messages=self._dropped,
            reply=reply,
            warnings=tuple(notes),
            device=getattr(self.model, "device", "cpu"),
        )

    def _reply_reserve(self, s: SamplingSettings) -> int:
        """Room kept free for the reply when fitting the prompt."""
        quarter = max(1, self.n_ctx // 4)
        return min(s.max_tokens, quarter) if s.max_tokens > 0 else quarter

    def _fit(self, messages: list[Message], reserve: int) -> tuple[list[int] | None, list[Message] | None]:
        """The prompt that fits n_ctx - reserve: the system prompt, then the most recent turns.

        Oldest turns are dropped in whole user/assistant pairs, and once dropped they stay dropped in later
        turns, so the kept prefix (and its cache) survives from turn to turn.
        """
        self._dropped_now = False  # whether this fit dropped more than the last one
        system = messages[:1] if messages and messages[0].role == "system" else []
        rest = messages[len(system) :]
        drop = min(self._dropped, max(0, len(rest) - 1))
        budget = self.n_ctx - reserve
        while True:
            kept = system + rest[drop:]
            prompt = self.prompt_tokens(kept, tools=self._tools)
            if len(prompt) <= budget:
                if drop != self._dropped:
                    self._dropped_now = drop > self._dropped
                self._dropped = drop
                return prompt, kept
            if drop >= len(rest) - 1:  # only the newest message is left and it still does not fit
                if len(prompt) < self.n_ctx:
                    self._dropped = drop
                    return prompt, kept
                return None, None
            # Drop half of what is left (at least one pair), like llama.cpp's context shift.
            drop += max(2, (len(rest) - drop) // 2)
            drop = min(drop, len(rest) - 1)
            if drop < len(rest) and rest[drop].role == "assistant":  # never start on an assistant turn
                drop = min(drop + 1, len(rest) - 1)

    def _shift(
        self, messages: list[Message], prompt: list[int], generated: list[int], reserve: int
    ) -> tuple[list[int], np.ndarray] | None:
        """The cache is full mid-reply: drop old turns and continue from the same partial reply."""
        before = self._dropped
        self._dropped += 2
        new_prompt, _ = self._fit(messages, reserve)
        if new_prompt is None or self._dropped == before or len(new_prompt) + len(generated) >= self.n_ctx:
            self._dropped = before
            return None
        sequence = new_prompt + generated
        keep = common_prefix(self.session.tokens, sequence)
        keep = min(keep, len(sequence) - 1)
        self.session.truncate(keep)
        logits = self.session.eval(sequence[keep:])
        return new_prompt, logits


def prompt_ids(tok: Tokenizer, prompt: RenderedPrompt) -> list[int]:
    """A rendered chat prompt's token ids: special tokens on outside its plain spans, BOS first where the model
    wants one and the template did not write it."""
    ids = tok.tokenize(prompt.text, special=True, plain_spans=prompt.plain_spans)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
    return ids


class _LogitShaper:
    """What changes the logits before sampling, for one reply: a logit bias and a grammar's mask."""

    def __init__(self, bias: tuple[np.ndarray, np.ndarray] | None, grammar: Grammar | None) -> None:
        self._bias = bias  # (ids, values); -inf bans
        self._grammar = grammar

    @classmethod
    def build(
        cls, tokenizer: Tokenizer, constraint: GrammarSpec | None, logit_bias: Mapping[int, float] | None
    ) -> _LogitShaper | None:
        bias = None
        if logit_bias:
            n = tokenizer.n_vocab
            for token_id, value in logit_bias.items():
                if not 0 <= int(token_id) < n:
                    raise SettingsError(f"logit_bias: token id {token_id} is outside the vocabulary (0 to {n - 1})")
                if not -100 <= value <= 100:
                    raise SettingsError(f"logit_bias: value {value} for token {token_id} is not between -100 and 100")
            ids = np.fromiter((int(t) for t in logit_bias), dtype=np.int64)
            values = np.array([-np.inf if v <= -100 else v for v in logit_bias.values()], dtype=np.float32)
            bias = (ids, values)
        grammar = compile_grammar(tokenizer, constraint) if constraint is not None else None
        return cls(bias, grammar) if bias is not None or grammar is not None else None

    def start(self) -> ConstraintState | None:
        return self._grammar.start() if self._grammar is not None else None

    def shape(self, logits: np.ndarray, state: ConstraintState | None) -> None:
        """Bias, then mask `logits` in place (the grammar has the last word: a bias never un-bans a token)."""
        if self._bias is not None:
            ids, values = self._bias
            logits[ids] += values
        if state is not None:
            state.mask_logits(logits)
