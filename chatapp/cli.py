"""`chatapp`: the TUI with no subcommand; `run`, `serve`, `pull`, `models`, `bench` for the terminal and scripts.

Every error a user can cause ends as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the commands import what they use when they run
    from gguf import GGMLQuantizationType

    from engine.events import GrammarSpec, TurnStats

    from .backend import ChatBackend
    from .model_choices import ModelChoice
    from .settings import AppSettings

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


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
    # Both checked by the settings schema (one-line errors), not by argparse.
    p.add_argument("--device", help="auto (a CUDA GPU when CuPy finds one; the default), cpu or cuda")
    p.add_argument(
        "-ngl", "--gpu-layers", dest="gpu_layers", metavar="N",
        help="leading layers on the GPU; -1 (default) = all and the output head, as llama.cpp's -ngl",
    )  # fmt: skip


def _mcp_args(p: argparse.ArgumentParser) -> None:
    shape = '{"mcpServers": {"NAME": {"command": ..., "args": [...]}}} (or "url")'
    p.add_argument("--mcp-config", metavar="FILE", help=f"MCP servers the chat may call tools of: {shape}")


def build_parser() -> argparse.ArgumentParser:
    from .drafting import add_draft_args
    from .remote_cli import add_remote_args

    parser = argparse.ArgumentParser(prog="chatapp", description="Chat with local language models.")
    _model_args(parser)
    add_draft_args(parser)
    add_remote_args(parser)
    parser.add_argument("--system", dest="system_prompt", help="system prompt for new chats")
    _mcp_args(parser)
    app_shape = parser.add_mutually_exclusive_group()  # the app's starting reply format (/format changes it)
    app_shape.add_argument("-j", "--json-schema", metavar="FILE|JSON", help="replies must match this JSON schema")
    app_shape.add_argument("--grammar", metavar="FILE", help="replies match this GBNF/Lark grammar")
    _sampling_args(parser)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="generate from a prompt and print it")
    _model_args(run)
    add_draft_args(run)
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
    add_remote_args(run)

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
    add_draft_args(bench)
    bench.add_argument("-p", "--n-prompt", type=int, default=256)
    bench.add_argument("-n", "--n-gen", type=int, default=128)
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("--json", action="store_true")
    add_remote_args(bench)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "model", "n_ctx", "threads", "device", "gpu_layers", "system_prompt", "temperature", "top_k", "top_p",
        "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "max_tokens",
        "deterministic",
    )  # fmt: skip
    from .drafting import draft_overrides
    from .remote_cli import remote_overrides

    given = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "mcp_config", None):
        given["mcp_config"] = args.mcp_config
    return given | draft_overrides(args) | remote_overrides(args)


def _settings(args: argparse.Namespace):
    from .settings import ConfigError, load_settings

    try:
        return load_settings(_overrides(args))
    except ConfigError as e:
        raise CliError(str(e)) from None


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


def _load(
    args: argparse.Namespace, settings, say: Callable[[str], None], console: bool = True, pull: bool = False,
    requantize: GGMLQuantizationType | None = None,
):  # fmt: skip
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
    )
    model.deterministic = settings.deterministic
    if model.device != "cpu":
        say(f"running on {model.device}")
    return model


def reply_constraint(args: argparse.Namespace) -> GrammarSpec | None:
    """`--json-schema FILE|JSON` or `--grammar FILE` as a GrammarSpec; CliError naming the flag."""
    from engine.events import GrammarSpec

    if getattr(args, "json_schema", None):
        text = args.json_schema
        if not text.lstrip().startswith(("{", "[")):
            text = _read_flag_file("--json-schema", text)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"--json-schema: not valid JSON: {e}") from None
        return GrammarSpec("json_schema", text)
    if getattr(args, "grammar", None):
        return GrammarSpec("gbnf", _read_flag_file("--grammar", args.grammar))  # GBNF, or Lark as it is
    return None


def _read_flag_file(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def run_tools(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """`--tools FILE|JSON`: OpenAI's tools array, each a function with a name; CliError naming the flag."""
    text = getattr(args, "tools", None)
    if not text:
        return None
    if not args.chat:
        raise CliError("--tools: needs --chat")
    if not text.lstrip().startswith("["):
        text = _read_flag_file("--tools", text)
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"--tools: not valid JSON: {e}") from None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    )
    if not ok:
        raise CliError('--tools: expected an array of {"type": "function", "function": {"name": ...}}')
    return tools


def print_calls(stats: Any) -> None:
    """A reply's tool calls on stdout, one JSON object a line."""
    for call in getattr(stats, "tool_calls", ()) or ():
        print(json.dumps({"id": call.id, "name": call.name, "arguments": call.arguments}, ensure_ascii=False))


class _Constrained:
    """A backend whose every reply is held to one constraint and offered the same tools (`run --chat`)."""

    def __init__(
        self, backend: ChatBackend, constraint: GrammarSpec | None, tools: list[dict[str, Any]] | None = None
    ) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_constraint", constraint)
        object.__setattr__(self, "_tools", tools)

    def stream_reply(self, messages, tools=None):  # noqa: ANN001, ANN201 - ChatBackend's
        tools = tools or self._tools
        if self._constraint is None:
            return self._backend.stream_reply(messages, tools)
        return self._backend.stream_reply(messages, tools, constraint=self._constraint)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)


def cmd_run(args: argparse.Namespace) -> int:
    from engine.chat import ChatSession
    from engine.events import TurnStats

    from .report import print_run_summary

    settings = _settings(args)
    if args.mcp_config and not args.chat:
        raise CliError("--mcp-config needs --chat: tools are called from a chat reply")
    if args.mcp_config and getattr(args, "tools", None):
        raise CliError("--tools prints the calls, --mcp-config runs them: give one of the two")
    if settings.remote.enabled:
        from .remote_cli import run_remote

        return run_remote(args, settings)

    def say(msg: str) -> None:
        print(f"chatapp: {msg}", file=sys.stderr, flush=True)

    constraint = reply_constraint(args)
    tools = run_tools(args)
    model = _load(args, settings, say)
    for warning in model.warnings:
        say(f"warning: {warning}")
    if constraint is not None:
        from engine.constraint import compile_grammar
        from engine.errors import GrammarError

        try:
            compile_grammar(model.tokenizer, constraint)
        except GrammarError as e:
            raise CliError(f"{'--json-schema' if args.json_schema else '--grammar'}: {e}") from None
    from .drafting import make_drafter

    drafter = make_drafter(settings, model, partial(_load, args, say=say), say)
    chat = ChatSession(model, settings.sampling, drafter=drafter)
    for note in settings.sampling.validated()[1]:
        say(f"warning: {note}")
    if args.chat:
        for w in chat.warnings():
            if w not in model.warnings:  # those were said above
                say(f"warning: {w}")
        backend = chat if constraint is None and tools is None else _Constrained(chat, constraint, tools)
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
    with _ctrl_c_cancels(chat.cancel) as pressed:
        for event in chat.stream_completion(ids, constraint=constraint):
            if isinstance(event, TurnStats):
                stats = event
            else:
                print(event.text, end="", flush=True)
    print(flush=True)
    print_run_summary(model, stats, sys.stderr)
    return EXIT_INTERRUPTED if pressed else 0


def run_chat_reply(
    backend: ChatBackend, settings: AppSettings, prompt: str, *, yes: bool = False
) -> tuple[TurnStats | None, bool]:
    """`run --chat`: one user message through the chat service (no store), the reply on stdout as it comes.
    With MCP servers configured, their tools are offered: each call is printed to stderr and asked about on
    the terminal (`yes`: every call runs unasked).

    Returns the reply's stats (None if it failed) and whether Ctrl+C stopped it."""
    from .chat_service import ChatService, ReplyError
    from .mcp.terminal import TerminalTools
    from .recorder import Recorder

    service = ChatService(
        Recorder(None, lambda _text: None),
        model_name=getattr(backend, "model_name", ""),
        settings=backend.settings,
        system_prompt=settings.system_prompt,
        backend=backend,
    )
    with TerminalTools(settings.mcp, yes=yes) as tools, _ctrl_c_cancels(service.stop) as interrupted:
        try:
            reply = service.ask(prompt, lambda text: print(text, end="", flush=True), tools.chat, tools.show,
                                tools.approve)  # fmt: skip
        except ReplyError as e:
            print(flush=True)
            raise CliError(str(e)) from None
    print(flush=True)
    return reply.stats, bool(interrupted)


@contextlib.contextmanager
def _ctrl_c_cancels(cancel: Callable[[], object]) -> Iterator[list[bool]]:
    """While generating, the first Ctrl+C cancels the reply (the token loop ends it with its stats); a second
    one interrupts. A KeyboardInterrupt raised inside the generator would kill it and lose the stats.

    Yields a list that is non-empty once Ctrl+C was pressed.
    """
    pressed: list[bool] = []

    def on_sigint(_signum: int, _frame: object) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)
        cancel()

    if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from .serve import ServeOptions, serve

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: expected 0 to 65535")
    if args.n_slots < 1:
        raise CliError(f"--parallel {args.n_slots}: expected at least 1")
    if args.max_queue < 0:
        raise CliError(f"--queue {args.max_queue}: expected 0 or more")
    settings = _settings(args)

    def say(msg: str) -> None:
        print(f"chatapp: {msg}", file=sys.stderr, flush=True)

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
    return serve(lambda: _load(args, resolved, say), options, settings.sampling, say)


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
    from .bench import run_bench

    settings = _settings(args)
    if settings.remote.enabled:
        from .remote_cli import bench_remote

        return bench_remote(args, settings)
    from .drafting import make_drafter

    def say(msg: str) -> None:
        print(f"chatapp: {msg}", file=sys.stderr, flush=True)

    model = _load(args, settings, say)
    drafter = make_drafter(settings, model, partial(_load, args, say=say), say)
    return run_bench(model, args.n_prompt, args.n_gen, args.repetitions, args.json, drafter=drafter)


def cmd_tui(args: argparse.Namespace) -> int:
    from .tui.launch import run_app

    settings = _settings(args)
    reply_format = reply_constraint(args)

    def factory_for_model(spec: str):
        """A backend factory for the model `spec` (the picker's choice), with every other setting as given."""
        return lambda progress: local_factory(progress, dataclasses.replace(settings, model=spec))

    def factory(progress: Callable[[str], None]):
        return local_factory(progress, settings)

    def local_factory(progress: Callable[[str], None], settings):
        from engine.chat import ChatSession

        from .catalog import load_catalog
        from .drafting import make_drafter
        from .naming import display_name

        model = _load(args, settings, progress, console=False, pull=True)
        drafter = make_drafter(settings, model, partial(_load, args, say=progress, console=False), progress)
        from .kv_cache import kv_store_for

        chat = ChatSession(model, settings.sampling, drafter=drafter)
        chat.display_name = display_name(model.file.path, model.file.metadata, load_catalog())
        chat.kv_store = kv_store_for(settings)  # a resumed chat starts from its saved cache; each turn saves it
        chat.autosave = True
        return chat

    from .model_choices import model_choices

    model_name = settings.model
    choices: Callable[[], list[ModelChoice]] | None = partial(model_choices, settings.models_folder)
    switch: Callable[[str], Any] | None = factory_for_model
    if settings.remote.enabled:
        choices = switch = None  # the server's models: another -m
        from .remote_cli import open_remote, remote_label

        def factory(progress: Callable[[str], None]):  # noqa: F811 - the remote server instead
            return open_remote(args, settings, progress)

        model_name = remote_label(args, settings)

    from .paths import user_data_dir

    run_app(
        factory,
        model_name=model_name,
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
