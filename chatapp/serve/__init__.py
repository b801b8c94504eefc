"""`chatapp serve`: the engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

    app.py        routes, errors, auth
    schema.py     request validation
    prompts.py    requests to token ids
    scheduler.py  the inference thread and its bounded queue
    slots.py      conversation slots (KV caches kept per client conversation)
    streaming.py  SSE and disconnect handling
    formats.py    response shapes

The socket is bound first (an address in use is a one-line error), then the model loads on the inference
thread while /health answers 503 "Loading model", as llama-server does.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

    from engine import Model
    from engine.sampling import SamplingSettings

BACKLOG = 2048  # connections the kernel queues before the server accepts them (uvicorn's default)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    n_slots: int = 4  # conversation slots, llama-server's -np
    max_queue: int = 16  # requests that may wait behind the running one; more get 503
    model_id: str = ""  # the name /v1/models lists
    model_names: frozenset[str] = frozenset()  # names a request may use for the model


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening; OSError naming the address when that fails.

    It listens before "listening on" is printed, so a client that connects on reading that line waits in the
    backlog until the server accepts (the model loads meanwhile) instead of being refused."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(
    load: Callable[[], Model],
    options: ServeOptions,
    defaults: SamplingSettings,
    say: Callable[[str], None],
) -> int:
    """Serve until interrupted. `load` runs on the inference thread; its exception, if any, is raised here."""
    import uvicorn

    from .app import Service, build_app
    from .lengths import longest_token_bytes
    from .scheduler import Scheduler

    sock = bind(options.host, options.port)
    failures: list[BaseException] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            scheduler.close()  # running replies end now, so the graceful shutdown does not wait on them
            super().handle_exit(sig, frame)

    def on_failure(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    def on_ready(model: Model, warnings: list[str]) -> None:
        for warning in warnings:
            say(f"warning: {warning}")
        say(f"ready: {options.model_id}, context {model.n_ctx}, {options.n_slots} slots, {model.threads} threads")
        longest_token_bytes(model.tokenizer)  # cached for the first request's length check (lengths.py)

    scheduler = Scheduler(load, options.n_slots, options.max_queue, on_failure, on_ready)
    service = Service(scheduler, options.model_id, options.model_names, defaults, options.api_key)
    config = uvicorn.Config(
        build_app(service), http="h11", lifespan="off", log_level="warning", timeout_graceful_shutdown=5
    )
    server = Server(config)
    host = f"[{options.host}]" if ":" in options.host else options.host
    say(f"listening on http://{host}:{sock.getsockname()[1]}")
    scheduler.start()
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()
        sock.close()
    if failures:
        raise failures[0]
    return 0
