"""Settings: bundled defaults < the user's config.toml < the command line; errors name the culprit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from chatapp import catalog
from chatapp.settings import AppSettings, ConfigError, defaults_file, load_settings, read_toml
from engine.sampling import SamplingSettings


@pytest.fixture
def user_config(isolated_dirs: dict[str, Path]) -> Path:
    """The (not yet written) user config file, in an isolated config dir."""
    return isolated_dirs["config"] / "config.toml"


def test_defaults(user_config: Path):
    settings = load_settings({})
    assert settings == AppSettings(
        model="smollm2-135m-instruct",
        n_ctx=2048,
        threads=0,
        device="auto",
        gpu_layers=-1,
        system_prompt="",
        sampling=SamplingSettings(
            temperature=0.8,
            top_k=40,
            top_p=0.95,
            min_p=0.05,
            repeat_penalty=1.0,
            repeat_last_n=64,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            seed=-1,
            max_tokens=512,
        ),
        sources=(str(defaults_file()),),
    )


def test_bundled_defaults_agree_with_the_engine_and_the_catalog():
    data = read_toml(defaults_file())
    assert set(data["sampling"]) == {f.name for f in dataclasses.fields(SamplingSettings)}
    assert load_settings({}, config_file=None).sampling == SamplingSettings()
    assert data["model"] == catalog.default_model_name()


def test_precedence_defaults_then_user_file_then_command_line(user_config: Path):
    user_config.write_text(
        'model = "qwen2.5-coder-0.5b-instruct"\nn_ctx = 4096\n\n[sampling]\ntemperature = 0.5\ntop_k = 20\n'
    )
    from_file = load_settings({})
    assert from_file.model == "qwen2.5-coder-0.5b-instruct"
    assert (from_file.n_ctx, from_file.sampling.temperature, from_file.sampling.top_k) == (4096, 0.5, 20)
    assert from_file.sampling.top_p == 0.95  # untouched default
    assert from_file.sources == (str(defaults_file()), str(user_config))

    settings = load_settings(
        {"temperature": 0.1, "sampling": {"top_p": 0.5}, "sampling.seed": 7, "threads": 2}
    )
    assert settings.model == "qwen2.5-coder-0.5b-instruct"  # user file
    assert settings.n_ctx == 4096  # user file
    assert settings.sampling.top_k == 20  # user file
    assert settings.sampling.temperature == 0.1  # command line beats the user file
    assert (settings.sampling.top_p, settings.sampling.seed, settings.threads) == (0.5, 7, 2)
    assert settings.device == "auto"  # default
    assert settings.sources[-1] == "command line"


def test_command_line_none_means_not_given_and_strings_are_parsed(user_config: Path):
    user_config.write_text("n_ctx = 1024\n")
    settings = load_settings({"n_ctx": None, "model": None, "temperature": "0.25", "top_k": "7"})
    assert (settings.n_ctx, settings.model) == (1024, "smollm2-135m-instruct")
    assert (settings.sampling.temperature, settings.sampling.top_k) == (0.25, 7)


def test_an_integer_is_accepted_where_a_number_is_expected(user_config: Path):
    user_config.write_text("[sampling]\ntemperature = 1\n")
    temperature = load_settings({}).sampling.temperature
    assert temperature == 1.0 and isinstance(temperature, float)


def test_malformed_toml_names_the_file_and_line(user_config: Path):
    user_config.write_text('model = "smollm2-135m-instruct"\n\n[sampling]\ntemperature = = 0.3\n')
    with pytest.raises(ConfigError) as caught:
        load_settings({})
    message = str(caught.value)
    assert message.startswith(f"{user_config}, line 4: invalid TOML: ")
    assert "\n" not in message


def test_unterminated_toml_names_the_file_and_a_line(user_config: Path):
    user_config.write_text('system_prompt = "You are\n')
    with pytest.raises(ConfigError, match=r"config\.toml, line 1: invalid TOML"):
        load_settings({})


def test_unknown_top_level_key(user_config: Path):
    user_config.write_text('model = "x"\nn_ctxx = 4096\n')
    with pytest.raises(ConfigError) as caught:
        load_settings({})
    message = str(caught.value)
    assert message.startswith(f"{user_config}, line 2: n_ctxx: unknown key in the top level")
    assert "did you mean 'n_ctx'?" in message
    assert "expected one of: model, n_ctx," in message


def test_unknown_sampling_key(user_config: Path):
    user_config.write_text("[sampling]\ntop_k = 3\ntemprature = 0.2\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({})
    message = str(caught.value)
    assert message.startswith(f"{user_config}, line 3: sampling.temprature: unknown key in [sampling]")
    assert "did you mean 'temperature'?" in message


@pytest.mark.parametrize(
    ("text", "line", "key", "expected"),
    [
        ('n_ctx = "big"', 1, "n_ctx", "expected an integer ≥ 1, got 'big'"),
        ("n_ctx = true", 1, "n_ctx", "expected an integer ≥ 1, got True"),
        ("n_ctx = 0", 1, "n_ctx", "expected an integer ≥ 1, got 0"),
        ("threads = 1.5", 1, "threads", "expected an integer ≥ 0 (0 = all cores), got 1.5"),
        ('device = "tpu"', 1, "device", "expected one of 'auto', 'cpu', 'cuda', got 'tpu'"),
        ("system_prompt = 3", 1, "system_prompt", "expected a string, got 3"),
        ("\n[sampling]\ntemperature = 'hot'", 3, "sampling.temperature", "expected a number between 0 and 100"),
        (
            "[sampling]\npresence_penalty = -1e308",
            2,
            "sampling.presence_penalty",
            "expected a number between -1000 and 1000, got -1e+308",
        ),
        (
            "[sampling]\nrepeat_penalty = 5e-324",
            2,
            "sampling.repeat_penalty",
            "expected a number between 0.001 and 1000 (1 = off), got 5e-324",
        ),
        ("[sampling]\ntemperature = nan", 2, "sampling.temperature", "expected a number between 0 and 100"),
        ("[sampling]\ntop_p = 1.5", 2, "sampling.top_p", "expected a number between 0 and 1, got 1.5"),
        (
            "[sampling]\nmax_tokens = 0",
            2,
            "sampling.max_tokens",
            "expected an integer ≥ 1, or -1 (-1 = unlimited)",
        ),
        ("sampling = 3", 1, "sampling", "expected a table of sampling settings, got 3"),
    ],
)
def test_wrong_type_or_range_names_file_line_key_and_expectation(
    user_config: Path, text: str, line: int, key: str, expected: str
):
    user_config.write_text(text + "\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({})
    assert str(caught.value).startswith(f"{user_config}, line {line}: {key}: {expected}")


def test_bad_command_line_values_name_the_command_line(user_config: Path):
    with pytest.raises(ConfigError, match=r"^command line: sampling\.temperature: expected a number between 0 and 100"):
        load_settings({"temperature": "warm"})
    with pytest.raises(ConfigError, match=r"^command line: n_ctx: expected an integer ≥ 1, got -5"):
        load_settings({"n_ctx": -5})
    with pytest.raises(ConfigError, match=r"^command line: colour: unknown key"):
        load_settings({"colour": "red"})
    with pytest.raises(ConfigError, match=r"^command line: sampling\.top_q: unknown key in \[sampling\]"):
        load_settings({"sampling.top_q": 0.5})


def test_an_explicit_config_file_must_exist(tmp_path: Path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"^{missing}: file not found$"):
        load_settings({}, config_file=missing)


def test_an_explicit_config_file_is_used(tmp_path: Path, user_config: Path):
    user_config.write_text("n_ctx = 111\n")
    other = tmp_path / "other.toml"
    other.write_text("n_ctx = 222\n")
    assert load_settings({}, config_file=other).n_ctx == 222


def test_a_config_file_that_is_not_utf8(user_config: Path):
    user_config.write_bytes(b'system_prompt = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"config\.toml: not UTF-8 text"):
        load_settings({})


def test_incomplete_bundled_defaults_are_an_error(tmp_path: Path, user_config: Path):
    defaults = tmp_path / "defaults.toml"
    defaults.write_text(defaults_file().read_text().replace("top_k = 40", ""))
    with pytest.raises(ConfigError, match=f"^{defaults}: missing key 'sampling.top_k'$"):
        load_settings({}, defaults=defaults)


def test_deterministic_from_the_config_and_the_command_line() -> None:
    """Off by default (it slows prefill); `deterministic = true` or `--deterministic` turns it on."""
    from chatapp.cli import _overrides, build_parser
    from chatapp.settings import load_settings

    assert load_settings().deterministic is False
    assert _overrides(build_parser().parse_args(["serve"])).get("deterministic") is None
    assert load_settings(_overrides(build_parser().parse_args(["serve", "--deterministic"]))).deterministic is True
