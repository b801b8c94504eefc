"""The theme the user picks is kept in their config.toml, which is otherwise left as they wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.settings import ConfigError, load_settings, save_user_setting
from chatapp.tui.app import ChatApp
from tests.app.fake_backend import FakeBackend, factory_for, ready, record_notices

USER_CONFIG = """# my settings
n_ctx = 4096  # long chats

[sampling]
temperature = 0.5
"""


def test_a_new_key_goes_on_top_and_the_rest_is_kept(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(USER_CONFIG, encoding="utf-8")
    save_user_setting("theme", "nord", config)
    text = config.read_text(encoding="utf-8")
    assert text.endswith(USER_CONFIG) and text.startswith('theme = "nord"')
    settings = load_settings(config_file=config)
    assert (settings.theme, settings.n_ctx, settings.sampling.temperature) == ("nord", 4096, 0.5)

    save_user_setting("theme", "gruvbox", config)  # a key already there is replaced where it is
    assert config.read_text(encoding="utf-8") == text.replace("nord", "gruvbox")


def test_no_config_yet_makes_one(tmp_path: Path) -> None:
    config = tmp_path / "new" / "config.toml"
    save_user_setting("theme", "dracula", config)
    assert load_settings(config_file=config).theme == "dracula"


def test_a_config_that_is_not_toml_is_left_alone(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("n_ctx = = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="cannot update theme"):
        save_user_setting("theme", "nord", config)
    assert config.read_text(encoding="utf-8") == "n_ctx = = 3\n"


def theme_app(theme: str | None, saved: list[str]) -> ChatApp:
    backend = FakeBackend()
    app = ChatApp(
        factory_for(backend), model_name=backend.model_name, settings=backend.settings, theme=theme,
        save_theme=saved.append,
    )  # fmt: skip
    record_notices(app)
    return app


async def test_the_app_starts_in_the_saved_theme_and_saves_a_new_pick() -> None:
    saved: list[str] = []
    app = theme_app("nord", saved)
    async with app.run_test() as pilot:
        await ready(pilot)
        assert app.theme == "nord" and saved == []  # starting in it is not a pick
        app.theme = "gruvbox"  # what the command palette's theme picker does
        await pilot.pause()
        assert saved == ["gruvbox"]


async def test_an_unknown_saved_theme_is_named_and_the_default_used() -> None:
    app = theme_app("no-such-theme", [])
    async with app.run_test() as pilot:
        await ready(pilot)
        assert app.theme == "textual-dark"
        assert any("no-such-theme" in n for n in app.notices), app.notices
