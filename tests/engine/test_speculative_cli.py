"""Speculative decoding from the command line and config: -md/--model-draft, --draft-max, --lookup."""

from __future__ import annotations

import pytest

from chatapp.cli import main
from chatapp.settings import ConfigError, load_settings

from .synthetic import write_tiny_model


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(smollm2_path, tmp_path, isolated_dirs, capsys) -> None:
    tiny = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    rc = main(["run", "-m", str(smollm2_path), "-md", str(tiny.path), "-p", "Hello", "-n", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert "does not share the vocabulary" in err[-1] and err[-1].startswith("chatapp: error:")
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("flags", [["--lookup"], ["-md", "SELF", "--draft-max", "4"]], ids=["lookup", "draft"])
def test_run_with_a_drafter_reports_its_guesses(smollm2_path, isolated_dirs, capsys, flags) -> None:
    flags = [str(smollm2_path) if f == "SELF" else f for f in flags]
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    rc = main(["run", "-m", str(smollm2_path), *flags, "-p", text, "-n", "12", "--temp", "0"])
    out = capsys.readouterr()
    assert rc == 0
    assert "guesses accepted" in out.err and "tokens per target pass" in out.err


def test_config_keys(tmp_path, isolated_dirs) -> None:
    config = tmp_path / "config.toml"
    config.write_text('lookup = true\ndraft_max = 8\nmodel_draft = "small.gguf"\nkv_cache_mb = 64\n')
    s = load_settings(config_file=config)
    assert (s.lookup, s.draft_max, s.model_draft, s.kv_cache_mb) == (True, 8, "small.gguf", 64)
    assert load_settings({"lookup": True, "draft_max": 3}).draft_max == 3
    config.write_text("draft_max = 0\n")
    with pytest.raises(ConfigError, match="draft_max"):
        load_settings(config_file=config)
