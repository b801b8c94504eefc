"""Process-wide Numba settings: which threading layer runs `prange`, and how many threads.

Numba's default `workqueue` layer costs 135-245 µs per parallel launch here against 6-45 µs for OpenMP,
and a token makes hundreds of launches, so OpenMP is preferred whenever it loads.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def _kernel_cache_dir() -> Path:
    """Numba's on-disk cache, in a folder named after a hash of every kernel source file.

    Numba keys a cached function on its own file's timestamp only, so an edit to an inlined helper in another
    module would leave a stale kernel in use. A new hash of the sources means a new, empty folder.
    """
    h = hashlib.sha256()
    for source in sorted((Path(__file__).parent / "kernels").glob("*.py")):
        h.update(source.name.encode())
        h.update(source.read_bytes())
    base = os.environ.get("CHATAPP_CACHE_DIR")
    if not base:
        import platformdirs

        base = platformdirs.user_cache_dir("chatapp")
    return Path(base) / "numba" / h.hexdigest()[:16]


# Both must be in the environment before numba is first imported anywhere in the process.
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")
KERNEL_CACHE_DIR = _kernel_cache_dir()
os.environ["NUMBA_CACHE_DIR"] = str(KERNEL_CACHE_DIR)

from .errors import SettingsError  # noqa: E402

if "numba" in sys.modules:  # imported before us: its config has been read already
    sys.modules["numba"].config.CACHE_DIR = str(KERNEL_CACHE_DIR)


def kernels_compiled() -> bool:
    """Whether the kernel cache already holds compiled code (a start without compiling)."""
    return KERNEL_CACHE_DIR.is_dir() and any(KERNEL_CACHE_DIR.rglob("*.nbc"))


def configure_threads(threads: int | None) -> int:
    """Use `threads` cores for the kernels (None or 0: all of them). Returns the number in force.

    NumPy's BLAS is held to one thread: its workers spin after each call and take the cores from the Numba
    threads that run next (measured here with the other core busy: a (768, 64) @ (64, 256) product took 17 ms
    on two OpenBLAS threads, 1.7 ms on one). The kernels own the parallelism.
    """
    import numba
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")

    available = numba.config.NUMBA_NUM_THREADS
    if threads is None or threads == 0:
        n = available
    elif threads < 0:
        raise SettingsError(f"threads must be positive (got {threads})")
    else:
        n = min(threads, available)
    numba.set_num_threads(n)
    return n


def threading_layer() -> str:
    """The layer Numba chose (only known after the first parallel launch)."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"
