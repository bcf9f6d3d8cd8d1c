"""BLS calls the Triton models make to each other, and the errors they answer with (inside a
Python stub only).

``pb_utils`` is the stub's ``triton_python_backend_utils`` module, passed in by the model that
calls: it exists only inside a Triton Python backend stub.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tritonllm.contract.errors import triton_status


def triton_error(pb_utils: Any, message: str) -> Any:
    """The ``pb_utils.TritonError`` a model answers with ``message`` (an error in wire form):
    its code is ``contract.errors.triton_status``'s (a request's own fault: ``INVALID_ARG``,
    which a direct call reports as HTTP 400 / gRPC ``INVALID_ARGUMENT``; else ``INTERNAL``)."""
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, triton_status(message)))


def abort_generation(pb_utils: Any, request_id: str, control_secret: str | None) -> list[str]:
    """Ask the generator to abort ``request_id`` (its ``abort_request_id`` control request, which
    frees the generation's KV pages at once) and wait for its answer.

    Args:
        control_secret: the server's control secret (``ServingConfig.control_secret``), which
            the generator requires of every abort when it is set; None sends none.
    Returns:
        The error messages of the generator's responses (none when the abort was taken).
    """
    inputs = [pb_utils.Tensor("abort_request_id", _bytes(request_id))]
    if control_secret is not None:
        inputs.append(pb_utils.Tensor("control_secret", _bytes(control_secret)))
    control = pb_utils.InferenceRequest(
        model_name="generator", inputs=inputs, requested_output_names=[]
    )
    return [r.error().message() for r in control.exec(decoupled=True) if r.has_error()]


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)
