"""`chatapp bench --split`: where a decoded token's time goes, each part timed alone on the real model's state.
No speed is asserted: only that every part is there, measured, and that the parts add up to the whole step."""

from __future__ import annotations

import json

import pytest

from chatapp.bench import run_bench

PARTS = ["products", "attention", "rest of the layers", "output head", "embed + final norm", "sampling (argmax)"]

# |step - sum of its parts| / step, measured on SmolLM2 (Intel Xeon family 6 model 207, 2 threads, 2026-12-06):
# 0.18 with the machine at load 10 (other test runs beside it), 0.0x quiet. Each part runs alone, so it misses
# the caches the whole step would leave warm for it, and the load moves between the timings.
SPLIT_TOLERANCE = 0.35


def test_split_parts_present_and_add_up(smollm2_model, capsys: pytest.CaptureFixture[str]) -> None:
    """Every part of the split is reported, each a positive time, and their sum is the measured step within
    SPLIT_TOLERANCE; the products' read rate is the bytes they read over their time."""
    assert run_bench(smollm2_model, 8, 2, 1, as_json=True, split_depth=64) == 0
    result = json.loads(capsys.readouterr().out)
    split = result["split"]
    assert list(split["parts_ms"]) == PARTS
    measured = {k: ms for k, ms in split["parts_ms"].items() if k != "rest of the layers"}
    assert all(ms > 0 for ms in measured.values()), split["parts_ms"]
    # The layers' rest is their whole pass less the parts timed alone: a difference, held to the same tolerance
    assert split["parts_ms"]["rest of the layers"] >= -SPLIT_TOLERANCE * split["total_ms"], split["parts_ms"]
    assert split["depth"] == 64 + 1  # the prompt and the last token evaluated again
    assert split["parts_sum_ms"] == pytest.approx(sum(split["parts_ms"].values()))
    assert abs(split["unaccounted_ms"]) <= SPLIT_TOLERANCE * split["total_ms"], split
    assert split["product_mb"] == pytest.approx(smollm2_model.weights.decode_bytes() / 1e6)
    seconds = (split["parts_ms"]["products"] + split["parts_ms"]["output head"]) / 1e3
    assert split["products_gb_s"] == pytest.approx(split["product_mb"] / 1e3 / seconds)
    assert 0 < split["launches_ms"] < split["parts_ms"]["products"] + split["parts_ms"]["output head"]
    assert split["launches"] >= smollm2_model.cfg.n_layer  # at least one parallel launch a layer (its FFN)


def test_split_table_printed(smollm2_model, capsys: pytest.CaptureFixture[str]) -> None:
    """The table names every part and the unaccounted rest, and the products' rate against the read bandwidth."""
    assert run_bench(smollm2_model, 8, 2, 1, as_json=False, split_depth=16) == 0
    out = capsys.readouterr().out
    for part in [*PARTS, "(unaccounted"]:
        assert f"| {part}" in out, part
    assert "A decoded token at depth 17:" in out
    assert "% of the " in out and "thread wake-ups:" in out
