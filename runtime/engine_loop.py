"""The engine as every frontend sees it (`infhip-serve`, runtime/serving/; the Triton model,
runtime/serving/triton/; `infhip-run`, runtime/cli.py): one thread owns the `EngineCore`
(runtime/engine_core.py) and steps it; other threads hand it requests and read each request's
messages from its outbox. Its surface (docs/design/engine_interface.md) is all a frontend calls:

    loop = EngineLoop(llm).start()   # an LLM (runtime/llm.py) or an EngineCore; the thread owns it now
    outbox = loop.submit("Once upon a time", None, SamplingParams(max_tokens=8))          # submit
    for delta in loop.stream(outbox): ...      # stream: StreamDelta, the last with finish_reason
    loop.cancel(outbox)                        # abort: the client left, its KV pages are freed
    loop.end_all()                             # abort every live request with a last "abort" delta
    loop.stats(), loop.info                    # stats: EngineStats after the last turn; EngineInfo
    loop.alive, loop.death, loop.turn_started  # health
    loop.tokenizer, loop.compile_grammar(spec) # tokenizer (None: a --random-weights engine)
    loop.close()

Each outbox receives `_Accepted(prompt_tokens)`, then `StreamDelta`s, then None; or one exception
(ValueError: bad input, refused). A request may carry a deadline (``submit(...,
deadline=time.monotonic() + s)``): once it passes, queued or generating, the engine thread aborts
it and sends its last `StreamDelta` with finish_reason "abort", then None.

An outbox is anything with ``put(message)`` called from the engine thread (default a
`queue.Queue`; the HTTP server passes one that forwards into an asyncio queue). A request that
fails alone gets its final `StreamDelta` with ``error`` set; when `EngineCore.step` itself raises,
every live request gets that exception and the loop keeps serving. If the thread dies anyway,
every live and later request gets the reason at once (`alive` turns False).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Protocol

from infhip.runtime.outputs import EngineInfo, EngineStats, StreamDelta
from infhip.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infhip.runtime.engine_core import EngineCore
    from infhip.runtime.llm import LLM

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
    aborted, with the cause of an abort: "client" left, "deadline" passed, "shutdown"), a whole
    step that failed, and the engine's stats after every loop turn."""

    def accepted(self, req, submitted: float) -> None: ...
    def delta(self, req, delta) -> None: ...
    def gone(self, req, aborted: bool, cause: str = "client") -> None: ...
    def step_failed(self, num_requests: int) -> None: ...
    def sample(self, stats: EngineStats) -> None: ...


class EngineLoop:
    """The engine thread: takes requests from other threads, steps the core, hands out deltas
    (the module docstring gives its surface). ``engine``: an LLM or an EngineCore, which this
    loop's thread owns from `start()` on (nothing else may step it)."""

    def __init__(self, engine: LLM | EngineCore, observer: EngineObserver | None = None):
        self.core = core = getattr(engine, "core", engine)
        self.observer = observer
        self.info: EngineInfo = core.info()
        self.tokenizer = core.tokenizer
        self._stats = core.stats()  # after the last turn (replaced whole: readable from any thread)
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, tuple[object, Outbox]] = {}  # id(outbox) -> (request, outbox)
        self._deadlines: dict[int, float] = {}  # id(outbox) -> monotonic deadline, for live requests that have one
        self._stop = threading.Event()
        self._death_lock = threading.Lock()  # orders submit() against the thread's death
        self.death: BaseException | None = None  # why the thread died (None while it runs)
        self._thread = threading.Thread(target=self._run, name="infhip-engine", daemon=True)
        # Liveness: when the turn in progress began (None while the thread waits for work, idle).
        # A turn that runs for long means a step is stuck (or one huge prefill chunk).
        self.turn_started: float | None = None
        self._ended: list[tuple[Outbox, object]] = []  # messages of requests _end()ed this turn, sent after sample

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
               outbox: Outbox | None = None, deadline: float | None = None) -> Outbox:
        """Queue a request (prompt text, or token ids, or both: then the ids are used and the text
        is kept as the request's prompt); returns its outbox. deadline: a time.monotonic() after
        which the request is aborted, queued or not (its last delta says "abort")."""
        outbox = queue.Queue() if outbox is None else outbox
        with self._death_lock:
            if self.death is not None:
                outbox.put(RuntimeError(f"the engine thread died: {self.death!r}"))
            else:
                self._inbox.put(("add", prompt, token_ids, params, outbox, time.monotonic(), deadline))
        return outbox

    def cancel(self, outbox: Outbox) -> None:
        """The client left: abort its request (no more messages are sent to its outbox)."""
        self._inbox.put(("abort", outbox))

    def end_all(self) -> None:
        """End every live request now: each gets its last delta (finish_reason "abort") and None."""
        self._inbox.put(("end_all",))

    def stream(self, outbox: queue.Queue, wait_s: float | None = None):
        """Yield the StreamDeltas of a request `submit` queued into a queue.Queue (the default
        outbox), until its last; raises what the engine sent instead (ValueError: refused).
        wait_s: also yield None whenever nothing came for that long (the caller may end it then)."""
        while True:
            try:
                msg = outbox.get(timeout=wait_s)
            except queue.Empty:
                yield None
                continue
            if msg is None:
                return
            if isinstance(msg, BaseException):
                raise msg
            if isinstance(msg, StreamDelta):
                yield msg

    def stats(self) -> EngineStats:
        """Requests and KV pages after the engine thread's last turn (any thread)."""
        return self._stats

    def compile_grammar(self, spec) -> None:
        """Compile a request's grammar (StructuredOutputsParams) into the engine's cache, on the
        caller's thread, so that `submit` finds it compiled (ValueError: it does not compile)."""
        self.core.grammars.compile(spec)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def _handle(self, msg) -> None:
        if msg is None:
            return
        if msg[0] == "add":
            _, prompt, token_ids, params, outbox, submitted, deadline = msg
            try:
                req = self.core.add_request(prompt, token_ids, params)
            except Exception as e:  # noqa: BLE001 - handed to the caller, which answers 400 for a ValueError
                outbox.put(e)
                return
            self._live[id(outbox)] = (req, outbox)
            if deadline is not None:
                self._deadlines[id(outbox)] = deadline
            if self.observer is not None:
                self.observer.accepted(req, submitted)
            outbox.put(_Accepted(len(req.seq.prompt_token_ids)))
        elif msg[0] == "abort":
            self._deadlines.pop(id(msg[1]), None)
            live = self._live.pop(id(msg[1]), None)
            if live is not None:
                self.core.abort(live[0])
                if self.observer is not None:
                    self.observer.gone(live[0], aborted=True)
        else:  # end_all
            for key in list(self._live):
                self._end(key, "shutdown")

    def _end(self, key: int, cause: str) -> None:
        """Abort live request `key` in the engine (pages freed) and send its last delta
        (finish_reason "abort", with any text the detokenizer still held) and None."""
        req, outbox = self._live.pop(key)
        self._deadlines.pop(key, None)
        self.core.abort(req)
        deltas = self.core.deltas(req)  # one per completion (n > 1: several)
        if self.observer is not None:
            for delta in deltas:
                self.observer.delta(req, delta)
            self.observer.gone(req, aborted=True, cause=cause)
        self._ended += [(outbox, delta) for delta in deltas]
        self._ended.append((outbox, None))

    def _expire(self) -> None:
        """End the live requests whose deadline has passed."""
        if self._deadlines:
            now = time.monotonic()
            for key in [k for k, d in self._deadlines.items() if d <= now]:
                self._end(key, "deadline")

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
        self.turn_started = None
        try:
            self._handle(self._inbox.get(timeout=None if not self._live else 0.0))
            self.turn_started = time.monotonic()
            while True:
                self._handle(self._inbox.get_nowait())
        except queue.Empty:
            pass
        self.turn_started = self.turn_started or time.monotonic()
        self._expire()
        mail, self._ended = self._ended, []
        mail += self._step() if self._live and not self._stop.is_set() else []
        self._stats = self.core.stats()
        if self.observer is not None:
            self.observer.sample(self._stats)
        for outbox, message in mail:
            outbox.put(message)

    def _step(self) -> list[tuple[Outbox, object]]:
        """One core step; the (outbox, message) pairs it produced."""
        try:
            touched = {id(r) for r in self.core.step()}
        except Exception as e:  # noqa: BLE001 - every live request learns why and is freed
            mail = [(outbox, e) for _, outbox in self._live.values()]
            for req, _ in self._live.values():
                self.core.abort(req)
            if self.observer is not None:
                self.observer.step_failed(len(self._live))
            self._live.clear()
            self._deadlines.clear()
            return mail
        mail = []
        for key, (req, outbox) in list(self._live.items()):
            if id(req) not in touched and not req.is_finished:
                continue  # nothing new (e.g. still prefilling): no detokenizer work
            for delta in self.core.deltas(req):  # one per completion that moved (n > 1: several)
                if self.observer is not None:
                    self.observer.delta(req, delta)
                mail.append((outbox, delta))
            if req.is_finished:  # every completion of it
                self.core.abort(req)  # forget it: its pages are already free
                if self.observer is not None:
                    self.observer.gone(req, aborted=False)
                mail.append((outbox, None))
                del self._live[key]
                self._deadlines.pop(key, None)
        return mail

    def _die(self, e: BaseException) -> None:
        """Fail every live and queued request with the reason; later submits fail at once."""
        with self._death_lock:
            self.death = e
        error = RuntimeError(f"the engine thread died: {e!r}")
        for req, outbox in self._live.values():
            outbox.put(error)
            try:  # free its KV pages if the core still can
                self.core.abort(req)
            except Exception:  # noqa: BLE001 - the core may be what broke
                _log.exception("aborting a request of the dead engine thread failed")
        self._live.clear()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg is not None and msg[0] == "add":
                msg[4].put(error)
