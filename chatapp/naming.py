"""The name a model goes by on screen: its catalog name, or its file's own name with size and quantization.

A GGUF's `general.name` is often the training run's ("Smollm2 135M 8k Lc100K Mix1 Ep2"); `general.basename`
and `general.size_label` are what people call the model, and the file type says which quantization it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from chatapp.catalog import CatalogEntry


def quant_label(metadata: Mapping[str, Any]) -> str:
    """"Q4_K_M" for general.file_type 15 (LlamaFileType.MOSTLY_Q4_K_M); "" when absent or unknown."""
    try:
        return gguf.LlamaFileType(int(metadata["general.file_type"])).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (KeyError, TypeError, ValueError):
        return ""


def _clean(text: object) -> str:
    return " ".join(str(text).split()) if text is not None else ""


def display_name(path: Path, metadata: Mapping[str, Any], catalog: Mapping[str, CatalogEntry]) -> str:
    """What the status line and the chat call the model at `path`."""
    for entry in catalog.values():
        if entry.file_name == path.name:
            return entry.name
    base = _clean(metadata.get("general.basename")) or _clean(metadata.get("general.name")) or path.stem
    size = _clean(metadata.get("general.size_label"))
    parts = [base]
    if size and size.lower() not in base.lower():
        parts.append(size)
    if (quant := quant_label(metadata)) and quant.lower() not in base.lower():
        parts.append(quant)
    return " ".join(parts)
