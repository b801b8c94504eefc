"""Importing the engine and its kernels is free: no environment variable set, nothing probed, nothing compiled.

load_model makes the process-wide choices (engine.runtime.start); an import that made them would be paid by
every `chatapp --help` and could not be told what to choose.
"""

from __future__ import annotations

import json
import subprocess
import sys

# CPU seconds, so that other processes on a shared machine do not count (the wall time did: 0.04-0.06 s at a
# load of 1, 0.23-0.33 s at a load of 10 on 2 cores). Measured on an Intel Xeon (2 cores, avx512vnni):
# 0.014 s; 0.36-0.38 s (0.5-0.8 s wall at a load of 1) when the import brought in NumPy, Numba and the block
# kernels and sampled /proc/stat for 50 ms.
IMPORT_BOUND_S = 0.25

CHILD = """
import json, os, sys, time
before = dict(os.environ)
t0, c0 = time.perf_counter(), time.process_time()
import engine, engine.kernels
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
heavy = sorted(m for m in ("numpy", "numba", "llvmlite", "engine.runtime", "engine.formats") if m in sys.modules)
print(json.dumps({"cpu": cpu, "wall": wall, "changed": changed, "heavy": heavy}))
"""


def _import_once() -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_importing_the_engine_sets_nothing_probes_nothing_and_is_quick() -> None:
    runs = [_import_once() for _ in range(3)]
    best = min(runs, key=lambda r: r["cpu"])  # the least disturbed of three: a loaded machine only adds to it
    assert best["cpu"] < IMPORT_BOUND_S, f"import took {best['cpu']:.3f} CPU s ({best['wall']:.3f} s wall)"
    assert all(r["changed"] == [] for r in runs), f"importing set environment variables: {runs[0]['changed']}"
    assert all(r["heavy"] == [] for r in runs), f"importing loaded {runs[0]['heavy']}"
