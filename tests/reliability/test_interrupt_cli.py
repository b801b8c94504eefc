"""Ctrl+C during `chatapp run`: the reply stops, the timing summary is printed, exit status 130, no traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.reliability.support import PYTHON, REPO, child_env

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a faraway kingdom,"


def _pump(stream, into: bytearray) -> None:
    """Copy a child's pipe into `into` as the bytes arrive."""
    while chunk := stream.read1(4096):
        into.extend(chunk)


def test_sigint_mid_generation_prints_the_summary_and_exits_130(smollm2_path: Path, tmp_path: Path) -> None:
    child = subprocess.Popen(
        [PYTHON, "-m", "chatapp", "run", "-m", str(smollm2_path), "-p", PROMPT, "-n", "400", "--seed", "1"],
        cwd=REPO,
        env=child_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = bytearray(), bytearray()
    readers = [
        threading.Thread(target=_pump, args=(child.stdout, out), daemon=True),
        threading.Thread(target=_pump, args=(child.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        # The prompt is echoed first; the generated text follows it.
        deadline = time.monotonic() + 300
        while len(out) < len(PROMPT.encode()) + 8:
            assert child.poll() is None, f"chatapp run ended before generating:\n{err.decode(errors='replace')}"
            assert time.monotonic() < deadline, "no tokens on stdout within 300 s"
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        status = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    for reader in readers:
        reader.join(timeout=10)
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")

    assert "Traceback" not in stderr + stdout, stderr
    assert status == 130, f"exit status {status}\n{stderr}"
    assert stdout.startswith(PROMPT) and len(stdout) > len(PROMPT)
    assert "prompt eval time" in stderr, stderr
    runs = re.search(r"^\s*eval time = .* / +(\d+) runs", stderr, re.MULTILINE)
    assert runs, stderr
    assert int(runs.group(1)) < 399, "the generation was not cut short"
    assert re.search(r"^\s*stop = cancelled;", stderr, re.MULTILINE), stderr
