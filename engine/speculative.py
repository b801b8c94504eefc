"""Drafters for speculative decoding: cheap guesses of the next few tokens, checked by one target pass.

A drafter is deterministic given the context, so the chat layer accepts its tokens with the point-mass form of
the speculative-sampling rule (Sampler.sample_draft) and the reply follows the target's distribution exactly.

- `LookupDrafter` (prompt lookup): the tokens that followed the latest earlier occurrence of the context's last
  n-gram. Free to compute; it pays off when a reply repeats text already in the conversation.
- `ModelDrafter`: a smaller model with the same vocabulary, greedy, with its own KV cache that follows the
  target's (it is truncated to the longest common prefix with the target's tokens before every draft).
- `CombinedDrafter`: lookup's guesses where the context has a match, the draft model's elsewhere.

Both adapt the draft length (3, 7, 15, ... guesses up to draft_max: it grows after a fully accepted draft and
starts over after a rejection), and, as the app runs them, pause guessing while it does not pay (`Pace`): a
verification pass over k tokens costs more than a one-token pass on a CPU, so wasted guesses must stay rare.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .errors import SettingsError
from .sequences import common_prefix

if TYPE_CHECKING:
    from .model import Model

DRAFT_MAX = 16  # llama.cpp's --draft-max default
DRAFT_P_MIN = 0.75  # a draft model stops guessing when its own top probability falls below this (llama.cpp's)
LOOKUP_NGRAM = 4  # longest n-gram prompt lookup matches; it tries shorter ones down to LOOKUP_NGRAM_MIN
LOOKUP_NGRAM_MIN = 3  # shorter matches (a bigram of indentation) guess wrong too often to pay for their check


class Drafter(Protocol):
    """Guesses continuations of a token sequence."""

    name: str  # "lookup" or the draft model's name, for display

    def draft(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens guessed to follow `context` (which ends with the newest sampled token)."""
        ...

    def feedback(self, drafted: int, accepted: int, pass_ms: float) -> None:
        """How many of the last draft's tokens the target accepted, and what that pass cost (drafting
        included); drafted 0 reports a plain one-token pass."""
        ...

    def follow(self, tokens: Sequence[int]) -> None:
        """The target's KV cache now holds exactly `tokens` (after a turn, a cancel or a context shift)."""
        ...

    def prepare(self, prompt: Sequence[int]) -> int:
        """The target has just evaluated `prompt`: catch up on it now, as part of the prompt's processing,
        so that the reply's first guesses do not pay for it. Returns the tokens evaluated."""
        ...


class _Length:
    """Adaptive draft length: FIRST_LENGTH, then 2·FIRST_LENGTH + 1, ... guesses, up to `most`. It grows after
    a fully accepted draft and starts over after a rejection.

    The newest token and the guesses fill whole tiles of AVX2's kernels (packed.matmul, 4 rows): a verification
    pass runs its rows a tile at a time, the first tile streaming the weights from memory while it computes, and
    a pass of fewer rows is padded to one tile, so 2, 3 and 4 rows cost alike and leftovers past a tile cost more
    than their share. Full passes of Qwen2.5-Coder-1.5B with tiles of 4 (Intel Xeon, 2 threads, fastest of 4-6):
    1 row 40-42 ms, 2 rows 56-58, 3 rows 58-60, 4 rows 58-61, 5 rows 69-76; 8 rows 91, 9 rows 102, 16 rows 168,
    17 rows 181. AVX-512's tiles are 8 rows (see FIRST_LENGTH)."""

    def __init__(self, most: int) -> None:
        self.most = max(1, most)
        self.now = min(FIRST_LENGTH, self.most)

    def feedback(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted >= drafted:
            self.now = min(self.most, 2 * self.now + 1)
        else:
            self.now = min(FIRST_LENGTH, self.most)


# 3 guesses and the newest token fill AVX2's tile of 4 rows. AVX-512's tile is 8 rows, so a pass of 4 runs as one
# padded tile there; whether starting at 7 guesses pays on such a CPU is not measured yet, so both start at 3.
FIRST_LENGTH = 3


class Pace:
    """Whether guessing pays on this machine: the tokens a verification pass yields per millisecond, against
    a plain pass's one token. When guessing loses, it pauses for a number of steps that doubles each time
    (up to PACE_MAX_PAUSE) and then tries again, so a turn where nothing matches stays at plain speed and one
    where the reply starts repeating text picks guessing up again."""

    def __init__(self) -> None:
        self.plain_ms = 0.0  # running mean of a one-token pass
        self.spec_ms = 0.0  # running mean of a verification pass
        self.spec_tokens = 0.0  # running mean of the tokens a verification pass yields (accepted + 1)
        self.pause = 0  # plain steps left before guessing again
        self.next_pause = PACE_FIRST_PAUSE

    def allow(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int, pass_ms: float, attempted: bool = False) -> None:
        """A step's pass time: plain (no guesses, none tried), or a try at guessing: guesses checked, or, with
        `attempted`, a draft model's pass that found no guess confident enough (its time spent for nothing)."""
        if drafted == 0 and not attempted:
            self.plain_ms = _mean(self.plain_ms, pass_ms)
            return
        self.spec_ms = _mean(self.spec_ms, pass_ms)
        self.spec_tokens = _mean(self.spec_tokens, accepted + 1.0)
        if self.plain_ms <= 0:  # nothing to compare with yet: the next step runs plain and measures it
            self.pause = 1
            return
        # A pass that accepted none of its guesses yielded one token at more than a plain pass's cost, whatever
        # the clock says: a noisy timing must not count it as paying and reset the pause.
        if (drafted > 0 and accepted == 0) or self.spec_tokens / self.spec_ms < PACE_MARGIN / self.plain_ms:
            self.pause = self.next_pause
            self.next_pause = min(PACE_MAX_PAUSE, self.next_pause * 2)
        else:
            self.next_pause = PACE_FIRST_PAUSE


PACE_MARGIN = 1.0  # guessing must yield at least the plain pass's tokens per millisecond
PACE_FIRST_PAUSE = 4
PACE_MAX_PAUSE = 64


def _mean(old: float, new: float, weight: float = 0.3) -> float:
    return new if old <= 0 else old + weight * (new - old)


class LookupDrafter:
    """Prompt lookup: continue the latest earlier match of the context's last n tokens, n = ngram .. ngram_min,
    or, right after the target replaced one of a copy's guesses, the copy past the replaced token."""

    name = "lookup"

    def __init__(
        self,
        draft_max: int = DRAFT_MAX,
        ngram: int = LOOKUP_NGRAM,
        ngram_min: int = LOOKUP_NGRAM_MIN,
        paced: bool = False,
        realign: bool = True,
    ) -> None:
        if ngram < 1 or ngram_min < 1 or ngram_min > ngram:
            raise SettingsError(f"lookup n-gram sizes {ngram_min}..{ngram} must be 1 or more, smallest first")
        self.ngram, self.ngram_min = ngram, ngram_min
        self.length = _Length(draft_max)
        self.pace = Pace() if paced else None  # None: always guess (the tests' setting: no timing involved)
        self.realign = realign  # follow the copy: its expected place first, past a replaced token (`draft`)
        self._last: tuple[int, int, int] | None = None  # the last draft: context length, source start, guesses

    def draft(self, context: Sequence[int], limit: int) -> list[int]:
        last, self._last = self._last, None  # only the draft just before this one tells where a copy goes on
        n = min(limit, self.length.now)
        if n <= 0 or (self.pace is not None and not self.pace.allow()):
            return []
        ids = np.asarray(context, dtype=np.int64)
        # Where the copy the last draft followed goes on: past its accepted guesses and the token the target
        # put after them (the next guess, or its replacement).
        accepted, expected = -1, None
        if last is not None:
            before, src, guessed = last
            accepted = len(ids) - before - 1
            if 0 <= accepted <= guessed and src + accepted + 1 < before:
                expected = src + accepted + 1
        start = self._match(ids, expected)
        # No n-gram matches right after the target replaced a guess: a copy that had run on likely goes on
        # past the replaced token ("rewrite with one change": a renamed identifier).
        if start is None and self.realign and expected is not None and accepted >= 1:
            start = expected
        if start is None:
            return []
        follow = ids[start : start + n]
        self._last = (len(ids), start, len(follow))
        return [int(t) for t in follow]

    def _match(self, ids: np.ndarray, expected: int | None) -> int | None:
        """Where the tokens after an earlier occurrence of the context's last n-gram start: the longest n-gram,
        at the copy's expected place if it occurs there, else its latest occurrence."""
        for g in range(min(self.ngram, len(ids) - 1), self.ngram_min - 1, -1):
            key = ids[-g:]
            if self.realign and expected is not None and expected >= g:
                if np.array_equal(ids[expected - g : expected], key):
                    return expected
            # Candidate starts j < len - g whose first token matches, newest first; then the whole n-gram.
            starts = np.flatnonzero(ids[: len(ids) - g] == key[0])
            for j in starts[::-1]:
                if np.array_equal(ids[j : j + g], key):
                    return int(j + g)
        return None

    def feedback(self, drafted: int, accepted: int, pass_ms: float) -> None:
        self.length.feedback(drafted, accepted)
        if self.pace is not None:
            self.pace.record(drafted, accepted, pass_ms)

    def follow(self, tokens: Sequence[int]) -> None:
        self._last = None  # the context is read afresh each time; a new turn starts no copy

    def prepare(self, prompt: Sequence[int]) -> int:
        return 0


def check_same_vocab(target: Model, draft: Model) -> None:
    """Raise SettingsError (one line) unless the draft's tokens are the target's, id for id."""
    a, b = target.tokenizer, draft.tokenizer
    why = None
    if a.n_vocab != b.n_vocab:
        why = f"{b.n_vocab} tokens against the target's {a.n_vocab}"
    elif (a.bos_id, a.eos_id) != (b.bos_id, b.eos_id):
        why = f"BOS/EOS ids {b.bos_id}/{b.eos_id} against the target's {a.bos_id}/{a.eos_id}"
    else:
        for i in range(a.n_vocab):
            if a.token_text(i) != b.token_text(i):
                why = f"token {i} is {b.token_text(i)!r}, the target's is {a.token_text(i)!r}"
                break
    if why is not None:
        raise SettingsError(f"draft model {draft.name} does not share the vocabulary of {target.name}: {why}")


class ModelDrafter:
    """Greedy guesses from a smaller model of the same vocabulary, with its own KV cache."""

    def __init__(
        self,
        model: Model,
        target: Model,
        n_ctx: int | None = None,
        draft_max: int = DRAFT_MAX,
        p_min: float = DRAFT_P_MIN,
        paced: bool = False,
    ) -> None:
        check_same_vocab(target, model)
        self.pace = Pace() if paced else None
        self._catch_up_ms = 0.0  # the latest draft's catch-up prefill
        self._tried = False  # whether the latest draft ran the draft model (guesses or not)
        self.model = model
        self.session = model.session(n_ctx)
        self.name = model.name
        self.p_min = p_min
        self.length = _Length(draft_max)
        self.n_vocab_target = target.n_vocab  # a padded draft vocabulary's extra ids are never offered

    @property
    def cached_tokens(self) -> list[int]:
        return list(self.session.tokens)

    def follow(self, tokens: Sequence[int]) -> None:
        keep = common_prefix(self.session.tokens, tokens)
        self.session.truncate(keep)

    def prepare(self, prompt: Sequence[int]) -> int:
        # A turn's new prompt tokens are a prefill for the draft as for the target. Left to the first draft, the
        # 0.5B draft's catch-up on a 600-token prompt (~1 s) made the 1.5B's 64-token reply slower than plain.
        keep = common_prefix(self.session.tokens, prompt)
        if not keep < len(prompt) <= self.session.n_ctx:
            return 0
        self.session.truncate(keep)
        self.session.eval(prompt[keep:])
        return len(prompt) - keep

    def draft(self, context: Sequence[int], limit: int) -> list[int]:
        self._catch_up_ms = 0.0
        self._tried = False
        n = min(limit, self.length.now, self.session.n_ctx - len(context))
        if n <= 0 or not context or (self.pace is not None and not self.pace.allow()):
            return []
        self._tried = True
        keep = min(common_prefix(self.session.tokens, context), len(context) - 1)
        self.session.truncate(keep)
        t0 = time.perf_counter()
        logits = self.session.eval(context[keep:])
        # Catching up on a new prompt (a turn's start, a shift) is a prefill once per turn, not what a guess
        # costs: Pace is told the pass time without it.
        self._catch_up_ms = (time.perf_counter() - t0) * 1000 if len(context) - keep > 2 else 0.0
        out: list[int] = []
        while True:
            tok = int(logits.argmax())
            if tok >= self.n_vocab_target:
                break
            # Only confident guesses: a rejected one costs the target a wider pass for nothing.
            if self.p_min > 0 and 1.0 / float(np.exp(logits - logits[tok]).sum(dtype=np.float64)) < self.p_min:
                break
            out.append(tok)
            if len(out) >= n:
                break
            logits = self.session.eval([tok])
        return out

    def feedback(self, drafted: int, accepted: int, pass_ms: float) -> None:
        self.length.feedback(drafted, accepted)
        if self.pace is not None:  # a pass that found no confident guess was a try all the same (on prose, most)
            self.pace.record(drafted, accepted, pass_ms - self._catch_up_ms, attempted=self._tried)


class CombinedDrafter:
    """Prompt lookup first, a draft model where nothing matches (`--lookup` with `-md`). Lookup's guesses cost
    nothing to make, so a reply that repeats the chat (a rewrite) takes them, and the rest takes the model's;
    the model's cache catches up on the tokens lookup supplied at its next draft.

    Each keeps its own draft length and pacing, and lookup's pacing sets its passes against the model's steps
    rather than plain ones: where the model's guesses pay (new code), lookup guesses only while it beats them.
    On Qwen2.5-Coder-1.5B with the 0.5B draft (Intel Xeon, medians of 3), set against plain passes instead, it
    had taken `code` from 1.34x plain (the model alone) to 1.28x."""

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter) -> None:
        self.lookup, self.model = lookup, model
        self.name = f"lookup + {model.name}"
        self._last: LookupDrafter | ModelDrafter = model  # which one the latest draft came from

    @property
    def cached_tokens(self) -> list[int]:
        return self.model.cached_tokens

    def draft(self, context: Sequence[int], limit: int) -> list[int]:
        guesses = self.lookup.draft(context, limit)
        self._last = self.lookup if guesses else self.model
        return guesses or self.model.draft(context, limit)

    def feedback(self, drafted: int, accepted: int, pass_ms: float) -> None:
        self._last.feedback(drafted, accepted, pass_ms)
        if self._last is self.model:  # what lookup must beat: the model's step, per token it yielded
            self.lookup.feedback(0, 0, pass_ms / (accepted + 1))

    def follow(self, tokens: Sequence[int]) -> None:
        self.lookup.follow(tokens)
        self.model.follow(tokens)

    def prepare(self, prompt: Sequence[int]) -> int:
        self.lookup.prepare(prompt)
        return self.model.prepare(prompt)
