"""SmolLM2 and Qwen2.5-Coder-1.5B re-quantized to IQ4_NL and IQ4_XS by llama.cpp's own quantizer, against llama.cpp
on the same files.

The files are made once (`llama_model_quantize` in llama-cpp-python's own virtual environment, the one
tests/app/llama_cpp_server.py builds; no importance matrix is needed for these two types) and kept in the user
cache with llama.cpp's outputs on them: the teacher-forced text and greedy prompts of the SmolLM2 golden
(tests/golden), so a run after the first only loads them. SmolLM2's rows of 576 are no multiple of 256, so
llama.cpp's IQ4_XS file holds IQ4_XS only where the rows allow (ffn_down, 1536) and IQ4_NL elsewhere; the 1.5B's
rows of 1536 and 8960 allow it (nearly) everywhere.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from chatapp import paths
from engine import load_model

from ..app.llama_cpp_server import VERSION, ensure_server_python
from .test_golden import (
    FLOAT64_FIRST_POSITION,
    GREEDY_STEPS,
    LONG_MAX_DLOGP,
    LONG_MAX_MEAN_DLOGP,
    LONG_MIN_AGREEMENT,
    LONG_TEACHER,
    greedy_failures,
    greedy_run,
    log_softmax,
)
from .test_golden import MAX_NEAR_TIES as GOLDEN_MAX_NEAR_TIES

# Taken at import, before a test points CHATAPP_CACHE_DIR elsewhere: the files stay in the real cache.
CACHE = paths.user_cache_dir() / f"requantized-llama-cpp-{VERSION}"

_QUANTIZE = r"""
import sys, llama_cpp
src, dst, ftype = sys.argv[1:4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))
"""

# llama.cpp on one file: top-5 next tokens with log-probs at each teacher-forced position, and greedy steps.
_REFERENCE = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, job = sys.argv[1], json.loads(sys.argv[2])
llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=2, logits_all=True, verbose=False)
out = {"teacher": [], "greedy": []}
for ids in job["teacher"]:
    llm.reset()
    llm.eval(ids)
    x = np.array(llm.scores[: len(ids)], dtype=np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    top = np.argsort(-lp, axis=-1)[:, :5]
    out["teacher"].append({"ids": ids, "top5_ids": top.tolist(),
                           "top5_logprobs": np.take_along_axis(lp, top, -1).tolist()})
for prompt in job["prompts"]:
    llm.reset()
    llm.eval(prompt)
    greedy = []
    for _ in range(job["steps"]):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(tok)
        llm.eval([tok])
    out["greedy"].append({"prompt_ids": prompt, "greedy_ids": greedy})
print(json.dumps(out))
"""


def requantized(src: Path, ftype: str) -> Path:
    """src re-quantized by llama.cpp to `ftype`, made once into the user cache."""
    dst = CACHE / f"{src.stem}-{ftype}.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".part")
        run = [str(ensure_server_python()), "-c", _QUANTIZE, str(src), str(tmp), ftype]
        done = subprocess.run(run, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"llama.cpp could not quantize {src.name} to {ftype}:\n{done.stderr[-2000:]}"
        tmp.rename(dst)
    return dst


def llama_cpp_reference(path: Path, golden: dict, texts: list[list[int]]) -> dict:
    """llama.cpp's teacher-forced top-5 on `texts` and greedy continuations of the golden's prompts on `path`;
    cached beside the file under a key of its bytes and the texts."""
    job = {
        "teacher": texts,
        "prompts": [item["prompt_ids"] for item in golden["greedy"]],
        "steps": GREEDY_STEPS,
    }
    digest = hashlib.sha256(path.read_bytes() + json.dumps(job).encode()).hexdigest()[:16]
    cached = path.with_name(f"{path.stem}.llama-cpp-{digest}.json")
    if not cached.exists():
        run = [str(ensure_server_python()), "-c", _REFERENCE, str(path), json.dumps(job)]
        done = subprocess.run(run, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-2000:]
        cached.write_text(done.stdout.strip().splitlines()[-1])
    return json.loads(cached.read_text())


FILES = [("smollm2", "IQ4_NL"), ("smollm2", "IQ4_XS"), ("qwen15", "IQ4_NL"), ("qwen15", "IQ4_XS")]


@pytest.fixture(scope="module", params=FILES, ids=lambda f: f"{f[0]}-{f[1]}")
def iq4(request, golden_dir: Path):
    """(model name, file type, the re-quantized file, loaded, llama.cpp's outputs on it): the golden's
    teacher-forced text and the longer ones, and its greedy prompts."""
    name, ftype = request.param
    golden = request.getfixturevalue(f"golden_{name}")
    path = requantized(request.getfixturevalue(f"{name}_path"), ftype)
    long = json.loads((golden_dir / LONG_TEACHER[name]).read_text(encoding="utf-8"))
    texts = [item["ids"] for item in golden["teacher"] + long["teacher"]]
    return name, ftype, path, load_model(path, n_ctx=2048), llama_cpp_reference(path, golden, texts)


# The smallest share of a file's matrices (2-D tensors but the embedding) that llama.cpp wrote in each type.
SHARE_OF_MATRICES = {
    ("smollm2", "IQ4_NL"): {"IQ4_NL": 0.8},  # all but the output and a few attn_v (Q5_K/Q6_K by llama.cpp's rules)
    ("smollm2", "IQ4_XS"): {"IQ4_NL": 0.7, "IQ4_XS": 0.1},  # IQ4_XS only on ffn_down, whose rows are 1536
    ("qwen15", "IQ4_NL"): {"IQ4_NL": 0.8},
    ("qwen15", "IQ4_XS"): {"IQ4_XS": 0.8},
}


def test_the_files_hold_the_types(iq4) -> None:
    name, ftype, path, _, _ = iq4
    counts: dict[str, int] = {}
    matrices = [t for t in GGUFReader(path).tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    for t in matrices:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    for qtype, share in SHARE_OF_MATRICES[name, ftype].items():
        assert counts.get(qtype, 0) >= share * len(matrices), counts


# SmolLM2, over the five texts (553 positions), against llama.cpp on the same file; measured on an Intel Xeon
# (family 6 model 207, AVX-512 VNNI, 2 threads; 2026-12-06): top-1 agreement 0.958 (IQ4_NL) and 0.953 (IQ4_XS),
# held to the real models' common bound (test_golden's LONG_MIN_AGREEMENT); mean |Δ log p| of llama.cpp's top-1
# 0.051 and 0.060, max 0.65 and 0.76. These 4-bit files of a 135M model move with activation rounding more than
# the goldens' files: our own int8 path against our float products differs by 0.049 mean on the first text, and
# llama.cpp rounds IQ4_XS's activations per 256 values (Q8_K) where the engine rounds per 32. Bounds ~20% over.
# The 1.5B's files are held to the golden bounds of the real models' longer texts (test_golden's LONG_*), from
# position 1 as there (FLOAT64_FIRST_POSITION: llama.cpp's int8 activations go wrong at its first token; here
# 6.3 nats off at position 0 of the IQ4_XS file). Measured (same Xeon, 525 positions): IQ4_NL agreement 0.983,
# mean 0.021, max 0.137, one greedy divergence in 72 steps (by 0.033); IQ4_XS 0.966, 0.024, 0.152, none.
MEAN_DLOGP_BOUND = {"smollm2": 0.072, "qwen15": LONG_MAX_MEAN_DLOGP}
MAX_DLOGP_BOUND = {"smollm2": 0.92, "qwen15": LONG_MAX_DLOGP}


def test_teacher_forced_logits_match_llama_cpp(iq4) -> None:
    """Every top-1 among llama.cpp's top 5; agreement, mean and max |Δ log p| within the bounds above."""
    name, _, _, model, ref = iq4
    agree, deltas = [], []
    for item in ref["teacher"]:
        ids = item["ids"]
        ref_top5 = np.array(item["top5_ids"])  # (n, 5)
        logp = log_softmax(model.logits(ids))  # (n, n_vocab)
        ours_top1 = logp.argmax(axis=-1)
        assert all(ours_top1[i] in ref_top5[i] for i in range(len(ids))), "a top-1 outside llama.cpp's top-5"
        agree.append(ours_top1 == ref_top5[:, 0])
        delta = np.abs(logp[np.arange(len(ids)), ref_top5[:, 0]] - np.array(item["top5_logprobs"])[:, 0])  # (n,)
        deltas.append(delta[1:] if name in FLOAT64_FIRST_POSITION else delta)  # as test_golden: llama.cpp's is off
    agreement, delta = float(np.concatenate(agree).mean()), np.concatenate(deltas)  # (553,)
    assert agreement >= LONG_MIN_AGREEMENT, agreement
    assert delta.mean() <= MEAN_DLOGP_BOUND[name], delta.mean()
    assert delta.max() <= MAX_DLOGP_BOUND[name], delta.max()


# Near-ties in the greedy runs (below), each step fed llama.cpp's token. SmolLM2's files, over 3 prompts of 24
# steps: on the Intel Xeon above, IQ4_NL one divergence (by 0.115 logits), IQ4_XS three (0.100-0.124); on an AMD
# EPYC family 23 model 1 (Zen 1, AVX2, the `avx2` set; llama.cpp's reference made there by its portable build;
# 2 threads; 2026-12-07) IQ4_NL 0.128, 0.021, 0.006 in prompt 0 and 0.338 in prompt 2, IQ4_XS 0.066 in prompt 0
# and 0.384, 0.070, 0.023 in prompt 1: near-ties as wide as these files' logits move (max |Δ log p| above),
# against the golden file's 0.3 and two a prompt. Bounds ~20% over the largest, and one over the most in a
# prompt. The 1.5B's files keep the golden bounds (Xeon: one divergence in 72 steps, by 0.033).
NEAR_TIE = {"smollm2": 0.46, "qwen15": None}  # None: the model's golden bound
MAX_NEAR_TIES = {"smollm2": 4, "qwen15": GOLDEN_MAX_NEAR_TIES}


def test_greedy_continuations_match_llama_cpp(iq4) -> None:
    """llama.cpp's greedy tokens on the same file, each step fed its token; a divergence only at a near-tie
    (the bounds above)."""
    name, _, _, model, ref = iq4
    runs = [greedy_run(model, item) for item in ref["greedy"]]
    assert not greedy_failures(name, runs, NEAR_TIE[name], MAX_NEAR_TIES[name]), runs


def test_types_still_not_run_are_refused_in_one_line(tmp_path: Path) -> None:
    """A type the engine does not run (Q8_1 here: blocks of 32, so it fits the tiny model's rows of 64; the other
    i-quants, IQ2_XS, IQ3_S, ..., take the same check): one line naming the tensor and its type."""
    import gguf

    from engine import UnsupportedModelError
    from engine.kernels import SUPPORTED_TYPES

    assert not {T.IQ1_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.Q8_1} & SUPPORTED_TYPES

    from .synthetic import copy_metadata, write_tiny_model

    tiny = write_tiny_model(tmp_path / "ok.gguf", "llama", matrix_type=T.F32)
    path = tmp_path / "q8_1.gguf"
    reader = gguf.GGUFReader(tiny.path)
    writer = gguf.GGUFWriter(str(path), "llama")
    copy_metadata(reader, writer)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":  # (128, 64): two Q8_1 blocks of 40 bytes a row
            writer.add_tensor(t.name, np.zeros((128, 80), np.uint8), raw_dtype=T.Q8_1)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"^tensor blk\.0\.ffn_up\.weight: type Q8_1 is not supported$"):
        load_model(path)
