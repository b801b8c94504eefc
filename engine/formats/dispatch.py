"""Dispatch on a weight's format inside compiled code, resolved when a kernel is compiled, generated from the
registry.

A kernel is passed its weight's format as a *tag* (`tag(code)`: an empty array whose record dtype names the
format), not as the type id. The tag's type differs per format, so Numba compiles each kernel once per format
it is called with, and `by_format` picks that format's kernel while typing: a compiled kernel holds the one
format it runs. A kernel that took the type id as a number held every format's code behind a comparison chain,
and a first start compiled all ten formats' SIMD kernels into every driver (SmolLM2, which has two formats:
64.5 s of compiling on one core so, 38.4 s with tags). Passing a tag costs about what an int does (0.39 against
0.22 µs a call).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import numpy as np
from numba import from_dtype, types
from numba.extending import overload

from .spec import Kernel


@cache
def tag(code: int) -> np.ndarray:
    """Format `code`'s tag: what the compiled kernels take in place of its type id."""
    return np.empty(0, dtype=np.dtype([(f"ggml_type_{int(code)}", np.uint8)]))


def _code_of(fmt: types.Type) -> int | None:
    """The type id a tag's Numba type stands for, or None for anything else."""
    dtype = getattr(fmt, "dtype", None)
    if not isinstance(fmt, types.Array) or not isinstance(dtype, types.Record) or len(dtype.fields) != 1:
        return None
    (name,) = dtype.fields
    code = name.removeprefix("ggml_type_")
    return int(code) if code.isdigit() and from_dtype(tag(int(code)).dtype) == dtype else None


def by_format(kernels: Mapping[int, Kernel], params: str) -> Kernel:
    """f(fmt, <params>) -> kernels[code](<params>) for the format whose tag is fmt; inlined where called.

    params: the kernels' common parameters, as source ("row, f16, out"). A tag of a format without a kernel
    here is a typing error, at compile time.
    """
    # Numba's @overload wants the stub, the typing function and each implementation to have the same parameters.
    namespace: dict = {}
    exec(f"def dispatch(fmt, {params}):\n    raise NotImplementedError('compiled code only')", namespace)
    impls = {}
    for code, kernel in kernels.items():
        exec(f"def impl(fmt, {params}):\n    return kernel({params})", scope := {"kernel": kernel})
        impls[int(code)] = scope["impl"]
    pick = {"impls": impls, "code_of": _code_of}
    exec(f"def typer(fmt, {params}):\n    return impls.get(code_of(fmt))", pick)
    overload(namespace["dispatch"], inline="always")(pick["typer"])
    return namespace["dispatch"]
