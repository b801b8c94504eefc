"""engine.footprint's Numba savings: the runtime module comes from the cache, and a kernel loaded from the cache
without its parsed link module still links into a later compilation. Each check runs in a fresh interpreter,
since the savings act on Numba's first start in a process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


PRELUDE = """
from pathlib import Path
from engine.footprint import install_numba_savings
assert install_numba_savings(Path("rt"))
"""


def _run(code: str, cwd: Path, install: bool = True) -> str:
    """Run code (after installing the savings, by default) with Numba's kernel cache in cwd; its stdout."""
    env = {"PYTHONPATH": f"{cwd}:{REPO}", "CHATAPP_CACHE_DIR": str(cwd / "cache"), "PATH": "/usr/bin:/bin"}
    script = (PRELUDE if install else "") + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


RUNTIME_USER = """
    import numba, numpy as np

    @numba.njit
    def total(n):
        return np.arange(n).sum()  # allocates: needs the runtime module

    print(total(5))
"""


def test_runtime_module_is_cached_then_reused_and_a_bad_file_is_rebuilt(tmp_path: Path) -> None:
    assert _run(RUNTIME_USER, tmp_path) == "10"
    (cached,) = (tmp_path / "rt").glob("numba-runtime-*.pkl")
    stamp = cached.stat().st_mtime_ns

    assert _run(RUNTIME_USER, tmp_path) == "10"
    assert cached.stat().st_mtime_ns == stamp, "the second start rebuilt the runtime module"

    cached.write_bytes(b"not a pickle")
    assert _run(RUNTIME_USER, tmp_path) == "10"
    assert cached.read_bytes() != b"not a pickle", "a damaged runtime module was not rebuilt"


def test_cached_kernel_links_into_a_new_compilation(tmp_path: Path) -> None:
    (tmp_path / "doubler.py").write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef double(x):\n    return 2 * x\n", encoding="utf-8"
    )
    _run("import doubler; print(doubler.double(1))", tmp_path)  # compile and cache

    out = _run(
        """
        import numba, doubler
        assert doubler.double(3) == 6
        assert doubler.double.stats.cache_hits, "not loaded from the cache"
        (library,) = [c.library for c in doubler.double.overloads.values()]
        assert library._shared_module is None and library._link_bitcode, "loaded with its link module parsed"

        @numba.njit
        def double_plus_one(x):
            return doubler.double(x) + 1

        print(double_plus_one(20))
        """,
        tmp_path,
    )
    assert out == "41"


def test_an_unchecked_numba_release_is_left_as_shipped(tmp_path: Path) -> None:
    code = """
        from pathlib import Path
        import numba
        from numba.core import codegen
        from numba.core.runtime import nrtdynmod
        shipped = (nrtdynmod.compile_nrt_functions, codegen.CPUCodeLibrary._get_module_for_linking)
        numba.__version__ = "0.99.0"
        from engine.footprint import install_numba_savings
        assert not install_numba_savings(Path("rt"))
        assert (nrtdynmod.compile_nrt_functions, codegen.CPUCodeLibrary._get_module_for_linking) == shipped
        print("untouched")
        """
    assert _run(code, tmp_path, install=False) == "untouched"


# Each internal the patches rely on, made to look as another Numba might have it: the patches must stand back.
MISSING_INTERNALS = {
    "runtime-module builder": "del nrtdynmod.create_nrt_module",
    "unserialize classmethod": "codegen.CPUCodeLibrary._unserialize = staticmethod(lambda *a: None)",
    "module-for-linking method": "codegen.CPUCodeLibrary._get_module_for_linking = None",
}


@pytest.mark.parametrize("change", MISSING_INTERNALS.values(), ids=MISSING_INTERNALS.keys())
def test_numba_internals_not_as_expected_are_left_as_shipped(tmp_path: Path, change: str) -> None:
    code = f"""
        from pathlib import Path
        from numba.core import codegen
        from numba.core.runtime import nrtdynmod
        {change}
        shipped = (nrtdynmod.compile_nrt_functions, codegen.CPUCodeLibrary.__dict__.get("_unserialize"))
        from engine.footprint import install_numba_savings
        assert not install_numba_savings(Path("rt"))
        assert (nrtdynmod.compile_nrt_functions, codegen.CPUCodeLibrary.__dict__.get("_unserialize")) == shipped
        print("untouched")
        """
    assert _run(code, tmp_path, install=False) == "untouched"


GREEDY_LOGITS = """
    import sys
    import numpy as np
    import engine.loader
    if sys.argv[1] == "off":
        engine.loader.install_numba_savings = lambda cache_dir: False
    from numba.core.runtime import nrtdynmod
    from engine import load_model
    model = load_model(sys.argv[2], n_ctx=256)
    patched = nrtdynmod.compile_nrt_functions.__module__ == "engine.footprint"
    assert patched == (sys.argv[1] == "on"), "the savings are not in the state this run asked for"
    session = model.session()
    logits = session.eval(model.tokenize("The capital of France is"))
    for _ in range(8):
        logits = session.eval([int(logits.argmax())])
    np.save(sys.argv[3], logits)
"""


def test_a_real_model_runs_the_same_with_the_savings_off(smollm2_path: Path, tmp_path: Path) -> None:
    """The savings change memory only: SmolLM2 on Numba as shipped gives the same logits, bit for bit."""
    script = tmp_path / "greedy.py"
    script.write_text(textwrap.dedent(GREEDY_LOGITS), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the real kernel cache: nothing to compile
    for state in ("on", "off"):
        args = [sys.executable, str(script), state, str(smollm2_path), str(tmp_path / f"{state}.npy")]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "off.npy"), np.load(tmp_path / "on.npy"))


RESIDENT = """
    import re

    def resident(fragment):
        # kB resident in the mappings of libraries whose path holds fragment, (clean read-only, the rest)
        clean = other = 0
        mine = False
        rss = anon = 0
        for line in open("/proc/self/smaps"):
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                mine = len(fields) >= 6 and fragment in fields[5]
                ro = mine and "w" not in fields[1]
            elif mine and line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif mine and line.startswith("Anonymous:"):
                anon = int(line.split()[1])
                if ro and anon == 0:
                    clean += rss
                else:
                    other += rss
        return clean, other
"""

LLVM_PAGES = RESIDENT + """
    import numba
    from engine.footprint import release_library_pages

    before = resident("libllvmlite")
    released = release_library_pages()
    after = resident("libllvmlite")

    @numba.njit
    def twice(x):
        return 2 * x

    print(before[0], before[1], after[0], after[1], released, twice(21))  # LLVM compiles again after it
"""


def test_llvms_clean_pages_are_released_and_come_back_when_needed(tmp_path: Path) -> None:
    """After the import, LLVM's library holds megabytes of clean code pages; releasing them leaves its relocated
    data (private copies) resident, and compiling a new kernel afterwards works (the pages come back)."""
    clean, other, clean_after, other_after, released, result = map(int, _run(LLVM_PAGES, tmp_path).split())
    assert clean > 10_000 and released > 0  # kB: tens of MB resident after the import
    assert clean_after < clean / 10
    assert other_after == other  # relocated data untouched
    assert result == 42


AFTER_LOADS = RESIDENT + """
    import sys
    import numba
    from engine.footprint import release_library_pages, release_library_pages_after_kernel_loads

    release_library_pages()
    if sys.argv[1:] == ["on"]:
        release_library_pages_after_kernel_loads()

    @numba.njit
    def twice(x):
        return 2 * x

    result = twice(21)  # compiled here
    print(resident("libllvmlite")[0], result)
"""


def test_llvms_pages_are_released_after_each_kernel_load(tmp_path: Path) -> None:
    """With the release after kernel loads in force, what compiling a kernel touched of LLVM is gone once Numba
    lets go of its compiler lock; without it, the same compile leaves megabytes of LLVM resident."""
    script = tmp_path / "after_loads.py"
    script.write_text(PRELUDE + textwrap.dedent(AFTER_LOADS), encoding="utf-8")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "CHATAPP_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    kept = {}
    for state in ("off", "on"):
        done = subprocess.run([sys.executable, str(script), state], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        clean, result = map(int, done.stdout.split())
        assert result == 42
        kept[state] = clean
    assert kept["off"] > 5_000  # kB: a compile touches tens of MB of LLVM's code
    assert kept["on"] < kept["off"] / 5
