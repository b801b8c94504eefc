"""chatapp's inference engine: GGUF models on Numba-compiled CPU kernels.

    from engine import load_model
    model = load_model(path, n_ctx=2048, threads=None)
    model.logits(ids)           # (len(ids), n_vocab), fresh context
    session = model.session()   # owns a KV cache of n_ctx positions
    session.eval(ids)           # (n_vocab,) logits of the last id

The heavy parts (Numba, the kernels, the model) load on first use, so `engine.events` and `engine.sampling`
stay cheap to import for the app. Importing sets nothing: load_model makes the process-wide choices (threads,
the OpenMP wait policy, Numba's kernel cache and threading layer: engine.runtime.start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import EngineError, ModelFileError, SettingsError, UnsupportedModelError

if TYPE_CHECKING:
    from .loader import load_model
    from .model import ContextFullError, Model, Session

_LAZY = {"load_model": "loader", "ContextFullError": "model", "Model": "model", "Session": "model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "ContextFullError",
    "EngineError",
    "Model",
    "ModelFileError",
    "Session",
    "SettingsError",
    "UnsupportedModelError",
    "load_model",
]
