"""Requests whose bytes are no message of their method: refused with INVALID_ARGUMENT.

gRPC decodes a request with its method's deserializer before the servicer runs, and answers
a deserializer that raises (protobuf's DecodeError: a string field with bad UTF-8, a
truncated message, bytes that are no protobuf) with UNKNOWN, logging an ERROR with a
traceback: a wrong status, and a log any client could fill. :class:`RequestCheck`, the
first interceptor of every rollserve server, hands the servicer such a request's decode
error instead, and the call is refused with INVALID_ARGUMENT and protobuf's message, which
names the message type; a streaming request (reflection's) at the message that does not
decode. Handlers that are plain functions (which gRPC runs on a thread pool; rollserve
registers none) go through unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["RequestCheck"]


class _Undecodable:
    """What the checked deserializer hands on for bytes its message cannot take."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class RequestCheck(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses (INVALID_ARGUMENT) a request that does not decode, before the servicer (or an
    interceptor after this one) sees it."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behaviour = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler  # (a plain function runs on gRPC's thread pool: left as it is)
        if handler.request_streaming:
            return _checked_stream(handler)
        return _checked(handler)


def _decoder(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # (DecodeError, or whatever a deserializer raises)
            return _Undecodable(f"the request does not decode: {exc}")

    return decode


def _checked(handler: Any) -> grpc.RpcMethodHandler[Any, Any]:
    decode = _decoder(handler.request_deserializer)

    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def answer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return await unary(request, context)

        return handler._replace(request_deserializer=decode, unary_unary=answer)  # type: ignore[no-any-return]

    stream = handler.unary_stream
    if inspect.isasyncgenfunction(stream):

        async def answers(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            async for item in stream(request, context):
                yield item

        return handler._replace(request_deserializer=decode, unary_stream=answers)  # type: ignore[no-any-return]

    async def writes(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # (a streaming servicer that writes with context.write)
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        await stream(request, context)

    return handler._replace(request_deserializer=decode, unary_stream=writes)  # type: ignore[no-any-return]


def _checked_stream(handler: Any) -> grpc.RpcMethodHandler[Any, Any]:
    """A client-streaming handler whose requests are checked as they come: the call is
    refused at the first that does not decode."""
    decode = _decoder(handler.request_deserializer)

    async def checked(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            yield request

    if handler.stream_stream is not None:
        both = handler.stream_stream

        async def answers(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async for item in both(checked(requests, context), context):
                yield item

        return handler._replace(request_deserializer=decode, stream_stream=answers)  # type: ignore[no-any-return]

    many = handler.stream_unary

    async def answer(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        return await many(checked(requests, context), context)

    return handler._replace(request_deserializer=decode, stream_unary=answer)  # type: ignore[no-any-return]
