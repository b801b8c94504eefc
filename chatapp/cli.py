"""`chatapp`: the TUI with no subcommand; `run`, `serve`, `pull`, `models`, `bench` for the terminal and scripts.

Every error a user can cause ends as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from engine.cache_types import CACHE_TYPES

from .cli_common import EXIT_INTERRUPTED, EXIT_USAGE, BackendCli, CliError, reply_constraint, say
from .local_cli import LOCAL, load, resolve_model_path
from .remote_cli import REMOTE

if TYPE_CHECKING:  # annotations only: the commands import what they use when they run
    from .model_choices import ModelChoice
    from .settings import AppSettings

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "CliError", "build_parser", "main", "resolve_model_path"]

# llama.cpp's spelling where it is not the setting's name; max_tokens is each command's own -n.
_SAMPLING_FLAGS = {"temperature": "--temp", "max_tokens": None}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """One flag per sampling setting, from the engine's declaration (type, accepted values, meaning)."""
    from engine.sampling import SAMPLER_SETTINGS

    g = p.add_argument_group("sampling")
    for setting in SAMPLER_SETTINGS:
        flag = _SAMPLING_FLAGS.get(setting.name, "--" + setting.name.replace("_", "-"))
        if flag is not None:
            help_text = f"{setting.help} Accepts {setting.expected}." if setting.expected else setting.help
            g.add_argument(flag, dest=setting.name, type=setting.kind, help=help_text.replace("%", "%%"))


def _n_predict(p: argparse.ArgumentParser, what: str) -> None:
    """-n, llama.cpp's name for max_tokens, with the declaration's accepted values."""
    from engine.sampling import SAMPLER_SETTINGS_BY_NAME

    setting = SAMPLER_SETTINGS_BY_NAME["max_tokens"]
    p.add_argument("-n", "--n-predict", dest="max_tokens", type=setting.kind, help=f"{what}: {setting.expected}")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="a catalog name (see `chatapp models`) or a path to a .gguf file")
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, help="context size in tokens")
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument(
        "--deterministic", action="store_true", default=None,
        help="the same tokens give the same logits however the cache computed them (greedy replies repeat); "
        "slower prefill",
    )  # fmt: skip
    # Checked by the settings schema (one-line errors), not by argparse.
    for short, name, what in (("-ctk", "k", "keys"), ("-ctv", "v", "values")):
        p.add_argument(
            short, f"--cache-type-{name}", dest=f"cache_type_{name}", metavar="TYPE",
            help=f"how the KV cache stores {what}: {' or '.join(CACHE_TYPES)} (default f16; q8_0 halves its memory)",
        )  # fmt: skip
    p.add_argument("--device", help="auto (a CUDA GPU when CuPy finds one; the default), cpu or cuda")
    p.add_argument(
        "-ngl", "--gpu-layers", dest="gpu_layers", metavar="N",
        help="leading layers on the GPU; -1 (default) = all and the output head, as llama.cpp's -ngl",
    )  # fmt: skip


def _mcp_args(p: argparse.ArgumentParser) -> None:
    shape = '{"mcpServers": {"NAME": {"command": ..., "args": [...]}}} (or "url")'
    p.add_argument("--mcp-config", metavar="FILE", help=f"MCP servers the chat may call tools of: {shape}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatapp", description="Chat with local language models.")
    _model_args(parser)
    LOCAL.add_args(parser)
    REMOTE.add_args(parser)
    parser.add_argument("--system", dest="system_prompt", help="system prompt for new chats")
    _mcp_args(parser)
    app_shape = parser.add_mutually_exclusive_group()  # the app's starting reply format (/format changes it)
    app_shape.add_argument("-j", "--json-schema", metavar="FILE|JSON", help="replies must match this JSON schema")
    app_shape.add_argument("--grammar", metavar="FILE", help="replies match this GBNF/Lark grammar")
    _sampling_args(parser)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="generate from a prompt and print it")
    _model_args(run)
    LOCAL.add_args(run)
    run.add_argument("-p", "--prompt", required=True)
    _n_predict(run, "tokens to generate")
    run.add_argument("--chat", action="store_true", help="send the prompt as a user message via the template")
    run.add_argument("--system", dest="system_prompt", help="system prompt (with --chat)")
    _mcp_args(run)
    run.add_argument("--yes", action="store_true", help="with --mcp-config: run every tool call without asking")
    shape = run.add_mutually_exclusive_group()
    shape.add_argument("-j", "--json-schema", metavar="FILE|JSON", help="the reply must match this JSON schema")
    shape.add_argument(
        "--grammar", "--grammar-file", dest="grammar", metavar="FILE", help="reply in this GBNF/Lark grammar"
    )
    run.add_argument(
        "--tools", metavar="FILE|JSON", help="with --chat: tools the model may call; calls print as JSON"
    )
    _sampling_args(run)
    REMOTE.add_args(run)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: 8080)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health")
    serve.add_argument("-a", "--alias", help="the model's name in /v1/models (default: MODEL as given)")
    serve.add_argument(
        "-np", "--parallel", dest="n_slots", type=int, default=4, metavar="N",
        help="conversation slots, each keeping one client's KV cache (default: 4; one reply runs at a time)",
    )  # fmt: skip
    serve.add_argument(
        "--queue", dest="max_queue", type=int, default=16, metavar="N",
        help="requests that may wait behind the running one; more are answered 503 (default: 16)",
    )  # fmt: skip
    _n_predict(serve, "the default reply limit")
    _sampling_args(serve)

    pull = sub.add_parser("pull", help="download a catalog model, or hf:ORG/REPO[:QUANT|/FILE.gguf], into the cache")
    pull.add_argument("name", help="a catalog name, or hf:ORG/REPO[:QUANT] or hf:ORG/REPO/FILE.gguf from the hub")
    pull.add_argument("--force", action="store_true", help="download again even if present")

    sub.add_parser("models", help="list catalog models and downloaded files")

    bench = sub.add_parser("bench", help="measure prefill and decode speed")
    _model_args(bench)
    LOCAL.add_args(bench)
    bench.add_argument("-p", "--n-prompt", type=int, default=256)
    bench.add_argument("-n", "--n-gen", type=int, default=128)
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--split", action="store_true", help="where a decoded token's time goes, part by part")
    bench.add_argument("--depth", type=int, default=0, help="the split after a prompt of this many tokens (-p's)")
    REMOTE.add_args(bench)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "model", "n_ctx", "threads", "device", "gpu_layers", "system_prompt", "temperature", "top_k", "top_p",
        "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "max_tokens",
        "deterministic", "cache_type_k", "cache_type_v",
    )  # fmt: skip
    given = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "mcp_config", None):
        given["mcp_config"] = args.mcp_config
    return given | LOCAL.overrides(args) | REMOTE.overrides(args)


def backend_cli(settings: AppSettings) -> BackendCli:
    """The backend the settings name: a server when `[remote]` has a base URL, else the local engine."""
    return REMOTE if settings.remote.enabled else LOCAL


def _settings(args: argparse.Namespace) -> AppSettings:
    from .settings import ConfigError, load_settings

    try:
        return load_settings(_overrides(args))
    except ConfigError as e:
        raise CliError(str(e)) from None


def cmd_run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.mcp_config and not args.chat:
        raise CliError("--mcp-config needs --chat: tools are called from a chat reply")
    if args.mcp_config and getattr(args, "tools", None):
        raise CliError("--tools prints the calls, --mcp-config runs them: give one of the two")
    return backend_cli(settings).run(args, settings)


def cmd_serve(args: argparse.Namespace) -> int:

    from .serve import ServeOptions, serve

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: expected 0 to 65535")
    if args.n_slots < 1:
        raise CliError(f"--parallel {args.n_slots}: expected at least 1")
    if args.max_queue < 0:
        raise CliError(f"--queue {args.max_queue}: expected 0 or more")
    settings = _settings(args)
    path = resolve_model_path(settings.model, say)  # before binding: a bad name fails at once
    model_id = args.alias or settings.model
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        n_slots=args.n_slots,
        max_queue=args.max_queue,
        model_id=model_id,
        model_names=frozenset({model_id, settings.model, path.name, path.stem}),
    )
    resolved = dataclasses.replace(settings, model=str(path))
    return serve(lambda: load(resolved, say), options, settings.sampling, say)


def cmd_pull(args: argparse.Namespace) -> int:
    from . import hub
    from .pull import pull_with_progress

    if hub.is_hub_spec(args.name):
        path = hub.pull(args.name, force=args.force)
        print(f"{args.name}: sha256 verified against the hub, saved to {path}")
        return 0
    pull_with_progress(args.name, force=args.force)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .catalog import default_model_name, list_models

    table = Table("name", "present", "size", "description")
    default = default_model_name()
    for row in list_models():
        entry = row.entry
        size = f"{entry.size / 1e6:.0f} MB" if entry else f"{row.path.stat().st_size / 1e6:.0f} MB"
        name = row.name + (" (default)" if row.name == default else "")
        table.add_row(
            name, "yes" if row.present else "no", size, entry.description if entry else str(row.path)
        )
    Console().print(table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    settings = _settings(args)
    return backend_cli(settings).bench(args, settings)


def cmd_tui(args: argparse.Namespace) -> int:
    from .model_choices import model_choices
    from .paths import user_data_dir
    from .tui.launch import run_app

    settings = _settings(args)
    reply_format = reply_constraint(args)
    side = backend_cli(settings)

    def factory_for_model(spec: str) -> Callable[[Callable[[str], None]], Any]:
        """A backend factory for the model `spec` (the picker's choice), with every other setting as given."""
        return lambda progress: side.open(args, dataclasses.replace(settings, model=spec), progress)

    choices: Callable[[], list[ModelChoice]] | None = None
    switch: Callable[[str], Any] | None = None
    if side.picks_models:
        choices, switch = partial(model_choices, settings.models_folder), factory_for_model
    run_app(
        partial(side.open, args, settings),
        model_name=side.label(args, settings),
        settings=settings.sampling,
        system_prompt=settings.system_prompt,
        store_path=user_data_dir() / "conversations.db",
        theme=settings.theme,
        model_choices=choices,
        factory_for_model=switch,
        mcp=settings.mcp,
        reply_format=reply_format,
    )
    return 0


COMMANDS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    None: cmd_tui,
    "run": cmd_run,
    "serve": cmd_serve,
    "pull": cmd_pull,
    "models": cmd_models,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import EngineError

    from .catalog import ModelError
    from .settings import ConfigError

    try:
        return COMMANDS[args.command](args)
    except (CliError, EngineError, ModelError, ConfigError, OSError) as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("chatapp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
