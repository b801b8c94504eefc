"""llama.cpp's logits on the tiny synthetic model of each family, for tests/engine/test_synthetic_llama_cpp.py.

    python benchmarks/llama_cpp_synthetic.py --llama-python /path/to/llama-venv/bin/python
    python benchmarks/llama_cpp_synthetic.py --llama-python ... --families qwen3moe olmoe qwen2moe \
        granitemoe granitemoeshared --out tests/golden/synthetic-moe-llama-cpp.npz
    python benchmarks/llama_cpp_synthetic.py --llama-python ... --families llama3 qwen3moe --types MXFP4 \
        --out tests/golden/synthetic-mxfp4-llama-cpp.npz

Writes every family's tiny GGUF (tests/engine/synthetic.py, seed 0, F32 and Q8_0 matrices) to a scratch
directory, has llama-cpp-python (in its own virtual environment, never a dependency of ours) evaluate one
sequence longer than the Gemma models' sliding window on each, and saves the logits with each file's sha256
to tests/golden/synthetic-llama-cpp.npz, so the test can check that it regenerates the very same files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.engine.synthetic import write_tiny_model  # noqa: E402

FAMILIES = ("llama3", "qwen3", "gemma2", "gemma3")
# The mixture-of-experts families, in a golden file of their own:
# --families qwen3moe olmoe qwen2moe granitemoe granitemoeshared --out MOE_OUT (granitemoeshared: a granitemoe
# file with a shared expert).
TYPES = (T.F32, T.Q8_0)
IDS = [3, 250, 17, 260, 99, 5, 42, 261, 7, 128, 64, 200, 1, 33, 77, 150, 9, 211, 45, 120]  # 20 > window 5
# Qwen3 with YaRN rope scaling: factor 4 over an original context of 16, attention factor 0.9, read over 40
# positions (past the original context); its own ids, 40 of them.
YARN = (4.0, 16, 0.9)
YARN_IDS = [int(i) for i in np.random.default_rng(7).integers(0, 250, 40)]
OUT = REPO / "tests" / "golden" / "synthetic-llama-cpp.npz"
MOE_OUT = REPO / "tests" / "golden" / "synthetic-moe-llama-cpp.npz"

# Runs inside the llama-cpp-python environment: logits of every position of IDS, 2 threads, F16 KV cache.
_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
jobs = json.loads(sys.argv[1])
out = {}
for name, path in jobs["files"].items():
    llm = Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False)
    ids = jobs["yarn_ids"] if "yarn" in name else jobs["ids"]
    llm.eval(ids)
    out[name] = np.array(llm.scores[: len(ids)], dtype=np.float32).tolist()
    del llm
import llama_cpp
out["__version__"] = llama_cpp.__version__
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python installed")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--families", nargs="+", default=FAMILIES, help=f"default: {' '.join(FAMILIES)}")
    ap.add_argument("--types", nargs="+", default=[t.name for t in TYPES], help="the matrices' ggml types")
    args = ap.parse_args()
    types = [T[name] for name in args.types]
    with tempfile.TemporaryDirectory() as tmp:
        files, shas = {}, {}
        for family in args.families:
            for ggml_type in types:
                name = f"{family}-{ggml_type.name}"
                tiny = write_tiny_model(Path(tmp) / f"{name}.gguf", family, matrix_type=ggml_type)
                files[name] = str(tiny.path)
                shas[name] = hashlib.sha256(tiny.path.read_bytes()).hexdigest()
        for ggml_type in types if "qwen3" in args.families else ():  # YaRN's file is a qwen3 one
            name = f"qwen3-yarn-{ggml_type.name}"
            tiny = write_tiny_model(Path(tmp) / f"{name}.gguf", "qwen3", matrix_type=ggml_type, yarn=YARN)
            files[name] = str(tiny.path)
            shas[name] = hashlib.sha256(tiny.path.read_bytes()).hexdigest()
        job = json.dumps({"files": files, "ids": IDS, "yarn_ids": YARN_IDS})
        done = subprocess.run([args.llama_python, "-c", _CHILD, job], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(done.stdout.strip().splitlines()[-1])
    arrays = {f"logits/{name}": np.array(result[name], dtype=np.float32) for name in files}  # (len(IDS), n_vocab)
    arrays.update({f"sha256/{name}": np.array(sha) for name, sha in shas.items()})
    arrays["ids"] = np.array(IDS)
    if "qwen3" in args.families:
        arrays["yarn_ids"] = np.array(YARN_IDS)
    arrays["source"] = np.array(f"llama.cpp via llama-cpp-python {result['__version__']}, n_threads=2")
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({len(files)} models)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
