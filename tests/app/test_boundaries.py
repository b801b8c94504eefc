"""The app/engine boundary, checked on the source: what each side may import.

The TUI reaches the engine only through `chatapp.backend.ChatBackend` and the plain value types it exchanges
(engine.events, engine.sampling, engine.errors); never Numba, the kernels or the model. The engine knows
nothing of the UI: no Textual, no Rich, no chatapp.

This reads every `import` statement (and `importlib.import_module("...")` / `__import__("...")` with a
literal name) with `ast`, so it holds whatever `engine/__init__.py` happens to import at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUI = ROOT / "chatapp" / "tui"
ENGINE = ROOT / "engine"

TUI_MAY_IMPORT_FROM_ENGINE = {"engine.events", "engine.sampling", "engine.errors"}
TUI_FORBIDDEN = ("numba", "llvmlite", "engine.kernels", "engine.model")
ENGINE_FORBIDDEN = ("textual", "rich", "chatapp")


def module_package(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of the modules `source` imports (relative imports resolved against `package`)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            # `from engine import model` imports the submodule engine.model
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def sources(folder: Path) -> list[Path]:
    files = sorted(folder.rglob("*.py"))
    assert files, f"no Python files under {folder}"
    return files


@pytest.mark.parametrize("path", sources(TUI), ids=lambda p: str(p.relative_to(ROOT)))
def test_tui_modules_reach_the_engine_only_through_the_boundary_types(path: Path):
    names = imported_modules(path.read_text(encoding="utf-8"), module_package(path))
    forbidden = sorted(n for n in names if any(is_within(n, f) for f in TUI_FORBIDDEN))
    assert not forbidden, f"{path.relative_to(ROOT)} imports {forbidden}"
    engine_names = {n for n in names if is_within(n, "engine")}
    # `from engine.events import Message` yields engine.events and engine.events.Message: judge the module.
    outside = sorted(n for n in engine_names if not any(is_within(n, ok) for ok in TUI_MAY_IMPORT_FROM_ENGINE))
    assert not outside, f"{path.relative_to(ROOT)} imports {outside}; use chatapp.backend.ChatBackend"


@pytest.mark.parametrize("path", sources(ENGINE), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_modules_know_nothing_of_the_ui(path: Path):
    names = imported_modules(path.read_text(encoding="utf-8"), module_package(path))
    forbidden = sorted(n for n in names if any(is_within(n, f) for f in ENGINE_FORBIDDEN))
    assert not forbidden, f"{path.relative_to(ROOT)} imports {forbidden}"


def test_the_scan_sees_every_spelling_of_an_import():
    source = (
        "import numba\n"
        "from engine import model\n"
        "from engine.kernels.cpu import matvec\n"
        "import importlib\n"
        "importlib.import_module('llvmlite')\n"
        "from .. import backend\n"
        "from .widgets import chat_log\n"
    )
    names = imported_modules(source, "chatapp.tui")
    assert {"numba", "engine.model", "engine.kernels.cpu", "llvmlite", "chatapp.backend"} <= names
    assert "chatapp.tui.widgets.chat_log" in names
