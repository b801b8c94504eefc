"""The first start compiles the kernels, for the host's instruction set only, and says so; the next start loads
them and compiles nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.kernels import simd
from engine.runtime import KERNEL_CACHE_DIR

pytestmark = pytest.mark.slow

LOAD = "import sys, engine; engine.load_model(sys.argv[1], n_ctx=64, progress=print)"


def _start(model_path: Path, cache_dir: Path) -> list[str]:
    env = {**os.environ, "CHATAPP_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(model_path)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def _kernel_files(cache_dir: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (cache_dir / "numba").rglob("*") if p.is_file()}


def test_second_start_compiles_nothing(smollm2_path: Path, tmp_path: Path) -> None:
    first = _start(smollm2_path, tmp_path)
    assert any("compiling kernels" in line for line in first), first
    if (os.cpu_count() or 1) >= 2:  # the prompt path compiled in a second process, into the same cache
        assert any("(the prompt path in a second process)" in line for line in first), first
    # progress is a count of kernels compiled: any interim counts rise, and the last line gives the total
    counts = [int(m[1]) for line in first if (m := re.fullmatch(r"compiling kernels: (\d+) compiled in \d+ s", line))]
    assert counts == sorted(counts), counts
    total = re.fullmatch(r"(\d+) kernels compiled in \d+ s; later starts load them", first[-1])
    assert total is not None and int(total[1]) >= max(counts, default=0), first[-3:]  # the helper may end last
    compiled = _kernel_files(tmp_path)
    assert compiled, "the first start left no compiled kernels behind"
    # one folder, named after the host's kernel set and CPU: no other instruction set was compiled
    assert [p.name for p in (tmp_path / "numba").iterdir()] == [KERNEL_CACHE_DIR.name]
    assert KERNEL_CACHE_DIR.name.startswith(simd.KERNELS.isa + "-")

    second = _start(smollm2_path, tmp_path)
    assert any("loading kernels" in line for line in second), second
    assert not any("compiling" in line for line in second), second
    assert _kernel_files(tmp_path) == compiled, "the second start compiled (or rewrote) kernels"


def test_each_installation_of_the_same_sources_has_its_own_kernel_folder(tmp_path: Path) -> None:
    """Numba files kernels under their source paths: a copy of the engine elsewhere (another virtual environment)
    compiles its own, so its first start must be seen as one, whatever this copy has compiled."""
    import shutil

    import engine

    shutil.copytree(Path(engine.__file__).parent, tmp_path / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    show = "from engine import runtime; print(runtime.KERNEL_CACHE_DIR); print(runtime.kernels_compiled())"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = [sys.executable, "-c", show]
    done = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    folder, compiled = done.stdout.split()
    assert Path(folder).parent == KERNEL_CACHE_DIR.parent  # the same cache, the same kernel set and CPU ...
    assert Path(folder).name.split("-")[0] == KERNEL_CACHE_DIR.name.split("-")[0]
    assert Path(folder) != KERNEL_CACHE_DIR  # ... and a folder of its own
    assert compiled == "False"


SIGNATURES = """
import json, sys, engine
from engine.kernels import packed
m = engine.load_model(sys.argv[1], n_ctx=64)
drivers = {"matvec": (packed.matvec, 2), "matmul": (packed.matmul_quantized, 2), "group_simd": (packed.group_simd, 2),
           "pack": (packed.pack_groups, 3)}  # the format's argument of each
print(json.dumps({name: sorted({str(sig[at]) for sig in f.signatures}) for name, (f, at) in drivers.items()}))
"""


def test_kernels_are_compiled_for_the_formats_of_the_model_alone(smollm2_path: Path) -> None:
    """Each driver is compiled once per format the model has (Q4_1 and a Q8_0 head for SmolLM2), taking the
    format's tag: a driver that took the type id would hold every format's kernels (engine/formats/dispatch.py)."""
    import json

    import numba
    from gguf import GGMLQuantizationType as T

    from engine.formats.dispatch import tag

    done = subprocess.run(
        [sys.executable, "-c", SIGNATURES, str(smollm2_path)], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.splitlines()[-1])
    tags = {str(numba.typeof(tag(int(t)))) for t in (T.Q4_1, T.Q8_0)}
    # Kernels loaded from the cache list only what was called from Python (the fused layer's callees are linked
    # into it): so each driver's formats are some of the model's, and every weight was packed by its own.
    assert all(set(formats) <= tags for formats in compiled.values()), compiled
    assert set(compiled["pack"]) == set(compiled["matmul"]) == tags, compiled


def test_kernel_folders_unused_for_a_month_are_removed(tmp_path: Path) -> None:
    from engine.runtime import KERNEL_FOLDER_MAX_AGE_S, prune_kernel_folders

    def folder(name: str, age_s: float) -> Path:
        f = tmp_path / name
        (f / "kernels_0a1b").mkdir(parents=True)
        (f / "kernels_0a1b" / "packed.matvec-1.py311.nbi").write_bytes(b"x")
        os.utime(f, (time.time() - age_s,) * 2)
        return f

    ours = folder("avx2-00112233445566ff", 2 * KERNEL_FOLDER_MAX_AGE_S)  # long unused, but this process's
    stale = folder("avx512vnni-8899aabbccddeeff", KERNEL_FOLDER_MAX_AGE_S + 3600)
    recent = folder("avx512vnni-0123456789abcdef", KERNEL_FOLDER_MAX_AGE_S - 3600)
    other = folder("notes", 2 * KERNEL_FOLDER_MAX_AGE_S)  # not named as a kernel folder: never touched

    assert prune_kernel_folders(ours) == [stale]
    assert not stale.exists() and recent.is_dir() and other.is_dir()
    assert time.time() - ours.stat().st_mtime < 60  # marked as used now
    assert (ours / "kernels_0a1b" / "packed.matvec-1.py311.nbi").read_bytes() == b"x"


def test_compile_progress_counts_compiles_not_cache_loads() -> None:
    from numba import njit

    from engine.runtime import compile_progress

    reports = []

    @njit  # a fresh function, uncached: one real compile per signature
    def twice(x):
        return 2 * x

    with compile_progress(lambda n, s: reports.append(n), every_s=0.0) as compiled:
        twice(1)
        twice(2)  # already compiled for int: no compile
        twice(1.5)
    assert compiled() == 2 and reports == [1, 2]
    with compile_progress(lambda n, s: reports.append(n), every_s=0.0) as compiled:
        twice(3)
    assert compiled() == 0 and reports == [1, 2]


def test_the_first_start_compiles_the_prompt_path_beside_where_it_pays(tmp_path: Path, monkeypatch) -> None:
    from engine import prompt_compile

    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(prompt_compile.os, "cpu_count", lambda: 1)
    assert prompt_compile.start(model) is None  # one core: nothing to gain
    monkeypatch.setattr(prompt_compile.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(prompt_compile, "_available_memory", lambda: 4 * 4096 - 1)
    assert prompt_compile.start(model) is None  # its copy of the weights would not fit easily
    prompt_compile.finish(None)
    prompt_compile.stop(None)


def test_a_stuck_helper_is_stopped(monkeypatch) -> None:
    from engine import prompt_compile

    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(prompt_compile, "_WAIT_S", 0.2)
    prompt_compile.finish(helper)
    assert helper.poll() is not None
