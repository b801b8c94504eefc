"""Each sampling setting's declared range is one the real sampler survives, at both ends.

`SAMPLER_SETTINGS` is what the server, the command line and config.toml accept; a value inside it must never make
`Sampler.sample` fail ("logits are not usable for sampling") or return NaN. A value outside it is refused by
`accepts`, so it never reaches the sampler from a request.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from engine.sampling import SAMPLER_SETTINGS, SAMPLER_SETTINGS_BY_NAME, Sampler, SamplingSettings

TINY = 5e-324  # the smallest positive float64: rounds to 0 in float32
HUGE = 1e308  # near float64's largest: infinite in float32
LOGIT_SCALE = 1e4  # the largest logit magnitude the declaration's comment allows for (SmolLM2's: about 30)
WINDOW = 100_000  # tokens in the penalty window: every id of the vocabulary seen many times


def _ends(name: str) -> list[float]:
    """The extremes of a float setting's accepted values: both ends, each special value, and the smallest
    positive value inside the range (where float32 rounding bites)."""
    s = SAMPLER_SETTINGS_BY_NAME[name]
    ends = [v for v in (s.low, s.high) if v is not None] + [v for v, _ in s.special]
    if s.low is not None and s.low <= 0 < (s.high or math.inf):
        ends.append(TINY)
    return [v for v in ends if s.accepts(v)]


@pytest.fixture(scope="module")
def logits(smollm2_model) -> list[np.ndarray]:
    """Real logits, and the same stretched to LOGIT_SCALE."""
    ids = smollm2_model.tokenize("The owl is a bird that", special=True)
    real = np.asarray(smollm2_model.logits(ids)[-1], dtype=np.float32)
    return [real, real * np.float32(LOGIT_SCALE / np.abs(real).max())]


def _check(sample_logits: np.ndarray, settings: SamplingSettings) -> None:
    assert settings.validated()[1] == [], settings  # inside the declaration: used as given
    recent = np.resize(np.arange(sample_logits.shape[0]), WINDOW).tolist()
    res = Sampler(0).sample(sample_logits, settings, recent)
    assert 0 <= res.token_id < sample_logits.shape[0]
    assert 0.0 <= res.prob <= 1.0 and math.isfinite(res.prob), (settings, res)


FLOATS = [s.name for s in SAMPLER_SETTINGS if s.kind is float]


@pytest.mark.parametrize("name", FLOATS)
def test_each_end_of_each_float_range_samples(logits: list[np.ndarray], name: str) -> None:
    for x, value, temperature, last_n in itertools.product(logits, _ends(name), (0.0, 0.7, TINY, 100.0), (-1, 64)):
        base = SamplingSettings(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=last_n)
        _check(x, SamplingSettings(**{**base.__dict__, name: value}))


def test_every_penalty_at_its_ends_at_once(logits: list[np.ndarray]) -> None:
    """The three penalties together, each at either end, over a window that holds every id many times."""
    names = ("repeat_penalty", "presence_penalty", "frequency_penalty")
    for x, combo, temperature in itertools.product(logits, itertools.product(*map(_ends, names)), (0.0, 1.0)):
        for top in ({"top_k": 0, "top_p": 1.0, "min_p": 0.0}, {}):
            penalties = dict(zip(names, combo, strict=True))
            _check(x, SamplingSettings(temperature=temperature, repeat_last_n=-1, **penalties, **top))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("presence_penalty", -HUGE),
        ("presence_penalty", HUGE),
        ("frequency_penalty", -HUGE),
        ("repeat_penalty", TINY),
        ("repeat_penalty", HUGE),
        ("temperature", HUGE),
        ("temperature", math.nan),
        ("top_p", math.inf),
        ("min_p", -math.inf),
        ("presence_penalty", math.nan),
    ],
)
def test_values_past_the_float32_range_are_refused(name: str, value: float) -> None:
    """What used to reach the sampler and overflow there (-1e308 presence, 5e-324 repeat penalty) is refused."""
    assert not SAMPLER_SETTINGS_BY_NAME[name].accepts(value)
