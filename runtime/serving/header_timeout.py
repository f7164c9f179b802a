"""uvicorn's h11 protocol with a deadline on each request's request line and headers.

uvicorn (0.55) times only the idle gap between keep-alive requests (`timeout_keep_alive`); a
client that connects and sends its request line and headers a byte at a time holds the
connection, and a task, forever (slowloris). uvicorn has no option for it, so this subclass of
its `H11Protocol`, handed to `uvicorn.Config(http=...)`, starts a timer when a request begins (the
connection is made, or the first byte of the next keep-alive request arrives) and stops it once
h11 has the whole head; if it fires first, the client gets a 408 and the connection is closed.
The body has its own timeout in the app (--body-timeout).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """The H11Protocol subclass closing connections whose request head takes over timeout_s."""

    body = json.dumps({"error": {"message": f"the request line and headers did not arrive within {timeout_s:g} s "
                                            "(--header-timeout)", "type": "invalid_request_error",
                                 "code": 408}}).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class HeaderTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self._awaiting_head():
                self._arm()  # the first bytes of the next keep-alive request
            super().data_received(data)
            if self._head_timer is not None and not self._awaiting_head():
                self._disarm()  # h11 has the whole head (or the connection is done for)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                # h11 cannot send a response before it has parsed a request: raw bytes, then close.
                self.transport.write(answer)
                self.transport.close()

    return HeaderTimeoutH11Protocol
