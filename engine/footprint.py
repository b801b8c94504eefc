"""Keep the process's resident memory small: two savings in Numba's runtime, and giving freed heap back.

Measured on SmolLM2-135M (Q4_1, 92 MB of packed weights), peak RSS for a 256-token prompt and 128 tokens went
from 319 MB to about 265 MB with all three:

- Numba compiles its runtime module (NRT: a few atomic refcount functions) through LLVM's full optimizer and
  code generator at every start, even when every kernel comes from the cache. That alone touches ~20 MB of
  LLVM's code pages. We keep its object code in the kernel cache and load it like any cached kernel.
- A cached kernel's entry holds, beside its machine code, the LLVM bitcode of its module, which Numba parses
  into an in-memory module on load in case a later compilation links against it. Parsed, that is 10-20x the
  bitcode: ~11 MB for the one-call decode layer. We read it only for its symbol names and parse it again if
  a compilation ever asks for it (a new kernel signature linking this one; never on a warm start).
- Parsing leaves the C heap with freed holes that glibc keeps; `release_free_heap` returns them.
- llvmlite's LLVM is one 179 MB library. Importing it maps 48 MB of it resident, or 104 MB when the page cache
  holds the file in large folios (a freshly installed file: each fault maps a whole folio); after that, LLVM
  runs only to load cached kernels (or compile on a first start), and each load touches ~10-25 MB of it
  again. `release_library_pages` unmaps its clean pages, as memory pressure would: after the import, and
  (`release_library_pages_after_kernel_loads`) after every load or compile of kernels, so that what one load
  touched is gone before the weights packed next add to the peak. SmolLM2's peak for a 256-token prompt went
  from 274 to 240 MB with releases after the import and at the end of loading, 236 MB with one more after the
  one-token path; its peak while loading went from 230 to 221 MB with a release after every kernel load
  (Intel Xeon, 2026-12-05, two runs each).

Both Numba savings rely on Numba internals (numba.core.codegen, numba.core.runtime.nrtdynmod), which are the
same in every release from 0.60 to 0.68 (compared). On another release, or when they are not as expected,
nothing is changed and Numba runs as shipped: the savings are memory, never correctness.
"""

from __future__ import annotations

import ctypes
import hashlib
import pickle
import re
from pathlib import Path
from typing import Any

_installed = False
_CHECKED_RELEASES = ((0, 60), (0, 68))  # first and last Numba minor release whose internals match the patches


def install_numba_savings(cache_dir: Path) -> bool:
    """Patch Numba (once per process) to cache its runtime module in cache_dir and parse link modules lazily.

    Returns whether the patches are in place. Call before the first kernel runs for the runtime-module saving.
    """
    global _installed
    if _installed:
        return True
    import llvmlite
    import llvmlite.binding as llvm
    import numba
    from numba.core import codegen
    from numba.core.runtime import nrtdynmod

    release = tuple(int(part) for part in numba.__version__.split(".")[:2] if part.isdigit())
    if not _CHECKED_RELEASES[0] <= release <= _CHECKED_RELEASES[1]:
        return False
    library_class = codegen.CPUCodeLibrary
    needed = (
        hasattr(nrtdynmod, "compile_nrt_functions") and hasattr(nrtdynmod, "create_nrt_module"),
        isinstance(library_class.__dict__.get("_unserialize"), classmethod),
        callable(library_class.__dict__.get("_get_module_for_linking")),
    )
    if not all(needed):
        return False
    _cache_runtime_module(nrtdynmod, cache_dir, f"{numba.__version__}-{llvmlite.__version__}")
    _parse_link_modules_lazily(library_class, llvm)
    _installed = True
    return True


def _cache_runtime_module(nrtdynmod: Any, cache_dir: Path, versions: str) -> None:
    def compile_or_load(ctx: Any) -> Any:
        codegen = ctx.codegen()
        # The same key Numba's own cache checks: target triple, host CPU and its features.
        machine = hashlib.sha256(repr((versions, codegen.magic_tuple())).encode()).hexdigest()[:16]
        path = cache_dir / f"numba-runtime-{machine}.pkl"
        try:
            state = pickle.loads(path.read_bytes())
            if not (isinstance(state, tuple) and len(state) == 3 and state[:2] == ("nrt", "object")):
                raise ValueError("not a runtime module")
            return codegen.unserialize_library(state)
        except Exception:  # absent, unreadable or foreign: build it as Numba does
            pass
        ir_module, library = nrtdynmod.create_nrt_module(ctx)
        library.enable_object_caching()
        library.add_ir_module(ir_module)
        library.finalize()
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(library.serialize_using_object_code()))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache costs the compile next time, nothing else
        return library

    nrtdynmod.compile_nrt_functions = compile_or_load


def _parse_link_modules_lazily(library_class: Any, llvm: Any) -> None:  # Numba's private library class
    unserialize = library_class._unserialize.__func__
    module_for_linking = library_class._get_module_for_linking

    def lean_unserialize(cls: type, codegen: Any, state: tuple) -> Any:
        name, kind, data = state
        if kind != "object":
            return unserialize(cls, codegen, state)
        object_code, link_bitcode = data
        library = codegen.create_library(name)
        library.enable_object_caching()
        library._set_compiled_object(object_code)
        module = llvm.parse_bitcode(link_bitcode)
        library._finalize_final_module()
        library._codegen._engine._load_defined_symbols(module)  # all that loading needs the module for
        del module
        library._link_bitcode = link_bitcode
        return library

    def lazy_module_for_linking(self: Any) -> Any:
        bitcode = getattr(self, "_link_bitcode", None)
        if bitcode is not None and self._shared_module is None:
            self._shared_module = llvm.parse_bitcode(bitcode)
        return module_for_linking(self)

    library_class._unserialize = classmethod(lean_unserialize)
    library_class._get_module_for_linking = lazy_module_for_linking


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim); a no-op elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the process already runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


LLVM_LIBRARY = "libllvmlite"  # llvmlite's shared library, LLVM inside


def release_library_pages(fragment: str = LLVM_LIBRARY) -> int:
    """Unmap the resident pages of the clean, read-only mappings of libraries whose path holds `fragment`;
    returns the bytes of the mappings released (0 where /proc is missing).

    The next touch maps them again from the page cache, as after the kernel evicts them under memory pressure.
    Mappings holding private copies (relocated data, `Anonymous` above 0 in smaps) are left alone: dropping
    those would lose the relocations.
    """
    from .kernels import pages  # noqa: PLC0415 (keeps `import engine.footprint` light)

    released, span = 0, None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                if _MAPPING.match(line):
                    fields = line.split()
                    mine = len(fields) >= 6 and fragment in fields[5] and "w" not in fields[1]
                    span = [int(x, 16) for x in fields[0].split("-")] if mine else None
                elif span is not None and line.startswith("Anonymous:"):
                    if int(line.split()[1]) == 0 and pages.release_range(span[0], span[1] - span[0]):
                        released += span[1] - span[0]
                    span = None
    except OSError:
        return 0
    return released


_after_loads_installed = False


def release_library_pages_after_kernel_loads() -> None:
    """From now on (once per process), release LLVM's pages and the free heap each time Numba lets go of its
    compiler lock, which it holds to compile a kernel or load one from the cache, and at no other time a kernel
    runs.

    The lock is re-entrant (a kernel's callees load inside its own load): only the outermost release counts.
    """
    global _after_loads_installed
    if _after_loads_installed:
        return
    import threading  # noqa: PLC0415

    from numba.core import event  # noqa: PLC0415

    lock, depth = threading.Lock(), [0]

    class AfterLoads(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            with lock:
                depth[0] += 1

        def on_end(self, ev: event.Event) -> None:
            with lock:
                depth[0] -= 1
                outermost = depth[0] == 0
            if outermost:
                release_library_pages()
                release_free_heap()  # what the load parsed and dropped (~10 MB for the one-call decode layer)

    event.register("numba:compiler_lock", AfterLoads())
    _after_loads_installed = True


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")  # an smaps line that starts a mapping
