"""The engine thread shared by `infhip-serve` (runtime/serving/) and the Triton model
(builder/triton_model.py): one thread owns the `LLM` and steps it; other threads hand it
requests and read each request's messages from its outbox.

    loop = EngineLoop(llm).start()
    outbox = loop.submit("Once upon a time", None, SamplingParams(max_tokens=8))
    first = outbox.get()            # _Accepted(prompt_tokens), or an Exception (ValueError: bad input)
    while (msg := outbox.get()) is not None:
        ...                         # StreamDelta (the last one has finish_reason), or an Exception
    loop.cancel(outbox)             # a client that left: abort the request, free its KV pages
    loop.close()

An outbox is anything with ``put(message)`` called from the engine thread (default a
`queue.Queue`; the HTTP server passes one that forwards into an asyncio queue). A request that
fails alone (the LLM finished it with finish_reason "error") gets its final `StreamDelta` like any
other, whose ``error`` attribute says why; when `LLM.step` itself raises, every live request gets
that exception and the loop keeps serving. If the thread dies anyway, every live and later request
gets the reason at once (`alive` turns False).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

from infhip.runtime.sampling_params import SamplingParams

_log = logging.getLogger("infhip.engine_loop")


class _Accepted:
    """First message of a request's outbox: the engine took it (prompt length for the usage)."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens


class Outbox(Protocol):
    def put(self, message) -> None: ...


class EngineObserver(Protocol):
    """Told what the engine thread does, on that thread (runtime/serving/metrics.py): a request
    accepted (with the monotonic time it was submitted), each delta, a request gone (finished or
    aborted), a whole step that failed, and the state after every loop turn."""

    def accepted(self, req, submitted: float) -> None: ...
    def delta(self, req, delta) -> None: ...
    def gone(self, req, aborted: bool) -> None: ...
    def step_failed(self, num_requests: int) -> None: ...
    def sample(self, llm) -> None: ...


class EngineLoop:
    """The engine thread: takes requests from other threads, steps the LLM, hands out deltas.

    Each request's outbox receives `_Accepted`, then `StreamDelta`s (the last with its finish
    reason), then None; or one exception if the engine refused the request."""

    def __init__(self, llm, observer: EngineObserver | None = None):
        self.llm = llm
        self.observer = observer
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, tuple[object, Outbox]] = {}  # id(outbox) -> (request, outbox)
        self._stop = threading.Event()
        self._death_lock = threading.Lock()  # orders submit() against the thread's death
        self.death: BaseException | None = None  # why the thread died (None while it runs)
        self._thread = threading.Thread(target=self._run, name="infhip-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.death is None and self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join()

    def submit(self, prompt: str | None, token_ids: list[int] | None, params: SamplingParams,
               outbox: Outbox | None = None) -> Outbox:
        """Queue a request (prompt text, or token ids, or both: then the ids are used and the text
        is kept as the request's prompt); returns its outbox."""
        outbox = queue.Queue() if outbox is None else outbox
        with self._death_lock:
            if self.death is not None:
                outbox.put(RuntimeError(f"the engine thread died: {self.death!r}"))
            else:
                self._inbox.put(("add", prompt, token_ids, params, outbox, time.monotonic()))
        return outbox

    def cancel(self, outbox: Outbox) -> None:
        self._inbox.put(("abort", outbox))

    def _handle(self, msg) -> None:
        if msg is None:
            return
        if msg[0] == "add":
            _, prompt, token_ids, params, outbox, submitted = msg
            try:
                req = self.llm._add(prompt, token_ids, params)
            except Exception as e:  # noqa: BLE001 - handed to the caller, which answers 400 for a ValueError
                outbox.put(e)
                return
            self._live[id(outbox)] = (req, outbox)
            if self.observer is not None:
                self.observer.accepted(req, submitted)
            outbox.put(_Accepted(len(req.seq.prompt_token_ids)))
        else:
            live = self._live.pop(id(msg[1]), None)
            if live is not None:
                self.llm._abort(live[0])
                if self.observer is not None:
                    self.observer.gone(live[0], aborted=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._turn()
        except BaseException as e:  # noqa: BLE001 - nobody may wait forever on a dead thread
            _log.exception("the engine thread died")
            self._die(e)

    def _turn(self) -> None:
        """Take what arrived (waiting for it when idle), run one step, then hand out its messages
        (after the observer has sampled the state, so a client that has its answer never reads
        metrics from before it)."""
        try:
            self._handle(self._inbox.get(timeout=None if not self._live else 0.0))
            while True:
                self._handle(self._inbox.get_nowait())
        except queue.Empty:
            pass
        mail = self._step() if self._live and not self._stop.is_set() else []
        if self.observer is not None:
            self.observer.sample(self.llm)
        for outbox, message in mail:
            outbox.put(message)

    def _step(self) -> list[tuple[Outbox, object]]:
        """One LLM step; the (outbox, message) pairs it produced."""
        try:
            touched = {id(r) for r in self.llm.step()}
        except Exception as e:  # noqa: BLE001 - every live request learns why and is freed
            mail = [(outbox, e) for _, outbox in self._live.values()]
            for req, _ in self._live.values():
                self.llm._abort(req)
            if self.observer is not None:
                self.observer.step_failed(len(self._live))
            self._live.clear()
            return mail
        mail = []
        for key, (req, outbox) in list(self._live.items()):
            if id(req) not in touched and not req.seq.is_finished:
                continue  # nothing new (e.g. still prefilling): no detokenizer work
            delta = self.llm._delta(req)
            if delta is not None:
                if self.observer is not None:
                    self.observer.delta(req, delta)
                mail.append((outbox, delta))
            if req.seq.is_finished:
                self.llm._abort(req)  # forget it: its pages are already free
                if self.observer is not None:
                    self.observer.gone(req, aborted=False)
                mail.append((outbox, None))
                del self._live[key]
        return mail

    def _die(self, e: BaseException) -> None:
        """Fail every live and queued request with the reason; later submits fail at once."""
        with self._death_lock:
            self.death = e
        error = RuntimeError(f"the engine thread died: {e!r}")
        for req, outbox in self._live.values():
            outbox.put(error)
            try:  # free its KV pages if the LLM still can
                self.llm._abort(req)
            except Exception:  # noqa: BLE001 - the LLM may be what broke
                _log.exception("aborting a request of the dead engine thread failed")
        self._live.clear()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg is not None and msg[0] == "add":
                msg[4].put(error)
