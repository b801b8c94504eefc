"""Helpers shared by the reliability tests: the repository root, a child-process environment, memory readings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def child_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a `python -m chatapp` child: its own config and data dirs under `tmp_path`.

    The cache dir is left alone on purpose: it holds the real models and Numba's compiled kernels, and a fresh
    one would make the child compile every kernel again (minutes).
    """
    env = dict(os.environ)
    for kind in ("config", "data"):
        path = tmp_path / f"child-{kind}"
        path.mkdir(exist_ok=True)
        env[f"CHATAPP_{kind.upper()}_DIR"] = str(path)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def live_rss_mb() -> float:
    """RSS after giving the C allocator's free memory back (glibc's malloc_trim), so that a reading counts the
    memory in use, not what malloc keeps cached: the kernels' worker threads allocate transient buffers in
    arenas of their own, whose retained size follows the largest evaluation seen so far."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the plain reading
    return rss_mb()


def rss_mb() -> float:
    """This process's resident set size (VmRSS) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line in /proc/self/status")


def pilot_waits_briefly(monkeypatch) -> None:
    """Make Pilot's "wait until the process is idle" give up after 50 ms instead of 1 s.

    After every key, Pilot waits for the process's CPU time to stop advancing. With the real engine computing
    in the same process that never happens during a reply, so each key would cost a full second and a long
    Pilot session mostly sleeps. The app itself is untouched.
    """
    import textual._wait
    import textual.app
    import textual.pilot

    real = textual._wait.wait_for_idle

    async def wait_for_idle(min_sleep: float = textual._wait.SLEEP_GRANULARITY, max_sleep: float = 1) -> None:
        await real(min_sleep, min(max_sleep, 0.05))

    monkeypatch.setattr(textual.app, "wait_for_idle", wait_for_idle)
    monkeypatch.setattr(textual.pilot, "wait_for_idle", wait_for_idle)
