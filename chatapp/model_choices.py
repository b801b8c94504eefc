"""The models the picker offers: the catalog (downloaded or not), GGUF files in the model cache (dropped in or
pulled from the hub) and in the user's own models folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.filesize import decimal

from chatapp import paths
from chatapp.catalog import CatalogEntry, list_models, load_catalog


@dataclass(frozen=True)
class ModelChoice:
    spec: str  # what loads it: a catalog name, a path or an hf: spec
    name: str  # what it is called
    detail: str  # size · family · chat or base · where it is
    present: bool  # on disk now (a catalog model that is not is pulled when picked)


def _kind(entry: CatalogEntry) -> str:
    return "base model" if "base model" in entry.description.lower() else "chat"


def _file_choice(path: Path, where: str, spec: str | None = None) -> ModelChoice:
    try:
        size = decimal(path.stat().st_size)
    except OSError:
        size = "?"
    return ModelChoice(spec or str(path), path.name, f"{size} · {where}", True)


def model_choices(models_folder: str = "", models_dir: Path | None = None) -> list[ModelChoice]:
    """Catalog models first (in catalog order), then files in the cache, then the user's folder's."""
    models_dir = paths.models_dir() if models_dir is None else models_dir
    catalog = load_catalog()
    rows: list[ModelChoice] = []
    for listing in list_models(catalog=catalog, models_dir=models_dir):
        e = listing.entry
        if e is None:
            rows.append(_file_choice(listing.path, "in the model cache", listing.path.name))
            continue
        where = "downloaded" if listing.present else "not downloaded: picking it pulls it"
        detail = f"{decimal(e.size)} · {e.architecture} {e.quant} · {_kind(e)} · {where}"
        rows.append(ModelChoice(e.name, e.name, detail, listing.present))
    for record in sorted((models_dir / "hf").glob("*/**/*.gguf.hub.json")):
        try:
            meta = json.loads(record.read_text(encoding="utf-8"))
            spec = f"hf:{meta['repo']}/{meta['file']}"
        except (OSError, ValueError, KeyError, TypeError):
            continue
        model = record.with_name(record.name.removesuffix(".hub.json"))
        if model.is_file():
            rows.append(_file_choice(model, f"from the hub, {meta['repo']}", spec))
    folder = Path(models_folder).expanduser() if models_folder.strip() else None
    if folder is not None and folder.is_dir():
        for path in sorted(folder.rglob("*.gguf")):
            if path.is_file():
                rows.append(_file_choice(path, f"in {folder}"))
    return rows
