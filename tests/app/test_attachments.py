"""Attaching a file to a message: /read PATH in the message box, or F9; text goes in fenced under its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.attachments import AttachmentError, expand_read_command, fenced, read_attachment
from engine.events import Message
from tests.app.fake_backend import FakeBackend, make_app, ready, record_notices, send, wait_for


def test_a_text_file_goes_in_fenced_under_its_name(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a + b\n", encoding="utf-8")
    assert read_attachment("calc.py", cwd=tmp_path) == "`calc.py`\n```python\ndef add(a, b):\n    return a + b\n```"


def test_the_fence_outgrows_backticks_in_the_file() -> None:
    block = fenced("notes.md", "see ```code``` and ````more````", "markdown")
    assert block.splitlines()[1] == "`````markdown" and block.endswith("\n`````")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "no such file: missing.txt"),
        ("blob.bin", b"\x7fELF\x00\x01", "blob.bin is a binary file"),
        ("latin.txt", "café".encode("latin-1"), "latin.txt is not UTF-8 text"),
        ("huge.txt", b"x" * (256 * 1024 + 1), "huge.txt is 256 KB; files up to 256 KB can be attached"),
        ("folder", "dir", "folder is a directory"),
        ("", None, "/read needs a file"),
    ],
)
def test_what_cannot_be_attached_is_named(tmp_path: Path, name: str, content, message: str) -> None:
    if content == "dir":
        (tmp_path / name).mkdir()
    elif content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(AttachmentError, match=message):
        read_attachment(name, cwd=tmp_path)


def test_the_read_command_is_the_first_line_only(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    assert (
        expand_read_command("/read a.txt\nWhat does it say?", tmp_path)
        == "`a.txt`\n```txt\nhello\n```\n\nWhat does it say?"
    )
    assert expand_read_command("please /read a.txt", tmp_path) is None
    assert expand_read_command("/reading is fun", tmp_path) is None


async def test_read_in_the_box_puts_the_file_there_and_sends_it_with_the_question(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "todo.txt").write_text("buy milk\n", encoding="utf-8")
    backend = FakeBackend(["Milk."])
    app = make_app(backend)
    record_notices(app)
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "/read nothing-here.txt", wait=False)
        await pilot.pause()
        assert backend.calls == [] and any("no such file: nothing-here.txt" in n for n in app.notices)
        assert app.prompt.text.strip() == "/read nothing-here.txt"  # kept, to correct
        app.prompt.clear()
        await send(pilot, "/read todo.txt", wait=False)
        await pilot.pause()
        assert backend.calls == [] and app.prompt.text.startswith("`todo.txt`\n```txt\nbuy milk\n```")
        await pilot.press(*"What should I buy?", "enter")
        await wait_for(pilot, lambda: backend.calls, what="the message")
    assert backend.calls[-1][-1] == Message("user", "`todo.txt`\n```txt\nbuy milk\n```\n\nWhat should I buy?")


async def test_f9_attaches_above_the_draft(tmp_path) -> None:
    (tmp_path / "log.txt").write_text("error 42\n", encoding="utf-8")
    app = make_app(FakeBackend())
    async with app.run_test() as pilot:
        await ready(pilot)
        app.prompt.set_text("Why does this fail?")
        await pilot.press("f9")
        await pilot.press(*str(tmp_path / "log.txt"), "enter")
        await pilot.pause()
        assert app.prompt.text == "`log.txt`\n```txt\nerror 42\n```\n\nWhy does this fail?\n"
