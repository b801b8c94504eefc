"""Logits that do not depend on how a prompt's tokens were computed (Model.deterministic: `--deterministic`).

The same token ids give the same logits and the same KV cache, bit for bit, whether the prompt ran in one pass,
in passes split at random places, one token at a time, on top of another conversation's shared prefix, from a
saved cache, or after a re-evaluation of kept tokens. Before, passes of more than kernels.SHORT_PASS rows
attended through BLAS, whose sums run in another order than the one-token kernel's: SmolLM2's prompt log-probs
moved by ~0.01 with the split, enough to change a greedy reply at a near-tie.

The last test runs a split with Model.deterministic off (the default) and sees the logits differ: what the others
would catch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import load_model
from engine.kv_store import KVStore
from engine.model import Model, Session
from tests.engine.synthetic import write_tiny_model

MODELS = ["smollm2_model", "qwen_model", "gemma3_model", "qwen15_model"]
LONG = 1000  # prompt tokens on the small models
SHORT = 120  # on Qwen2.5-Coder-1.5B, which prefills at ~10-20 tokens/s on this shared 2-core machine


@pytest.fixture
def deterministic(request) -> Callable[[str], Model]:
    """model_fixture_name -> that (shared) model with `deterministic` on, off again after the test."""
    on: list[Model] = []

    def get(name: str) -> Model:
        model = request.getfixturevalue(name)
        model.deterministic = True
        on.append(model)
        return model

    yield get
    for model in on:
        model.deterministic = False


def prompt_ids(model, n: int) -> list[int]:
    """n ids of ordinary text (numbered lines), without special tokens."""
    lines = [
        f"{i}. The owl at station {i * 7 % 31} counted {i * i % 97} moths and wrote def f_{i}(x): return x * {i}"
        for i in range(400)
    ]
    ids = model.tokenize("\n".join(lines), special=False)
    assert len(ids) >= n
    return ids[:n]


def cached_positions(session: Session) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every layer's cached keys and values for the positions the session holds (a ring: those it keeps), in
    position order."""
    n, out = session.n_past, []
    for k, v in zip(session.cache.k, session.cache.v, strict=True):  # (n_kv, rows, hd) each
        rows = k.shape[1]
        kept = np.arange(max(0, n - rows), n) % rows
        out.append((k[:, kept], v[:, kept]))
    return out


def assert_same(a: Session, la: np.ndarray, b: Session, lb: np.ndarray, what: str) -> None:
    assert a.tokens == b.tokens, what
    np.testing.assert_array_equal(la, lb, err_msg=f"logits, {what}")
    for li, ((ka, va), (kb, vb)) in enumerate(zip(cached_positions(a), cached_positions(b), strict=True)):
        np.testing.assert_array_equal(ka.view(np.uint16), kb.view(np.uint16), err_msg=f"keys of layer {li}, {what}")
        np.testing.assert_array_equal(va.view(np.uint16), vb.view(np.uint16), err_msg=f"values of layer {li}, {what}")


def eval_split(model, ids: list[int], cuts: list[int]) -> tuple[Session, np.ndarray]:
    session = model.session()
    logits = None
    for lo, hi in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        logits = session.eval(ids[lo:hi])
    return session, logits


def random_cuts(rng: np.random.Generator, n: int, k: int) -> list[int]:
    """k random cut points in (0, n), then the last three tokens one at a time (the one-token path)."""
    cuts = sorted(int(c) for c in rng.choice(np.arange(1, n - 3), size=k, replace=False))
    return [*cuts, n - 3, n - 2, n - 1]


@pytest.mark.parametrize("model_name", MODELS)
def test_logits_do_not_depend_on_the_split(model_name: str, deterministic) -> None:
    """One pass (chunked as Session.eval chunks) against passes cut at random places (seeded; pieces of 1 to
    hundreds of rows, the last ones single tokens)."""
    model = deterministic(model_name)
    n = SHORT if model_name == "qwen15_model" else LONG
    ids = prompt_ids(model, n)
    whole = model.session()
    want = whole.eval(ids)
    rng = np.random.default_rng(48)
    for k in (3, 9):
        cuts = random_cuts(rng, n, k)
        got_session, got = eval_split(model, ids, cuts)
        assert_same(got_session, got, whole, want, f"cut at {cuts}")


@pytest.mark.parametrize("model_name", MODELS[:3])
def test_a_prefix_left_by_another_conversation(model_name: str, deterministic) -> None:
    """A session that held another conversation with the same first 300 tokens keeps them (truncate, as the
    chat does) and computes the rest: the same as a fresh session; and a second turn on top of the first."""
    model = deterministic(model_name)
    ids = prompt_ids(model, LONG)
    other = ids[:300] + model.tokenize(" An unrelated question about the weather in Lisbon?" * 8, special=False)
    fresh = model.session()
    want = fresh.eval(ids)
    reused = model.session()
    reused.eval(other)
    reused.truncate(300)
    got = reused.eval(ids[300:])
    assert_same(reused, got, fresh, want, "on another conversation's prefix")
    # a second turn on top of the first, against the whole conversation at once
    turn2 = model.tokenize(" And the second question, please answer briefly.", special=False)
    got = reused.eval(turn2)
    both = model.session()
    assert_same(reused, got, both, both.eval(ids + turn2), "turn 2 on turn 1's cache")


@pytest.mark.parametrize("model_name", MODELS[:2])
def test_a_saved_and_restored_cache(model_name: str, deterministic, tmp_path) -> None:
    """engine/kv_store.py: a cache saved after 700 tokens, restored into a new session that goes on with the
    rest, against the prompt in one go. (Gemma 3's sliding-window rings are never saved.)"""
    model = deterministic(model_name)
    ids = prompt_ids(model, LONG)
    store = KVStore(tmp_path / "kv", 1 << 30)
    first = model.session()
    first.eval(ids[:700])
    assert store.save(first, "model", "template") is not None
    resumed = model.session()
    assert store.restore(resumed, "model", "template", ids) == 700
    got = resumed.eval(ids[700:])
    fresh = model.session()
    assert_same(resumed, got, fresh, fresh.eval(ids), "restored from a saved cache")


def test_a_re_evaluation_of_kept_tokens(deterministic) -> None:
    """Gemma 3's sliding-window rings lose keys that a shorter context would read, so Session.truncate
    evaluates the kept tokens again in one pass (as after a context shift); going on from there equals the
    prompt computed once."""
    gemma3_model = deterministic("gemma3_model")
    ids = prompt_ids(gemma3_model, LONG)
    shifted = gemma3_model.session()
    shifted.eval(ids[:600] + gemma3_model.tokenize(" dropped" * 300, special=False))
    shifted.truncate(600)
    assert shifted.cache.low == 0  # it was re-evaluated
    got = shifted.eval(ids[600:])
    fresh = gemma3_model.session()
    assert_same(shifted, got, fresh, fresh.eval(ids), "after the re-evaluation of 600 kept tokens")


def test_the_split_mattered_before(smollm2_model) -> None:
    """With Model.deterministic off (the default), prompt passes attend through BLAS and the same SmolLM2
    prompt's logits depend on the split: what the tests above would catch."""
    assert not smollm2_model.deterministic
    ids = prompt_ids(smollm2_model, LONG)
    want = smollm2_model.session().eval(ids)
    _, got = eval_split(smollm2_model, ids, [417, 998, 999])
    assert not np.array_equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("matrix_type", [T.F16, T.BF16, T.F32, T.Q8_0], ids=lambda t: t.name)
def test_every_family_and_float_matrices(tmp_path, arch: str, matrix_type: T) -> None:
    """Small synthetic models (tests/engine/synthetic.py): float matrices, whose prompt products go to BLAS
    without --deterministic, and GPT-2's LayerNorm and GELU, which the prompt path computes in NumPy without it,
    give the same logits and cache whatever the split (40 tokens past Gemma's window of 5; pieces of 1 to 23)."""
    tiny = write_tiny_model(tmp_path / "m.gguf", arch, matrix_type=matrix_type)
    model = load_model(tiny.path, n_ctx=64, deterministic=True)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, tiny.n_vocab, 40)]
    whole = model.session()
    want = whole.eval(ids)
    for cuts in ([17], [2, 25, 37, 38, 39], list(range(1, 40))):
        got_session, got = eval_split(model, ids, cuts)
        assert_same(got_session, got, whole, want, f"{arch}, {matrix_type.name}, cut at {cuts}")
