"""The machine's memory read bandwidth, measured the way decode reads its weights: every kernel thread
streaming its own contiguous part of a buffer larger than any cache."""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from ..runtime import configure_numba

configure_numba()  # the kernel cache folder before the @njit(cache=True) below, even when imported directly


@njit(parallel=True, cache=True, nogil=True)
def _sum_parts(a, parts):
    """sum(a) for a int64 (n,), in len(parts) contiguous parts, one per thread."""
    t = parts.shape[0]
    n = a.shape[0]
    for i in prange(t):
        parts[i] = a[i * n // t : (i + 1) * n // t].sum()  # a slice: no index wrap-around, so it vectorizes
    return parts.sum()


class ReadProbe:
    """The machine's read bandwidth on demand: a resident buffer of nbytes, read in parallel with the kernel
    thread count. Kept between measurements, so that a benchmark can measure right beside each repetition (on
    a shared machine the limit moves as much as the speed measured against it)."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        self.buffer = np.ones(nbytes // 8, dtype=np.int64)  # written once: every page resident before timing
        self._parts = np.zeros(numba.get_num_threads(), dtype=np.int64)
        if _sum_parts(self.buffer, self._parts) != self.buffer.shape[0]:
            raise RuntimeError("the bandwidth probe summed wrongly")

    def measure(self, repeats: int = 5) -> float:
        """Bytes per second of a parallel read of the buffer: best of `repeats`."""
        best = np.inf
        for _ in range(repeats):
            t = time.perf_counter()
            _sum_parts(self.buffer, self._parts)
            best = min(best, time.perf_counter() - t)
        return self.buffer.nbytes / best


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a parallel read of an nbytes buffer with the kernel thread count: best of `repeats`."""
    return ReadProbe(nbytes).measure(repeats)
