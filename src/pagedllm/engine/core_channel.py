"""The messages between the API server and its engine process (engine/core_proc.py and
engine/core_client.py): msgpack frames over ZMQ sockets, typed with msgspec. Each direction has
one socket (PUSH to PULL), so messages arrive in the order they were sent. A request travels as
its typed struct (EngineCoreRequest), the engine's outputs and counters as theirs
(EngineCoreOutput: token ids; EngineStats); calls' arguments and values still travel inside as
pickles: both ends run the same code, and the sockets are local to the machine and the user."""

from __future__ import annotations

import pickle
from typing import Any

import msgspec

from pagedllm.engine.core_output import EngineCoreOutput
from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.engine.stats import EngineStats

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
    """A call answered by a Reply of the same id: `method` of the engine core's CALLS."""

    call_id: int
    method: str
    args: bytes  # pickled tuple


class Stop(msgspec.Struct, tag=True):
    pass


# -- engine -> server -----------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    pid: int
    stats: EngineStats  # as in Outputs
    lora_stats: dict[str, Any] | None


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
    value: bytes  # pickled result, or the exception's message


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


def pack(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    return pickle.loads(data)
