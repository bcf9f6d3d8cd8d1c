"""The messages between `EngineProcess` (the parent) and its engine child process.

Down the command pipe the parent sends lists of commands: `(SUBMIT, request_id, prompt_ids,
params)`, `(ABORT, request_id)`, `(FORWARD, payload)`, `(STOP,)`. Up the result pipe the child
first sends `(READY, RequestLimits, EngineStats)` or `(FAILED, error and traceback)`, then one
step message per engine step: `encode_step`'s bytes, the step's outputs, the engine's stats and
the loop's times.

A shared engine (`EngineProcess(..., listen=True)`, several generator instances) also serves
`EngineConnection`s over a socket: the same commands and messages, one duplex connection each.
A `FORWARD` command's payload reaches every other client as a control message
(`encode_control`), which `decode_message` tells from a step message: how one instance's
control requests (an abort by client id, a lease renewed or ended) reach its siblings. After a
step in which a client joined or left, the engine itself sends every client `(CLIENTS, n)`.

Tensor parallelism adds one message kind, from rank 0 to ranks 1..N-1, each down its own pipe
(`StepBroadcast`): `encode_forward`'s bytes, the host arrays of one forward (`StepInputs`) and
how many ids rank 0 samples from it. End-of-file on that pipe stops the rank.

A step message carries each `RequestOutput` (and the stats and times) as a plain tuple of its
fields, rebuilt in the parent: unpickling dataclass objects costs several times more, and the
parent decodes on its receiver thread, which shares the Triton stub's GIL (BENCHMARKS.md,
"Engine-process transport").
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
from multiprocessing.connection import Connection

from tritonllm.engine.client import LoopTimes
from tritonllm.engine.model_runner import StepInputs
from tritonllm.engine.request import RequestOutput
from tritonllm.engine.stats import EngineStats

# Commands (parent → child) and the tags of the child's first message.
SUBMIT, ABORT, FORWARD, STOP = "submit", "abort", "forward", "stop"
READY, FAILED = "ready", "failed"
CONTROL = "control"  # the tag of a control message (a 2-tuple; a step message is a 3-tuple)
# A shared engine's own control payload, `(CLIENTS, n)`: n clients are connected now.
CLIENTS = "clients"

# Tuples of the dataclass fields in declaration order, so `Class(*row)` rebuilds them.
output_row = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestOutput)))
_stats_row = operator.attrgetter(*(f.name for f in dataclasses.fields(EngineStats)))
_times_row = operator.attrgetter(*(f.name for f in dataclasses.fields(LoopTimes)))
_inputs_row = operator.attrgetter(*(f.name for f in dataclasses.fields(StepInputs)))


def encode_step(outputs: list[RequestOutput], stats: EngineStats, times: LoopTimes) -> bytes:
    """The bytes of one step message (see `decode_step`)."""
    return encode_rows([output_row(out) for out in outputs], stats, times)


def encode_rows(rows: list[tuple], stats: EngineStats, times: LoopTimes) -> bytes:
    """`encode_step` of outputs already turned into rows (`output_row`)."""
    return pickle.dumps((rows, _stats_row(stats), _times_row(times)), pickle.HIGHEST_PROTOCOL)


def decode_step(data: bytes) -> tuple[list[RequestOutput], EngineStats, LoopTimes]:
    """(outputs, stats, loop times) of a message made by `encode_step`."""
    rows, stats, times = pickle.loads(data)
    return [RequestOutput(*row) for row in rows], EngineStats(*stats), LoopTimes(*times)


def encode_control(payload: object) -> bytes:
    """The bytes of a control message carrying a sibling's `FORWARD` payload."""
    return pickle.dumps((CONTROL, payload), pickle.HIGHEST_PROTOCOL)


def decode_message(
    data: bytes,
) -> tuple[list[RequestOutput], EngineStats, LoopTimes] | tuple[str, object]:
    """A step message as `decode_step` returns it (a 3-tuple), or `(CONTROL, payload)`."""
    message = pickle.loads(data)
    if len(message) == 2:
        return message
    rows, stats, times = message
    return [RequestOutput(*row) for row in rows], EngineStats(*stats), LoopTimes(*times)


def encode_forward(host: StepInputs, num_samples: int) -> bytes:
    """The bytes of one forward for ranks 1..N-1 (see `decode_forward`)."""
    return pickle.dumps((_inputs_row(host), num_samples), pickle.HIGHEST_PROTOCOL)


def decode_forward(data: bytes) -> tuple[StepInputs, int]:
    """(host inputs, number of sampled ids) of a message made by `encode_forward`."""
    row, num_samples = pickle.loads(data)
    return StepInputs(*row), num_samples


class StepBroadcast:
    """Rank 0's ends of the pipes to ranks 1..N-1: each forward goes to all of them.

    Args:
        connections: one writable `Connection` per other rank, in rank order.
    """

    def __init__(self, connections: list[Connection]) -> None:
        self.connections = connections

    def send(self, host: StepInputs, num_samples: int) -> None:
        """Send one forward to every other rank.

        Raises:
            OSError: a rank is gone (its pipe is closed).
        """
        data = encode_forward(host, num_samples)
        for conn in self.connections:
            conn.send_bytes(data)

    def close(self) -> None:
        """Close the pipes: the other ranks see end-of-file and exit."""
        for conn in self.connections:
            conn.close()
