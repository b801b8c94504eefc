"""chatapp's inference engine: GGUF models on Numba-compiled CPU kernels.

    from engine import load_model
    model = load_model(path, n_ctx=2048, threads=None)
    model.logits(ids)           # (len(ids), n_vocab), fresh context
    session = model.session()   # owns a KV cache of n_ctx positions
    session.eval(ids)           # (n_vocab,) logits of the last id
"""

from . import runtime  # noqa: F401  (selects Numba's threading layer before any kernel is imported)
from .errors import EngineError, ModelFileError, SettingsError, UnsupportedModelError
from .loader import load_model
from .model import ContextFullError, Model, Session

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
