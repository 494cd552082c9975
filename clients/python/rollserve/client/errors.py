"""Errors of the trainer SDK.

Every error the SDK raises is a :class:`RolloutError`. Errors from the scheduler
keep its message, which names the field and the limit, e.g.
``groups[3].sampling.max_tokens (9000) exceeds the model's context (4096) minus the prompt (812)``.
"""

from __future__ import annotations

import grpc
import redis


class RolloutError(Exception):
    """Base of every error the SDK raises. ``code`` is the gRPC status, if any."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidArgument(RolloutError, ValueError):
    """A request the scheduler (or the SDK, before sending it) rejects as malformed."""


class AlreadySubmitted(InvalidArgument):
    """A group id the run has taken already; nothing of the batch was queued. After a
    Submit that ran past its deadline, the groups it named may be the ones taken: it was
    accepted after all."""


class ResourceExhausted(RolloutError):
    """The scheduler's queue cannot take the batch; nothing of it was queued. Retry later."""


class SchedulerUnavailable(RolloutError):
    """The scheduler cannot be reached, or did not answer within the deadline.

    A Submit that ran past its deadline (``code`` DEADLINE_EXCEEDED) may still have
    been accepted; with UNAVAILABLE it normally never reached the scheduler.
    """


class Unauthenticated(RolloutError):
    """The scheduler wants credentials the client did not show, or does not accept those it
    showed (a token not in its tokens file): see ``SchedulerCredentials``."""


class PermissionDenied(RolloutError):
    """The scheduler accepted the client's token but its grant does not cover the call: the
    token's role does not take it, or its ``runs=`` does not cover the client's run (see the
    scheduler's tokens file). Nothing of the call was done."""


class RunDeleted(RolloutError):
    """The run was deleted (DeleteRun) since this client began to read its stream: nothing
    more of it will come. A Submit of the run id since starts another run; read it with a new
    client (this one's memory of acknowledged group ids is the old run's)."""


class StreamUnavailable(RolloutError):
    """Redis, which carries the finished groups, cannot be reached."""


class StreamReadOnly(StreamUnavailable):
    """The Redis reached is a read-only replica: a failover is under way (the old primary
    became a replica), or ``redis_url`` names a replica. Retry once the failover is done, or
    point ``redis_url`` at the primary. Nothing the client holds was acknowledged."""


class StreamRefused(RolloutError):
    """Redis refused the reader's command for a reason a retry does not mend; the message
    names it: the Redis user lacks a permission (its ACL: the commands or the keys of the
    run's stream), or the stream's key holds another type (another program writes there)."""


class ClientClosed(RolloutError):
    """The client was closed (``close()``, or the end of its ``with`` block): make a new one."""


class UndecodableEntry(RolloutError):
    """A stream entry this SDK cannot decode (a newer schema version, or a bad body).

    The entry is not acknowledged: it stays pending in the consumer group, so it is
    neither lost nor skipped silently. Upgrade the SDK, or give up on the entry with
    ``client.discard(error.entry_id)`` (it stays readable in the stream with XRANGE for the
    scheduler's acked retention, 300 s by default, to be kept by hand).
    """

    def __init__(self, message: str, *, entry_id: str, fields: dict[bytes, bytes]) -> None:
        super().__init__(message)
        self.entry_id = entry_id
        self.fields = fields


# Redis errors that mean "cannot reach it" rather than "it said no".
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
# As Redis names them refusing one (Redis 7 names a subcommand: 'script|load').
_SCRIPTING_COMMANDS = ("'evalsha'", "'eval'", "'script'", "'script|")


def stream_error(exc: redis.RedisError, doing: str) -> RolloutError:
    """The SDK's error for a Redis error met while ``doing`` (e.g. ``"XACK <stream>"``)."""
    text = str(exc)
    if is_read_only(exc):
        return StreamReadOnly(
            f"{doing}: the Redis reached is a read-only replica ({text}): retry once a "
            "failover is done, or point redis_url at the primary"
        )
    if not isinstance(exc, redis.ResponseError):  # unreachable, or a reply it cannot read
        return StreamUnavailable(f"{doing}: {text}")
    if isinstance(exc, redis.exceptions.NoPermissionError) or text.startswith("NOPERM"):
        return StreamRefused(
            f"{doing}: the Redis user has no permission ({text}): its ACL must allow the "
            "stream commands (XREADGROUP, XAUTOCLAIM, XACK, XPENDING, XGROUP), EVALSHA and "
            "SCRIPT LOAD on the keys of the run"
        )
    if is_wrong_type(exc):
        return StreamRefused(
            f"{doing}: the key holds another type than a stream ({text}): something other "
            "than rollserve's scheduler writes to the run's keys; check the run id and the "
            "Redis database in redis_url"
        )
    return StreamRefused(f"{doing}: Redis refused it ({text})")


def is_read_only(exc: redis.RedisError) -> bool:
    """The Redis reached is a replica (redis-py drops the READONLY code from its message;
    a script's error keeps only the text)."""
    return isinstance(exc, redis.exceptions.ReadOnlyError) or "read only replica" in str(exc)


def is_wrong_type(exc: redis.RedisError) -> bool:
    return "WRONGTYPE" in str(exc)


def refuses_keys(exc: redis.RedisError) -> bool:
    """The user's ACL does not cover the keys used (Redis 6: "... to access one of the keys
    used as arguments"; 7: "No permissions to access a key")."""
    text = str(exc).lower()
    return "no permissions to access" in text and "key" in text


def refuses_scripting(exc: redis.RedisError) -> bool:
    """Redis refused EVALSHA or SCRIPT: the user's ACL leaves scripting out, or the commands
    were renamed away."""
    text = str(exc).lower()
    return any(command in text for command in _SCRIPTING_COMMANDS) and (
        "no permissions" in text or "unknown command" in text
    )


_BY_CODE: dict[grpc.StatusCode, type[RolloutError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadySubmitted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: SchedulerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: SchedulerUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def error_from_rpc(exc: grpc.RpcError, method: str) -> RolloutError:
    """The SDK's error for a failed call of ``method`` (e.g. ``"Submit"``)."""
    code: grpc.StatusCode | None = None
    details = str(exc)
    if isinstance(exc, (grpc.Call, grpc.aio.AioRpcError)):
        code = exc.code()
        details = exc.details() or code.name
    cls = _BY_CODE.get(code, RolloutError) if code is not None else RolloutError
    name = code.name if code is not None else "error"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details:
        # Not a full queue, which a retry passes: the same call is refused every time (and a
        # StepBatcher sends a launch refused as invalid one group a call).
        return InvalidArgument(
            f"{method}: {details} ({name}): the call's message is larger than the scheduler "
            "reads (its --max-grpc-message-bytes, 64 MiB by default); send fewer groups a "
            "call",
            code=code,
        )
    return cls(f"{method}: {details} ({name})", code=code)
