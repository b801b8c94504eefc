"""The one inference thread: it loads the model, then runs queued jobs one at a time on the conversation slots.

HTTP handlers run on the event loop; they `submit` a `Job` (refused with 503 when the queue is full) and read its
events from an asyncio queue that the inference thread fills. `Job.cancel()` may be called from any thread: a
waiting job is skipped, a running one stops after its current token.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.events import TokenEvent, TurnStats

from .schema import ApiError, Generation

if TYPE_CHECKING:
    from engine import Model
    from engine.chat import ChatSession

    from .slots import SlotPool

RETRY_AFTER_S = 1  # what a refused client is told to wait; one reply is usually done by then
CANCELLED = ApiError(503, "the request was cancelled before it ran", type="unavailable_error", code="cancelled")


@dataclass(frozen=True)
class Token:
    event: TokenEvent
    piece: str  # the token's own text (for logprobs); "" when logprobs were not asked for


@dataclass(eq=False)
class Job:
    """One request's generation; created on the event loop that will read its events."""

    prompt: list[int]
    gen: Generation
    request_id: str = ""  # the response's id, shown in /slots
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue[Token | TurnStats | ApiError] = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _chat: ChatSession | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop this job: skipped if still queued, else ended after the current token."""
        self._cancelled.set()
        chat = self._chat
        if chat is not None:
            chat.cancel()

    async def stream(self) -> AsyncIterator[Token | TurnStats]:
        """The job's Tokens, then its TurnStats; an ApiError from the engine is raised."""
        while True:
            item = await self.events.get()
            if isinstance(item, ApiError):
                raise item
            yield item
            if isinstance(item, TurnStats):
                return

    def _put(self, item: Token | TurnStats | ApiError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is reading
            self.cancel()


class Scheduler:
    """Owns the model and the slots; only its thread runs the engine."""

    def __init__(
        self,
        load: Callable[[], Model],
        n_slots: int,
        max_queue: int,
        on_failure: Callable[[BaseException], None],
        on_ready: Callable[[Model, list[str]], None] = lambda model, warnings: None,
    ) -> None:
        self._load = load
        self._n_slots = n_slots
        self.max_queue = max_queue
        self._on_failure = on_failure
        self._on_ready = on_ready
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: Job | None = None
        self.state = "loading"  # -> "ready" | "failed"; "closed" after close()
        self.model: Model | None = None
        self.pool: SlotPool | None = None
        self._thread = threading.Thread(target=self._main, name="inference", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; ApiError 503 while loading or when `max_queue` jobs are already waiting."""
        with self._cond:
            if self.state == "loading":
                raise ApiError(503, "Loading model", type="unavailable_error", code="loading")
            if self.state != "ready":
                raise ApiError(503, "the server is shutting down", type="unavailable_error", code="unavailable")
            waiting = sum(not j.cancelled for j in self._pending)
            if waiting >= self.max_queue:
                raise ApiError(
                    503,
                    f"the server is busy: {waiting} requests are waiting (at most {self.max_queue}); retry later",
                    type="unavailable_error",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._pending.append(job)
            self._cond.notify()

    def close(self) -> None:
        """Cancel every job and let the thread end."""
        with self._cond:
            if self.state in ("loading", "ready"):
                self.state = "closed"
            running = self._running
            jobs = [*self._pending, *([running] if running else [])]
            self._pending.clear()
            self._cond.notify()
        for job in jobs:
            job.cancel()
            if job is not running:
                job._put(CANCELLED)

    def slots_info(self) -> list[dict[str, object]]:
        return [slot.info() for slot in self.pool.slots] if self.pool else []

    # -- the inference thread ------------------------------------------------------------------------------

    def _main(self) -> None:
        from .slots import SlotPool

        try:
            model = self._load()
            pool = SlotPool.create(model, self._n_slots)
        except BaseException as e:  # reported by the caller as one line
            with self._cond:
                self.state = "failed"
            self._on_failure(e)
            return
        with self._cond:
            self.model, self.pool = model, pool
            if self.state == "loading":
                self.state = "ready"
        self._on_ready(model, pool.slots[0].chat.warnings())
        while True:
            with self._cond:
                while not self._pending and self.state == "ready":
                    self._cond.wait()
                if self.state != "ready":
                    return
                job = self._pending.popleft()
                if job.cancelled:
                    job._put(CANCELLED)  # its reader may still be waiting for an end
                    continue
                self._running = job
            try:
                self._run(job, pool)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job, pool: SlotPool) -> None:
        slot = pool.choose(job.prompt)
        chat = slot.chat
        chat.settings = job.gen.settings
        want_pieces = job.gen.n_logprobs is not None
        slot.busy, slot.last_request = True, job.request_id
        job._chat = chat
        try:
            bias = dict(job.gen.logit_bias) or None
            stop_ids = () if job.gen.ignore_eos else None  # None: the model's end-of-turn tokens
            events = chat.stream_completion(
                job.prompt, constraint=job.gen.constraint, logit_bias=bias, stop=job.gen.stop, stop_ids=stop_ids
            )
            for event in events:
                if job.cancelled:  # a cancel that came before the session cleared its flag at the start
                    chat.cancel()
                if isinstance(event, TurnStats):
                    slot.last_stop, slot.last_generated = event.stop_reason, event.generated_tokens
                    job._put(event)
                else:
                    piece = chat.model.detokenize([event.token_id]) if want_pieces else ""
                    job._put(Token(event, piece))
        except Exception as e:  # an engine failure ends this request, not the server
            print(f"chatapp: error: generation failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            job._put(ApiError(500, f"generation failed: {e}", type="server_error", code="engine_error"))
        finally:
            job._chat = None
            slot.busy = False
            pool.touch(slot)
