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

Rows looked up in a file-mapped table (the token embeddings) are read with pread, not through the mapping:
Linux 6.x caches a file in large folios and a fault maps the whole folio, so 256 random rows of Gemma 3's
262k-row, 178 MB embedding table made 135 MB of the file resident in the process (Linux 6.18, 2 MB folios)
though they hold 170 KB. A read copies only the bytes asked for; the page cache stays the kernel's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from contextlib import suppress

import numpy as np

_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20
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


def release_range(start: int, length: int) -> bool:
    """Drop the resident pages of [start, start + length), both page-aligned; True when done. For clean file
    pages only: the next touch reads them back from the page cache."""
    return _madvise is not None and _madvise(start, length, mmap.MADV_DONTNEED) == 0


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


def resident_empty(size: int, dtype: np.dtype | type) -> np.ndarray:
    """A 1-D array of `size` items, its contents undefined, every page already resident: a buffer that parallel
    loops will fill, which would otherwise take its page faults inside them, where they are slowest. Huge
    pages where the kernel gives them (a 2 MB page is one fault), the rest small ones."""
    nbytes = size * np.dtype(dtype).itemsize
    if nbytes == 0 or _madvise is None:
        return np.empty(size, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(buf, dtype=dtype)
    populate(a)
    return a


def _file_mapping(a: np.ndarray) -> np.memmap | None:
    """The np.memmap that maps the file under `a` (its outermost one), if any."""
    base: np.ndarray | None = a
    found = None
    while base is not None:
        if isinstance(base, np.memmap):
            found = base
        base = getattr(base, "base", None)
    return found


def is_shared_file_mapping(a: np.ndarray) -> bool:
    """True when `a` is a view of a np.memmap opened read-only or read-write (a MAP_SHARED file mapping)."""
    root = _file_mapping(a)
    return root is not None and getattr(root, "mode", None) in _SHARED_MODES


class FileRows:
    """Rows of a matrix that lies in a file mapping, read from the file instead of through the mapping.

    The file is opened when this is made, right after it was mapped, and kept open: a file renamed over the
    model's name later is never read.
    """

    def __init__(self, a: np.ndarray) -> None:
        """a: a C-contiguous 2-D view of a read-only np.memmap; ValueError when it is not one."""
        root = _file_mapping(a)
        if (root is None or root.filename is None or root.mode not in ("r", "readonly")
                or a.ndim != 2 or not a.flags.c_contiguous):  # fmt: skip
            raise ValueError("not a 2-D view of a read-only file mapping")
        self._offset = int(root.offset) + (a.ctypes.data - root.ctypes.data)  # of row 0 in the file
        self._shape, self._dtype = a.shape, a.dtype
        self._row_bytes = a.strides[0]
        self._file = open(root.filename, "rb", buffering=0)  # noqa: SIM115 (lives as long as the weights)
        if os.fstat(self._file.fileno()).st_size < self._offset + a.nbytes:
            self._file.close()
            raise ValueError("the file is shorter than its mapping")

    @classmethod
    def of(cls, a: np.ndarray) -> FileRows | None:
        """A reader for `a`'s rows where pread can serve them (Unix, a read-only file mapping), else None."""
        if not hasattr(os, "preadv"):
            return None
        try:
            return cls(a)
        except (ValueError, OSError):
            return None

    def take(self, ids: np.ndarray) -> np.ndarray:
        """a[ids] as a new array (len(ids), cols), bytes equal to the mapping's."""
        out = np.empty((len(ids), *self._shape[1:]), dtype=self._dtype)
        fd, n = self._file.fileno(), self._row_bytes
        for i, row in enumerate(ids.tolist()):
            if not 0 <= row < self._shape[0]:
                raise IndexError(f"row {row} out of range for {self._shape[0]} rows")
            if os.preadv(fd, [out[i]], self._offset + row * n) != n:
                raise OSError(f"short read of row {row} from {self._file.name}")
        return out


def file_copy(a: np.ndarray) -> np.ndarray:
    """A copy of `a`. Where `a` is a C-contiguous view of a read-only file mapping, it is read from the file with
    pread (`FileRows`), so that none of the mapping's pages become resident: a fault on a mapped file maps the
    64 KB around the page it touches (the kernel's fault-around), and a model's small tensors (norms, biases) lie
    between its big ones, so copying SmolLM2's 61 norm vectors through the mapping kept 4 MB of it resident."""
    reader = FileRows.of(a.reshape(1, -1)) if a.flags.c_contiguous else None
    if reader is not None:
        with suppress(OSError):
            return reader.take(np.zeros(1, dtype=np.int64)).reshape(a.shape)
    return np.array(a)  # not a file mapping, or unreadable now: through the mapping, as before


# madvise(MADV_POPULATE_WRITE) (Linux 5.14): fault a range in, writable, in one call. Python's mmap module
# names it only from 3.13.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def populate(a: np.ndarray) -> bool:
    """Make the pages under the C-contiguous array `a` resident and writable now, from this thread, instead of
    at their first writes; True when done (False: unsupported here, and the pages fault in as usual)."""
    if _madvise is None or a.nbytes == 0 or not a.flags.c_contiguous:
        return False
    start = a.ctypes.data
    lo = start & ~(_PAGE - 1)
    return _madvise(lo, start + a.nbytes - lo, _MADV_POPULATE_WRITE) == 0


def release(a: np.ndarray) -> bool:
    """Drop the resident pages under `a` if it lies in a shared file mapping; True when done."""
    if _madvise is None or a.nbytes == 0 or not a.flags.c_contiguous or not is_shared_file_mapping(a):
        return False
    start = a.ctypes.data
    lo = start & ~(_PAGE - 1)
    hi = start + a.nbytes  # the last partial page goes too: its neighbour's bytes simply fault back in
    return _madvise(lo, hi - lo, mmap.MADV_DONTNEED) == 0
