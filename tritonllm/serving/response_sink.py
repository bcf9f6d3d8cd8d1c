"""``ResponseSink``: what ``GeneratorCore`` needs from one Triton request's response path.

The generator's ``model.py`` implements it over ``pb_utils``' response sender; the tests
implement it over plain lists, so the core is tested without tritonserver.
"""

from __future__ import annotations

from typing import Protocol

from tritonllm.serving.stream_state import ResponseChunk


class ResponseSink(Protocol):
    """The response path of one Triton request (the adapter's ``pb_utils`` response sender).

    Attributes:
        response_cost: what one of its responses costs the response path, in the pacer's
            budget units (``serving.pacer``: 1 for text, ``DETOKENIZED_RESPONSE_COST`` for ids
            that a detokenizer step turns into text).
    """

    response_cost: float

    def send(self, chunk: ResponseChunk | None, final: bool) -> None:
        """Send the outputs of ``chunk`` (None: an empty response, flags only).

        Raises:
            Exception: the stream is gone (the request is then aborted).
        """

    def send_error(self, message: str) -> None:
        """Send one final error response whose message is ``message`` (wire form)."""

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request."""

    def send_info(self, max_model_len: int, engine_steps: int) -> None:
        """Send one final response carrying the served model's facts (a health probe's): its
        context limit in tokens and the steps its engine ran so far."""


__all__ = ["ResponseSink"]
