"""One module per ggml type, and the registry built from them.

Each module (q4_k.py, f16.py, ...) holds everything the engine knows about its type, and declares it in its
`FORMAT` record (spec.py): the layout (sizes from gguf.GGML_QUANT_SIZES), the reference dequantizer and dot product,
the packing spec, the SIMD emitters per instruction family, and the array-module dequantizer the GPU runs. The
kernels never name a type: each is compiled for the format it is called with, the format's kernel picked from
this registry (dispatch.py), the way gguf-py's quants.py and ggml's type_traits pick theirs. Adding a type is
a module here and a line in `_MODULES`; adding an instruction set is an emitter beside the others in each module
that gets one (emit.py's KernelSet says which the set uses).

Shared toolkits: fields.py (reading block fields in Numba), emit.py (emitting LLVM vector IR), arrays.py (array-
module helpers), dispatch.py (the format's kernel picked when a kernel is compiled).
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from ..runtime import configure_numba

configure_numba()  # before the format modules' @njit(cache=True): their kernels go to the kernel cache folder

from . import bf16, f16, f32, iq4_nl, iq4_xs, mxfp4, q2_k, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0  # noqa: E402
from .spec import Format, Packing  # noqa: E402

__all__ = ["FORMATS", "QUANTIZED", "Format", "Packing", "bf16", "f16", "f32"]

_MODULES = (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4)

# Every type the engine runs, in ggml's type-id order.
FORMATS: dict[T, Format] = {m.FORMAT.type: m.FORMAT for m in sorted(_MODULES, key=lambda m: m.FORMAT.code)}
# The block formats: quantized, with CPU kernels over the packed layout.
QUANTIZED: dict[T, Format] = {t: f for t, f in FORMATS.items() if f.packing is not None}
