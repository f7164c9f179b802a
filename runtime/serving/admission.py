"""How long a new request would wait, and so whether `infhip-serve` admits it (docs/serving.md,
"Admission control").

The server holds requests (running, queued, reading their body, tokenizing); each has work left:
its prompt tokens until its first token arrives, then the output tokens it may still generate
(`max_tokens` x completions). The engine works through tokens at a throughput `Throughput`
measures while it is busy (prompt and output tokens per second, a 30-s exponential average);
before it has seen a second of work it assumes one decode step per second at the full batch,
slower than any engine we build (a tiny CPU engine does tens of steps per second).

    backlog wait = (work left of every request in the server) / throughput

By default a request is refused (429) only when the server already holds at least `FLOOR`
requests and the backlog wait passes `max_queue_wait_s` (the request timeout when one is set:
a request admitted past it would time out anyway). A benchmark with hundreds of clients is
answered, slowly, rather than told to go away. The explicit limits (--max-waiting-requests,
--max-waiting-tokens) refuse what passes them, as before. Every 429's Retry-After is the
expected time until a retry would get in: the backlog wait beyond the bound, or, for a count or
token limit, the time until the running request closest to its end finishes.
"""

from __future__ import annotations

import math
import threading
import time

FLOOR = 256  # requests always admitted (by the time rule) whatever the estimate says
DEFAULT_MAX_QUEUE_WAIT_S = 600.0  # without --request-timeout: ten minutes of backlog
MIN_MEASURED_BUSY_S = 1.0  # busy seconds before the measured throughput replaces the estimate
TAU_S = 30.0  # the throughput average forgets older work with this time constant


class Throughput:
    """Tokens per second the engine gets through while it has work. `observe` runs on the
    engine thread after every loop turn; `tokens_per_s` is read from the event loop (one float,
    written whole)."""

    def __init__(self, cold_tokens_per_s: float):
        if not cold_tokens_per_s > 0:
            raise ValueError(f"cold_tokens_per_s must be > 0, got {cold_tokens_per_s}")
        self.cold_tokens_per_s = cold_tokens_per_s
        self.tokens_per_s = cold_tokens_per_s
        self.measured = False
        self._tokens = 0.0  # decayed sums
        self._busy_s = 0.0
        self._lock = threading.Lock()  # observe() may also be called by tests from another thread

    def observe(self, tokens: int, busy_s: float) -> None:
        """One busy interval: `tokens` prompt + output tokens processed in `busy_s` seconds."""
        if tokens <= 0 or busy_s <= 0:
            return
        with self._lock:
            keep = math.exp(-busy_s / TAU_S)
            self._tokens = self._tokens * keep + tokens
            self._busy_s = self._busy_s * keep + busy_s
            if self.measured or self._busy_s >= MIN_MEASURED_BUSY_S:
                self.measured = True
                self.tokens_per_s = self._tokens / self._busy_s


class WorkMeter:
    """Feeds a Throughput from the engine thread: tokens processed per loop turn (prompt tokens
    counted when a request's first token comes, output tokens as they come) over the turn's
    length, from the loop's `turn_started` (EngineLoop: after an idle engine's wait for work,
    which is not busy time) to the end of the turn."""

    def __init__(self, throughput: Throughput, loop):
        self.throughput, self._loop = throughput, loop
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def turn_done(self) -> None:
        started = self._loop.turn_started
        if self._tokens and started is not None:
            self.throughput.observe(self._tokens, time.monotonic() - started)
        self._tokens = 0


def cold_tokens_per_s(max_num_seqs: int) -> float:
    """The estimate before any measurement: one decode step per second at the full batch."""
    return float(max(1, max_num_seqs))


class Work:
    """One request's work left, as its handler learns it (event-loop state)."""

    def __init__(self) -> None:
        self.prompt = 0  # prompt tokens not yet prefilled (0 once the first token came)
        self.output = 0  # output tokens it may still generate

    @property
    def left(self) -> int:
        return self.prompt + self.output

    def start(self, prompt_tokens: int, max_output_tokens: int) -> None:
        self.prompt, self.output = prompt_tokens, max_output_tokens

    def generated(self, tokens: int) -> None:
        """`tokens` more output tokens came (the first ones end the prefill)."""
        if tokens:
            self.prompt = 0
            self.output = max(0, self.output - tokens)


def backlog_wait_s(works, throughput: Throughput) -> float:
    """Seconds the engine needs for the work left of every request in the server."""
    return sum(w.left for w in works) / throughput.tokens_per_s


def first_leave_s(works, batch: int, throughput: Throughput) -> float:
    """Seconds until the running request nearest its end finishes: its work left at its share
    of the throughput (the running ones split it). Requests that have generated are taken as
    running; before any has, all are (prefilling)."""
    live = [w for w in works if w.left > 0]
    if not live:
        return 0.0
    running = [w for w in live if w.prompt == 0] or live
    share = throughput.tokens_per_s / max(1, min(len(live), batch))
    return min(w.left for w in running) / share


def retry_after(seconds: float) -> int:
    """A Retry-After header's whole seconds (at least 1)."""
    return max(1, math.ceil(seconds))
