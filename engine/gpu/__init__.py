"""Optional GPU offload: the first layers (or all, and the output head) of a model on a CUDA device via CuPy.

    backend.py  which array module: CuPy on a CUDA device, or NumPy (tests run the same code on the CPU)
    dequantize.py  one vectorised dequantizer per ggml type, from the file's raw blocks
    matrix.py   weights uploaded once in their file encoding; W @ x dequantizing a tile of rows at a time
    ops.py      norms, activations, RoPE, attention: the CPU layer's numerics on xp arrays
    offload.py  the layer's ops on the device (DeviceOps for engine/layer.py run_layer), and its KV cache

`engine.loader.load_model(..., device=, gpu_layers=)` is the way in; `offload_for` builds the offload that a
Model is constructed with (tests use it with the NumPy backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import DEVICES, NUMPY, TEST_DEVICE, Backend, DeviceError, find_cuda, normalize_device, pick_backend

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..model import Offload
    from ..weights import Weights


def split_layers(gpu_layers: int, n_layer: int) -> tuple[int, bool]:
    """llama.cpp's -ngl: (layers on the device, whether the output head is too).

    0..n_layer: that many leading layers, the output on the CPU. -1, or n_layer + 1 and more: every layer and
    the output head (llama.cpp counts the output as one more layer).
    """
    if gpu_layers == -1 or gpu_layers > n_layer:
        return n_layer, True
    return gpu_layers, False


def offload_for(
    cfg: ModelConfig, weights: Weights, n_ctx: int, backend: Backend = NUMPY, gpu_layers: int = -1
) -> Offload | None:
    """The first layers of a model (`cfg`, `weights`, a cache of `n_ctx`) uploaded per `gpu_layers`, for its
    Model's constructor; None for 0."""
    from .offload import DeviceOffload  # noqa: PLC0415 (imports engine.model)

    n_layers, with_output = split_layers(gpu_layers, cfg.n_layer)
    if n_layers == 0:
        return None
    return DeviceOffload(backend, cfg, weights, n_layers, with_output, n_ctx)


__all__ = [
    "DEVICES",
    "NUMPY",
    "TEST_DEVICE",
    "Backend",
    "DeviceError",
    "find_cuda",
    "normalize_device",
    "offload_for",
    "pick_backend",
    "split_layers",
]
