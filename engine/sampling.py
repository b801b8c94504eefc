"""Token sampling: small pure functions over a logits vector.  (skeleton: to be completed)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSettings:
    """A value the caller may replace at any moment; the next sampled token uses the new one.

    Defaults follow llama.cpp's.
    """

    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64  # how many recent tokens the penalties look at
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: a fresh random seed per turn
    max_tokens: int = 512  # reply length limit; -1: until the context is full
