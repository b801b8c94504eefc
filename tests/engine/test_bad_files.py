"""Untrusted model files: every defect is one clear error (ModelFileError), never a crash, hang or huge allocation."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineError, ModelFileError, load_model
from engine.gguf_file import open_gguf

from .synthetic import write_tiny_model


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_model(path, "llama", matrix_type=T.Q8_0)
    return path.read_bytes()


def write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def expect_clean_error(path: Path, match: str | None = None) -> None:
    with pytest.raises(ModelFileError, match=match):
        load_model(path, n_ctx=64)


def test_missing_path(tmp_path: Path) -> None:
    expect_clean_error(tmp_path / "nope.gguf", "no such file")


def test_directory(tmp_path: Path) -> None:
    expect_clean_error(tmp_path, "is a directory")


def test_empty_file(tmp_path: Path) -> None:
    expect_clean_error(write(tmp_path, b""), "empty file")


def test_wrong_magic(tmp_path: Path, tiny_bytes: bytes) -> None:
    expect_clean_error(write(tmp_path, b"GGML" + tiny_bytes[4:]), "not a GGUF file")


def test_wrong_version(tmp_path: Path, tiny_bytes: bytes) -> None:
    data = tiny_bytes[:4] + struct.pack("<I", 99) + tiny_bytes[8:]
    expect_clean_error(write(tmp_path, data), "version")


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05, 0.3, 0.7, 0.99])
def test_truncated_anywhere(tmp_path: Path, tiny_bytes: bytes, fraction: float) -> None:
    """Cut in the header, in the metadata, in the tensor infos or in the tensor data."""
    cut = max(1, int(len(tiny_bytes) * fraction))
    expect_clean_error(write(tmp_path, tiny_bytes[:cut]))


def test_absurd_tensor_count(tmp_path: Path, tiny_bytes: bytes) -> None:
    data = tiny_bytes[:8] + struct.pack("<Q", 2**40) + tiny_bytes[16:]
    expect_clean_error(write(tmp_path, data))


def test_absurd_metadata_count(tmp_path: Path, tiny_bytes: bytes) -> None:
    data = tiny_bytes[:16] + struct.pack("<Q", 2**62) + tiny_bytes[24:]
    expect_clean_error(write(tmp_path, data))


def test_absurd_string_length(tmp_path: Path, tiny_bytes: bytes) -> None:
    # The first metadata key's length prefix sits right after the 24-byte fixed header.
    data = tiny_bytes[:24] + struct.pack("<Q", 2**63) + tiny_bytes[32:]
    expect_clean_error(write(tmp_path, data))


def test_cli_reports_one_line_and_status_2(tmp_path: Path, tiny_bytes: bytes) -> None:
    path = write(tmp_path, tiny_bytes[: len(tiny_bytes) // 2])
    result = subprocess.run(
        [sys.executable, "-m", "chatapp", "run", "-m", str(path), "-p", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("chatapp: error: ") and str(path) in lines[-1]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_load_or_fail_cleanly(tmp_path: Path, tiny_bytes: bytes, data) -> None:
    """Random byte edits in the header region: a clean load, or our clean error; nothing else."""
    limit = min(len(tiny_bytes), 6000)  # the fixed header, metadata and tensor infos
    buf = bytearray(tiny_bytes)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, limit - 1))
        kind = data.draw(st.sampled_from(["byte", "u64", "cut"]))
        if kind == "byte":
            buf[at] = data.draw(st.integers(0, 255))
        elif kind == "u64":
            value = data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]))
            buf[at : at + 8] = struct.pack("<Q", value)
        else:
            del buf[at:]
            break
    path = write(tmp_path, bytes(buf), "fuzz.gguf")
    try:
        open_gguf(path)
        load_model(path, n_ctx=32)
    except EngineError:
        pass


@pytest.mark.parametrize(
    ("key", "value"),
    [("rope.freq_base", -1.0), ("rope.freq_base", float("nan")), ("attention.layer_norm_rms_epsilon", float("inf"))],
)
def test_nonsense_float_metadata_is_refused(tmp_path: Path, key: str, value: float) -> None:
    """A negative or non-finite RoPE base or norm epsilon would turn every logit into nan: refused at load."""
    from engine.config import ModelConfig

    tiny = write_tiny_model(tmp_path / "m.gguf", "llama")
    meta = dict(open_gguf(tiny.path).metadata)
    meta[f"llama.{key}"] = value
    with pytest.raises(ModelFileError, match=key.split(".")[-1].replace("layer_norm_rms_epsilon", "epsilon")):
        ModelConfig.from_metadata(meta, n_vocab=tiny.n_vocab)


@pytest.mark.parametrize("key", ["attention.key_length", "attention.head_count", "embedding_length"])
def test_a_zero_size_is_refused_before_anything_divides_by_it(tmp_path: Path, key: str) -> None:
    """A fuzzed header with key_length 0 once reached the attention scale's division (ZeroDivisionError)."""
    from engine.config import ModelConfig

    tiny = write_tiny_model(tmp_path / "m.gguf", "llama")
    meta = dict(open_gguf(tiny.path).metadata)
    meta[f"llama.{key}"] = 0
    with pytest.raises(ModelFileError):
        ModelConfig.from_metadata(meta, n_vocab=tiny.n_vocab)


def test_an_absurd_block_count_is_refused_without_building_per_layer_state(tmp_path: Path) -> None:
    """A fuzzed block_count of 2**40 once built a tuple of that many per-layer flags before the size check
    (the test run was killed for memory)."""
    from engine.config import ModelConfig

    tiny = write_tiny_model(tmp_path / "m.gguf", "llama")
    meta = dict(open_gguf(tiny.path).metadata)
    meta["llama.block_count"] = 2**40
    with pytest.raises(ModelFileError, match="n_layer"):
        ModelConfig.from_metadata(meta, n_vocab=tiny.n_vocab)
