"""Speculative decoding options: `-md/--model-draft`, `--draft-max` (llama.cpp's names) and `--lookup`, for the
app, `run` and `bench`; config keys `model_draft`, `draft_max` and `lookup`. Both a draft model and lookup: lookup's
guesses where the chat has a match, the model's elsewhere."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import Model
    from engine.speculative import Drafter

    from .settings import AppSettings

KEYS = ("model_draft", "draft_max", "draft_type", "lookup")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "-md", "--model-draft", dest="model_draft", metavar="MODEL",
        help="a smaller model of the same vocabulary that guesses tokens for the main one to check",
    )  # fmt: skip
    g.add_argument("--draft-max", dest="draft_max", type=int, metavar="N", help="most tokens per guess (default 16)")
    g.add_argument(
        "--draft-type", dest="draft_type", metavar="TYPE",
        help="the draft model's weights: file (as stored; the default) or q4_0 (re-encoded at load, cheaper guesses)",
    )  # fmt: skip
    g.add_argument(
        "--lookup", action="store_true", default=None,
        help="guess tokens from n-gram matches in the conversation itself (prompt lookup; with -md, before the model)",
    )  # fmt: skip


def draft_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in KEYS if getattr(args, k, None) is not None}


def make_drafter(
    settings: AppSettings, target: Model, load: Callable[..., Model], say: Callable[[str], None]
) -> Drafter | None:
    """The drafter the settings ask for, or None. `load(settings, requantize=TYPE)` loads the model named by its
    settings' `model`, its matrices re-encoded to TYPE where that has fewer bits (None: as stored)."""
    from engine.requantize import parse_type
    from engine.speculative import CombinedDrafter, LookupDrafter, ModelDrafter

    lookup = LookupDrafter(draft_max=settings.draft_max, paced=True) if settings.lookup else None
    if not settings.model_draft:
        return lookup
    draft = load(
        dataclasses.replace(settings, model=settings.model_draft, n_ctx=target.n_ctx),
        requantize=parse_type(settings.draft_type),
    )
    drafter = ModelDrafter(draft, target, draft_max=settings.draft_max, paced=True)  # refuses another vocabulary
    encoded = f", weights {draft.requantized}" if draft.requantized else ""
    first = ", prompt lookup's guesses first" if lookup else ""
    say(f"draft model {draft.name}{encoded}: up to {settings.draft_max} guessed tokens per step{first}")
    return CombinedDrafter(lookup, drafter) if lookup else drafter
