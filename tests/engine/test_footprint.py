"""engine.footprint's Numba savings: the runtime module comes from the cache, and a kernel loaded from the cache
without its parsed link module still links into a later compilation. Each check runs in a fresh interpreter,
since the savings act on Numba's first start in a process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
