"""Resident pages: give back those of a file-mapped tensor once its bytes have been copied elsewhere, and
allocate the KV cache in small pages.

Pages of a memory-mapped file count in the process's resident memory once touched. After a weight is
repacked, its file bytes are never read again, so they are dropped with madvise(MADV_DONTNEED): for a shared
(read-only or read-write) file mapping this only unmaps them, and a later read would fault them back in from
the page cache. Anonymous or copy-on-write memory is never touched (there DONTNEED would discard data).

NumPy asks for transparent huge pages on large arrays, so the first touch of any position of a KV cache
zeroes the 2 MB around it: restoring 1,323 saved positions of the 1.5B model's 4,096-position cache (38 MB)
faulted in and zeroed the whole 234 MB, 0.26-0.33 s against 0.06 s in small pages (Zen 5 VM, THP "madvise").
A cache in small pages also holds only the positions a chat has used.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

_PAGE = mmap.PAGESIZE
_SHARED_MODES = ("r", "readonly", "r+", "readwrite")


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def is_supported() -> bool:
    """Whether this platform can release pages (Linux, with libc's madvise)."""
    return _madvise is not None


def small_page_zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zeroed array in anonymous memory that is never backed by huge pages: each page is allocated (and
    zeroed) by the kernel on first touch."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):  # not Linux: the platform's usual allocation
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # anonymous and zero-filled
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def is_shared_file_mapping(a: np.ndarray) -> bool:
    """True when `a` is a view of a np.memmap opened read-only or read-write (a MAP_SHARED file mapping)."""
    base = a
    while base is not None:
        if isinstance(base, np.memmap):
            return getattr(base, "mode", None) in _SHARED_MODES
        base = getattr(base, "base", None)
    return False


def release(a: np.ndarray) -> bool:
    """Drop the resident pages under `a` if it lies in a shared file mapping; True when done."""
    if _madvise is None or a.nbytes == 0 or not a.flags.c_contiguous or not is_shared_file_mapping(a):
        return False
    start = a.ctypes.data
    lo = start & ~(_PAGE - 1)
    hi = start + a.nbytes  # the last partial page goes too: its neighbour's bytes simply fault back in
    return _madvise(lo, hi - lo, mmap.MADV_DONTNEED) == 0
