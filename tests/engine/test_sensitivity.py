"""The comparisons the suite relies on, shown to catch real engine faults.

Each test runs one of the suite's own checks twice: on the engine as it is (the check passes), then with one
fault patched in (the check must fail). A check that passes both ways could not tell the fault from the engine.
Forward-pass faults go in through the names the CPU layer calls (engine/kernels/prompt_ops.py's kernels,
engine/layer.py's RoPE tables, engine.model's DecodeLayer), on a tiny
synthetic llama (4 query heads over 2 kv heads, so the grouped heads can be mapped wrong); the sampler's and
the chat layer's through their own functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest

import engine.kernels.prompt_ops
import engine.layer
import engine.model
import engine.sampling
from engine import load_model
from engine.chat import ChatSession
from engine.events import STOP_CANCELLED, Message, TokenEvent, TurnStats
from engine.kernels import WeightMatrix, float_products
from engine.layer import LayerSpec
from engine.model import Model
from engine.sampling import SamplingSettings

from . import oracle
from .compare import assert_cache_exactly_fresh, assert_cache_matches_fresh, assert_matches_reference
from .synthetic import TinyModel, reference_logits, write_tiny_model
from .test_chat import check_cancel_keeps_the_reply
from .test_sampling import assert_pipeline_keeps_what_the_masks_keep

IDS = [3, 250, 17, 260, 99, 5, 42, 261, 7, 128, 64, 200, 1, 33]  # as test_architectures evaluates


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return write_tiny_model(tmp_path_factory.mktemp("sensitivity") / "llama.gguf", "llama")


@pytest.fixture
def model(tiny: TinyModel) -> Model:
    return load_model(tiny.path, n_ctx=64)


def check_reference(model: Model, tiny: TinyModel) -> None:
    """test_architectures' comparison: a fresh evaluation of IDS against the float64 reference."""
    assert_matches_reference(model.logits(IDS), reference_logits(tiny, IDS))


def check_cache_exactly_fresh(model: Model) -> None:
    """The chat tests' exact comparison: IDS in a session's cache, one probe token on top, against fresh."""
    chat = ChatSession(model)
    with float_products():
        chat.session.eval(IDS)
        assert_cache_exactly_fresh(chat)


def one_token_store(
    change: Callable[[int, np.ndarray, np.ndarray], tuple[int, np.ndarray, np.ndarray]],
) -> Callable[..., None]:
    """The prompt path's rope_into_cache with `change(start, cos, sin)` applied when one token is stored: a fault
    in the incremental path only, so a cache built token by token differs from a fresh prompt."""
    real = engine.kernels.prompt_ops.rope_into_cache

    def store(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, kc: np.ndarray, vc: np.ndarray,
        start: int, cos: np.ndarray, sin: np.ndarray, shape: tuple,
    ) -> None:  # fmt: skip
        if len(q) == 1:
            start, cos, sin = change(start, cos, sin)
            if start >= kc.shape[1]:  # the kernel does not check bounds
                raise IndexError(f"row {start} is outside the cache of {kc.shape[1]}")
        real(q, k, v, kc, vc, start, cos, sin, shape)

    return store


# --- the KV cache and positions: cache against fresh, exact mode ------------------------------------------


def test_kv_cache_shifted_by_one_fails_cache_vs_fresh(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new token's k, v stored one row late: assert_cache_exactly_fresh fails."""
    check_cache_exactly_fresh(model)
    monkeypatch.setattr(
        engine.kernels.prompt_ops, "rope_into_cache", one_token_store(lambda start, c, s: (start + 1, c, s))
    )
    with pytest.raises(AssertionError):
        check_cache_exactly_fresh(model)


def test_rope_position_off_by_one_fails_cache_vs_fresh(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new token's q and k rotated for position start + 1 (RoPE is relative: only a mixed cache shows it):
    assert_cache_exactly_fresh fails."""
    check_cache_exactly_fresh(model)

    def next_position(start: int, cos: np.ndarray, sin: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        rope = model.layer_specs()[0].attention.rope  # every layer's tables, in this llama
        return start, rope.cos[start + 1 : start + 2], rope.sin[start + 1 : start + 2]

    monkeypatch.setattr(engine.kernels.prompt_ops, "rope_into_cache", one_token_store(next_position))
    with pytest.raises(AssertionError):
        check_cache_exactly_fresh(model)


# --- the forward pass: a synthetic model against the float64 reference -----------------------------------


def test_wrong_rope_base_fails_the_reference(tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """RoPE tables built for base 1e6 (Qwen2's) where the file says 1e4: assert_matches_reference fails."""
    check_reference(load_model(tiny.path, n_ctx=64), tiny)
    real = engine.layer.rope_tables
    monkeypatch.setattr(
        engine.layer, "rope_tables", lambda cfg, *args, **kw: real(replace(cfg, rope_base=1e6), *args, **kw)
    )
    faulty = load_model(tiny.path, n_ctx=64)  # the tables are built when the model loads
    with pytest.raises(AssertionError):
        check_reference(faulty, tiny)


def test_dropped_residual_fails_the_reference(model: Model, tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last layer's FFN output replaces x instead of adding to it: assert_matches_reference fails."""
    check_reference(model, tiny)
    # x += W_down h is the residual; returning W_down h - x makes it x = W_down h. The FFN norm's input is x.
    norm, matmul = engine.kernels.prompt_ops.rms_norm_rows, engine.kernels.prompt_ops.matmul
    down = model.weights.layers[-1].w_down
    seen: list[np.ndarray] = []

    def remember_norm_input(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
        seen[:] = [x]
        return norm(x, w, eps, out=out)

    def without_residual(w: WeightMatrix, xs: np.ndarray, **kwargs: bool) -> np.ndarray:
        out = matmul(w, xs, **kwargs)
        return out - seen[0] if w is down else out

    monkeypatch.setattr(engine.kernels.prompt_ops, "rms_norm_rows", remember_norm_input)
    monkeypatch.setattr(engine.kernels.prompt_ops, "matmul", without_residual)
    with pytest.raises(AssertionError):
        check_reference(model, tiny)


def grouped_attention(kv_of_head: Callable[[np.ndarray, int, int], np.ndarray]) -> Callable[..., np.ndarray]:
    """causal_attention as the oracle's NumPy `attention`, query head h reading kv head kv_of_head(h, ...)."""

    def attend(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, *layer: float, **_: object) -> np.ndarray:
        n_head, n_kv, n_pos = q.shape[1], kc.shape[0], start + len(q)
        heads = kv_of_head(np.arange(n_head), n_head, n_kv)
        k = kc[heads, :n_pos].astype(np.float32)  # (n_head, n_pos, hd): one kv head per query head
        v = vc[heads, :n_pos].astype(np.float32)
        return oracle.attention(q.astype(np.float32), k, v, start, 0, *layer)  # layer: scale, window, softcap

    return attend


def test_wrong_gqa_mapping_fails_the_reference(model: Model, tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query head h reads kv head h % n_kv instead of h // group: assert_matches_reference fails."""
    check_reference(model, tiny)
    # The same stand-in with the right mapping passes: what fails below is the mapping, not the stand-in.
    right = grouped_attention(lambda h, n_head, n_kv: h // (n_head // n_kv))
    monkeypatch.setattr(engine.kernels.prompt_ops, "causal_attention", right)
    check_reference(model, tiny)
    monkeypatch.setattr(
        engine.kernels.prompt_ops, "causal_attention", grouped_attention(lambda h, n_head, n_kv: h % n_kv)
    )
    with pytest.raises(AssertionError):
        check_reference(model, tiny)


def test_wrong_softmax_scale_fails_the_reference(
    model: Model, tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores scaled by 1/head_dim instead of 1/sqrt(head_dim): assert_matches_reference fails."""
    check_reference(model, tiny)
    real = engine.kernels.prompt_ops.causal_attention
    hd = model.cfg.head_dim

    def scaled_twice(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, *layer: float, **kw) -> np.ndarray:
        return real(q * np.float32(1 / np.sqrt(hd)), kc, vc, start, *layer, **kw)  # the layer's 1/sqrt(hd) on top: 1/hd

    monkeypatch.setattr(engine.kernels.prompt_ops, "causal_attention", scaled_twice)
    with pytest.raises(AssertionError):
        check_reference(model, tiny)


# --- the sampler: distribution() against the masks --------------------------------------------------------


def test_sampler_ignoring_top_p_fails_the_mask_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidate search run with top_p = 1: test_sampling's pipeline-against-masks check fails."""
    case = (0, 0.6, 0.01, 1.0)  # top-p stops first, as in test_pipeline_keeps_exactly_what_the_masks_keep
    assert_pipeline_keeps_what_the_masks_keep(*case)
    # Patched in _candidates, which distribution() and Sampler use and top_p_mask (the oracle) does not.
    real = engine.sampling._candidates
    monkeypatch.setattr(engine.sampling, "_candidates", lambda x, top_k, top_p, min_p: real(x, top_k, 1.0, min_p))
    with pytest.raises(AssertionError):
        assert_pipeline_keeps_what_the_masks_keep(*case)


# --- the chat layer: a cancelled reply stays in the cache -------------------------------------------------


def test_cancel_dropping_the_reply_fails_the_cancel_check(smollm2_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that takes the partial reply's ids back out of the cache: the cancel scenario's cache check fails."""
    check_cancel_keeps_the_reply(ChatSession(smollm2_model), assert_cache_matches_fresh)
    real = ChatSession._generate

    def forget_on_cancel(self: ChatSession, prompt: list[int], *args: object) -> Iterator[TokenEvent | TurnStats]:
        for event in real(self, prompt, *args):
            if isinstance(event, TurnStats) and event.stop_reason == STOP_CANCELLED:
                self.session.truncate(len(prompt))
            yield event

    monkeypatch.setattr(ChatSession, "_generate", forget_on_cancel)
    with pytest.raises(AssertionError):
        check_cancel_keeps_the_reply(ChatSession(smollm2_model), assert_cache_matches_fresh)


# --- the fused one-token path: FUSED_BOUND and INT8_BOUND -------------------------------------------------


def fused_attn_norm_scaled(model: Model, layer: int, factor: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path's copy of one layer's attention-norm weight scaled by `factor`: that block's activations
    (q, k, v inputs) come out off by that much on the one-token path only; the per-op path reads the model's own."""
    real = engine.model.DecodeLayer
    built: list[int] = []

    class Faulty(real):
        def __init__(self, spec: LayerSpec) -> None:
            if len(built) == layer:
                scaled = replace(spec.attn_norm, weight=spec.attn_norm.weight * np.float32(factor))
                spec = replace(spec, attn_norm=scaled)
            built.append(1)
            super().__init__(spec)

    monkeypatch.setattr(engine.model, "DecodeLayer", Faulty)
    monkeypatch.setattr(model, "_decode_layers", False)  # rebuilt, with the fault, on the next token


def test_perturbed_fused_activation_scale_fails_fused_bound(smollm2_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """One middle block's activations 50% high on the fused path: test_decode_path's FUSED_BOUND check fails.

    Measured on SmolLM2 (Intel Xeon family 6 model 207, AVX-512 VNNI, AMX, 2 threads; 2026-12-06), worst of the six
    steps as a share of the spread: 0 unfaulted; middle block x1.02 0.019, x1.1 0.021, x1.5 0.068, x-1 0.20;
    first block x1.1 0.024, x1.5 0.21. So FUSED_BOUND (0.04) misses a 10% scale error in one block."""
    from .test_decode_path import check_fused_logits

    check_fused_logits(smollm2_model)
    fused_attn_norm_scaled(smollm2_model, smollm2_model.cfg.n_layer // 2, 1.5, monkeypatch)
    with pytest.raises(AssertionError, match="of the spread"):
        check_fused_logits(smollm2_model)
    monkeypatch.undo()
    smollm2_model._decode_layers = False  # the real layers again for the other tests


def test_perturbed_fused_activation_scale_fails_int8_bound(smollm2_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fault, doubled: a reply decoded on the fused path leaves a cache whose next logits miss a fresh
    (prefill) evaluation by more than compare.INT8_BOUND (0.08).

    Measured on SmolLM2 (AMD EPYC Zen 4, AVX-512 VNNI, 2 threads; 2026-12-07), max |Δ| as a share of the spread:
    0.022 unfaulted; middle block x1.1 0.023, x1.5 0.074, x2 0.195, x-1 0.229; first block x1.5 0.135. x1.5 had
    cleared the bound on the Intel Xeon model 207 and fell under it here, so the fault is x2."""
    messages = [Message("user", "Name three rivers in Europe.")]

    def check() -> None:
        chat = ChatSession(smollm2_model, SamplingSettings(temperature=0.0, max_tokens=16))
        list(chat.stream_reply(messages))
        assert_cache_matches_fresh(chat)  # default bound: INT8_BOUND

    check()
    fused_attn_norm_scaled(smollm2_model, smollm2_model.cfg.n_layer // 2, 2.0, monkeypatch)
    with pytest.raises(AssertionError, match="of the spread"):
        check()
    monkeypatch.undo()
    smollm2_model._decode_layers = False
