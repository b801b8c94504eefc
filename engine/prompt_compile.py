"""First start: the prompt path's kernels compiled in a second process, beside the one-token path's here.

Numba compiles on one thread, behind a process-wide lock, so a first start used one core for all of its
compiling. The one-token path (the fused decode layer) and the prompt path (tiled matmul, causal attention)
share few kernels, and the compiled kernels land in one on-disk cache: a second process that runs the prompt
path while this one runs the one-token path halves the wait on two cores. When it is done, this process loads
its kernels from the cache. If it fails or is killed, this process compiles them itself, as it would alone.

    python -m engine.prompt_compile MODEL.gguf

The helper opens the same file and packs its weights, so it runs only where that second copy fits easily.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .kernels import SHORT_PASS

if TYPE_CHECKING:
    from .model import Model

# The helper's weights (a second packed copy) may take at most this share of the memory free at start.
_MAX_MEMORY_SHARE = 0.25
_WAIT_S = 1200.0  # a helper still compiling after this is stuck: stop waiting, compile here
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # where `engine` imports from, installed or not


def _available_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return 0


def start(path: str | os.PathLike[str]) -> subprocess.Popen | None:
    """Start the helper on model `path`, or None where it would not pay: one core, or too big a file."""
    if (os.cpu_count() or 1) < 2 or Path(path).stat().st_size > _MAX_MEMORY_SHARE * _available_memory():
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "engine.prompt_compile", os.fspath(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.getenv("PYTHONPATH")]))},
        )
    except OSError:
        return None


def finish(helper: subprocess.Popen | None) -> None:
    """Wait for the helper (its kernels are then in the cache); stop one that is stuck."""
    if helper is None:
        return
    try:
        helper.wait(timeout=_WAIT_S)
    except subprocess.TimeoutExpired:
        stop(helper)


def stop(helper: subprocess.Popen | None) -> None:
    if helper is not None and helper.poll() is None:
        helper.kill()
        helper.wait()


def run_prompt_paths(model: Model) -> None:
    """Run a short pass (a speculative check's: one-token kernels, attention row by row) and, where the context
    holds one, a prompt's (tiles, blocked attention). Besides compiling or loading their kernels, the second
    sets up what a process's first prompt would otherwise pay for inside its parallel loops: SmolLM2's first
    256-token prompt took 165-207 ms after a load that ran the short pass alone, 147-177 with this (8 fresh
    processes each, alternating; 137-159 ms for a second prompt in either)."""
    model.logits([0, 0])
    if model.n_ctx > SHORT_PASS:  # the last logits only: all of Gemma 3's would add 19 MB to the peak
        model.session().eval([0] * (SHORT_PASS + 1))


def main(argv: list[str]) -> int:
    from . import load_model  # noqa: PLC0415 (the helper process only)

    model = load_model(argv[0], n_ctx=2 * SHORT_PASS, threads=1, compile_kernels=False)
    run_prompt_paths(model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
