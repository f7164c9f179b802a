"""The serving lifecycle of `infhip-serve`: admission limits (429), drain (503, then ending what
still runs), per-request deadlines, liveness / readiness, and the API key; the reference with
every flag and default is docs/serving.md ("Lifecycle").

All of `Lifecycle`'s state lives on the server's event loop (handlers and the drain task run
there), so its counters need no lock. A request holds a `Ticket` from the moment its handler
starts until its answer is written (streams included): the drain waits for the tickets to go.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from infhip.runtime.serving import admission as A

# Paths answered whatever the state (probes, scrapes): never 503 for draining nor 401.
OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics", "/version"})
END_GRACE_S = 5.0  # after ending every request, how long their handlers get to write the last event
# Prompt tokens held beyond the KV cache's capacity by default: queued prompts cost host memory
# only (token lists, ~40 bytes a token: 16M tokens ~ 0.7 GB); the time rule bounds the wait.
DEFAULT_WAITING_TOKENS = 1 << 24


@dataclass(frozen=True)
class ServingPolicy:
    """Limits and timeouts of the lifecycle. None for an admission limit means "derived from the
    engine" (`Lifecycle` says how); 0 for request_timeout_s means no server-side deadline."""

    drain_timeout_s: float = 30.0  # SIGTERM/SIGINT: how long running requests may go on
    max_waiting_requests: int | None = None  # requests beyond the engine's batch; None: no count limit
    max_waiting_tokens: int | None = None  # prompt tokens beyond what the KV cache holds; None: DEFAULT_WAITING_TOKENS
    max_queue_wait_s: float | None = None  # backlog wait past which (over FLOOR requests) 429; None: derived
    request_timeout_s: float = 0.0  # default (and cap of) a request's "timeout"; 0 = none
    header_timeout_s: float = 10.0  # request line + headers must arrive within this, else 408 and closed
    stall_timeout_s: float = 120.0  # /health/live: 503 once one engine turn has run this long
    retry_after_s: int = 1  # Retry-After of a draining 503 (a 429's is the expected wait)
    api_key: str | None = None  # Bearer token required on /v1/*, /tokenize, /detokenize

    def __post_init__(self) -> None:
        for name in ("drain_timeout_s", "request_timeout_s", "header_timeout_s", "stall_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ServingPolicy.{name} ({_flag(name)}) must be a finite number >= 0, got {v!r}")
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"ServingPolicy.{name} ({_flag(name)}) must be an int >= 0 or None (derived), "
                                 f"got {v!r}")
        if self.max_queue_wait_s is not None and not (isinstance(self.max_queue_wait_s, (int, float))
                                                      and not isinstance(self.max_queue_wait_s, bool)
                                                      and 0 < self.max_queue_wait_s < math.inf):
            raise ValueError(f"ServingPolicy.max_queue_wait_s (--max-queue-wait) must be a finite number > 0 or "
                             f"None (derived), got {self.max_queue_wait_s!r}")
        if isinstance(self.retry_after_s, bool) or not isinstance(self.retry_after_s, int) or self.retry_after_s < 1:
            raise ValueError(f"ServingPolicy.retry_after_s must be an int >= 1, got {self.retry_after_s!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServingPolicy.api_key must be a non-empty string or None")


def _flag(field: str) -> str:
    """infhip-serve's flag of a ServingPolicy field (drain_timeout_s -> --drain-timeout)."""
    return "--" + field.removesuffix("_s").replace("_", "-")


class Refused(Exception):
    """A request turned away at the door: status 429 or 503, with Retry-After."""

    def __init__(self, status: int, message: str, retry_after_s: int):
        super().__init__(message)
        self.status, self.message = status, message
        self.headers = {"Retry-After": str(retry_after_s)}


class Ticket:
    """One request's place in the server (from its handler's start to its answer's end)."""

    def __init__(self, lifecycle: "Lifecycle", arrived: float):
        self._lc, self.arrived, self.prompt_tokens, self._done = lifecycle, arrived, 0, False
        self.streaming = False  # the answer is a stream: released when it ends, not when the handler returns
        self.work = A.Work()  # its work left, for the expected waits (admission.py)

    def add_prompt(self, num_tokens: int) -> None:
        """Count the tokenized prompt; Refused (429) when the prompt-token budget is full. A
        request alone in the server is always let in (the engine says whether it fits)."""
        lc = self._lc
        others = lc.prompt_tokens_in
        if others and others + num_tokens > lc.max_prompt_tokens:
            lc.metrics.rejected.labels(reason="prompt_tokens").inc()
            retry = A.retry_after(lc.first_leave_s())
            raise Refused(429, f"the server holds {others} prompt tokens; this prompt's {num_tokens} would pass "
                               f"the limit of {lc.max_prompt_tokens} (--max-waiting-tokens); retry in {retry} s", retry)
        self.prompt_tokens = num_tokens
        lc.prompt_tokens_in += num_tokens

    def start(self, prompt_tokens: int, max_output_tokens: int) -> None:
        """The request goes to the engine: its work is known."""
        self.work.start(prompt_tokens, max_output_tokens)

    def deadline(self, requested_s: float | None) -> float | None:
        """The request's monotonic deadline: its own timeout, capped by --request-timeout."""
        limits = [t for t in (requested_s, self._lc.policy.request_timeout_s or None) if t]
        return self.arrived + min(limits) if limits else None

    def release_unless_streaming(self) -> None:
        if not self.streaming:
            self.release()

    def release(self) -> None:
        if not self._done:
            self._done = True
            lc = self._lc
            lc.requests_in -= 1
            lc.prompt_tokens_in -= self.prompt_tokens
            lc.works.discard(self.work)
            if lc.requests_in == 0:
                lc._empty.set()


class Lifecycle:
    """Admission, drain and health of one server (event-loop state; see the module docstring).

    Defaults (admission.py): no count limit; past FLOOR requests, a new one is refused when the
    backlog wait passes max_queue_wait (the request timeout if set, else 600 s). Prompt tokens:
    at most kv_capacity_tokens + max_waiting_tokens (default DEFAULT_WAITING_TOKENS: host memory).
    An explicit max_waiting_requests W: at most max_num_seqs + W requests in the server."""

    def __init__(self, policy: ServingPolicy, info, loop, metrics):
        """info: the engine's EngineInfo (runtime/outputs.py); loop: its EngineLoop."""
        self.policy, self.loop, self.metrics = policy, loop, metrics
        self.batch = batch = info.max_num_seqs
        kv_tokens = info.kv_capacity_tokens
        self.max_waiting_requests = policy.max_waiting_requests  # None: no count limit (the time rule)
        self.max_waiting_tokens = (max(kv_tokens, DEFAULT_WAITING_TOKENS) if policy.max_waiting_tokens is None
                                   else policy.max_waiting_tokens)
        self.max_requests = None if self.max_waiting_requests is None else batch + self.max_waiting_requests
        self.max_prompt_tokens = kv_tokens + self.max_waiting_tokens
        self.max_queue_wait_s = policy.max_queue_wait_s or policy.request_timeout_s or A.DEFAULT_MAX_QUEUE_WAIT_S
        self.throughput = A.Throughput(A.cold_tokens_per_s(batch))
        self.works: set[A.Work] = set()  # of the tickets out
        self.requests_in = 0
        self.prompt_tokens_in = 0
        self.draining = False  # set by drain(): new requests get 503, /health/ready 503
        self.ending = False  # the drain ran out (or a second signal): every request ends now
        self._empty = asyncio.Event()  # requests_in reached 0 (created on the server's loop)
        self._empty.set()

    # -- admission ------------------------------------------------------------------------------
    def admit(self) -> Ticket:
        """A ticket for a new generating request; Refused (503 draining, 429 full) otherwise."""
        if self.draining:
            self.metrics.rejected.labels(reason="draining").inc()
            raise Refused(503, "the server is shutting down; send the request to another replica",
                          self.policy.retry_after_s)
        if self.max_requests is not None and self.requests_in >= self.max_requests:
            self.metrics.rejected.labels(reason="queue_full").inc()
            retry = A.retry_after(self.first_leave_s())  # the body says what the header says
            raise Refused(429, f"the server holds {self.requests_in} requests, its limit (the engine's batch + "
                               f"{self.max_waiting_requests} waiting, --max-waiting-requests); retry in {retry} s",
                          retry)
        if self.max_requests is None and self.requests_in >= A.FLOOR:
            wait = self.backlog_wait_s()
            if wait > self.max_queue_wait_s:
                self.metrics.rejected.labels(reason="queue_wait").inc()
                retry = A.retry_after(wait - self.max_queue_wait_s)
                raise Refused(429, f"the server holds {self.requests_in} requests, about {wait:.0f} s of work at "
                                   f"{self.throughput.tokens_per_s:.0f} tokens/s, more than its bound of "
                                   f"{self.max_queue_wait_s:g} s (--max-queue-wait); retry in {retry} s", retry)
        self.requests_in += 1
        self._empty.clear()
        ticket = Ticket(self, time.monotonic())
        self.works.add(ticket.work)
        return ticket

    def backlog_wait_s(self) -> float:
        """Seconds of work in the server at the engine's throughput (admission.py)."""
        return A.backlog_wait_s(self.works, self.throughput)

    def first_leave_s(self) -> float:
        """Seconds until the running request nearest its end finishes (admission.py)."""
        return A.first_leave_s(self.works, self.batch, self.throughput)

    def check_not_ending(self) -> None:
        """Before handing a request to the engine: once the drain has ended everything, nothing
        new may start (a request still tokenizing at that moment gets 503)."""
        if self.ending:
            raise Refused(503, "the server is shutting down; send the request to another replica",
                          self.policy.retry_after_s)

    # -- drain ----------------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting, wait up to timeout_s for the requests in the server to finish, then
        end the rest (last event "abort") and give their handlers END_GRACE_S to answer.
        Whether everything finished by itself."""
        self.draining = True
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
            return True
        except TimeoutError:
            pass
        await self.end_now()
        return False

    async def end_now(self) -> None:
        """End every request in the engine now and wait (bounded) for their answers to go out."""
        self.draining = self.ending = True
        self.loop.end_all()
        try:
            await asyncio.wait_for(self._empty.wait(), END_GRACE_S)
        except TimeoutError:
            pass

    # -- health ---------------------------------------------------------------------------------
    def live(self) -> str | None:
        """Why the server is not live (None: it is): the engine thread died, or one turn has
        run for more than stall_timeout_s."""
        if not self.loop.alive:
            return f"the engine thread is not running ({self.loop.death!r})"
        started = self.loop.turn_started
        if started is not None and time.monotonic() - started > self.policy.stall_timeout_s:
            return (f"one engine step has run for {time.monotonic() - started:.0f} s "
                    f"(> {self.policy.stall_timeout_s:g} s, --stall-timeout)")
        return None

    def ready(self) -> str | None:
        """Why the server should get no traffic now (None: ready)."""
        if self.draining:
            return "draining: the server is shutting down"
        if (why := self.live()) is not None:
            return why
        if self.max_requests is not None and self.requests_in >= self.max_requests:
            return f"full: {self.requests_in} requests (limit {self.max_requests})"
        if self.requests_in >= A.FLOOR and self.backlog_wait_s() > self.max_queue_wait_s:
            return f"full: {self.backlog_wait_s():.0f} s of work queued (bound {self.max_queue_wait_s:g} s)"
        return None


# A refused request's body is read (and dropped) up to this many bytes before the answer: a socket
# closed with unread data in it is reset (RST), and the client then sees a broken connection
# instead of the 503 (tests/test_server_drain.py met it); past the limit the client pays that.
DISCARD_LIMIT = 1 << 20


async def _read_body(receive, limit: int) -> None:
    """Read and drop the request body, up to ``limit`` bytes."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class Gate:
    """ASGI middleware in front of the app: while draining, every request but the probes and
    scrapes (OPEN_PATHS) gets 503 with Retry-After and Connection: close; with an API key, the
    API paths need ``Authorization: Bearer <key>`` (else 401)."""

    API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, lifecycle: Lifecycle, error_body):
        self.app, self.lc, self.error_body = app, lifecycle, error_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.lc.draining:
            self.lc.metrics.rejected.labels(reason="draining").inc()
            headers = {"Retry-After": str(self.lc.policy.retry_after_s), "Connection": "close"}
            msg = "the server is shutting down; send the request to another replica"
            await _read_body(receive, DISCARD_LIMIT)  # closing on an unread body resets the connection
            return await JSONResponse(self.error_body(503, msg), 503, headers)(scope, receive, send)
        key = self.lc.policy.api_key
        if key is not None and scope["path"].startswith(self.API_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + key.encode()):
                msg = "missing or wrong API key: send the header 'Authorization: Bearer <key>' (--api-key)"
                return await JSONResponse(self.error_body(401, msg), 401,
                                          {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        return await self.app(scope, receive, send)
