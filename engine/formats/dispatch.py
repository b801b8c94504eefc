"""Dispatch on a format's type id inside compiled code, generated from the registry.

Numba cannot index a table of functions by a runtime value, so `by_code` writes the table out as the chain
`if code == 2: k2(...) elif code == 3: k3(...) ...` and compiles it inline: its callers (cached drivers) see one
comparison chain, as hand-written, and each branch is the format's own kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numba import njit

from .spec import Kernel


def by_code(kernels: Mapping[int, Kernel], params: str, default: str | None = None) -> Kernel:
    """f(code, <params>) -> kernels[code](<params>), an inline Numba function.

    params: the kernels' common parameters, as source ("row, f16, out"). default: an expression returned when
    no code matches (then each branch returns its kernel's result); None: the kernels return nothing and an
    unknown code does nothing.
    """
    ret = "return " if default is not None else ""
    lines = [f"def dispatch(code, {params}):"]
    for i, code in enumerate(kernels):
        lines += [f"    {'el' if i else ''}if code == {int(code)}:", f"        {ret}k{int(code)}({params})"]
    lines.append(f"    return {default}" if default is not None else "    return")
    namespace = {"np": np} | {f"k{int(c)}": k for c, k in kernels.items()}
    exec(compile("\n".join(lines), f"<dispatch on code: {params}>", "exec"), namespace)
    return njit(inline="always", nogil=True)(namespace["dispatch"])
