"""Process-wide Numba settings: which threading layer runs `prange`, and how many threads.

Numba's default `workqueue` layer costs 135-245 µs per parallel launch here against 6-45 µs for OpenMP,
and a token makes hundreds of launches, so OpenMP is preferred whenever it loads.
"""

from __future__ import annotations

import os

# Must be in the environment before numba is first imported anywhere in the process.
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")

import numba  # noqa: E402

from .errors import SettingsError  # noqa: E402


def configure_threads(threads: int | None) -> int:
    """Use `threads` cores for the kernels (None or 0: all of them). Returns the number in force."""
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
    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"
