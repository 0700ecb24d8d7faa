"""One engine loop shared by every HTTP request.

The engine is not thread-safe and its step() blocks, so a single background
thread owns it: it applies queued commands (add / abort), runs step() while
work remains, and hands each RequestOutput to the asyncio queue of the request
it belongs to. HTTP handlers only ever talk to this class. Outputs carry
cumulative state, so a slow client that misses intermediate outputs just
coalesces them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from deepinfer.entrypoints.openai.request_context import RequestContext, current_request
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer.server")


class QueueFullError(Exception):
    """The engine's waiting queue is at its limit (answered as 503 + Retry-After)."""


class EngineStoppedError(Exception):
    """The engine loop is draining or stopped and takes no new requests."""


class EngineStepError(Exception):
    """engine.step() raised; the requests in flight are failed, not hung."""


class RequestFailedError(Exception):
    """The engine failed this one request (RequestOutput.error is set; its other requests go on).

    `error` is the engine's one-line description (logged, never sent to the client)."""

    def __init__(self, request_id: str, error: str):
        super().__init__(f"request {request_id} failed inside the engine")
        self.request_id = request_id
        self.error = error


@dataclass
class _Tracked:
    """Per-request state kept on the engine thread (timings feed the latency histograms)."""

    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


def _fails(item: RequestOutput | BaseException) -> bool:
    """An item of a request's queue that ends it in failure: an exception, or an output the engine failed."""
    return isinstance(item, BaseException) or item.error is not None


@dataclass
class RequestHandle:
    """What add_request returns: iterate outputs(); abort() when the client goes away."""

    request_id: str
    queue: asyncio.Queue
    engine: "AsyncEngine"
    finished: bool = False
    last: RequestOutput | None = None
    context: RequestContext | None = None  # the HTTP request's (access log: TTFT, completion tokens)
    _counted: int = 0

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield the newest cumulative output each time the request progresses; abort if left early.

        An output with `error` set (the engine failed this request alone) raises RequestFailedError. A failure
        never supersedes the progress queued before it: the tokens streamed before the failure reach the client
        first (a consumer that lagged a few steps behind once lost them: the error alone was sent)."""
        pending = None
        try:
            while not self.finished:
                if pending is not None:
                    item, pending = pending, None
                else:
                    item = await self.queue.get()
                while not self.queue.empty() and not _fails(item):
                    nxt = self.queue.get_nowait()  # cumulative: the newest supersedes the rest...
                    if _fails(nxt):  # ... but a failure waits until the progress before it is yielded
                        pending = nxt
                        break
                    item = nxt
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.last = item
                self._account(item)
                if item.error is not None:
                    self.finished = True  # the engine finished it and freed its blocks
                    raise RequestFailedError(self.request_id, item.error)
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    def _account(self, item: RequestOutput) -> None:
        if self.context is None:
            return
        total = sum(len(c.token_ids) for c in item.outputs)
        if total > self._counted:
            self.context.on_first_token()
            self.context.completion_tokens += total - self._counted
            self._counted = total

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


@dataclass
class StatsSnapshot:
    """The engine's stats as last seen by the loop thread (read by /metrics without touching the engine)."""

    stats: Any = None
    time: float = field(default_factory=time.monotonic)


class AsyncEngine:
    """Drives `engine` from one thread; safe to call from any asyncio loop."""

    def __init__(self, engine, max_waiting_requests: int | None = None, metrics=None, idle_wait_s: float = 0.2):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.snapshot = StatsSnapshot(stats=engine.stats())
        self.draining = False
        self.dead: BaseException | None = None
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deepinfer-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the loop thread (after the HTTP server has drained)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def num_in_flight(self) -> int:
        return len(self._tracked)

    # ------------------------------------------------------------ API for handlers

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; raises the engine's InvalidRequestError, QueueFullError or EngineStoppedError."""
        if self.draining or self._stop or not self.running:
            raise EngineStoppedError("the server is shutting down" if self.draining else "the engine loop is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        tracked = _Tracked(request_id, queue, loop, arrival=time.monotonic())
        self._commands.append(("add", tracked, prompt, params, accepted))
        self._wake.set()
        handle = RequestHandle(request_id, queue, self, context=current_request())
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left before the engine took it
            raise
        return handle

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            while True:
                self._apply_commands()
                if self._stop:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self.snapshot = StatsSnapshot(self.engine.stats())
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # the loop itself broke: fail everyone, report unhealthy
            logger.exception("engine loop died")
            self.dead = exc
            self._fail_all(EngineStepError(f"engine loop died: {exc!r}"))
            return
        for rid in list(self._tracked):
            self._abort_now(rid)
        self._fail_all(EngineStoppedError("the server stopped before the request finished"))

    def _apply_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                self._add_now(*cmd[1:])
            else:
                self._abort_now(cmd[1])

    def _add_now(self, tracked: _Tracked, prompt, params: SamplingParams, accepted) -> None:
        if accepted.done():  # cancelled by the handler already
            return
        try:
            limit = self.max_waiting_requests
            if limit is not None and self.engine.stats().num_waiting >= limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
            self.engine.add_request(tracked.request_id, prompt, params)
        except BaseException as exc:
            accepted.set_exception(exc)
            return
        self._tracked[tracked.request_id] = tracked
        accepted.set_result(None)

    def _abort_now(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return  # finished already, or never accepted
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%s) failed", request_id)
        if self.metrics is not None:
            self.metrics.on_finished("abort", tracked, time.monotonic())
        self.snapshot = StatsSnapshot(self.engine.stats())

    def _abort_engine(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%s) failed", request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine.step() failed; failing the %d requests in flight", len(self._tracked))
            for rid in list(self._tracked):
                tracked = self._tracked.pop(rid)
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    pass
                self._deliver(tracked, EngineStepError(f"engine step failed: {exc!r}"))
            return
        now = time.monotonic()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted while this step ran
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > tracked.num_tokens:
                if self.metrics is not None:
                    if tracked.first_token is None:
                        self.metrics.on_first_token(now - tracked.arrival)
                    else:
                        self.metrics.on_inter_token(now - tracked.last_token)
                tracked.first_token = tracked.first_token or now
                tracked.last_token = now
                tracked.num_tokens = num_tokens
            if out.error is not None:  # the engine failed this request alone (RequestOutput.error)
                logger.error("engine request %s failed: %s", out.request_id, out.error)
                if not out.finished:
                    self._abort_engine(out.request_id)
            if out.finished or out.error is not None:
                del self._tracked[out.request_id]
                if self.metrics is not None:
                    reasons = {"error"} if out.error is not None else {c.finish_reason for c in out.outputs}
                    self.metrics.on_finished(reasons.pop() if len(reasons) == 1 else "mixed", tracked, now)
            self._deliver(tracked, out)
        self.snapshot = StatsSnapshot(self.engine.stats())

    @staticmethod
    def _deliver(tracked: _Tracked, item) -> None:
        try:
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening
            pass

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._tracked):
            self._deliver(self._tracked.pop(rid), exc)
