"""The asyncio side of the engine thread: the HTTP handlers' way into `EngineLoop`.

The engine thread puts each request's messages into an `_AsyncOutbox`, which forwards them onto
the server's event loop (`call_soon_threadsafe`) into an `asyncio.Queue`; a watcher task puts
`_GONE` into the same queue when the client disconnects, so a handler waits on one queue for
"next delta" and "client left" alike and never polls. Prompts are tokenized here, on one
worker thread, not on the engine thread: a long prompt's tokenization would stall every
running request's next token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from infhip.runtime.engine_loop import EngineLoop, _Accepted
from infhip.runtime.serving.protocol import BadRequest, EngineLimits

_GONE = object()  # put by the watcher: the client disconnected


class ClientGone(Exception):
    """The client disconnected; its request has been (or is being) aborted."""


class EngineFailure(Exception):
    """A whole engine step failed (or the engine thread died) while this request was live."""


class _AsyncOutbox:
    """An EngineLoop outbox whose put(), called on the engine thread, lands in an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, message) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, message)
        except RuntimeError:  # the event loop is closed: the server stopped and nobody reads
            pass


class Generation:
    """One request in the engine, seen from its HTTP handler. Always `close()` it (finally)."""

    def __init__(self, engine: EngineLoop, receive):
        self._engine = engine
        self._receive = receive  # the ASGI receive of the request, its body already read
        self._outbox = _AsyncOutbox(asyncio.get_running_loop())
        self._watcher: asyncio.Task | None = None
        self._settled = False  # the engine holds nothing of it (refused, or finished and forgotten)

    async def start(self, prompt: str | None, token_ids: list[int], params, deadline: float | None = None) -> int:
        """Hand the request in (deadline: a time.monotonic() after which the engine aborts it);
        its prompt length once accepted. Raises what the engine raised (ValueError: bad input),
        or ClientGone."""
        self._engine.submit(prompt, token_ids, params, self._outbox, deadline)
        self._watcher = asyncio.create_task(self._watch())
        first = await self._next()
        if isinstance(first, Exception):
            self._settled = True
            raise first
        assert isinstance(first, _Accepted), first
        return first.prompt_tokens

    async def deltas(self) -> AsyncIterator:
        """The request's StreamDeltas; EngineFailure or ClientGone when it ends otherwise."""
        while (msg := await self._next()) is not None:
            if isinstance(msg, Exception):
                self._settled = True
                raise EngineFailure(f"{type(msg).__name__}: {msg}") from msg
            yield msg
        self._settled = True

    def close(self) -> None:
        """Stop watching; abort the request in the engine unless it already ended there."""
        if self._watcher is not None:
            self._watcher.cancel()
        if not self._settled:
            self._engine.cancel(self._outbox)
            self._settled = True

    async def _next(self):
        msg = await self._outbox.queue.get()
        if msg is _GONE:
            raise ClientGone()
        return msg

    async def _watch(self) -> None:
        # With the body read, the server's receive() returns only once the client disconnects.
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._outbox.queue.put_nowait(_GONE)


class AsyncEngine:
    """The engine thread (`EngineLoop`, started: the server's one way into the engine), its
    limits, and prompt tokenization off that thread."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.limits = EngineLimits(vocab_size=loop.info.vocab_size, max_seq_len=loop.info.max_seq_len)
        self.tokenizer = loop.tokenizer  # None: a --random-weights engine
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="infhip-tokenize")

    def close(self) -> None:
        self._tokenizer_thread.shutdown(cancel_futures=True)
        self.loop.close()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, as `EngineCore.add_request` would tokenize it."""
        if self.tokenizer is None:
            raise BadRequest("this engine has no tokenizer (built with --random-weights from a config); "
                             "send \"prompt\" as a list of token ids")
        return await self._off_thread(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens included), for POST /detokenize."""
        if self.tokenizer is None:
            raise BadRequest("this engine has no tokenizer (built with --random-weights from a config)")
        return await self._off_thread(lambda: self.tokenizer.decode(token_ids))

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """(rendered text, token ids) of a conversation through the engine's chat template
        (runtime/chat_template.py, LLM.chat's too), ending with the assistant's turn, with
        `tools` (OpenAI function tools) rendered as the template renders them."""
        from infhip.runtime.chat_template import ChatTemplateError, render_chat

        def render():
            try:
                return render_chat(self.tokenizer, messages, tools, chat_template_kwargs)
            except ChatTemplateError as e:
                raise BadRequest(str(e).replace("send a plain prompt (LLM.generate, POST /v1/completions)",
                                                "use POST /v1/completions")) from None
        return await self._off_thread(render)

    async def compile_grammar(self, spec) -> None:
        """Compile a request's grammar (StructuredOutputsParams) on the tokenizer thread, into
        the engine's cache, so that EngineCore.add_request on the engine thread finds it: a new schema's
        compile (up to ~0.15 s) and the first grammar's vocabulary setup (~0.3-0.8 s) would
        stall every running request there. ValueError: it does not compile."""
        await self._off_thread(lambda: self.loop.compile_grammar(spec))

    async def _off_thread(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)
