"""Token sampling: small pure functions over a logits vector, and a seeded `Sampler` that chains them.

The pipeline follows llama.cpp's default sampler order:

    penalties -> top-k -> top-p -> min-p -> temperature -> softmax -> draw

top-p and min-p look at the distribution at temperature 1 (as llama.cpp does); temperature only reshapes
the tokens that survive. A temperature <= 0 means greedy: the argmax after penalties.

Candidates are ordered by (logit descending, token id ascending), so every mask is exact and ties are
broken the same way on every run: among equal logits the lower token id wins.

Cost per token (2 shared vCPUs, median): defaults ~0.4 ms at a 49k vocab, ~0.9 ms at 152k; top_k = 0
sorts only the head that top-p needs (a few ms when that head is thousands of tokens).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

N_TOP = 5  # alternatives reported with each sampled token
# The smallest temperature float32 can hold: a smaller one rounds to 0, and 0 / 0 would make the top token NaN.
_T_MIN_F32 = float(np.finfo(np.float32).smallest_subnormal)


@dataclass(frozen=True)
class SamplingSettings:
    """A value the caller may replace at any moment; the next sampled token uses the new one.

    Defaults follow llama.cpp's.
    """

    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64  # how many recent tokens the penalties look at; -1: all of `recent`; 0 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: a fresh random seed per turn
    max_tokens: int = 512  # reply length limit; -1: until the context is full

    def validated(self) -> tuple[SamplingSettings, list[str]]:
        """Settings with absurd values replaced by usable ones, and one message per field replaced.

        What is absurd, and what replaces it, is `SAMPLER_SETTINGS`' declaration. Each message names the field,
        the value given and the value used, e.g. "top_p 7 is above 1; using 1.0".
        """
        values: dict[str, Any] = {}  # each a value of its field's type (`repaired`)
        messages = []
        for setting in SAMPLER_SETTINGS:
            given = getattr(self, setting.name)
            used, why = setting.repaired(given)
            values[setting.name] = used
            if why:
                messages.append(f"{setting.name} {given!r} {why}; using {used!r}")
        return replace(self, **values), messages


def _num(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class SamplerSetting:
    """One field of `SamplingSettings`: its type, the values it takes and what they mean.

    The one declaration that the config's checks, the command-line flags, the sampling panel and `validated`
    all read, so a value means the same everywhere. Ordinary values lie between `low` and `high`; `special`
    values have a meaning of their own (inside the range, like 0 = off, or below it, like -1 = random).
    """

    name: str
    kind: type[int] | type[float]
    low: float | None  # the smallest ordinary value; None: no bound
    high: float | None = None  # the largest; None: no bound
    help: str = ""  # one or two sentences for the user
    special: tuple[tuple[float, str], ...] = ()  # (value, meaning), e.g. ((-1, "random"),)
    low_open: bool = False  # `low` itself is not accepted ("> 0")
    if_too_low: float | None = None  # what replaces a value below every accepted one; None: `low`

    @property
    def default(self) -> float:
        return getattr(SamplingSettings(), self.name)

    def accepts(self, value: float) -> bool:
        """True for a value of this setting that needs no repair (never NaN or an infinity)."""
        if not math.isfinite(value):
            return False
        if any(value == v for v, _ in self.special):
            return True
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value <= self.high

    @property
    def expected(self) -> str:
        """The accepted values in words: "≥ -1 (-1 = random)", "between 0 and 1"."""
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            text = f"between {_num(lo)} and {_num(hi)}"
        elif lo is not None:
            text = f"{'>' if self.low_open else '≥'} {_num(lo)}"
        else:
            text = f"≤ {_num(hi)}" if hi is not None else ""
        outside = [v for v, _ in self.special if not (lo is None or v >= lo)]
        text += "".join(f", or {_num(v)}" for v in outside)
        if self.special:
            text += " (" + ", ".join(f"{_num(v)} = {meaning}" for v, meaning in self.special) + ")"
        return text.strip()

    def repaired(self, given: object) -> tuple[float, str]:
        """`given` if accepted, else the value to use instead and why (for `validated`)."""
        if isinstance(given, bool) or not isinstance(given, (int, float)) or math.isnan(given):
            return self.default, "is not a number"
        if math.isinf(given):
            return self.default, "is infinite"
        why = ""
        if self.kind is int and given != int(given):
            given, why = int(given), "is not a whole number"
        value: float = self.kind(given)
        if self.accepts(value):
            return value, why
        meanings = f" ({', '.join(f'{_num(v)} = {m}' for v, m in self.special)})" if self.special else ""
        if self.high is not None and value > self.high:
            return self.kind(self.high), f"is above {_num(self.high)}"
        lowest = min([v for v, _ in self.special] + ([self.low] if self.low is not None else []))
        if value > lowest:  # between a special value below the range and the range: nothing it could mean
            return self.default, f"is not {self.expected}"
        used = self.low if self.if_too_low is None else self.if_too_low
        if used is None:  # not reached: without a lower bound, `accepts` took every value up to `high`
            return self.default, f"is not {self.expected}"
        bound = "is not above" if self.low_open else "is below"
        shown = self.low if self.low_open and self.low is not None else lowest
        return self.kind(used), f"{bound} {_num(shown)}{meanings}"


# The float ranges are ones the sampler survives at both ends (tests/engine/test_sampler_bounds.py runs each end
# through `Sampler`): logits of magnitude up to 1e4, penalised by at most 1000 per occurrence over a million-token
# window, stay far inside float32 (3.4e38); a repeat penalty of 0.001 or 1000 scales a logit by 1e3 at most.
SAMPLER_SETTINGS: tuple[SamplerSetting, ...] = (
    SamplerSetting(
        "temperature", float, 0.0, 100.0, special=((0.0, "greedy"),),
        help="Randomness. 0 is greedy (always the most likely token).",
    ),
    SamplerSetting(
        "top_k", int, 0, special=((0, "off"),),
        help="Sample only among the k most likely tokens. 0 disables.",
    ),
    SamplerSetting(
        "top_p", float, 0.0, 1.0,
        help="Keep the most likely tokens whose probabilities add up to p. 1.0 disables.",
    ),
    SamplerSetting(
        "min_p", float, 0.0, 1.0,
        help="Drop tokens less likely than min-p × the top token's probability. 0 disables.",
    ),
    SamplerSetting(
        "repeat_penalty", float, 0.001, 1000.0, special=((1.0, "off"),), if_too_low=1.0,
        help="Make tokens seen in the penalty window less likely (their logits divided by it). 1.0 disables.",
    ),
    SamplerSetting(
        "presence_penalty", float, -1000.0, 1000.0,
        help="Subtracted from the logit of every token seen in the penalty window. 0 disables.",
    ),
    SamplerSetting(
        "frequency_penalty", float, -1000.0, 1000.0,
        help="Subtracted once for each time a token was seen in the penalty window. 0 disables.",
    ),
    SamplerSetting(
        "repeat_last_n", int, 0, special=((-1, "whole context"), (0, "off")),
        help="How many recent tokens the three penalties look at. 0 turns them off; -1: the whole context.",
    ),
    SamplerSetting(
        "seed", int, 0, special=((-1, "random"),), if_too_low=-1,
        help="A fixed seed makes replies reproducible; -1 is random (a new seed each turn).",
    ),
    SamplerSetting(
        "max_tokens", int, 1, special=((-1, "unlimited"),), if_too_low=-1,
        help="Reply length limit; -1 is unlimited (until the context is full).",
    ),
)  # fmt: skip
SAMPLER_SETTINGS_BY_NAME = {s.name: s for s in SAMPLER_SETTINGS}


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    prob: float  # probability of token_id in the distribution it was drawn from
    top: tuple[tuple[int, float], ...]  # up to N_TOP (id, prob) from that distribution, most likely first


# --- the steps, as pure functions -------------------------------------------------------------------------


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities (float64) from logits; -inf entries get probability 0.

    float32 input is exponentiated in float32 (4x faster over a 152k vocab), then normalised in float64.
    """
    e = _exp_shifted(logits)
    return e.astype(np.float64) / e.sum(dtype=np.float64)


def _exp_shifted(logits: np.ndarray) -> np.ndarray:
    """exp(logits - max): unnormalised probabilities, float32 for float32 input."""
    x = np.asarray(logits)
    if x.dtype != np.float32:
        x = x.astype(np.float64)
    return np.exp(x - x.max())


def apply_penalties(
    logits: np.ndarray,
    recent: Sequence[int],
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> np.ndarray:
    """Logits with llama.cpp's penalties applied to tokens seen in the last `repeat_last_n` of `recent`.

    For each such token seen `count` times: a positive logit is divided by `repeat_penalty`, a negative one
    multiplied by it; then `count * frequency_penalty + presence_penalty` is subtracted. Returns `logits`
    itself when no penalty applies (callers never write into it), else a new float32 array.
    """
    if repeat_last_n == 0 or (repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0):
        return logits
    window = recent if repeat_last_n < 0 else recent[-repeat_last_n:]
    if len(window) == 0:
        return logits
    ids = np.asarray(window, dtype=np.int64)
    n_vocab = logits.shape[0]
    bad = ids[(ids < 0) | (ids >= n_vocab)]
    if bad.size:
        raise ValueError(f"recent token id {int(bad[0])} is outside the vocabulary (n_vocab={n_vocab})")
    uniq, counts = np.unique(ids, return_counts=True)
    out = np.array(logits, dtype=np.float32)  # a copy
    x = out[uniq]
    # Dividing a negative logit would make the token *more* likely; llama.cpp multiplies instead.
    x = np.where(x > 0, x / np.float32(repeat_penalty), x * np.float32(repeat_penalty))
    x -= counts.astype(np.float32) * np.float32(frequency_penalty) + np.float32(presence_penalty)
    out[uniq] = x
    return out


def _order_keys(logits: np.ndarray) -> np.ndarray:
    """One int64 per token whose ascending order is (logit descending, token id ascending).

    High 32 bits: the float32 logit's bits mapped to an order-preserving int and negated; low 32 bits: the
    id. Keys are unique, so a plain (fast, unstable) sort or partition gives an exact, tie-free order.
    """
    n = logits.shape[0]
    bits = (np.asarray(logits, dtype=np.float32) + np.float32(0.0)).view(np.int32)  # -0.0 -> 0.0: they tie
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negative floats: flip the magnitude bits so they sort as ints
    keys = np.empty(n, dtype=np.int64)
    np.invert(bits, out=keys)  # descending logit = ascending ~bits
    keys <<= 32
    keys |= _ids(n)
    return keys


@functools.cache
def _ids(n: int) -> np.ndarray:
    ids = np.arange(n, dtype=np.int64)
    ids.flags.writeable = False
    return ids


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the `k` highest logits, ordered by (logit descending, id ascending); all ids if k >= n.

    Exact under ties: tokens tied at the boundary are taken lowest id first. O(n) for k < n (partition).
    """
    return _top(_order_keys(logits), k)


def _top(keys: np.ndarray, k: int) -> np.ndarray:
    if k <= 0:
        return np.empty(0, dtype=np.intp)
    if k < keys.size:
        keys = np.partition(keys, k - 1)[:k]
    return (np.sort(keys) & 0xFFFFFFFF).astype(np.intp)


def _top_p_count(sorted_probs: np.ndarray, p: float) -> int:
    """How many of the (descending) probs the smallest set with cumulative prob >= p needs; at least 1."""
    if p >= 1.0:
        return sorted_probs.size
    # side="left": the first index whose cumulative sum reaches p is included, as in llama.cpp.
    return min(int(np.searchsorted(np.cumsum(sorted_probs), p, side="left")) + 1, sorted_probs.size)


def _min_p_threshold(max_logit: float, min_p: float) -> np.float32:
    """The logit a token needs to survive min-p: p >= min_p * p_max  <=>  l >= l_max + log(min_p).

    Computed in float32 in logit space, as llama.cpp does; no exp over the vocabulary.
    """
    return np.float32(max_logit) + np.float32(math.log(min_p))


def _min_p_count(sorted_logits: np.ndarray, min_p: float) -> int:
    """How many of the (descending) logits survive min-p; at least 1."""
    if min_p <= 0.0:
        return sorted_logits.size
    return max(int(np.count_nonzero(sorted_logits >= _min_p_threshold(sorted_logits[0], min_p))), 1)


def _mask(n: int, keep: np.ndarray) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[keep] = True
    return mask


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the `k` tokens with the highest logits (ties: lower id first); k <= 0 keeps all."""
    n = logits.shape[0]
    return np.ones(n, dtype=bool) if k <= 0 or k >= n else _mask(n, top_ids(logits, k))


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Boolean mask of the smallest most-likely set whose probability is >= p (at least one token).

    Tokens already excluded should carry -inf; they have probability 0 and are never kept.
    """
    order = top_ids(logits, logits.shape[0])
    count = _top_p_count(softmax(logits)[order], p)
    return _mask(logits.shape[0], order[:count])


def min_p_mask(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Boolean mask of tokens whose probability is >= min_p times the top token's."""
    if min_p <= 0:
        return np.ones(logits.shape[0], dtype=bool)
    return logits >= _min_p_threshold(logits.max(), min_p)


# --- the sampler ------------------------------------------------------------------------------------------


def _candidates(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray | None:
    """Sorted ids that survive top-k, top-p and min-p; None when nothing is filtered (the whole vocab)."""
    n = x.shape[0]
    if 0 < top_k < n:
        ids = top_ids(x, top_k)
        keep = _top_p_count(softmax(x[ids]), top_p)
        return ids[: min(keep, _min_p_count(x[ids[:keep]], min_p))]
    if top_p >= 1.0 and min_p <= 0.0:
        return None
    # No top-k: the survivors are still a prefix of the sorted vocab, so sort only as far as needed.
    keep = n
    if min_p > 0.0:
        keep = max(int(np.count_nonzero(x >= _min_p_threshold(x.max(), min_p))), 1)
    if top_p < 1.0:
        e = _exp_shifted(x)
        z = e.sum(dtype=np.float64)  # as softmax() computes it, so the masks and this agree to the bit
        # Usually a short head holds top_p of the mass; if not, widen it (partitioning is cheaper than sorting).
        keys = _order_keys(x)
        m = min(256, keep)
        while True:
            ids = _top(keys, m)
            head = e[ids].astype(np.float64) / z
            if np.cumsum(head)[-1] >= top_p or m == keep:
                return ids[: min(_top_p_count(head, top_p), keep)]
            m = min(m * 16, keep)
    return top_ids(x, keep)


def distribution(logits: np.ndarray, settings: SamplingSettings) -> tuple[np.ndarray | None, np.ndarray]:
    """The distribution a token is drawn from: top-k, top-p, min-p, then temperature (which must be > 0).

    Returns (ids, probs): the surviving ids, most likely first, and their probabilities. ids is None when
    nothing was filtered; probs then covers the whole vocabulary in id order. Penalties come before this
    (apply_penalties); `settings` should be validated.
    """
    s = settings
    ids = _candidates(logits, s.top_k, s.top_p, s.min_p)
    # Shift before dividing: with a tiny temperature, logit / t alone overflows to inf (and inf - inf = nan).
    if ids is None:
        with np.errstate(over="ignore"):  # -huge / tiny t -> -inf -> probability 0, as it should
            return None, softmax((logits - logits.max()) / np.float32(max(s.temperature, _T_MIN_F32)))
    x = logits[ids].astype(np.float64)
    with np.errstate(over="ignore"):
        return ids, softmax((x - x[0]) / s.temperature)


class Sampler:
    """Draws tokens from logits with its own seeded RNG; settings are passed per call.

    The same seed, settings and sequence of logits give the same tokens.
    """

    def __init__(self, seed: int) -> None:
        self.reseed(seed)
        self._settings: SamplingSettings | None = None
        self._valid = SamplingSettings()

    def reseed(self, seed: int) -> None:
        """Restart the RNG; a negative seed takes fresh entropy from the OS."""
        self._rng = np.random.default_rng(None if seed < 0 else seed)

    def sample(self, logits: np.ndarray, settings: SamplingSettings, recent: Sequence[int]) -> SampleResult:
        """Pick the next token from `logits` (n_vocab,) given the tokens seen so far (`recent`)."""
        if settings is not self._settings:  # validate once per settings object, not per token
            self._settings, self._valid = settings, settings.validated()[0]
        s = self._valid
        x = apply_penalties(logits, recent, s.repeat_penalty, s.repeat_last_n, s.presence_penalty, s.frequency_penalty)
        x_max = float(x.max())
        if not math.isfinite(x_max):
            raise ValueError(f"logits are not usable for sampling (max is {x_max})")

        if s.temperature <= 0:
            # Greedy; report the softmax of the penalised logits so the UI still shows a confidence.
            top = top_ids(x, N_TOP)
            e = np.exp(x - np.float32(x_max))  # float32: the sum only feeds a displayed confidence
            top_probs = e[top].astype(np.float64) / e.sum(dtype=np.float64)
            return SampleResult(int(top[0]), float(top_probs[0]), _pairs(top, top_probs))

        ids, probs = distribution(x, s)
        i = _draw(self._rng, probs)
        return _result(x, ids, probs, i)

    def sample_draft(
        self, logits: np.ndarray, settings: SamplingSettings, recent: Sequence[int], draft: int
    ) -> tuple[SampleResult, bool]:
        """The next token when a deterministic draft proposed `draft`, and whether the draft was accepted.

        Speculative sampling's rule for a draft that is a point mass: accept with probability p(draft) under
        the distribution `sample` would draw from, else draw from p with the draft removed (renormalised).
        The token is then distributed exactly as `sample`'s. Greedy: the argmax, accepted when it is the draft.
        """
        if settings is not self._settings:
            self._settings, self._valid = settings, settings.validated()[0]
        s = self._valid
        if s.temperature <= 0:
            res = self.sample(logits, settings, recent)
            return res, res.token_id == draft
        x = apply_penalties(logits, recent, s.repeat_penalty, s.repeat_last_n, s.presence_penalty, s.frequency_penalty)
        x_max = float(x.max())
        if not math.isfinite(x_max):
            raise ValueError(f"logits are not usable for sampling (max is {x_max})")
        ids, probs = distribution(x, s)
        if ids is None:
            at = draft if 0 <= draft < probs.size else -1
        else:
            hits = np.flatnonzero(ids == draft)
            at = int(hits[0]) if hits.size else -1
        p_draft = float(probs[at]) if at >= 0 else 0.0
        if p_draft > 0.0 and self._rng.random() < p_draft:
            return _result(x, ids, probs, at), True
        residual = probs
        if at >= 0:
            residual = probs.copy()
            residual[at] = 0.0
        if not residual.any():  # p(draft) was 1 up to rounding and the draw fell past it
            return _result(x, ids, probs, at), True
        return _result(x, ids, probs, _draw(self._rng, residual)), False


def _result(x: np.ndarray, ids: np.ndarray | None, probs: np.ndarray, i: int) -> SampleResult:
    """The SampleResult for index i of a distribution (ids, probs) drawn from the penalised logits x."""
    if ids is None:  # the whole vocab, in id order
        top = top_ids(x, N_TOP)  # temperature > 0 keeps the ranking of the logits
        return SampleResult(i, float(probs[i]), _pairs(top, probs[top]))
    return SampleResult(int(ids[i]), float(probs[i]), _pairs(ids[:N_TOP], probs[:N_TOP]))


_DRAW_BLOCK = 1024  # above this many candidates, find the block first: np.cumsum is slow over 152k


def _draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """Index drawn from `probs` (id order) by inverse CDF; a zero-probability entry is never chosen."""
    target = rng.random()
    if probs.size <= _DRAW_BLOCK:
        cdf = np.cumsum(probs)
        return _pick(cdf, probs, target * cdf[-1])
    n_full = probs.size // _DRAW_BLOCK * _DRAW_BLOCK
    sums = np.append(probs[:n_full].reshape(-1, _DRAW_BLOCK).sum(axis=1), probs[n_full:].sum())
    cdf = np.cumsum(sums)
    target *= cdf[-1]
    b = _pick(cdf, sums, target)
    target -= cdf[b - 1] if b else 0.0
    block = probs[b * _DRAW_BLOCK : (b + 1) * _DRAW_BLOCK]
    return b * _DRAW_BLOCK + _pick(np.cumsum(block), block, target)


def _pick(cdf: np.ndarray, weights: np.ndarray, target: float) -> int:
    """First index whose cumulative weight exceeds `target`; rounding past the end gives the last index
    with a non-zero weight, never a zero-weight one."""
    i = int(np.searchsorted(cdf, target, side="right"))
    return i if i < cdf.size else int(np.flatnonzero(weights)[-1])


def _pairs(ids: np.ndarray, probs: np.ndarray) -> tuple[tuple[int, float], ...]:
    return tuple((int(t), float(p)) for t, p in zip(ids, probs, strict=True) if p > 0)
