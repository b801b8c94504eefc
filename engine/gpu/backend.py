"""Which array module runs the offloaded layers: CuPy on a CUDA device when one is usable, NumPy for tests.

CuPy is imported here and nowhere else, and only when a device is asked for: `import engine` never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import SettingsError

DEVICES = ("auto", "cpu", "cuda")  # what a user may ask for; "gpu" is read as "cuda"
TEST_DEVICE = "numpy"  # the same offload code on NumPy arrays, on the CPU: for tests only


class DeviceError(SettingsError):
    """A device was asked for that this machine cannot provide (no CuPy, no CUDA device)."""


@dataclass(frozen=True)
class Backend:
    """An array module the offload runs on."""

    xp: ModuleType  # cupy or numpy
    label: str  # for display: "cuda:0 (NVIDIA H200)" or "numpy (test backend)"

    def to_host(self, a: Any) -> np.ndarray:
        """A device array as a NumPy array (NumPy arrays pass through)."""
        return a.get() if self.xp is not np else a

    def free_bytes(self) -> int | None:
        """Free device memory, or None where that means nothing (NumPy)."""
        if self.xp is np:
            return None
        free, _total = self.xp.cuda.runtime.memGetInfo()
        return int(free)


NUMPY = Backend(np, "numpy (test backend)")


def find_cuda() -> tuple[Backend | None, str]:
    """(CuPy on device 0, "") when CuPy imports and sees a CUDA device, else (None, why not)."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return None, "cupy is not installed"
    except Exception as e:  # a broken CuPy install raises all sorts; it is just not usable
        return None, f"cupy cannot be imported ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CUDARuntimeError without a driver
        count = 0
    if count < 1:
        return None, "no CUDA device"
    try:
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        cupy.cuda.Device(0).use()
    except Exception as e:
        return None, f"CUDA device 0 is not usable ({type(e).__name__}: {e})"
    return Backend(cupy, f"cuda:0 ({name})"), ""


def normalize_device(device: str) -> str:
    """The device name with "gpu" read as "cuda"; anything outside DEVICES (and the test device) is refused."""
    name = device.strip().lower() if isinstance(device, str) else device
    name = "cuda" if name == "gpu" else name
    if name not in (*DEVICES, TEST_DEVICE):
        raise SettingsError(f"device must be one of {', '.join(DEVICES)} (got {device!r})")
    return name


def pick_backend(device: str) -> tuple[Backend | None, str]:
    """The backend for a device setting: (None, "") for the CPU, (None, warning) when `auto` finds no GPU.

    Raises DeviceError for `cuda` when CuPy or a CUDA device is missing.
    """
    name = normalize_device(device)
    if name == "cpu":
        return None, ""
    if name == TEST_DEVICE:
        return NUMPY, ""
    backend, why = find_cuda()
    if backend is not None:
        return backend, ""
    if name == "cuda":
        hint = " (install the gpu extra: pip install '.[gpu]')" if "not installed" in why else ""
        raise DeviceError(f"device cuda is not usable: {why}{hint}")
    return None, f"no GPU: {why}; running on the CPU"
