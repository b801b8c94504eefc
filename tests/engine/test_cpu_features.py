"""The kernels' instruction set follows the CPU the process runs on."""

from __future__ import annotations

from pathlib import Path

from engine.kernels import simd


def host_flags() -> set[str]:
    """The feature flags the kernel reports for the first CPU (/proc/cpuinfo)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("no flags line in /proc/cpuinfo")


def test_avx2_is_used_exactly_when_the_host_has_it() -> None:
    assert simd.HAVE_AVX2 == ("avx2" in host_flags())
