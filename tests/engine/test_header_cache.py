"""The parsed-header cache: the same result as a fresh parse, and never a hit for a changed file."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from engine import header_cache
from engine.gguf_file import open_gguf

from .synthetic import write_tiny_model


def test_cached_parse_equals_fresh_parse(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    tiny = write_tiny_model(tmp_path / "m.gguf", "qwen2", matrix_type=T.Q8_0)
    assert header_cache.load(tiny.path) is None
    fresh = open_gguf(tiny.path)  # parses and stores
    assert header_cache.load(tiny.path) is not None
    cached = open_gguf(tiny.path)
    assert cached.metadata == fresh.metadata
    assert cached.tensors.keys() == fresh.tensors.keys()
    for name, t in fresh.tensors.items():
        c = cached.tensors[name]
        assert (c.ggml_type, c.shape) == (t.ggml_type, t.shape)
        np.testing.assert_array_equal(c.data.view(np.uint8).reshape(-1), t.data.view(np.uint8).reshape(-1))


def test_changed_header_misses(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    tiny = write_tiny_model(tmp_path / "m.gguf", "llama")
    open_gguf(tiny.path)
    data = bytearray(tiny.path.read_bytes())
    at = data.find(b"llama.block_count")
    assert at > 0
    data[at + 6] = ord("X")  # same size, different header
    tiny.path.write_bytes(bytes(data))
    assert header_cache.load(tiny.path) is None
