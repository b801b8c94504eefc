"""`-ctk/--cache-type-k` and `-ctv/--cache-type-v` (llama.cpp's names) and the config keys `cache_type_k` and
`cache_type_v`: from the command line and config to load_model, and a bad value refused in one line. What the
q8_0 cache computes is tested in tests/engine/test_cache_types.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp import cli
from chatapp.settings import ConfigError, load_settings

from .test_device_flags import load_model_kwargs

COMMANDS = [["run", "-p", "hi"], ["bench"], ["serve"], []]
COMMAND_IDS = ["run", "bench", "serve", "tui"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-ctk", "q4_0"], "cache_type_k: expected one of f16, q8_0, got 'q4_0'"),
        (["--cache-type-v", "f32"], "cache_type_v: expected one of f16, q8_0, got 'f32'"),
    ],
    ids=["k", "v"],
)
@pytest.mark.parametrize("command", COMMANDS, ids=COMMAND_IDS)
def test_a_bad_type_is_refused_in_one_line(
    isolated_dirs, capsys: pytest.CaptureFixture[str], command: list[str], args: list[str], named: str
) -> None:
    status = cli.main([*command, "-m", "/nonexistent/model.gguf", *args])
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    assert err.splitlines() == [f"chatapp: error: command line: {named}"]


def test_config_keys(isolated_dirs, tmp_path: Path) -> None:
    assert (load_settings().cache_type_k, load_settings().cache_type_v) == ("f16", "f16")
    config = tmp_path / "config.toml"
    config.write_text('cache_type_v = "q8_0"\n', encoding="utf-8")
    assert load_settings(config_file=config).cache_type_v == "q8_0"
    config.write_text('cache_type_k = "q4"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line 1: cache_type_k: expected one of f16, q8_0, got 'q4'"):
        load_settings(config_file=config)


@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["bench"]], ids=["run", "bench"])
def test_flags_and_config_reach_load_model(
    isolated_dirs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command
) -> None:
    seen = load_model_kwargs(monkeypatch, tmp_path, [*command, "-ctk", "q8_0", "--cache-type-v", "Q8_0"])
    assert (seen["cache_type_k"], seen["cache_type_v"]) == ("q8_0", "Q8_0")  # load_model reads either case
    (isolated_dirs["config"] / "config.toml").write_text('cache_type_v = "q8_0"\n', encoding="utf-8")
    seen = load_model_kwargs(monkeypatch, tmp_path, command)
    assert (seen["cache_type_k"], seen["cache_type_v"]) == ("f16", "q8_0")
    assert capsys.readouterr().err.splitlines() == ["chatapp: error: stop here"] * 2
