"""The access log of `infhip-serve`: one line per request once its answer's last byte is out
(streams included), on the `infhip.access` logger. The CLI prints it to stderr; `--access-log`
chooses what it covers (ACCESS_LOG_CHOICES): every request ("all", the default, as vLLM logs
every endpoint unless told `--disable-access-log-for-endpoints`), only the API's ("requests": the
probes and scrapes of OPEN_PATHS left out; aiperf scrapes /metrics 3-4 times a second) or none
("off", also `--no-access-log`, as uvicorn's `--no-access-log` and vLLM's
`--disable-uvicorn-access-log`):

    127.0.0.1:51234 "POST /v1/chat/completions HTTP/1.1" 200 1.532s prompt_tokens=24 completion_tokens=16

The latency runs from the request's arrival to its last byte. Token counts are those of the
answer's `usage` (also for a stream without include_usage), `-` where the route generates nothing
or the request ended before the engine took it. The layer sits outside everything else, so
refusals (401, 429, 503 while draining) are logged too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

LOGGER = logging.getLogger("infhip.access")
ACCESS_LOG_CHOICES = ("all", "requests", "off")
SCOPE_KEY = "infhip.access"  # the ASGI scope entry through which a handler reports its tokens


@dataclass
class AccessTokens:
    """What a generating handler reports for its line."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def tokens_of(scope) -> AccessTokens:
    """The request's AccessTokens to fill (a detached one when the log is off)."""
    return scope.get(SCOPE_KEY) or AccessTokens()


def format_line(scope, status: int | None, seconds: float, tokens: AccessTokens) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = scope.get("path", "")
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    def n(v):
        return "-" if v is None else str(v)
    return (f'{who} "{scope.get("method", "-")} {path} HTTP/{scope.get("http_version", "1.1")}" '
            f"{status if status is not None else '-'} {seconds:.3f}s "
            f"prompt_tokens={n(tokens.prompt_tokens)} completion_tokens={n(tokens.completion_tokens)}")


class AccessLog:
    """ASGI middleware: times each HTTP request and logs its line when the app returns; requests
    to ``skip_paths`` pass unlogged."""

    def __init__(self, app, logger: logging.Logger = LOGGER, skip_paths: frozenset[str] = frozenset()):
        self.app, self.logger, self.skip_paths = app, logger, skip_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.skip_paths:
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), None
        tokens = scope[SCOPE_KEY] = AccessTokens()

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            if self.logger.isEnabledFor(logging.INFO):  # no handler configured: no line to format
                self.logger.info(format_line(scope, status, time.monotonic() - start, tokens))
