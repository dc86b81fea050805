"""The frontend's view of the tokenizer pool: awaitable encode / render_chat /
decode over one zmq.asyncio DEALER socket.

Concurrent calls share the socket; replies are matched to callers by job id.
A job without a reply after `resend_interval` seconds is sent again with the
same id (the router ignores a resend of a job it still holds, and a second
reply is ignored here), until `timeout` seconds have passed in all. Every
(re)connection to the router sends the waiting jobs again at once: a restarted
router knows nothing of the jobs its predecessor took.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterable, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.errors import InvalidRequestError
from common.protocol import (ChatMessage, DetokenizeJob, MessageType, RenderChatJob, TokenizeJob,
                             TokenizerReply)
from common.transport import MessageDecoder, arecv, encode, make_socket
from tokenizer_pool.pool_errors import TokenizerUnavailableError

logger = logging.getLogger(__name__)

Job = TokenizeJob | RenderChatJob | DetokenizeJob


class TokenizerClient:
    def __init__(self, address: str | Sequence[str], *, ctx: zmq.asyncio.Context | None = None,
                 resend_interval: float = 5.0, timeout: float = 60.0):
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.resend_interval = resend_interval
        self.timeout = timeout
        self._ctx = ctx
        self._sock: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._connected: asyncio.Future | None = None  # resolved by the next (re)connection
        self._waiting: dict[str, asyncio.Future] = {}
        self._id_prefix = os.urandom(6).hex()
        self._counter = itertools.count()

    # ---- public API --------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        reply = await self.submit(TokenizeJob(job_id=self._new_id(), text=text,
                                              add_special_tokens=add_special_tokens))
        return reply.token_ids

    async def render_chat(self, messages: Iterable[dict | ChatMessage], add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          chat_template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        reply = await self.render_chat_reply(messages, add_generation_prompt, continue_final_message,
                                             chat_template_kwargs, add_special_tokens)
        return reply.token_ids

    async def render_chat_reply(self, messages: Iterable[dict | ChatMessage], add_generation_prompt: bool = True,
                                continue_final_message: bool = False,
                                chat_template_kwargs: dict | None = None,
                                add_special_tokens: bool = False) -> TokenizerReply:
        """Like render_chat, with the rendered prompt text in `.text` as well."""
        job = RenderChatJob(job_id=self._new_id(), messages=to_chat_messages(messages),
                            add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message,
                            chat_template_kwargs=chat_template_kwargs or {}, add_special_tokens=add_special_tokens)
        return await self.submit(job)

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        reply = await self.submit(DetokenizeJob(job_id=self._new_id(), token_ids=list(token_ids),
                                                skip_special_tokens=skip_special_tokens))
        return reply.text

    async def submit(self, job: Job) -> TokenizerReply:
        """Send a job and wait for its reply; worker errors raise InvalidRequestError,
        a pool that cannot answer raises TokenizerUnavailableError."""
        try:
            frames = encode(job)
        except (OverflowError, TypeError, UnicodeEncodeError, msgspec.EncodeError) as e:  # e.g. an integer beyond 64 bits
            raise InvalidRequestError(f"the request holds a value that cannot be sent: {e}") from None
        self._start()
        loop = asyncio.get_running_loop()
        reply_future = loop.create_future()
        self._waiting[job.job_id] = reply_future
        deadline = loop.time() + self.timeout
        try:
            while True:
                await self._sock.send_multipart(frames, copy=False)
                wait = min(self.resend_interval, deadline - loop.time())
                connected = self._connected
                await asyncio.wait([reply_future, connected], timeout=max(wait, 0.0),
                                   return_when=asyncio.FIRST_COMPLETED)
                if reply_future.done():
                    reply = reply_future.result()
                    break
                if loop.time() >= deadline:
                    raise TokenizerUnavailableError(
                        f"the tokenizer pool did not answer within {self.timeout:g}s") from None
                if not connected.done():
                    logger.warning("no reply to tokenizer job %s after %.1fs; sending it again",
                                   job.job_id, self.resend_interval)
        finally:
            self._waiting.pop(job.job_id, None)
        if reply.error is not None:
            if reply.status >= 500:
                raise TokenizerUnavailableError(reply.error)
            raise InvalidRequestError(reply.error)
        return reply

    def fail_all(self, error: Exception) -> None:
        """End every call still waiting for a reply with `error` (the frontend is stopping)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        for task in (self._receiver, self._monitor):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._receiver = self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(TokenizerUnavailableError("the tokenizer client was closed"))

    async def __aenter__(self) -> TokenizerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- internals ---------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self._id_prefix}-{next(self._counter)}"

    def _start(self) -> None:
        """Open the socket and the reply reader on first use, inside the running loop."""
        if self._sock is not None:
            return
        ctx = self._ctx or zmq.asyncio.Context.instance()
        self._sock = make_socket(ctx, zmq.DEALER)
        loop = asyncio.get_running_loop()
        self._connected = loop.create_future()
        monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for address in self.addresses:
            self._sock.connect(address)
        self._receiver = loop.create_task(self._read_replies(), name="tokenizer-replies")
        self._monitor = loop.create_task(self._watch_connections(monitor), name="tokenizer-connections")

    async def _watch_connections(self, monitor: zmq.asyncio.Socket) -> None:
        """Wake the waiting jobs on every (re)connection, so they are sent again."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected, self._connected = self._connected, asyncio.get_running_loop().create_future()
                    connected.set_result(None)
                    if self._waiting:
                        logger.info("connected to the tokenizer pool: sending %d waiting jobs again",
                                    len(self._waiting))
        finally:
            monitor.close(linger=0)

    async def _read_replies(self) -> None:
        decoder = MessageDecoder([MessageType.TOKENIZER_REPLY])
        while True:
            reply: TokenizerReply = await arecv(self._sock, decoder)  # drops bad frames with a log line
            future = self._waiting.get(reply.job_id)
            if future is not None and not future.done():
                future.set_result(reply)


def to_chat_messages(messages: Iterable[dict | ChatMessage]) -> list[ChatMessage]:
    """Validate OpenAI-style message dicts into ChatMessage structs."""
    try:
        return [m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage) for m in messages]
    except (msgspec.ValidationError, TypeError) as e:
        raise InvalidRequestError(f"invalid chat message: {e}", param="messages") from None
