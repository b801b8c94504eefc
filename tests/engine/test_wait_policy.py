"""The OpenMP wait policy is chosen from how busy the other cores are when load_model starts the kernels' threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from engine import kernels


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_busy_process_elsewhere_counts_and_our_own_threads_do_not() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        busy = kernels._busy_cores(0.3)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.6, busy

    # Our own spinning thread is not "others": a UI thread busy at start must not switch spinning off.
    stop = time.perf_counter() + 0.6
    def spin() -> None:
        while time.perf_counter() < stop:
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    own_only = kernels._busy_cores(0.3)
    thread.join()
    others_before = kernels._busy_cores(0.3)  # what else the machine was doing, measured the same way
    assert own_only is not None and others_before is not None
    assert own_only < others_before + 0.5, (own_only, others_before)


@pytest.mark.parametrize(
    ("environ", "busy", "chosen"),
    [
        ({}, 0.1, {"GOMP_SPINCOUNT": kernels._SPIN_COUNT}),  # idle: spin briefly
        ({}, 0.9, {"OMP_WAIT_POLICY": "PASSIVE"}),  # another process busy: wait passively
        ({}, None, {"OMP_WAIT_POLICY": "PASSIVE"}),  # unknown: the safe choice
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 0.1, {}),  # the user's own setting wins
        ({"GOMP_SPINCOUNT": "0"}, 0.9, {}),
    ],
)
def test_the_policy_follows_the_other_cores_and_defers_to_the_user(environ, busy, chosen) -> None:
    assert kernels.wait_policy(environ, lambda: busy) == chosen


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
    assert (policy_at_launch, spin_at_launch) in (("PASSIVE", "None"), ("None", kernels._SPIN_COUNT)), done.stdout
    assert gomp_at_launch == "False", "OpenMP was loaded before the wait policy was chosen"
