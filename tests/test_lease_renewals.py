"""The sidecar's generator lease (``TritonClient.hold_lease``) over a stand-in gRPC stream: a
renewal answered with an error (a generator instance that died) keeps the stream, so the lease
held open on the live instances does not end; a refused lease is given up; repeated failures
(renewals, tritonserver down) warn once per interval. No tritonserver: the stream's messages are
scripted."""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from openai_frontend import triton_client
from openai_frontend.triton_client import TritonClient
from tritonllm.contract.errors import ErrorCode, encode_error


class ScriptedCall:
    """A ``ModelStreamInfer`` call that answers each renewal with the next scripted message,
    and records whether the client cancelled it."""

    def __init__(self, requests, script: list[str]) -> None:
        self.requests, self.script, self.cancelled, self.answered = requests, script, False, 0

    def cancel(self) -> None:
        self.cancelled = True

    async def _messages(self):
        async for _ in self.requests:
            if not self.script:
                return
            self.answered += 1
            yield types.SimpleNamespace(error_message=self.script.pop(0))

    def __aiter__(self):
        return self._messages()


@pytest.fixture(autouse=True)
def no_waits(monkeypatch):
    monkeypatch.setattr(triton_client, "LEASE_RENEW_S", 0.0)
    monkeypatch.setattr(triton_client, "LEASE_RETRY_S", 0.0)


def _hold_lease(scripts: list[list[str]], seconds: float = 0.2) -> list[ScriptedCall]:
    """Run ``hold_lease`` for ``seconds`` over streams answering with ``scripts`` (one per
    stream opened; then streams that answer every renewal); return the streams opened."""
    calls: list[ScriptedCall] = []

    def stream_infer(requests):
        call = ScriptedCall(requests, scripts.pop(0) if scripts else [""] * 10**6)
        calls.append(call)
        return call

    async def request(model, request_id, inputs, stream=True):
        return inputs

    async def main():
        client = TritonClient("127.0.0.1:1", secret="s")  # (a gRPC channel needs the loop)
        client._request = request
        client._stub = types.SimpleNamespace(ModelStreamInfer=stream_infer)
        task = asyncio.create_task(client.hold_lease())
        await asyncio.sleep(seconds)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return calls


def test_a_failed_renewal_keeps_the_lease_stream():
    dead = encode_error(ErrorCode.INTERNAL_ERROR, "Stub process 'generator_0_1' is not healthy.")
    calls = _hold_lease([["", dead, "", dead, dead] + [""] * 10**6])
    (call,) = calls  # never closed and reopened: the one stream stayed
    assert call.answered > 5  # renewals went on after the errors (cancelled only at the end)


def test_a_refused_lease_is_given_up():
    refused = encode_error(ErrorCode.PERMISSION_DENIED, "no control secret")
    calls = _hold_lease([[refused]])
    assert len(calls) == 1 and calls[0].cancelled and calls[0].answered == 1


def test_failed_renewals_warn_once_per_interval(caplog):
    # A dead instance fails about every other renewal until tritonserver restarts: one warning
    # for the run of them, not one per failure after each success.
    dead = encode_error(ErrorCode.INTERNAL_ERROR, "Stub process 'generator_0_1' is not healthy.")
    with caplog.at_level("DEBUG", logger=triton_client.__name__):
        _hold_lease([["", dead] * 50 + [""] * 10**6])
    renewals = [r for r in caplog.records if "lease renewal" in r.getMessage()]
    assert len(renewals) == 50
    assert [r.levelname for r in renewals].count("WARNING") == 1


def test_a_failure_after_the_interval_warns_again_with_the_count(monkeypatch, caplog):
    clock = [1000.0]
    monkeypatch.setattr(triton_client.time, "monotonic", lambda: clock[0])
    failures = triton_client.RepeatedWarning(every_s=60.0)
    with caplog.at_level("WARNING", logger=triton_client.__name__):
        for t in (0, 10, 20, 59, 61, 62):
            clock[0] = 1000.0 + t
            failures.log("generator lease renewal: %s", "dead")
    assert [r.getMessage() for r in caplog.records] == [
        "generator lease renewal: dead",
        "generator lease renewal: dead (4 since the last warning)",
    ]


def test_tritonserver_down_warns_once_per_interval_not_per_request(monkeypatch, caplog):
    """Every request fails the same way while tritonserver is down (clients retrying at once
    made 17,000 such lines in one QA outage): one warning, the rest at DEBUG."""
    from openai_frontend import generation

    fresh = triton_client.RepeatedWarning(60.0, generation.log)
    monkeypatch.setattr(generation, "_UNAVAILABLE_LOG", fresh)
    refused = triton_client.TritonError("connection refused", unavailable=True)
    with caplog.at_level("WARNING", logger=generation.__name__):
        for _ in range(100):
            assert generation.to_openai_error(refused, "prompt").status == 503
    assert len(caplog.records) == 1
