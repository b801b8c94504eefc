"""Switching models in the app: the picker lists what can be loaded, the new model loads in the worker while
the old one stays in place, the chat carries over, and a model that fails to load changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import OptionList

from chatapp.model_choices import ModelChoice, model_choices
from chatapp.tui.app import ChatApp
from chatapp.tui.widgets.model_picker import ModelPickerScreen
from engine.chat import ChatSession
from engine.events import Message
from engine.sampling import SamplingSettings
from tests.app.fake_backend import FakeBackend, factory_for, ready, record_notices, send, wait_for

CHOICES = [
    ModelChoice("first-model", "first-model", "1 MB · llama · chat · downloaded", True),
    ModelChoice("second-model", "second-model", "2 MB · qwen2 · chat · downloaded", True),
    ModelChoice("broken-model", "broken-model", "3 MB · llama · chat · downloaded", True),
]


class Named(FakeBackend):
    def __init__(self, name: str, *replies: str) -> None:
        super().__init__(list(replies))
        self.model_name = name


def picker_app(first, others: dict[str, object]) -> ChatApp:
    def factory_for_model(spec: str):
        backend = others[spec]
        return factory_for(backend) if isinstance(backend, FakeBackend) else factory_for(first, fail=str(backend))

    app = ChatApp(
        factory_for(first), model_name=first.model_name, settings=SamplingSettings(),
        model_choices=lambda: CHOICES, factory_for_model=factory_for_model,
    )  # fmt: skip
    record_notices(app)
    return app


async def pick(pilot, name: str) -> None:
    await pilot.press("f10")
    screen = pilot.app.screen
    assert isinstance(screen, ModelPickerScreen)
    options = screen.query_one(OptionList)
    options.highlighted = [c.name for c in CHOICES].index(name)
    await pilot.press("enter")


async def test_the_chat_carries_over_to_the_new_model() -> None:
    first, second = Named("first-model", "Hello!"), Named("second-model", "Bonjour!")
    app = picker_app(first, {"second-model": second})
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "Hi")
        await pick(pilot, "second-model")
        await wait_for(pilot, lambda: app.backend is second, what="the second model")
        assert app.model_name == "second-model" and "second-model" in str(app.status.query_one("#status-left").render())
        assert any("Now chatting with second-model" in n for n in app.notices)
        await send(pilot, "And in French?")
    assert first.calls == [[Message("user", "Hi")]]
    assert second.calls == [[Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "And in French?")]]


async def test_a_model_that_fails_to_load_leaves_the_old_one_in_place() -> None:
    first = Named("first-model", "Still me.")
    app = picker_app(first, {"broken-model": "tensor blk.0.attn_q.weight: missing"})
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await pick(pilot, "broken-model")
        await wait_for(pilot, lambda: app.service.switching is None, what="the failed load")
        assert app.backend is first and app.model_name == "first-model"
        assert any("tensor blk.0.attn_q.weight: missing" in n and "Still using first-model" in n for n in app.notices)
        await send(pilot, "Are you there?")
        assert app.state.turns[-1].content == "Still me."


async def test_the_real_chat_is_evaluated_again_on_the_new_model(smollm2_model, qwen_model) -> None:
    greedy = SamplingSettings(temperature=0.0, max_tokens=6)
    sessions: dict[str, ChatSession] = {"smollm2": ChatSession(smollm2_model, greedy)}

    def factory_for_model(spec: str):
        def factory(progress):
            sessions[spec] = ChatSession(qwen_model, greedy)
            return sessions[spec]

        return factory

    app = ChatApp(
        lambda progress: sessions["smollm2"], model_name="smollm2", settings=greedy,
        model_choices=lambda: [ModelChoice("qwen", "qwen", "", True)], factory_for_model=factory_for_model,
    )  # fmt: skip
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "Name a colour.")
        first_reply = app.state.turns[-1].content
        await pilot.press("f10", "enter")
        await wait_for(pilot, lambda: "qwen" in sessions and app.backend is sessions["qwen"], timeout=120)
        await send(pilot, "Another one?")
    qwen = sessions["qwen"]
    stats = app.state.turns[-1].stats
    said = [Message("user", "Name a colour."), Message("assistant", first_reply), Message("user", "Another one?")]
    prompt = qwen.prompt_tokens(said)
    assert stats.reused_tokens == 0 and stats.evaluated_tokens == len(prompt)  # the whole chat, on Qwen's template
    assert qwen.cached_tokens[: len(prompt)] == prompt


def test_the_picker_lists_catalog_cache_hub_and_folder_models(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "hf" / "org--repo").mkdir(parents=True)
    (models / "dropped.gguf").write_bytes(b"GGUF")
    (models / "hf" / "org--repo" / "m.Q8_0.gguf").write_bytes(b"GGUF")
    record = {"repo": "org/repo", "file": "m.Q8_0.gguf", "sha256": "0", "size": 4}
    (models / "hf" / "org--repo" / "m.Q8_0.gguf.hub.json").write_text(json.dumps(record), encoding="utf-8")
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "own.gguf").write_bytes(b"GGUF")
    rows = {c.spec: c for c in model_choices(str(folder), models_dir=models)}
    smol = rows["smollm2-135m-instruct"]
    assert not smol.present and "llama Q4_1 · chat · not downloaded" in smol.detail
    assert "base model" in rows["gemma3-270m"].detail
    assert rows["dropped.gguf"].present and "in the model cache" in rows["dropped.gguf"].detail
    assert rows["hf:org/repo/m.Q8_0.gguf"].present
    assert rows[str(folder / "sub" / "own.gguf")].present
