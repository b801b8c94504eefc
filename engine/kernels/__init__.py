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
reference and for the float32 path. What each type is (layout, dequantizers, packing, emitters) comes from its module
in engine/formats; nothing here names a quantized type.

The package's names come from four modules by job: weight_matrix.py (the weight wrapper: `WeightMatrix`,
`PackedWeight`, the type sets), products.py (`matvec`, `matvec_many`, `matmul`, `float_products`, BLAS
discovery), rows.py (embedding rows, norms, GELU, RoPE into the cache, SwiGLU, GeGLU) and ops.py (the attention
wrapper, `causal_attention`).

Importing this package loads none of it: a name's first use imports the module that holds it after
`engine.runtime.configure_numba` has given Numba its kernel cache folder and threading layer, so
`import engine.kernels` costs no NumPy, no Numba and no probe of the CPU.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the names `__getattr__` hands out
    from .ops import *  # noqa: F403
    from .products import *  # noqa: F403
    from .products import PARALLEL_MIN_BYTES  # noqa: F401
    from .rows import *  # noqa: F403
    from .scratch import Scratch  # noqa: F401
    from .weight_matrix import *  # noqa: F403
    from .weight_matrix import BLOCK_CODES, FLOAT_TYPES, PACKED_TYPES, SUPPORTED_TYPES  # noqa: F401

# The submodules (loaded as any submodule, but only after Numba is configured: see configure_numba).
_SUBMODULES = frozenset(
    {"attention", "attention_tiles", "cpu", "decode", "experts", "floats", "memory", "one_token", "ops", "packed",
     "pages", "products", "prompt_ops", "rows", "scratch", "simd", "weight_matrix"}
)  # fmt: skip
# Where the package's own names live, searched in this order.
_FRONT = ("weight_matrix", "products", "rows", "ops", "scratch")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from ..runtime import configure_numba

    configure_numba()  # before the first @njit(cache=True) is decorated: it files its kernels where this says
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if not name.startswith("_"):  # private ones may be rebound in their module (a flag, a test's patch)
        for module in _FRONT:
            holder = importlib.import_module(f"{__name__}.{module}")
            if name in vars(holder):
                value = vars(holder)[name]
                globals()[name] = value  # later lookups skip this function
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
