"""Tensors of Triton's gRPC protocol: request inputs from Python values, response outputs as
numpy arrays (``tritonclient.utils``' encodings: a BYTES element is a 4-byte little-endian
length, then its bytes; numbers are little-endian)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

InputValue = str | bool | int | float | list[int] | tuple[int, ...]


class TritonError(Exception):
    """Triton rejected or failed a request.

    Attributes:
        message: Triton's error message (for inference errors, the model's own message).
        unavailable: True when Triton could not be reached or the model is not loaded/ready.
    """

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.unavailable = unavailable


@dataclass(frozen=True)
class InputSpec:
    """One model input from Triton's model metadata: datatype (``"INT32"``...) and dims."""

    datatype: str
    shape: tuple[int, ...]


def encode_tensor(name: str, value: InputValue, spec: InputSpec) -> tuple[Any, bytes]:
    """An input tensor proto and its raw bytes for ``value`` under ``spec``.

    Scalars fill every dim with 1; a list fills the last dim with its length.

    Raises:
        TritonError: the value cannot be sent as ``spec.datatype``.
    """
    dims = [1] * len(spec.shape)
    flat: list[Any]
    if isinstance(value, list | tuple):
        dims[-1] = len(value)
        flat = list(value)
    else:
        flat = [value]
    if spec.datatype == "BYTES":
        data = [v.encode() if isinstance(v, str) else v for v in flat]
        array = np.array(data, dtype=np.object_).reshape(dims)
        raw = serialize_byte_tensor(array).item()
    else:
        dtype = triton_to_np_dtype(spec.datatype)
        if dtype is None:
            raise TritonError(f"input {name}: unsupported datatype {spec.datatype}")
        raw = np.array(flat, dtype=dtype).reshape(dims).tobytes()
    tensor = service_pb2.ModelInferRequest.InferInputTensor(
        name=name, datatype=spec.datatype, shape=dims
    )
    return tensor, raw


def decode_outputs(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    """Every output of one response by name, as a numpy array of its shape (BYTES outputs as
    ``object`` arrays of ``bytes``).

    Raises:
        TritonError: outputs without raw contents, or an unknown datatype.
    """
    if len(response.raw_output_contents) != len(response.outputs):
        raise TritonError("response outputs without raw_output_contents")
    arrays = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        shape = tuple(output.shape)
        if output.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw) if raw else np.array([], dtype=np.object_)
        else:
            dtype = triton_to_np_dtype(output.datatype)
            if dtype is None:
                raise TritonError(f"output {output.name}: unsupported datatype {output.datatype}")
            array = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
        arrays[output.name] = array.reshape(shape)
    return arrays
