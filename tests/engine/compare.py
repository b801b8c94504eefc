"""How the engine tests compare logits: one place for every bound, each with the measurement it rests on.

Two kinds of comparison:
- **exact**: both sides computed with `engine.kernels.float_products()` in force (float32 activations into every
  product, the per-op path), so the only differences are float32 summation order; a wrong cache, position or
  head moves logits by orders of magnitude more.
- **int8 path**: the default numerics, activations rounded to 8 bits per 32 values before each quantized product
  (as llama.cpp does). A last-bit difference can move a value to the next step, so these bounds are a few percent
  of the spread, set from what the engine measures.
"""

from __future__ import annotations

import numpy as np

from engine.chat import ChatSession

# Exact mode: cache against fresh, regenerate/edit reuse, cancel-then-continue. Measured after two greedy turns
# of 16 tokens (cache_probe, float products): 3.0e-4 (SmolLM2), 1.5e-4 (Qwen 0.5B), 3.7e-4 (Gemma 3) of the spread,
# on an Intel Xeon (family 6 model 207, AVX-512 VNNI, AMX, 2 threads; 2026-12-06); the int8 path there measured
# 1.9e-2, 8.4e-3 and 1.6e-2, so a cache that skipped float products fails. Bound 2.7x the largest.
EXACT_BOUND = 1e-3

# Int8 path, long runs: measured up to 5.2% of the spread after long generations through the one-call decode path
# (SmolLM2, 300-turn soak); a cache holding other tokens moves logits by far more.
INT8_BOUND = 0.08
# Int8 path, a few turns of short replies (tests/engine/test_chat.py): measured 0.020-0.030 on SmolLM2
# (AMD Zen 5, 2026-12-01); 1.5x the largest, for the float32 parts whose BLAS kernels differ between CPUs.
INT8_SHORT_BOUND = 0.045

PROBE = 198  # "\n" in the byte-level BPE vocabularies of the real models


def spread(logits: np.ndarray) -> float:
    return float(logits.max() - logits.min())


def assert_exact_logits(ours: np.ndarray, fresh: np.ndarray, bound: float = EXACT_BOUND) -> None:
    """max |Δ| ≤ bound × spread and the same top-1: for two evaluations in the exact (float products) mode."""
    delta = float(np.abs(ours - fresh).max())
    assert delta <= bound * spread(fresh), f"max |Δ| {delta:.3g} is {delta / spread(fresh):.2e} of the spread"
    assert int(ours.argmax()) == int(fresh.argmax())


def assert_close_logits(ours: np.ndarray, fresh: np.ndarray, bound: float = INT8_BOUND) -> None:
    """Int8 path: same top-1 (unless two candidates are within a near-tie) and max |Δ| ≤ bound × spread."""
    s = spread(fresh)
    delta = float(np.abs(ours - fresh).max())
    assert delta <= bound * s, f"max |Δ| {delta:.3g} is {delta / s:.3f} of the spread"
    first, second = np.sort(fresh)[-2:][::-1]
    if first - second > 0.02 * s:
        assert int(ours.argmax()) == int(fresh.argmax())


def cache_probe(chat: ChatSession, probe: int = PROBE) -> tuple[np.ndarray, np.ndarray]:
    """(logits after one more token from the chat's cache, a fresh evaluation of the same ids); the probe is
    taken back out of the cache afterwards."""
    ids = chat.cached_tokens
    incremental = chat.session.eval([probe])
    chat.session.truncate(len(ids))
    fresh = chat.model.logits([*ids, probe])[-1]
    return incremental, fresh


def assert_cache_matches_fresh(chat: ChatSession, bound: float = INT8_BOUND) -> None:
    """Int8 path: logits after one more token from the chat's cache equal a fresh evaluation of the same ids."""
    assert_close_logits(*cache_probe(chat), bound=bound)


def assert_cache_exactly_fresh(chat: ChatSession) -> None:
    """Exact mode: the same, at EXACT_BOUND. Call it with `float_products()` in force."""
    assert_exact_logits(*cache_probe(chat))


# Synthetic models (tests/engine/synthetic.py) against their float64 reference: max |Δ| / spread, measured over
# llama/qwen2/gpt2, full-prompt logits and the session in chunks, seeds 0-19 (the tests use seed 0).
# Q8_0, Q4_0: activations rounded to 8 bits before each product; seed 0 (the tests' seed) up to 0.023 on AVX-512
# and seeds 0-4 up to 0.032 on AVX2 (the float32 sums' order follows the vector width); 20 seeds reach 0.050
# (Q8_0) and 0.044 (Q4_0), so a new synthetic draw needs a new measurement; float products bring all to 0.001.
# Bound 25% over the AVX2 figure.
INT8_REFERENCE_BOUND = 0.04
# F32, F16, BF16: float products with or without float_products() (no int8 rounding on these); what is left is
# q/k/v rounded to float16. Seed 0 up to 0.0013 (BF16), 20 seeds up to 0.0013 (F32 0.0013, F16 0.0012).
# Bound 50% over the maximum: a last-bit change can move a float16 rounding.
FLOAT_REFERENCE_BOUND = 0.002
REFERENCE_BOUNDS = {"Q8_0": INT8_REFERENCE_BOUND, "Q4_0": INT8_REFERENCE_BOUND, "F32": FLOAT_REFERENCE_BOUND,
                    "F16": FLOAT_REFERENCE_BOUND, "BF16": FLOAT_REFERENCE_BOUND,
                    "MXFP4": INT8_REFERENCE_BOUND}  # fmt: skip


def assert_matches_reference(ours: np.ndarray, ref: np.ndarray, bound: float = INT8_REFERENCE_BOUND) -> None:
    """A synthetic model's logits (t, n_vocab) against the float64 NumPy reference (tests/engine/synthetic.py):
    max |Δ| ≤ bound × spread, and the same top-1 wherever the reference's top two are more than half the bound
    apart (over 20 seeds, top-1 flips were at gaps ≤ 0.011 of the spread with int8 rounding, ≤ 1e-4 without)."""
    s = spread(ref)
    delta = float(np.abs(ours - ref).max())
    assert delta <= bound * s, f"max |Δ| {delta:.3g} is {delta / s:.2e} of the spread (bound {bound:g})"
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > bound / 2 * s  # positions without a near-tie
    np.testing.assert_array_equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
