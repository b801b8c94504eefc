"""The sampler: each step exact on hand-made logits, the pipeline against the steps, and the seeded draw."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.sampling import (
    Sampler,
    SampleResult,
    SamplingSettings,
    apply_penalties,
    distribution,
    min_p_mask,
    softmax,
    top_ids,
    top_k_mask,
    top_p_mask,
)

F32 = np.float32
GREEDY = SamplingSettings(temperature=0.0)
UNFILTERED = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=F32)


def kept(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(mask).tolist()


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# --- top-k ------------------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_highest() -> None:
    x = f32(1, 5, 3, 4, 2)
    assert kept(top_k_mask(x, 2)) == [1, 3]
    assert kept(top_k_mask(x, 3)) == [1, 2, 3]


def test_top_k_breaks_ties_by_lower_id() -> None:
    x = f32(1, 4, 4, 4, 0)
    assert kept(top_k_mask(x, 1)) == [1]
    assert kept(top_k_mask(x, 2)) == [1, 2]
    # -0.0 and 0.0 are the same logit: the lower id wins whichever sign it carries
    assert kept(top_k_mask(f32(-1, 0.0, -0.0), 1)) == [1]
    assert kept(top_k_mask(f32(-1, -0.0, 0.0), 1)) == [1]


def test_top_k_zero_or_above_vocab_keeps_all() -> None:
    x = f32(1, 2, 3)
    assert top_k_mask(x, 0).all()
    assert top_k_mask(x, 3).all()
    assert top_k_mask(x, 100).all()


def test_top_ids_order_matches_a_full_stable_sort_on_many_ties() -> None:
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal(20_000) * 2).astype(F32)  # ~15 distinct values: ties everywhere
    x[::97] = -np.inf
    reference = np.lexsort((np.arange(x.size), -x))  # logit descending, id ascending
    assert np.array_equal(top_ids(x, x.size), reference)
    for k in (1, 5, 40, 1000, 19_999):
        assert np.array_equal(top_ids(x, k), reference[:k])


# --- top-p ------------------------------------------------------------------------------------------------


def test_top_p_stops_at_the_first_token_reaching_p() -> None:
    x = f32(0, 0, 0, 0)  # exactly 0.25 each, cumulative 0.25, 0.5, 0.75, 1.0
    assert kept(top_p_mask(x, 0.5)) == [0, 1]  # the boundary: 0.5 >= 0.5 stops here
    assert kept(top_p_mask(x, 0.500001)) == [0, 1, 2]
    assert kept(top_p_mask(x, 0.25)) == [0]
    assert kept(top_p_mask(x, 0.75)) == [0, 1, 2]


def test_top_p_keeps_at_least_one_token_and_one_disables() -> None:
    x = f32(1, 3, 2)
    assert kept(top_p_mask(x, 0.0)) == [1]
    assert kept(top_p_mask(x, 1.0)) == [0, 1, 2]


def test_top_p_follows_probability_order() -> None:
    x = np.log(np.array([0.1, 0.6, 0.3])).astype(F32)
    assert kept(top_p_mask(x, 0.55)) == [1]
    assert kept(top_p_mask(x, 0.85)) == [1, 2]
    assert kept(top_p_mask(x, 0.95)) == [0, 1, 2]


def test_top_p_ignores_masked_tokens() -> None:
    x = f32(0, 0, -np.inf, 0)
    assert kept(top_p_mask(x, 0.99)) == [0, 1, 3]


# --- min-p ------------------------------------------------------------------------------------------------


def test_min_p_keeps_tokens_near_the_best() -> None:
    x = f32(2, 1, 0, 2)
    assert kept(min_p_mask(x, 1.0)) == [0, 3]  # tied maxima both survive min_p = 1
    assert kept(min_p_mask(x, 0.3)) == [0, 1, 3]  # exp(-1) = 0.37 >= 0.3, exp(-2) = 0.14 < 0.3
    assert kept(min_p_mask(x, 0.1)) == [0, 1, 2, 3]
    assert kept(min_p_mask(x, 0.0)) == [0, 1, 2, 3]


def test_min_p_matches_its_definition_on_probabilities() -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(5000) * 3).astype(F32)
    p = softmax(x)
    for min_p in (0.01, 0.05, 0.2, 0.7):
        ratio = p / p.max()
        clear = np.abs(ratio - min_p) > 1e-5  # leave out tokens within float rounding of the boundary
        assert np.array_equal(min_p_mask(x, min_p)[clear], (ratio >= min_p)[clear])


# --- softmax and temperature ------------------------------------------------------------------------------


def test_softmax() -> None:
    p = softmax(f32(0, 0, -np.inf, 0))
    assert p.tolist() == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])
    assert p[2] == 0.0
    assert softmax(f32(1000, 0))[0] == 1.0  # no overflow


def test_temperature_sharpens_and_flattens() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1000) * 2).astype(F32)
    entropies = []
    for t in (0.25, 0.5, 1.0, 2.0, 4.0):
        ids, probs = distribution(x, dataclasses.replace(UNFILTERED, temperature=t))
        assert ids is None and probs.size == x.size
        entropies.append(entropy(probs))
    assert entropies == sorted(entropies)
    assert entropies[0] < entropies[2] - 1.0 and entropies[-1] > entropies[2] + 1.0
    assert entropies[-1] < np.log(x.size)  # still below uniform
    _, at_one = distribution(x, UNFILTERED)
    assert np.allclose(at_one, softmax(x))


def test_a_tiny_temperature_is_nearly_greedy_not_nan() -> None:
    x = f32(10.0, 9.0, -3.0, 50.0)
    for settings in (SamplingSettings(temperature=1e-40), dataclasses.replace(UNFILTERED, temperature=1e-40)):
        ids, probs = distribution(x, settings)
        assert not np.isnan(probs).any()
        chosen = 3 if ids is None else int(ids[0])
        assert chosen == 3 and probs[3 if ids is None else 0] == 1.0
        assert Sampler(0).sample(x, settings, []).token_id == 3


def test_temperature_applies_after_top_p_and_min_p() -> None:
    # At temperature 1 token 2 holds 0.09 < min_p * p_max = 0.1 * 0.67 and is dropped; a high temperature
    # must not bring it back (llama.cpp applies temperature last).
    x = np.log(np.array([0.67, 0.24, 0.09])).astype(F32)
    s = SamplingSettings(temperature=5.0, top_k=0, top_p=1.0, min_p=0.2)
    ids, probs = distribution(x, s)
    assert ids.tolist() == [0, 1]
    assert probs[0] > probs[1] > 0.4  # flattened by temperature 5, over the two survivors only


# --- the pipeline against the steps -----------------------------------------------------------------------


def assert_pipeline_keeps_what_the_masks_keep(top_k: int, top_p: float, min_p: float, scale: float) -> None:
    """`distribution` keeps exactly the tokens top-k, then top-p, then min-p keep, in the masks' order.

    The masks are the oracle for `distribution`'s own candidate search; `_top_p_count`, which both use, is held
    to hand-made logits by the top-p tests above.
    """
    rng = np.random.default_rng(top_k + int(100 * top_p))
    x = np.round(rng.standard_normal(20_000) * scale, 1).astype(F32)  # rounded: ties everywhere
    settings = SamplingSettings(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    masked = np.where(top_k_mask(x, top_k), x, -np.inf).astype(F32)
    masked = np.where(top_p_mask(masked, top_p), masked, -np.inf).astype(F32)
    expected = np.flatnonzero(min_p_mask(masked, min_p) & np.isfinite(masked))
    ids, probs = distribution(x, settings)
    assert ids is not None
    assert sorted(ids.tolist()) == expected.tolist()
    assert np.array_equal(ids, top_ids(x, ids.size))  # most likely first, ties by id
    assert probs.sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "scale"),
    [
        (40, 0.95, 0.05, 1.0),
        (40, 1.0, 0.0, 4.0),
        (3, 0.5, 0.0, 4.0),
        (0, 0.95, 0.05, 1.0),  # no top-k: min-p stops first, with hundreds of tokens
        (0, 0.6, 0.01, 1.0),  # no top-k: top-p stops first
        (0, 0.9, 0.0, 4.0),  # top-p within the first 256 tokens
        (0, 0.999, 0.0, 4.0),  # top-p past them: thousands of tokens
        (0, 1.0, 0.1, 1.0),
    ],
)
def test_pipeline_keeps_exactly_what_the_masks_keep(top_k: int, top_p: float, min_p: float, scale: float) -> None:
    assert_pipeline_keeps_what_the_masks_keep(top_k, top_p, min_p, scale)


def test_nothing_filtered_means_the_whole_vocab() -> None:
    x = f32(1, 2, 3)
    ids, probs = distribution(x, UNFILTERED)
    assert ids is None
    assert np.allclose(probs, softmax(x))


# --- penalties --------------------------------------------------------------------------------------------


def test_penalties_change_exactly_the_seen_tokens() -> None:
    x = f32(2.0, -2.0, 0.5, 1.0, 0.0, 3.0)
    before = x.copy()
    out = apply_penalties(
        x, [0, 1, 0, 3, 4], repeat_penalty=2.0, repeat_last_n=64, presence_penalty=0.5, frequency_penalty=0.25
    )
    # token 0 (seen twice): 2/2 - (2*0.25 + 0.5); token 1: -2*2 - 0.75; token 3: 1/2 - 0.75;
    # token 4: a zero logit stays 0 under the repeat penalty, then - 0.75; tokens 2 and 5 untouched
    assert out.tolist() == [0.0, -4.75, 0.5, -0.25, -0.75, 3.0]
    assert out.dtype == F32
    assert np.array_equal(x, before)  # the input is never written


def test_penalties_look_only_at_the_last_n_tokens() -> None:
    x = f32(1.0, 1.0, 1.0, 1.0)
    recent = [0, 0, 1, 2]
    assert apply_penalties(x, recent, repeat_penalty=2.0, repeat_last_n=2).tolist() == [1.0, 0.5, 0.5, 1.0]
    assert apply_penalties(x, recent, repeat_penalty=2.0, repeat_last_n=-1).tolist() == [0.5, 0.5, 0.5, 1.0]
    assert apply_penalties(x, recent, repeat_penalty=2.0, repeat_last_n=0) is x
    assert apply_penalties(x, recent, repeat_penalty=1.0) is x  # nothing to do: no copy
    assert apply_penalties(x, [], repeat_penalty=2.0) is x


def test_frequency_and_presence_alone() -> None:
    x = f32(1.0, 1.0, 1.0)
    assert apply_penalties(x, [0, 0, 0, 1], frequency_penalty=0.5).tolist() == [-0.5, 0.5, 1.0]
    assert apply_penalties(x, [0, 0, 0, 1], presence_penalty=0.5).tolist() == [0.5, 0.5, 1.0]


def test_penalties_reject_ids_outside_the_vocab() -> None:
    with pytest.raises(ValueError, match="recent token id 7"):
        apply_penalties(f32(1, 2), [0, 7], repeat_penalty=1.1)


# --- the sampler ------------------------------------------------------------------------------------------


def test_greedy_is_argmax_after_penalties() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1000) * 3).astype(F32)
    best = int(np.argmax(x))
    r = Sampler(0).sample(x, GREEDY, [])
    assert r.token_id == best
    assert r.prob == pytest.approx(softmax(x)[best], rel=1e-5)  # a confidence, not 1.0
    assert [t for t, _ in r.top] == top_ids(x, 5).tolist()
    second = int(top_ids(x, 2)[1])
    penalised = Sampler(0).sample(x, dataclasses.replace(GREEDY, presence_penalty=100.0), [best])
    assert penalised.token_id == second


def test_greedy_tie_goes_to_the_lower_id() -> None:
    assert Sampler(0).sample(f32(0, 5, 1, 5), GREEDY, []).token_id == 1


def test_result_reports_the_final_distribution() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(F32)
    s = SamplingSettings(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    r = Sampler(0).sample(x, s, [])
    assert isinstance(r, SampleResult)
    assert [t for t, _ in r.top] == [0, 1]  # only what top-k kept
    assert [p for _, p in r.top] == pytest.approx([0.625, 0.375], rel=1e-6)
    assert r.prob == dict(r.top)[r.token_id]


def test_draws_follow_the_distribution() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(F32)
    x = np.append(x, F32(-np.inf))  # never drawn
    sampler = Sampler(123)
    s = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    counts = np.bincount([sampler.sample(x, s, []).token_id for _ in range(10_000)], minlength=5)
    assert counts[4] == 0
    assert counts[:4] / 10_000 == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.02)  # 4 sigma


def test_draws_over_a_large_vocab_reach_every_block() -> None:
    # Over 1024 candidates the draw finds a block first; mass in three far-apart blocks, the rest ~0.
    x = np.full(5000, -30.0, dtype=F32)
    x[[3, 2500, 4999]] = F32(0.0)
    sampler = Sampler(5)
    counts = np.bincount([sampler.sample(x, UNFILTERED, []).token_id for _ in range(3000)], minlength=5000)
    assert counts[[3, 2500, 4999]].sum() == 3000
    assert counts[[3, 2500, 4999]] / 3000 == pytest.approx([1 / 3] * 3, abs=0.05)


def _generate(sampler: Sampler, settings: SamplingSettings, n: int = 50) -> list[int]:
    # A stand-in model: the logits depend on the previous token, so one different draw changes the rest.
    table = (np.random.default_rng(99).standard_normal((500, 500)) * 1.5).astype(F32)
    tokens = [0]
    for _ in range(n):
        tokens.append(sampler.sample(table[tokens[-1]], settings, tokens).token_id)
    return tokens[1:]


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    s = SamplingSettings(repeat_penalty=1.1)
    first = _generate(Sampler(42), s)
    assert _generate(Sampler(42), s) == first
    assert len(set(first)) > 10  # really sampling, not stuck on one token
    assert _generate(Sampler(43), s) != first
    reseeded = Sampler(7)
    _generate(reseeded, s)
    reseeded.reseed(42)
    assert _generate(reseeded, s) == first


def test_a_settings_change_takes_effect_on_the_next_token() -> None:
    x = f32(3.0, 2.9, 0.0, 0.0)
    sampler = Sampler(0)
    assert sampler.sample(x, GREEDY, [0]).token_id == 0
    penalised = dataclasses.replace(GREEDY, repeat_penalty=2.0)  # 3.0 / 2 = 1.5 < 2.9
    assert sampler.sample(x, penalised, [0]).token_id == 1
    assert sampler.sample(x, GREEDY, [0]).token_id == 0
    only_best = SamplingSettings(temperature=1.0, top_k=1)
    assert {sampler.sample(x, only_best, []).token_id for _ in range(20)} == {0}


def test_sampler_uses_validated_settings() -> None:
    x = f32(3.0, 1.0, 2.0)
    absurd = SamplingSettings(temperature=-1.0, repeat_penalty=0.0)  # greedy, penalty off
    assert Sampler(0).sample(x, absurd, [0]).token_id == 0


def test_unusable_logits_are_refused() -> None:
    with pytest.raises(ValueError, match="not usable"):
        Sampler(0).sample(f32(1.0, np.nan), SamplingSettings(), [])
    with pytest.raises(ValueError, match="not usable"):
        Sampler(0).sample(f32(-np.inf, -np.inf), SamplingSettings(), [])


# --- settings ---------------------------------------------------------------------------------------------


def test_defaults_are_valid() -> None:
    s, messages = SamplingSettings().validated()
    assert s == SamplingSettings() and messages == []
    s, messages = SamplingSettings(repeat_last_n=-1, seed=-1, max_tokens=-1).validated()
    assert messages == [] and s.repeat_last_n == -1


@pytest.mark.parametrize(
    ("field", "given", "used"),
    [
        ("top_p", 7, 1.0),
        ("top_p", -0.5, 0.0),
        ("temperature", -0.5, 0.0),
        ("temperature", float("nan"), 0.8),
        ("temperature", float("inf"), 0.8),
        ("top_k", -3, 0),
        ("top_k", 40.5, 40),
        ("min_p", 1.5, 1.0),
        ("min_p", -0.1, 0.0),
        ("repeat_penalty", 0.0, 1.0),
        ("repeat_penalty", -2.0, 1.0),
        ("repeat_last_n", -5, 0),
        ("seed", -9, -1),
        ("max_tokens", 0, 512),
        ("max_tokens", -7, -1),
        ("presence_penalty", "lots", 0.0),
    ],
)
def test_validated_clamps_with_a_message(field: str, given: object, used: object) -> None:
    s, messages = SamplingSettings(**{field: given}).validated()
    assert getattr(s, field) == used and type(getattr(s, field)) is type(used)
    assert len(messages) == 1
    assert messages[0].startswith(f"{field} {given!r} ") and messages[0].endswith(f"using {used!r}")


def test_validated_reports_each_field_once_and_keeps_the_rest() -> None:
    s, messages = SamplingSettings(top_k=-2.5, top_p=7, temperature=0.3).validated()
    assert (s.top_k, s.top_p, s.temperature) == (0, 1.0, 0.3)
    assert [m.split()[0] for m in messages] == ["top_k", "top_p"]
    whole, messages = SamplingSettings(top_k=40.0).validated()
    assert whole.top_k == 40 and type(whole.top_k) is int and messages == []
