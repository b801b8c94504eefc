"""The kernel layer: the only place the forward pass touches quantized weights.

It is deliberately narrow -- `matvec`, `matmul`, `embedding_rows` over a `WeightMatrix`, `causal_attention`
over the float16 cache, `swiglu` -- so that another backend can provide the same few functions (engine/gpu runs
the layer on CuPy arrays). The layer's CPU executors sit on them: prompt_ops.py (a pass of several tokens) and
one_token.py (one token through a whole layer in one compiled call, decode.py).

Products of the quantized types (PACKED_TYPES: all of them) run on a repacked copy of the weight (packed.py, with
the SIMD block kernels of simd.py), built on the weight's first product and kept instead of the file's pages,
which are released. They quantize x to int8 per 32 values first, as llama.cpp does, in decode (`matvec`,
`matvec_many`) and in prefill (`matmul`) alike; `exact=True` selects the float32 path, for reference checks.
F16 and BF16 weights run floats.py on their 16-bit values. cpu.py keeps per-row float kernels of every type, for
reference and for the float32 path. What each type is (layout, decoders, packing, emitters) comes from its module
in engine/formats; nothing here names a quantized type.

Importing this package loads none of it: a name's first use imports the module that holds it (the operations
are in ops.py) after `engine.runtime.configure_numba` has given Numba its kernel cache folder and threading
layer, so `import engine.kernels` costs no NumPy, no Numba and no probe of the CPU.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the names `__getattr__` hands out
    from .ops import *  # noqa: F403
    from .ops import BLOCK_CODES, FLOAT_TYPES, PACKED_TYPES, PARALLEL_MIN_BYTES, SUPPORTED_TYPES  # noqa: F401

# The submodules (loaded as any submodule, but only after Numba is configured: see configure_numba).
_SUBMODULES = frozenset(
    {"attention", "cpu", "decode", "floats", "memory", "one_token", "ops", "packed", "pages", "prompt_ops", "scratch",
     "simd"}
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from ..runtime import configure_numba

    configure_numba()  # before the first @njit(cache=True) is decorated: it files its kernels where this says
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    ops = importlib.import_module(f"{__name__}.ops")
    try:
        value = getattr(ops, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    if not name.startswith("_"):  # private ones may be rebound in ops (a flag, a test's patch): read them there
        globals()[name] = value  # later lookups skip this function
    return value
