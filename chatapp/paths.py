"""Where chatapp keeps things: the bundled defaults, and the user's cache, config and data directories.

Each user directory honours an environment override (CHATAPP_CACHE_DIR, CHATAPP_CONFIG_DIR,
CHATAPP_DATA_DIR), so tests and unusual setups can point it elsewhere. Nothing here creates a directory:
whoever writes into one creates it.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

import chatapp

APP_NAME = "chatapp"


def config_dir() -> Path:
    """The bundled read-only defaults (`models.toml`, `defaults.toml`).

    An installed wheel carries them as `chatapp/_config`; a source or editable checkout uses the repo's
    top-level `config/`.
    """
    bundled = Path(chatapp.__file__).resolve().parent / "_config"
    if bundled.is_dir():
        return bundled
    return Path(chatapp.__file__).resolve().parents[1] / "config"


def _override(var: str) -> Path | None:
    value = os.environ.get(var, "").strip()
    return Path(value).expanduser() if value else None


def user_cache_dir() -> Path:
    """Large re-creatable files (the downloaded models). $CHATAPP_CACHE_DIR, else e.g. ~/.cache/chatapp."""
    return _override("CHATAPP_CACHE_DIR") or Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def user_config_dir() -> Path:
    """The user's settings (`config.toml`). $CHATAPP_CONFIG_DIR, else e.g. ~/.config/chatapp."""
    return _override("CHATAPP_CONFIG_DIR") or Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def user_data_dir() -> Path:
    """Things the user would miss (saved chats). $CHATAPP_DATA_DIR, else e.g. ~/.local/share/chatapp."""
    return _override("CHATAPP_DATA_DIR") or Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def models_dir() -> Path:
    """Where pulled models live, and where a user may drop their own .gguf files."""
    return user_cache_dir() / "models"


def user_config_file() -> Path:
    """The user's settings file, layered over the bundled `defaults.toml`."""
    return user_config_dir() / "config.toml"
