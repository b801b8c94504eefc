"""The OpenMP wait policy is chosen from how busy the other cores are when load_model starts the kernels' threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import runtime


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_busy_process_elsewhere_counts() -> None:
    """A process spinning elsewhere shows as at least 0.6 of a core. Counted, not timed: the reading is taken
    until it shows (a loaded machine only adds to it); 50 tries of 0.05 s are a hang guard, not a figure."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        readings = []
        for _ in range(50):
            readings.append(runtime._busy_cores(0.05))
            if readings[-1] is not None and readings[-1] >= 0.6:
                break
    finally:
        spinner.kill()
        spinner.wait()
    assert readings[-1] is not None and readings[-1] >= 0.6, readings


def test_our_own_threads_do_not_count(monkeypatch) -> None:
    """The arithmetic on given /proc/stat and clock readings: 2 cores, 100 jiffies of which 0 idle over 1 s of
    wall time, 1.5 s of it our own threads' CPU time: others used 0.5 of a core. No timing is involved."""
    samples = iter([(1000, 500, 10.0, 100.0), (1100, 500, 11.5, 101.0)])
    monkeypatch.setattr(runtime, "_cpu_sample", lambda: next(samples))
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    assert runtime._busy_cores() == pytest.approx(0.5)


def test_an_unreadable_or_frozen_proc_stat_reads_as_unknown(monkeypatch) -> None:
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    samples = iter([(1000, 500, 0.0, 0.0), (1000, 500, 0.0, 1.0)])
    monkeypatch.setattr(runtime, "_cpu_sample", lambda: next(samples))
    assert runtime._busy_cores() is None

    def unreadable():
        raise OSError("no /proc/stat")

    monkeypatch.setattr(runtime, "_cpu_sample", unreadable)
    assert runtime._busy_cores() is None


@pytest.mark.parametrize(
    ("environ", "busy", "chosen"),
    [
        ({}, 0.1, {"GOMP_SPINCOUNT": runtime._SPIN_COUNT}),  # idle: spin briefly
        ({}, 0.9, {"OMP_WAIT_POLICY": "PASSIVE"}),  # another process busy: wait passively
        ({}, None, {"OMP_WAIT_POLICY": "PASSIVE"}),  # unknown: the safe choice
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 0.1, {}),  # the user's own setting wins
        ({"GOMP_SPINCOUNT": "0"}, 0.9, {}),
    ],
)
def test_the_policy_follows_the_other_cores_and_defers_to_the_user(environ, busy, chosen) -> None:
    assert runtime.wait_policy(environ, lambda: busy) == chosen


CHILD = """
import os, sys
import numba
import engine.kernels
from engine import load_model

def state():
    gomp = "libgomp" in open("/proc/self/maps").read()
    return [os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), gomp]

after_import = state()
launch, at_launch = numba.set_num_threads, []
def watched(n):  # the first parallel launch: libgomp loads here and reads the variables
    at_launch.append(state())
    return launch(n)
numba.set_num_threads = watched
load_model(sys.argv[1], n_ctx=64, compile_kernels=False)
print(*after_import, *at_launch[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_load_model_sets_the_policy_before_openmp_loads_and_importing_sets_nothing(smollm2_path) -> None:
    """libgomp reads the variables once, when it loads: importing the kernels neither chooses nor sets them (no
    /proc/stat sampling at import); load_model sets them before its first parallel launch."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(smollm2_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    policy, spin, gomp_loaded, policy_at_launch, spin_at_launch, gomp_at_launch = done.stdout.split()
    assert (policy, spin, gomp_loaded) == ("None", "None", "False"), "importing the kernels set the wait policy"
    assert (policy_at_launch, spin_at_launch) in (("PASSIVE", "None"), ("None", runtime._SPIN_COUNT)), done.stdout
    assert gomp_at_launch == "False", "OpenMP was loaded before the wait policy was chosen"
