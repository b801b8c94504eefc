"""Starting the chat UI: open the saved chats, build the App, run it, close the store."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from chatapp.chat_service import open_store
from chatapp.mcp.config import McpSettings
from chatapp.model_choices import ModelChoice
from chatapp.tui.app import ChatApp
from chatapp.tui.worker import BackendFactory
from engine.events import GrammarSpec
from engine.sampling import SamplingSettings


def run_app(
    backend_factory: BackendFactory,
    *,
    model_name: str,
    settings: SamplingSettings,
    system_prompt: str,
    store_path: Path | None,
    theme: str | None = None,
    model_choices: Callable[[], Sequence[ModelChoice]] | None = None,
    factory_for_model: Callable[[str], BackendFactory] | None = None,
    mcp: McpSettings | None = None,
    reply_format: GrammarSpec | None = None,
) -> None:
    """Run the chat UI. `backend_factory(progress)` loads the model in a worker thread, reporting progress
    lines through `progress`; `store_path=None` turns history off; the model picker offers `model_choices()`
    and loads one with `factory_for_model(spec)`; `reply_format`: what every reply must match."""
    from chatapp import paths
    from chatapp.settings import save_user_setting

    store, warning = open_store(store_path)
    app = ChatApp(
        backend_factory,
        model_name=model_name,
        settings=settings,
        system_prompt=system_prompt,
        store=store,
        store_warning=warning,
        export_dir=paths.user_data_dir() / "exports",
        theme=theme,
        save_theme=lambda name: save_user_setting("theme", name),
        model_choices=model_choices,
        factory_for_model=factory_for_model,
        mcp=mcp,
        reply_format=reply_format,
    )
    try:
        app.run()
    finally:
        if store is not None:
            store.close()
