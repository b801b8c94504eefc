"""llama-cpp-python's OpenAI-compatible server, a real server we did not write, for testing the remote backend.

It is never a project dependency: it lives in its own virtual environment in the user cache,
`<user cache dir>/llama-cpp-python-0.3.36-server/venv`, built from source on first use and reused after. The
built wheel is kept beside it (`wheels/`), so a broken or deleted venv is remade without compiling again.
`CMAKE_ARGS="-DGGML_NATIVE=OFF"` makes a portable build: a cache carried to another CPU still runs there.

    python -m tests.app.llama_cpp_server            # build it now (about 10 minutes on 2 cores), print its python
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from chatapp import paths

VERSION = "0.3.36"
# Taken at import, before a test points CHATAPP_CACHE_DIR elsewhere: the build stays in the real cache.
HOME = paths.user_cache_dir() / f"llama-cpp-python-{VERSION}-server"
BUILD_TIMEOUT_S = 3600
START_TIMEOUT_S = 300


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _works(python: Path) -> bool:
    check = f"import llama_cpp, llama_cpp.server.app; assert llama_cpp.__version__ == {VERSION!r}"
    return python.is_file() and subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def _run(cmd: list[str | Path], log: Path, env: dict[str, str] | None = None) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))}... failed ({done.returncode}); log {log}:\n{tail}")


def ensure_server_python(home: Path = HOME) -> Path:
    """The interpreter of the venv holding llama-cpp-python[server]=={VERSION}, building it when missing."""
    venv = home / "venv"
    if (venv / ".complete").is_file() and _works(_python(venv)):
        return _python(venv)
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if (venv / ".complete").is_file() and _works(_python(venv)):
            return _python(venv)
        log = home / "build.log"
        wheels = home / "wheels"
        if not list(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl")):
            env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=OFF", "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())}
            # --no-cache-dir: pip's own wheel cache does not know CMAKE_ARGS, and could hand back a native build.
            _run(
                [sys.executable, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "-w", wheels,
                 f"llama-cpp-python=={VERSION}"],
                log,
                env,
            )
        if venv.exists():
            subprocess.run(["rm", "-rf", str(venv)], check=True)
        _run([sys.executable, "-m", "venv", venv], log)
        _run(
            [_python(venv), "-m", "pip", "install", "--quiet", "--find-links", wheels,
             f"llama-cpp-python[server]=={VERSION}"],
            log,
        )
        if not _works(_python(venv)):
            raise RuntimeError(f"llama-cpp-python {VERSION} installed in {venv} but does not import; see {log}")
        (venv / ".complete").write_text(VERSION)
    return _python(venv)


@dataclass
class LlamaServer:
    url: str  # http://127.0.0.1:PORT, without /v1
    model: str  # the id it serves (--model_alias)
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def llama_server(
    python: Path, model: Path, log: Path, *, alias: str = "smollm2", n_ctx: int = 2048, threads: int = 2,
    extra: tuple[str, ...] = (),
) -> Iterator[LlamaServer]:
    """llama-cpp-python's server on `model`, on 127.0.0.1 only, until the block ends."""
    try:
        import httpx2 as httpx  # what this openai release is built on
    except ImportError:  # older openai releases use httpx
        import httpx

    port = _free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [python, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias, "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--verbose", "False", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = log.read_text(errors="replace")
            assert process.poll() is None, f"llama-cpp-python's server exited with {process.returncode}:\n{text}"
            assert time.monotonic() < deadline, f"llama-cpp-python's server not ready in {START_TIMEOUT_S} s:\n{text}"
            if re.search(r"Uvicorn running on", text):
                try:
                    if httpx.get(f"{url}/v1/models", timeout=10).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        yield LlamaServer(url, alias, process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    print(ensure_server_python())
