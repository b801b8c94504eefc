"""The command line's remote side: `--api-base` / `--api-key`, and `run`, `bench` and the TUI on a remote model.

With a base URL (flag, OPENAI_BASE_URL or `[remote] base_url`), `-m` names the server's model; without `-m`
(or `[remote] model`) the first model the server lists is used. Errors are `RemoteError` lines, exit 2.
`REMOTE` is its `BackendCli`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from engine.events import TokenEvent, TurnStats

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

if TYPE_CHECKING:  # the client (openai, httpx) loads when a command connects, not with the parser
    from .remote import RemoteBackend
    from .settings import AppSettings


def add_remote_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("remote server (instead of the local engine)")
    g.add_argument(
        "--api-base", dest="remote_base_url", metavar="URL",
        help="an OpenAI-compatible server, e.g. http://gpu-box:8000/v1 (default: $OPENAI_BASE_URL); -m then "
        "names its model; '' = the local engine",
    )  # fmt: skip
    g.add_argument("--api-key", dest="remote_api_key", metavar="KEY", help="its API key (default: $OPENAI_API_KEY)")


def remote_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings layer of the remote flags (absent ones left out)."""
    names = {"remote_base_url": "remote.base_url", "remote_api_key": "remote.api_key"}
    return {key: getattr(args, name) for name, key in names.items() if getattr(args, name, None) is not None}


def remote_model(args: argparse.Namespace, settings: AppSettings) -> str:
    """The server's model asked for: -m, else `[remote] model`, else "" (the first listed)."""
    return getattr(args, "model", None) or settings.remote.model


def open_remote(args: argparse.Namespace, settings: AppSettings, say: Callable[[str], None]) -> RemoteBackend:
    from .remote import connect

    remote = settings.remote
    return connect(
        remote.base_url.strip(),
        api_key=remote.api_key,
        model=remote_model(args, settings),
        settings=settings.sampling,
        timeout=remote.timeout,
        logprobs=remote.logprobs,
        progress=say,
    )


def run_remote(args: argparse.Namespace, settings: AppSettings) -> int:
    """`chatapp run` on the server: the reply on stdout, the timing summary on stderr."""
    if not args.prompt:
        raise CliError("the prompt is empty")
    for note in settings.sampling.validated()[1]:
        say(f"warning: {note}")
    constraint = reply_constraint(args)
    tools = run_tools(args)
    backend = open_remote(args, settings, say)
    stats = None
    if args.chat:
        chat = backend if constraint is None and tools is None else Constrained(backend, constraint, tools)
        stats, interrupted = run_chat_reply(chat, settings, args.prompt, yes=getattr(args, "yes", False))
        print_calls(stats)
    else:
        print(args.prompt, end="", flush=True)
        with ctrl_c_cancels(backend.cancel) as pressed:
            for event in backend.stream_completion(args.prompt, constraint=constraint):
                if isinstance(event, TurnStats):
                    stats = event
                else:
                    print(event.text, end="", flush=True)
        print(flush=True)
        interrupted = bool(pressed)
    for warning in backend.warnings():
        say(f"warning: {warning}")
    print_remote_summary(backend, stats, sys.stderr)
    return EXIT_INTERRUPTED if interrupted else 0


def print_remote_summary(backend: RemoteBackend, stats: TurnStats | None, out: TextIO) -> None:
    """llama.cpp's summary where we can measure it: TTFT and arrivals on this side, counts from the server."""
    print(file=out)
    print(f"{'remote':>16} = {backend.model_id} on {backend.remote.server} at {backend.remote.host}", file=out)
    if stats is None:
        return
    steps = max(stats.generated_tokens - 1, 0)
    rate = 1000.0 * steps / stats.decode_ms if stats.decode_ms > 0 else 0.0
    print(f"{'time to first':>16} = {stats.ttft_ms:10.2f} ms (measured here, network included)", file=out)
    print(
        f"{'prompt':>16} = {stats.prompt_tokens:5d} tokens, {stats.reused_tokens} cached on the server"
        + ("" if stats.prompt_tokens else " (the server reported no usage)"),
        file=out,
    )
    print(
        f"{'eval time':>16} = {stats.decode_ms:10.2f} ms / {steps:5d} runs   ({rate:8.2f} tokens per second)",
        file=out,
    )
    print(f"{'stop':>16} = {stats.stop_reason}; {stats.generated_tokens} tokens generated", file=out)


# ---- bench ------------------------------------------------------------------------------------------------

WORDS = ("time", "river", "light", "stone", "green", "music", "paper", "window", "city", "house", "north", "cloud")


def bench_remote(args: argparse.Namespace, settings: AppSettings) -> int:
    """`chatapp bench` on the server: prefill and decode speed as seen from here, each repetition a fresh
    random prompt (so no prompt cache helps), greedy, `ignore_eos` where the server knows it."""
    import dataclasses

    greedy = dataclasses.replace(settings.sampling, temperature=0.0, seed=0, max_tokens=args.n_gen)
    remote = dataclasses.replace(settings.remote, logprobs=False)
    backend = open_remote(args, dataclasses.replace(settings, sampling=greedy, remote=remote), say)
    extra = {"ignore_eos": True, "cache_prompt": False}  # llama-server's and vLLM's; others ignore them

    def once(seed: int, n_prompt: int) -> tuple[float, float, int, int]:
        rng = random.Random(seed)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_prompt))
        tokens: list[TokenEvent] = []
        stats = None
        for event in backend.stream_completion(prompt, extra=extra):
            if isinstance(event, TurnStats):
                stats = event
            else:
                tokens.append(event)
        assert stats is not None
        evaluated = stats.evaluated_tokens or n_prompt
        pp = evaluated / (stats.prefill_ms / 1000) if stats.prefill_ms > 0 else 0.0
        return pp, stats.decode_tok_s, evaluated, stats.generated_tokens

    once(10_000, min(args.n_prompt, 8))  # warm-up
    runs = [once(r, args.n_prompt) for r in range(max(1, args.repetitions))]
    pp, tg = [r[0] for r in runs], [r[1] for r in runs]
    device = f"remote {backend.remote.server} at {backend.remote.host}"
    result = {
        "model": backend.model_id,
        "device": device,
        "n_prompt": runs[-1][2],
        "n_gen": runs[-1][3],
        "repetitions": len(runs),
        "prefill_tok_s": statistics.mean(pp),
        "prefill_tok_s_std": statistics.pstdev(pp),
        "decode_tok_s": statistics.mean(tg),
        "decode_tok_s_std": statistics.pstdev(tg),
        "note": "measured on the client: prefill from the time to the first token (network included)",
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("| model | device | test | t/s |\n|---|---|---|---|")
    for test, key in ((f"pp{result['n_prompt']}", "prefill_tok_s"), (f"tg{result['n_gen']}", "decode_tok_s")):
        print(f"| {backend.model_id} | {device} | {test} | {result[key]:.2f} ± {result[key + '_std']:.2f} |")
    return 0


def remote_label(args: argparse.Namespace, settings: AppSettings) -> str:
    """What the TUI shows until the server has answered."""
    from .remote import host_of

    model = remote_model(args, settings) or "the first model"
    return f"{model} @ {host_of(settings.remote.base_url.strip())}"


class RemoteCli:
    """A model on an OpenAI-compatible server as the command line sees it (a `BackendCli`)."""

    picks_models = False  # the server's models: another -m

    def add_args(self, p: argparse.ArgumentParser) -> None:
        add_remote_args(p)

    def overrides(self, args: argparse.Namespace) -> dict[str, Any]:
        return remote_overrides(args)

    def open(self, args: argparse.Namespace, settings: AppSettings, progress: Callable[[str], None]) -> RemoteBackend:
        return open_remote(args, settings, progress)

    def label(self, args: argparse.Namespace, settings: AppSettings) -> str:
        return remote_label(args, settings)

    def run(self, args: argparse.Namespace, settings: AppSettings) -> int:
        return run_remote(args, settings)

    def bench(self, args: argparse.Namespace, settings: AppSettings) -> int:
        return bench_remote(args, settings)


REMOTE = RemoteCli()
