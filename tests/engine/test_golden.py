"""The real models against llama.cpp's outputs in ../shared/golden (see golden/README.md for the bounds)."""

from __future__ import annotations

import numpy as np
import pytest

from .compare import assert_close_logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(params=["smollm2", "qwen"])
def case(request, smollm2_model, qwen_model, golden_smollm2, golden_qwen):
    if request.param == "smollm2":
        return smollm2_model, golden_smollm2
    return qwen_model, golden_qwen


def test_golden_is_for_this_file(case) -> None:
    model, golden = case
    from chatapp.catalog import sha256_file

    assert sha256_file(model.file.path) == golden["model_sha256"]


def test_tokenizer_matches_llama_cpp(case) -> None:
    model, golden = case
    for item in golden["tokenize"]:
        assert model.tokenize(item["text"], special=True) == item["ids"], item["text"]


def test_teacher_forced_logits_match_llama_cpp(case) -> None:
    model, golden = case
    for item in golden["teacher"]:
        ids = item["ids"]
        ref_top5 = np.array(item["top5_ids"])  # (n, 5): llama.cpp's next-token candidates at each position
        ref_lp = np.array(item["top5_logprobs"])
        logp = log_softmax(model.logits(ids))  # (n, n_vocab)
        ours_top1 = logp.argmax(axis=-1)
        assert all(ours_top1[i] in ref_top5[i] for i in range(len(ids))), "a top-1 outside llama.cpp's top-5"
        # Top-1 agreement over one short text is mostly int8 rounding noise: llama.cpp 0.3.36 itself, on this
        # AVX2 machine, agrees with this AVX-512-made reference at 0.927 (SmolLM2), and with its own run at
        # flash_attn on vs off at 0.909; a 1000x norm epsilon drops to 0.73. The log-prob bound below is
        # the sharper check.
        agreement = float(np.mean(ours_top1 == ref_top5[:, 0]))
        assert agreement >= 0.85, agreement
        delta = np.abs(logp[np.arange(len(ids)), ref_top5[:, 0]] - ref_lp[:, 0]).mean()
        assert delta <= 0.1, delta


def test_greedy_continuations_match_llama_cpp(case) -> None:
    """Greedy decoding follows llama.cpp's tokens; where it leaves them, it is at a near-tie.

    llama.cpp rounds activations to 8 bits and its KV cache to 16, so two candidates a few hundredths of a
    logit apart can swap places. Every prompt must match up to its first near-tie.
    """
    model, golden = case
    for item in golden["greedy"]:
        session = model.session()
        logits = session.eval(item["prompt_ids"])
        for step, want in enumerate(item["greedy_ids"][:8]):
            got = int(np.argmax(logits))
            if got != want:
                margin = float(logits[got] - logits[want])
                assert margin < 0.3, f"step {step}: {got} beat llama.cpp's {want} by {margin:.3f} logits"
                break
            logits = session.eval([got])


def test_greedy_first_eight_match_for_most_prompts(smollm2_model, qwen_model, golden_smollm2, golden_qwen) -> None:
    """Over all golden prompts of both models, most continue exactly as llama.cpp's for 8 tokens."""
    results = {}
    for name, model, golden in (("smollm2", smollm2_model, golden_smollm2), ("qwen", qwen_model, golden_qwen)):
        matched = 0
        for item in golden["greedy"]:
            session = model.session()
            logits = session.eval(item["prompt_ids"])
            ours = []
            for _ in range(8):
                ours.append(int(np.argmax(logits)))
                logits = session.eval([ours[-1]])
            matched += ours == item["greedy_ids"][:8]
        results[name] = (matched, len(golden["greedy"]))
    total = sum(m for m, _ in results.values())
    prompts = sum(n for _, n in results.values())
    assert total > prompts / 2, results


def test_session_in_chunks_equals_fresh_logits(smollm2_model, golden_smollm2) -> None:
    ids = golden_smollm2["teacher"][0]["ids"]
    full = smollm2_model.logits(ids)  # (n, n_vocab)
    session = smollm2_model.session()
    for chunk in (ids[:1], ids[1:7], ids[7:8], ids[8:30], ids[30:]):
        last = session.eval(chunk)
        assert_close_logits(last, full[session.n_past - 1])
    assert session.n_past == len(ids)
