"""Process-wide choices: which threading layer runs `prange`, how many threads, the OpenMP wait policy, the
kernel cache folder, and the instruction set the block kernels are emitted for.

None is made at import: `start` (called by load_model) makes them all and returns them as a `Runtime`, and
`configure_numba` (called before the first kernel module loads) gives Numba its cache folder and threading
layer through `numba.config` rather than the environment. Importing `engine` sets no variable and probes nothing.

Numba's default `workqueue` layer costs 135-245 µs per parallel launch here against 6-45 µs for OpenMP,
and a token makes hundreds of launches, so OpenMP is preferred whenever it loads.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .errors import SettingsError

# The block kernels' instruction sets (engine/kernels/simd.py), best first.
AVX512_VNNI = "avx512vnni"  # 512-bit vpdpbusd (and 512-bit pmaddubsw for the formats without a quad kernel)
AVX_VNNI = "avxvnni"  # 256-bit vpdpbusd, VEX-encoded (CPUs with VNNI but no AVX-512)
AVX512_BW = "avx512bw"  # 512-bit pmaddubsw
AVX2 = "avx2"  # 256-bit pmaddubsw
PORTABLE = "portable"  # plain LLVM vector IR: whatever the target has


def kernel_isa(features: Iterable[str]) -> str:
    """The best instruction set of the block kernels that a CPU with these LLVM features (names without the
    leading '+', as in NUMBA_CPU_FEATURES) runs."""
    return runnable_isas(features)[0]


# Names a lesser kernel set than the CPU's best, so that benchmarks and tests compare sets on one CPU.
KERNEL_SET_VARIABLE = "CHATAPP_KERNEL_SET"


def runnable_isas(features: Iterable[str]) -> list[str]:
    """The block kernels' instruction sets a CPU with these LLVM features runs, best first. The `avxvnni` set's
    256-bit vpdpbusd also runs on AVX-512 VNNI with VL (LLVM encodes it as EVEX there: a Zen 4 has no AVX-VNNI)."""
    f = set(features)
    avx512 = {"avx512f", "avx512bw"} <= f
    found = [
        (AVX512_VNNI, avx512 and "avx512vnni" in f),
        (AVX_VNNI, "avx2" in f and ("avxvnni" in f or {"avx512vnni", "avx512vl"} <= f)),
        (AVX512_BW, avx512),
        (AVX2, "avx2" in f),
        (PORTABLE, True),
    ]
    return [isa for isa, runs in found if runs]


def chosen_isa(environ: Mapping[str, str], features: Iterable[str]) -> str:
    """The kernel set to emit: the CPU's best (`kernel_isa`), or the one CHATAPP_KERNEL_SET names if it runs here."""
    wanted = environ.get(KERNEL_SET_VARIABLE)
    if not wanted:
        return kernel_isa(features)
    runs = runnable_isas(features)
    if wanted not in runs:
        raise SettingsError(f"{KERNEL_SET_VARIABLE}={wanted!r}: this CPU runs the kernel sets {', '.join(runs)}")
    return wanted


def compile_target(environ: Mapping[str, str]) -> tuple[str, frozenset[str]]:
    """The CPU name and LLVM features that Numba will compile for, found as Numba finds them (before it loads):
    NUMBA_CPU_NAME and NUMBA_CPU_FEATURES when set, else the host's, without AVX under NUMBA_ENABLE_AVX=0."""
    import llvmlite.binding as llvm

    name = environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
    flat = environ.get("NUMBA_CPU_FEATURES")
    if flat is None and name.lower() == "generic":
        flat = ""
    if flat is None:
        try:
            host = llvm.get_host_cpu_features()
        except RuntimeError:
            host = {}
        if environ.get("NUMBA_ENABLE_AVX") == "0":
            host = {k: v and not k.startswith("avx") for k, v in host.items()}
        return name, frozenset(k for k, v in host.items() if v)
    return name, frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))


@cache
def kernel_cache_dir() -> Path:
    """This process's kernel folder (`_kernel_cache_dir` for its environment at first use)."""
    return _kernel_cache_dir()


def _kernel_cache_dir() -> Path:
    """Numba's on-disk cache, in a folder named after a hash of every kernel source file (engine/kernels and the
    format modules, engine/formats) and of the CPU the kernels are compiled for, led by its instruction set's
    name (`avx512vnni-3f2a...`).

    Numba keys a cached function on its own file's timestamp only, so an edit to an inlined helper in another
    module would leave a stale kernel in use. A new hash of the sources means a new, empty folder. Numba checks
    the CPU name and features of each cached kernel too; the folder keeps each CPU's kernels apart besides,
    so a cache folder shared between machines never hands one machine's instructions to another.

    The hash covers where the sources are installed as well: Numba files each kernel under its source file's
    path, so a second installation of the same sources (another virtual environment) finds none of the first's
    kernels, and a folder shared with it would make `kernels_compiled()` take its first start for a later one
    (compiling without the second process: SmolLM2's first start of the app took 45 s instead of 28 s).
    """
    name, features = compile_target(os.environ)
    isa = chosen_isa(os.environ, features)
    h = hashlib.sha256()
    root = Path(__file__).parent
    for source in sorted([*(root / "kernels").glob("*.py"), *(root / "formats").glob("*.py")]):  # what is compiled
        h.update(source.relative_to(root).as_posix().encode())
        h.update(source.read_bytes())
    h.update(str(root.resolve()).encode())
    h.update(repr((name, sorted(features), isa)).encode())
    base = os.environ.get("CHATAPP_CACHE_DIR")
    if not base:
        import platformdirs

        base = platformdirs.user_cache_dir("chatapp")
    return Path(base) / "numba" / f"{isa}-{h.hexdigest()[:16]}"


THREADING_LAYERS = ["omp", "tbb", "workqueue"]  # best first; NUMBA_THREADING_LAYER_PRIORITY overrides it
_numba_configured = False


def configure_numba() -> None:
    """Give Numba the kernel cache folder and the threading layers to try, once per process, through
    `numba.config` (the environment is left alone).

    Both must be set before they are read: the folder when a kernel is decorated (@njit(cache=True) binds its
    cache then, so engine.kernels and engine.formats call this before their kernel modules load), the layers
    at the first parallel launch. Numba re-reads its NUMBA_* variables only when one of them changes, so
    values set here stay. A user's NUMBA_CACHE_DIR is replaced, as the folder must be keyed on the sources;
    a user's NUMBA_THREADING_LAYER_PRIORITY wins.
    """
    global _numba_configured
    if _numba_configured:
        return
    _numba_configured = True
    from numba.core import config

    config.CACHE_DIR = str(kernel_cache_dir())  # type: ignore[attr-defined]  # set from the environment at import
    if "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
        config.THREADING_LAYER_PRIORITY = list(THREADING_LAYERS)  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    if name == "KERNEL_CACHE_DIR":  # kept as a name: computed at first use, not at import
        return kernel_cache_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A kernel folder no start has used for this long is removed: its sources have since changed (an upgrade, an
# edit) or its installation is gone, and each holds tens of MB.
KERNEL_FOLDER_MAX_AGE_S = 30 * 24 * 3600
_KERNEL_FOLDER = re.compile(r"[a-z0-9]+-[0-9a-f]{16}")  # `_kernel_cache_dir`'s names


def prune_kernel_folders(folder: Path | None = None, max_age_s: float = KERNEL_FOLDER_MAX_AGE_S) -> list[Path]:
    """Mark `folder` (this process's kernel folder) as used now, and remove the kernel folders beside it that no
    start has marked for `max_age_s`. Returns those removed. Best effort: a folder that cannot be read or
    removed stays."""
    folder = folder or kernel_cache_dir()
    with suppress(OSError):
        if folder.is_dir():
            os.utime(folder)
    removed = []
    cutoff = time.time() - max_age_s
    with suppress(OSError):
        for other in folder.parent.iterdir():
            if other == folder or not _KERNEL_FOLDER.fullmatch(other.name) or not other.is_dir():
                continue
            if other.stat().st_mtime < cutoff:
                shutil.rmtree(other, ignore_errors=True)
                removed.append(other)
    return removed


def kernels_compiled() -> bool:
    """Whether the kernel cache already holds compiled code (a start without compiling)."""
    folder = kernel_cache_dir()
    return folder.is_dir() and any(folder.rglob("*.nbc"))


@contextmanager
def compile_progress(report: Callable[[int, float], None], every_s: float = 5.0) -> Iterator[Callable[[], int]]:
    """Count the kernels Numba compiles inside the block (loads from the cache are not compiles), calling
    report(count, seconds) at most every `every_s` seconds while it compiles. Yields a function for the count.

    A first start compiles for minutes; a count that moves says it is working, where a message alone does not.
    """
    from numba.core import event

    t0 = time.perf_counter()
    last = [t0]

    class Counter(event.Listener):
        count = 0

        def on_start(self, ev: event.Event) -> None:
            pass

        def on_end(self, ev: event.Event) -> None:
            self.count += 1
            now = time.perf_counter()
            if now - last[0] >= every_s:
                last[0] = now
                report(self.count, now - t0)

    counter = Counter()
    with event.install_listener("numba:compile", counter):
        yield lambda: counter.count


# Whether OpenMP threads spin between parallel launches, read by libgomp when it loads (at the first launch).
# A token makes ~90 launches a few microseconds apart: on an idle machine, threads that spin a little catch the
# next launch at once (SmolLM2 decode, 2 threads: 95-115 tok/s with GOMP_SPINCOUNT=50000, 73-80 with passive
# waiting); on a busy one, spinning threads take the core from the thread with work (with one other process
# busy: 34 tok/s spinning, 62 passive). So: spin briefly when the other cores are idle at start, else wait
# passively. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
_SPIN_COUNT = "50000"


def _cpu_sample() -> tuple[int, int, float, float]:
    """(all CPU jiffies, idle + iowait jiffies, this process's CPU seconds, wall seconds), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle, time.process_time(), time.perf_counter()


def _busy_cores(interval: float = 0.05) -> float | None:
    """Cores' worth of CPU time other processes used over `interval` seconds (Linux /proc/stat), or None."""
    try:
        total0, idle0, own0, wall0 = _cpu_sample()
        time.sleep(interval)
        total1, idle1, own1, wall1 = _cpu_sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    busy = (os.cpu_count() or 1) * (1.0 - (idle1 - idle0) / (total1 - total0))
    return busy - (own1 - own0) / (wall1 - wall0)  # this process's own threads (a UI, say) do not count


def wait_policy(environ: Mapping[str, str], busy_cores: Callable[[], float | None]) -> dict[str, str]:
    """The OpenMP variables to set: none when the user set either, else a brief spin when the other cores are
    idle (`busy_cores()` below half a core), else passive waiting (busy, or unknown)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    busy = busy_cores()
    if busy is not None and busy < 0.5:
        return {"GOMP_SPINCOUNT": _SPIN_COUNT}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


_wait_policy_chosen = False


def set_wait_policy() -> dict[str, str]:
    """Choose the OpenMP wait policy (`wait_policy`: it samples the other cores' load for 50 ms) and
    put it in the environment, once per process. Returns what it set.

    libgomp reads the variables once, when it loads at the first parallel launch: `configure_threads` calls this
    before its `numba.set_num_threads`, which launches the threads.
    """
    global _wait_policy_chosen
    if _wait_policy_chosen:
        return {}
    _wait_policy_chosen = True
    chosen = wait_policy(os.environ, _busy_cores)
    os.environ.update(chosen)
    return chosen


def configure_threads(threads: int | None) -> int:
    """Use `threads` cores for the kernels (None or 0: all of them), after setting the OpenMP wait policy
    (`set_wait_policy`). Returns the number in force.

    NumPy's BLAS is held to one thread: its workers spin after each call and take the cores from the Numba
    threads that run next (measured here with the other core busy: a (768, 64) @ (64, 256) product took 17 ms
    on two OpenBLAS threads, 1.7 ms on one). The kernels own the parallelism.
    """
    configure_numba()
    import numba
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
    set_wait_policy()  # before the first parallel launch below loads libgomp

    available = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # set from the environment at import
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


@dataclass(frozen=True)
class Runtime:
    """The process-wide choices `start` made (for a model's report and for tests)."""

    threads: int  # kernel threads in force
    wait_policy: dict[str, str]  # the OpenMP variables this start set; {} when the user's or an earlier start's hold
    cache_dir: Path  # Numba's kernel folder
    isa: str  # the block kernels' instruction set (`chosen_isa` for the compile target)


def start(threads: int | None) -> Runtime:
    """Make the process-wide choices before a model loads: Numba's cache folder and threading layer, the OpenMP
    wait policy, `threads` kernel threads (None or 0: all cores), and the kernel set for the compile target.
    Later calls change only the thread count."""
    configure_numba()
    policy = set_wait_policy()
    n = configure_threads(threads)
    return Runtime(n, policy, kernel_cache_dir(), chosen_isa(os.environ, compile_target(os.environ)[1]))
