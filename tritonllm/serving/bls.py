"""BLS calls the Triton models make to each other (inside a Python stub only).

``pb_utils`` is the stub's ``triton_python_backend_utils`` module, passed in by the model that
calls: it exists only inside a Triton Python backend stub.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def abort_generation(pb_utils: Any, request_id: str) -> list[str]:
    """Ask the generator to abort ``request_id`` (its ``abort_request_id`` control request, which
    frees the generation's KV pages at once) and wait for its answer.

    Returns:
        The error messages of the generator's responses (none when the abort was taken).
    """
    abort = np.array([request_id.encode("utf-8")], dtype=np.object_)
    control = pb_utils.InferenceRequest(
        model_name="generator",
        inputs=[pb_utils.Tensor("abort_request_id", abort)],
        requested_output_names=[],
    )
    return [r.error().message() for r in control.exec(decoupled=True) if r.has_error()]
