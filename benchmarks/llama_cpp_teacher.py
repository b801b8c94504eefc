"""llama.cpp's teacher-forced top-5 on the real models over longer texts, for tests/engine/test_golden.py.

    python benchmarks/llama_cpp_teacher.py --llama-python /path/to/llama-venv/bin/python

tests/golden/*.json hold one text of ~55 positions per model, where one near-tie flipped either way moves the
top-1 agreement by 0.018: too few to tell an engine that agrees at 0.93 from one at 0.90. This script has
llama-cpp-python (in its own virtual environment, never a dependency of ours; 2 threads, F16 KV cache, as the
goldens were made) evaluate TEXTS on every catalog model in the user cache, and writes each position's top-5
next-token ids and log-probs with the file's sha256 to tests/golden/teacher-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatapp.catalog import load_catalog, sha256_file  # noqa: E402
from chatapp.paths import models_dir  # noqa: E402

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma3-270m")
OUT = REPO / "tests" / "golden"

# Four genres, none of them the goldens' own text: prose, code, a dialogue and a list with numbers.
TEXTS = (
    "The river had risen overnight, and by morning the lower road was under water. Mara walked the long way "
    "round, past the mill and the old chapel, counting the fence posts that still showed above the flood. At "
    "the top of the hill she stopped to look back. The valley was a sheet of grey light, broken only by the "
    "tops of hedges and a single red tractor that someone had left in the field by the ford. She thought of "
    "her brother, who had promised to move it on Sunday, and laughed despite herself.",
    "def merge_intervals(intervals):\n"
    '    """Merge overlapping [start, end] intervals and return them sorted."""\n'
    "    if not intervals:\n"
    "        return []\n"
    "    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = [list(intervals[0])]\n"
    "    for start, end in intervals[1:]:\n"
    "        last = merged[-1]\n"
    "        if start <= last[1]:\n"
    "            last[1] = max(last[1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n\n\n"
    "print(merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]))\n",
    "Customer: Hi, I ordered a pair of walking boots last week, but the box arrived with two left boots.\n"
    "Agent: I'm sorry about that! Could you give me your order number so I can look into it?\n"
    "Customer: Sure, it's 48213. I'd like a replacement rather than a refund, if possible.\n"
    "Agent: Thank you. I've arranged a replacement pair, and a courier will collect the wrong ones on Thursday. "
    "Is there anything else I can help with today?\n"
    "Customer: No, that's perfect. Thanks for sorting it out so quickly.",
    "Shopping list for the weekend:\n"
    "1. Two loaves of wholemeal bread\n"
    "2. A dozen eggs (free range)\n"
    "3. 500 g of pasta and a jar of tomato sauce\n"
    "4. Apples, bananas and three lemons\n"
    "5. Coffee beans, 250 g, medium roast\n"
    "Budget: about 35 euros. The market opens at 8:00 on Saturday and closes at 13:30, so go early, because "
    "the bakery stall usually sells out before eleven.",
)

# Runs inside the llama-cpp-python environment: every text's ids (BOS first where the model adds one) and,
# at each position, the top-5 next tokens with log-probs.
_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
import llama_cpp
job = json.loads(sys.argv[1])
llm = Llama(model_path=job["path"], n_ctx=1024, n_batch=512, n_threads=2, logits_all=True, verbose=False)
add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") != "false"
items = []
for text in job["texts"]:
    ids = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    top5 = np.argsort(-logp, axis=-1)[:, :5]
    items.append({"text": text, "ids": ids, "top5_ids": top5.tolist(),
                  "top5_logprobs": np.take_along_axis(logp, top5, axis=-1).round(5).tolist()})
print(json.dumps({"llama_cpp_python": llama_cpp.__version__, "teacher": items}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python installed")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    for name in MODELS:
        entry = load_catalog()[name]
        path = models_dir() / entry.file_name
        job = json.dumps({"path": str(path), "texts": TEXTS})
        run = subprocess.run([args.llama_python, "-c", _CHILD, job], capture_output=True, text=True, check=True)
        result = json.loads(run.stdout)
        result = {"model_sha256": sha256_file(path), **result}
        target = args.out / f"teacher-{name}.json"
        target.write_text(json.dumps(result) + "\n")
        n = sum(len(t["ids"]) for t in result["teacher"])
        print(f"{name}: {n} positions -> {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
