"""The names models go by on screen."""

from __future__ import annotations

from pathlib import Path

from chatapp.catalog import load_catalog
from chatapp.naming import display_name, quant_label

SMOLLM2_META = {
    "general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2",  # as the real file has it
    "general.basename": "smollm2",
    "general.size_label": "135M",
    "general.file_type": 3,
}


def test_a_catalog_file_goes_by_its_catalog_name(smollm2_path: Path) -> None:
    assert display_name(smollm2_path, SMOLLM2_META, load_catalog()) == "smollm2-135m-instruct"


def test_another_file_goes_by_its_base_name_size_and_quantization() -> None:
    assert display_name(Path("/x/renamed.gguf"), SMOLLM2_META, {}) == "smollm2 135M Q4_1"
    qwen = {"general.basename": "Qwen2.5-Coder", "general.size_label": "0.5B", "general.file_type": 15}
    assert display_name(Path("q.gguf"), qwen, {}) == "Qwen2.5-Coder 0.5B Q4_K_M"
    # without a base name, the cleaned-up general.name; without either, the file's stem
    named = {"general.name": "  My\tModel  ", "general.file_type": 7}
    assert display_name(Path("a.gguf"), named, {}) == "My Model Q8_0"
    assert display_name(Path("/m/tiny-model.gguf"), {}, {}) == "tiny-model"
    # what the name already says is not said twice
    assert display_name(Path("b.gguf"), {"general.basename": "Llama-3.2-1B-Q8_0", "general.size_label": "1B",
                                         "general.file_type": 7}, {}) == "Llama-3.2-1B-Q8_0"  # fmt: skip


def test_quant_labels() -> None:
    assert quant_label({"general.file_type": 15}) == "Q4_K_M"
    assert quant_label({"general.file_type": 0}) == "F32"
    assert quant_label({"general.file_type": 9999}) == "" == quant_label({})
