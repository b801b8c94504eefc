"""The OpenMP wait policy is chosen from how busy the other cores are when the kernels load."""

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


def test_the_policy_is_set_before_openmp_starts() -> None:
    assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" or os.environ.get("GOMP_SPINCOUNT")
