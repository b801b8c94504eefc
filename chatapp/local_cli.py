"""The command line's local side: a model file run by this process's engine (the default backend).

Its flags are the speculative-decoding ones (chatapp/drafting.py); -m, -c, -t, --device and -ngl are every
command's. `LOCAL` is its `BackendCli`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli_common import (
    EXIT_INTERRUPTED,
    CliError,
    Constrained,
    ctrl_c_cancels,
    print_calls,
    reply_constraint,
    run_chat_reply,
    run_tools,
    say,
)

if TYPE_CHECKING:  # annotations only: the commands import what they use when they run
    from gguf import GGMLQuantizationType

    from engine.chat import ChatSession
    from engine.model import Model

    from .settings import AppSettings


def resolve_model_path(spec: str, say: Callable[[str], None], *, console: bool = True, pull: bool = False) -> Path:
    """A catalog name or a path; the default catalog model (with `pull`, any catalog model) is pulled on first
    use.

    With `console`, the pull draws a progress bar on the terminal; without (inside the TUI), progress goes
    through `say` as text lines.
    """
    from . import hub
    from .catalog import ModelError, default_model_name, resolve_model
    from .pull import ensure_model, pull_with_progress

    if hub.is_hub_spec(spec):  # pulled on first use, as llama.cpp's -hf does
        if (found := hub.find_local(hub.HubSpec.parse(spec))) is not None:
            return found
        say(f"downloading {spec} from the hub")
        return hub.pull(spec, progress_bars=console)
    from .catalog import load_catalog

    try:
        return resolve_model(spec)
    except ModelError:
        if spec != default_model_name() and not (pull and spec in load_catalog()):
            raise
    say(f"first start: downloading the default model {spec}" if spec == default_model_name() else f"downloading {spec}")
    if console:
        return pull_with_progress(spec)

    def report(phase: str, done: int, total: int) -> None:
        unit = "wheels" if phase == "download" else "MB"
        scale = 1 if phase == "download" else 1e6
        say(f"{phase}: {done / scale:.0f}/{total / scale:.0f} {unit}")

    return ensure_model(spec, progress=report)


def load(
    settings: AppSettings, say: Callable[[str], None], console: bool = True, pull: bool = False,
    requantize: GGMLQuantizationType | None = None,
) -> Model:  # fmt: skip
    """The model `settings.model` names, loaded with the settings' context, threads and device."""
    from engine import load_model

    path = resolve_model_path(settings.model, say, console=console, pull=pull)
    model = load_model(
        path,
        n_ctx=settings.n_ctx,
        threads=settings.threads or None,
        progress=say,
        device=settings.device,
        gpu_layers=settings.gpu_layers,
        requantize=requantize,
        deterministic=settings.deterministic,
        cache_type_k=settings.cache_type_k,
        cache_type_v=settings.cache_type_v,
    )
    if model.device != "cpu":
        say(f"running on {model.device}")
    return model


class LocalCli:
    """The local engine as the command line sees it (a `BackendCli`)."""

    picks_models = True

    def add_args(self, p: argparse.ArgumentParser) -> None:
        from .drafting import add_draft_args

        add_draft_args(p)

    def overrides(self, args: argparse.Namespace) -> dict[str, Any]:
        from .drafting import draft_overrides

        return draft_overrides(args)

    def open(self, args: argparse.Namespace, settings: AppSettings, progress: Callable[[str], None]) -> ChatSession:
        """For the TUI: the model pulled when missing, a drafter when asked for, and a saved-cache store that
        each turn writes (a resumed chat starts from its saved cache)."""
        from engine.chat import ChatSession

        from .catalog import load_catalog
        from .drafting import make_drafter
        from .kv_cache import kv_store_for
        from .naming import display_name

        model = load(settings, progress, console=False, pull=True)
        drafter = make_drafter(settings, model, partial(load, say=progress, console=False), progress)
        return ChatSession(
            model,
            settings.sampling,
            drafter=drafter,
            display_name=display_name(model.file.path, model.file.metadata, load_catalog()),
            kv_store=kv_store_for(settings),
            autosave=True,
        )

    def label(self, args: argparse.Namespace, settings: AppSettings) -> str:
        return settings.model

    def run(self, args: argparse.Namespace, settings: AppSettings) -> int:
        from engine.chat import ChatSession
        from engine.events import TurnStats

        from .drafting import make_drafter
        from .report import print_run_summary

        constraint = reply_constraint(args)
        tools = run_tools(args)
        model = load(settings, say)
        for warning in model.warnings:
            say(f"warning: {warning}")
        if constraint is not None:
            from engine.constraint import compile_grammar
            from engine.errors import GrammarError

            try:
                compile_grammar(model.tokenizer, constraint)
            except GrammarError as e:
                raise CliError(f"{'--json-schema' if args.json_schema else '--grammar'}: {e}") from None
        drafter = make_drafter(settings, model, partial(load, say=say), say)
        chat = ChatSession(model, settings.sampling, drafter=drafter)
        for note in settings.sampling.validated()[1]:
            say(f"warning: {note}")
        if args.chat:
            for w in chat.warnings():
                if w not in model.warnings:  # those were said above
                    say(f"warning: {w}")
            backend = chat if constraint is None and tools is None else Constrained(chat, constraint, tools)
            stats, interrupted = run_chat_reply(backend, settings, args.prompt, yes=args.yes)
            print_calls(stats)
            print_run_summary(model, stats, sys.stderr)
            return EXIT_INTERRUPTED if interrupted else 0
        tok = model.tokenizer
        ids = tok.tokenize(args.prompt, special=True)
        if tok.add_bos and tok.bos_id is not None:
            ids.insert(0, tok.bos_id)
        if not ids:
            raise CliError("the prompt is empty")
        print(args.prompt, end="", flush=True)
        stats = None
        with ctrl_c_cancels(chat.cancel) as pressed:
            for event in chat.stream_completion(ids, constraint=constraint):
                if isinstance(event, TurnStats):
                    stats = event
                else:
                    print(event.text, end="", flush=True)
        print(flush=True)
        print_run_summary(model, stats, sys.stderr)
        return EXIT_INTERRUPTED if pressed else 0

    def bench(self, args: argparse.Namespace, settings: AppSettings) -> int:
        from .bench import run_bench
        from .drafting import make_drafter

        model = load(settings, say)
        drafter = make_drafter(settings, model, partial(load, say=say), say)
        split_depth = (args.depth or args.n_prompt) if getattr(args, "split", False) else None
        return run_bench(model, args.n_prompt, args.n_gen, args.repetitions, args.json, drafter, split_depth)


LOCAL = LocalCli()
