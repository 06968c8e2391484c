"""The messages between the API server and its engine process (engine/core_proc.py and
engine/core_client.py): msgpack frames over ZMQ sockets, typed with msgspec. Each direction has
one socket (PUSH to PULL), so messages arrive in the order they were sent. A request travels as
its typed struct (EngineCoreRequest), the engine's outputs and counters as theirs
(EngineCoreOutput: token ids; EngineStats), a call's arguments as the types CALLS names for its
method (checked on arrival) and its value as plain data (numbers, strings, lists and maps).
Nothing is pickled."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.engine.core_output import EngineCoreOutput
from pagedllm.engine.stats import EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.request import EngineCoreRequest

# The engine process's exit status when it lost a tensor-parallel worker (not its requests'
# fault: they are resumed without blame).
WORKER_LOST_EXIT_CODE = 70

# -- server -> engine -----------------------------------------------------------------------


class Add(msgspec.Struct, tag=True):
    """A request (its `resumed` set when it comes back to a new engine); the engine's outputs
    come as deltas."""

    request: EngineCoreRequest


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Finish(msgspec.Struct, tag=True):
    """The server's side ended sample `index` of a request (a stop string matched), or the
    whole request (None): LLMEngine.finish_sample."""

    request_id: str
    index: int | None


class Call(msgspec.Struct, tag=True):
    """A call answered by a Reply of the same id: `method`, one of CALLS (EngineCore.calls)."""

    call_id: int
    method: str
    args: list[Any]  # CALLS[method]'s types: call_args() checks and converts them


# The calls an engine answers, with the types of their arguments.
CALLS: dict[str, Any] = {
    "kv_snapshot": tuple[bool],  # check
    "check_lora": tuple[LoRARequest],
    "reset_prefix_cache": tuple[()],
    # Diagnostics (a soak, a leak hunt): engine/diagnostics.py.
    "memory_report": tuple[bool, bool],  # trim_heap, by_type
    "leak_report": tuple[()],
    "make_pool_resident": tuple[()],
}


def call_args(message: Call) -> tuple:
    """The call's arguments as CALLS types them; ValueError for an unknown method or
    arguments of other types."""
    if message.method not in CALLS:
        raise ValueError(f"the engine has no call {message.method!r}")
    try:
        return msgspec.convert(message.args, CALLS[message.method])
    except msgspec.ValidationError as e:
        raise ValueError(f"{message.method}: {e}") from None


class Stop(msgspec.Struct, tag=True):
    pass


# -- engine -> server -----------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    pid: int
    stats: EngineStats  # as in Outputs
    lora_stats: dict[str, Any] | None
    device: str  # the device the engine resolved ("cpu" or "cuda")


class Outputs(msgspec.Struct, tag=True):
    """After every step (or, idle, every heartbeat interval): the step's outputs, and the
    engine's counters."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    lora_stats: dict[str, Any] | None  # LLMEngine.lora_stats()
    num_steps: int


class Rejected(msgspec.Struct, tag=True):
    """A request the engine refused (bad_request: a ValueError's message) or that failed on
    its way in (failed)."""

    request_id: str
    kind: str
    message: str


class Reply(msgspec.Struct, tag=True):
    call_id: int
    ok: bool
    value: Any  # the call's value (plain data), or the exception's message


class Fatal(msgspec.Struct, tag=True):
    """The engine loop raised and the process is exiting. `blame`: False when the cause is not
    the requests (a tensor-parallel worker that was killed)."""

    message: str
    blame: bool


ToEngine = Add | Abort | Finish | Call | Stop
FromEngine = Ready | Outputs | Rejected | Reply | Fatal

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(frame: bytes) -> ToEngine:
    return _to_engine.decode(frame)


def decode_from_engine(frame: bytes) -> FromEngine:
    return _from_engine.decode(frame)
