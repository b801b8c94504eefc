"""The prompt pass's reusable buffers (engine/kernels/scratch.py)."""

from __future__ import annotations

import numpy as np

from engine.kernels import Scratch

from .compare import INT8_SHORT_BOUND, assert_close_logits


def test_a_name_gives_back_its_buffer_and_grows_only_when_too_small() -> None:
    work = Scratch()
    a = work.take("q", (4, 8))
    assert a.shape == (4, 8) and a.dtype == np.float32 and a.flags.c_contiguous
    assert np.shares_memory(work.take("q", (2, 8)), a)  # smaller: the same memory
    assert not np.shares_memory(work.take("k", (4, 8)), a)  # another name: its own
    assert not np.shares_memory(work.take("q", (4, 8), np.int8), a)  # another dtype: its own
    big = work.take("q", (16, 8))  # larger: a new buffer, kept from now on
    assert not np.shares_memory(big, a) and np.shares_memory(work.take("q", (4, 8)), big)
    assert work.nbytes == 16 * 8 * 4 + 4 * 8 * 4 + 4 * 8


def test_passes_of_every_size_through_one_model_equal_fresh_ones(smollm2_model) -> None:
    """A model's passes share one Scratch: long, short and longer again, each row as one fresh pass's (int8
    bound: the chunks' attention products are other BLAS calls)."""
    ids = smollm2_model.tokenize("The quick brown fox jumps over the lazy dog. " * 12, special=False)[:120]
    want = smollm2_model.logits(ids)  # (120, n_vocab) in one pass
    session = smollm2_model.session()
    for lo, hi in ((0, 100), (100, 103), (103, 120)):
        for ours, fresh in zip(session.eval_all(ids[lo:hi]), want[lo:hi], strict=True):
            assert_close_logits(ours, fresh, INT8_SHORT_BOUND)
