"""Load and faults, bounded, on loopback, with the tiny model:

- 256 concurrent streaming clients of the sidecar all finish, each with its exact usage, and
  the KV cache is back to zero;
- 2,000 requests in a row leave the memory of every process (sidecar, tritonserver, each
  Python stub) stable;
- a fault injected inside the generator (from this file: a test model repository whose
  generator wraps the real one) fails only its own request;
- malformed requests sent straight to each model get error responses, and no stub dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import SERVER_ENV
from openai_helpers import chat_prompt_ids, engine_idle, wait_for_gauges
from test_triton_server_death import _group_members

from openai_frontend.triton_client import TritonClient, TritonError
from tritonllm.contract.errors import ErrorCode, decode_error
from tritonllm.triton_server import MODEL_REPOSITORY, TritonServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def _server_processes(triton: TritonServer, sidecar_pid: int) -> dict[str, int]:
    """name -> pid: the sidecar, tritonserver and each of its Python stubs (``MODEL-PID``)."""
    found = {"sidecar": sidecar_pid, "tritonserver": triton.process.pid}
    for pid, command in _stubs(triton).items():
        model = re.search(r"/(\w+)/1/model\.py", command)
        found[f"{model.group(1) if model else 'stub'}-{pid}"] = pid
    return found


def _stubs(triton: TritonServer) -> dict[int, str]:
    return {
        pid: command
        for pid, command in _group_members(triton.process.pid).items()
        if "triton_python_backend_stub" in command
    }


# --- 256 concurrent streams -----------------------------------------------------------------


async def _stream_chat(
    http: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Client {i} says hello"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, finish, text, done = None, None, [], False
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    text.append(choice["delta"].get("content") or "")
                usage = chunk.get("usage") or usage
    return {"i": i, "usage": usage, "finish": finish, "done": done, "text": "".join(text)}


def test_256_concurrent_streams_finish_with_exact_usage_and_free_the_kv_cache(sidecar, tokenizer):
    url = f"{sidecar.base_url}/chat/completions"

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(
                *(_stream_chat(http, url, sidecar.model_name, i, 8 + i % 9) for i in range(256))
            )

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    for r in results:
        max_tokens = 8 + r["i"] % 9
        messages = [{"role": "user", "content": f"Client {r['i']} says hello"}]
        assert r["done"] and r["finish"] in ("length", "stop"), r
        assert r["usage"]["prompt_tokens"] == len(chat_prompt_ids(tokenizer, messages)), r
        if r["finish"] == "length":
            assert r["usage"]["completion_tokens"] == max_tokens, r
        else:
            assert r["usage"]["completion_tokens"] <= max_tokens, r
    gauges = wait_for_gauges(sidecar.metrics_url, engine_idle, 30)
    assert engine_idle(gauges), gauges
    print(f"\n256 concurrent streams: all whole in {elapsed:.1f} s; KV pages used after: 0")


# --- 2,000 requests in a row ------------------------------------------------------------------

REQUESTS = 2000
WARMUP = 400
# After warm-up a leak grows the memory steadily, noise does not: RSS at the end may exceed RSS
# at the middle (both past warm-up) by at most this. A leak of 10 KiB per request (a response's
# tensors, a table entry with its outputs, a log line kept) is 8 MiB over the last 800 requests.
RSS_GROWTH_BOUND_MIB = 8.0


def test_2000_requests_in_a_row_leave_every_process_memory_stable(sidecar, triton_server):
    processes = _server_processes(triton_server, sidecar.process.pid)
    assert {"sidecar", "tritonserver"} < set(processes) and len(processes) >= 5, processes
    url = f"{sidecar.base_url}/completions"
    samples: dict[int, dict[str, float]] = {}

    async def run() -> None:
        done = 0
        queue: asyncio.Queue[int] = asyncio.Queue()
        for n in range(REQUESTS):
            queue.put_nowait(n)

        async def worker(http: httpx.AsyncClient) -> None:
            nonlocal done
            while not queue.empty():
                n = queue.get_nowait()
                body = {"model": sidecar.model_name, "prompt": f"Request {n}", "max_tokens": 2}
                body["stream"] = n % 2 == 0
                response = await http.post(url, json=body)
                assert response.status_code == 200, response.text
                done += 1
                if done in (WARMUP, (WARMUP + REQUESTS) // 2, REQUESTS):
                    samples[done] = {name: _rss_mib(pid) for name, pid in processes.items()}

        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(worker(http) for _ in range(4)))

    started = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - started
    warm, middle, end = (samples[k] for k in sorted(samples))
    report = {
        name: f"{warm[name]:.0f} -> {middle[name]:.0f} -> {end[name]:.0f} MiB" for name in warm
    }
    print(f"\n{REQUESTS} requests in {elapsed:.1f} s; RSS after {sorted(samples)}: {report}")
    grown = {name: end[name] - middle[name] for name in end}
    assert all(g <= RSS_GROWTH_BOUND_MIB for g in grown.values()), (grown, report)
    assert _server_processes(triton_server, sidecar.process.pid) == processes  # none died


# --- a fault inside the generator -------------------------------------------------------------

FAULTY_GENERATOR = '''
"""The real generator (loaded from its file), with a fault injected by the test: a request
whose id (after the client's lease) starts with "fault-" raises in its own output handling on the sender thread, at its
second output."""
import importlib.util

_spec = importlib.util.spec_from_file_location("real_generator_model", {real!r})
real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real)


class FaultyState:
    def __init__(self, state):
        self.state, self.outputs = state, 0

    def on_output(self, output):
        self.outputs += 1
        if self.outputs >= 2:
            raise RuntimeError("injected fault")
        return self.state.on_output(output)

    def __getattr__(self, name):
        return getattr(self.state, name)


class TritonPythonModel(real.TritonPythonModel):
    def execute(self, requests):
        super().execute(requests)
        for request in requests:
            # (the sidecar's client sends "<lease>/<id>")
            if request.request_id().rpartition("/")[2].startswith("fault-"):
                entry = self.core.requests.get(request.request_id())
                if entry is not None:
                    entry.states = [FaultyState(s) for s in entry.states]
        return None
'''


@pytest.fixture(scope="module")
def faulty_server(tiny_model_dir, tmp_path_factory):
    """tritonserver on a model repository whose generator carries the injected fault."""
    repo = tmp_path_factory.mktemp("faulty_repository")
    for model in ("tokenizer", "detokenizer", "llm", "llm_fused"):
        (repo / model).symlink_to(MODEL_REPOSITORY / model, target_is_directory=True)
    (repo / "generator" / "1").mkdir(parents=True)
    shutil.copy(MODEL_REPOSITORY / "generator" / "config.pbtxt", repo / "generator")
    real = str(MODEL_REPOSITORY / "generator" / "1" / "model.py")
    (repo / "generator" / "1" / "model.py").write_text(FAULTY_GENERATOR.format(real=real))
    log = tmp_path_factory.mktemp("logs") / "faulty-tritonserver.log"
    server = TritonServer(
        model_path=tiny_model_dir, model_repository=repo, env=dict(SERVER_ENV), log_path=log
    )
    try:
        server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
        yield server
    finally:
        server.stop()


async def _generate(client: TritonClient, request_id: str, max_tokens: int) -> tuple:
    inputs = {"text_input": f"Hello {request_id}", "max_tokens": max_tokens, "temperature": 0.0}
    stream = await client.stream(request_id, inputs)
    last = None
    try:
        while (chunk := await asyncio.wait_for(stream.read(), 60)) is not None:
            last = chunk
    except TritonError as exc:
        return "error", exc.message
    return "ok", (last.finish_reason, last.num_output_tokens)


def test_a_fault_inside_the_generator_fails_only_its_own_request(faulty_server):
    async def run() -> list[tuple]:
        client = TritonClient(faulty_server.grpc_url)
        try:
            ids = [f"ok-{i}" for i in range(6)]
            ids.insert(3, "fault-1")
            return await asyncio.gather(*(_generate(client, rid, 24) for rid in ids))
        finally:
            await client.close()

    results = asyncio.run(run())
    faulty = results.pop(3)
    assert faulty[0] == "error", faulty
    wire = decode_error(faulty[1])
    assert wire is not None and wire.code == ErrorCode.INTERNAL_ERROR, faulty
    assert results == [("ok", ("length", 24))] * 6, results
    gauges = wait_for_gauges(faulty_server.metrics_url, engine_idle, 30)
    assert engine_idle(gauges), gauges
    after = asyncio.run(_one_more(faulty_server))
    assert after == ("ok", ("length", 4))


async def _one_more(server: TritonServer) -> tuple:
    client = TritonClient(server.grpc_url)
    try:
        return await _generate(client, "ok-after", 4)
    finally:
        await client.close()


# --- malformed requests straight to each model ------------------------------------------------


def _tensor(name: str, array: np.ndarray, datatype: str | None = None) -> grpcclient.InferInput:
    datatype = datatype or ("BYTES" if array.dtype == object else None)
    if datatype is None:
        datatype = {np.int32: "INT32", np.int64: "INT64", np.float32: "FP32", np.bool_: "BOOL"}[
            array.dtype.type
        ]
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _strings(*values: bytes) -> np.ndarray:
    return np.array(list(values), dtype=object)


IDS = np.array([9707, 1879], dtype=np.int32)
ONE = np.array([1], dtype=np.int32)


def _detokenizer_inputs(ids, **extra) -> list[tuple[str, np.ndarray]]:
    """A whole detokenizer request (batch dim 1): output ids ``ids``, inputs ``extra`` added
    or replaced."""
    one = np.array([[1]], dtype=np.int32)
    inputs = {
        "output_ids": np.asarray([ids], dtype=np.int32),
        "prefix_ids": np.array([[9707]], dtype=np.int32),
        "finish_reason": _strings(b"").reshape(1, 1),
        "num_input_tokens": one,
        "num_output_tokens": one,
        "cached_tokens": one * 0,
        "trim_chars": one * 0,
    }
    return list({**inputs, **extra}.items())


# model -> [(what, inputs)]; every case must get an error response.
MALFORMED = {
    "tokenizer": [
        ("missing input", []),
        ("wrong dtype", [("text_input", np.array([1], dtype=np.int32))]),
        ("wrong shape", [("text_input", _strings(b"a", b"b").reshape(1, 2))]),
        ("non-UTF-8", [("text_input", _strings(b"\xff\xfe\xfd"))]),
        ("NUL bytes in messages", [("messages", _strings(b'[{"role": "user", "content\x00')) ]),
        ("non-UTF-8 messages", [("messages", _strings(b"\xc3\x28"))]),
        ("messages not JSON", [("messages", _strings(b"hello"))]),
    ],
    "generator": [
        ("missing input", [("max_tokens", ONE)]),
        ("wrong dtype", [("input_ids", IDS.astype(np.int64))]),
        ("wrong shape", [("input_ids", np.array([[1, 2], [3, 4]], dtype=np.int32))]),
        ("ids out of vocabulary", [("input_ids", np.array([-5, 10**9], dtype=np.int32))]),
        ("huge max_tokens", [("input_ids", IDS), ("max_tokens", np.array([2**31 - 1], np.int32))]),
        ("non-UTF-8 stop", [("input_ids", IDS), ("stop", _strings(b"\xff"))]),
        ("NUL abort id", [("abort_request_id", _strings(b"\x00\xff"))]),
        ("empty prompt", [("input_ids", np.array([], dtype=np.int32))]),
    ],
    "detokenizer": [
        ("missing input", [("output_ids", IDS.reshape(1, -1))]),
        # (Ids past the tokenizer's but within the model's vocabulary decode to "" by design.)
        ("ids out of vocabulary", _detokenizer_inputs(np.array([9707, 10**9], np.int32))),
        ("wrong dtype", _detokenizer_inputs(IDS, output_ids=IDS.reshape(1, -1).astype(np.float32))),
        ("logprobs of another length", _detokenizer_inputs(
            IDS, output_logprobs=np.array([[-0.5]], np.float32),
            top_logprob_ids=np.array([[1, 2, 3]], np.int32),
            top_logprobs=np.array([[-1.0]], np.float32))),
    ],
    "llm": [
        ("wrong dtype", [("text_input", _strings(b"hi")), ("max_tokens", np.array([1.5], np.float32))]),
        ("huge max_tokens", [("text_input", _strings(b"hi")), ("max_tokens", np.array([2**31 - 1], np.int32))]),
        ("non-UTF-8 and NUL text", [("text_input", _strings(b"\x00\xff\x00"))]),
        ("negative temperature", [("text_input", _strings(b"hi")), ("temperature", np.array([-1.0], np.float32))]),
        ("no prompt", [("max_tokens", ONE)]),
    ],
}  # fmt: skip
DECOUPLED = ("generator", "llm")


def _send(client: grpcclient.InferenceServerClient, model: str, case: str, inputs) -> str:
    """The error message of one malformed request ("" when it got no error)."""
    tensors = [_tensor(name, array) for name, array in inputs]
    if model not in DECOUPLED:
        try:
            client.infer(model, tensors, request_id=f"malformed-{case}", client_timeout=60)
        except Exception as exc:  # noqa: BLE001 (tritonclient's InferenceServerException)
            return str(exc) or type(exc).__name__
        return ""
    results: list = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        client.async_stream_infer(
            model, tensors, request_id=f"malformed-{case}", enable_empty_final_response=True
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            errors = [str(e) for _, e in results if e is not None]
            if errors:
                return errors[0]
            finals = [
                r
                for r, _ in results
                if r is not None and r.get_response().parameters["triton_final_response"].bool_param
            ]
            if finals:
                return ""
            time.sleep(0.02)
        return ""
    finally:
        client.stop_stream()


def test_malformed_requests_to_each_model_get_errors_and_no_stub_dies(triton_server):
    stubs = _stubs(triton_server)
    assert len(stubs) >= 4, stubs  # two tokenizers, the generator, the detokenizer
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        answered = {
            (model, case): _send(client, model, case, inputs)
            for model, cases in MALFORMED.items()
            for case, inputs in cases
        }
    finally:
        client.close()
    missing = [key for key, error in answered.items() if not error]
    assert missing == [], {key: answered[key] for key in answered}
    assert _stubs(triton_server) == stubs  # every stub still alive, none restarted
    assert asyncio.run(_one_more(triton_server)) == ("ok", ("length", 4))


# --- a SIGKILLed sidecar ----------------------------------------------------------------------


def _counter(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_a_sigkilled_sidecar_leaves_no_generation_running(triton_server, tmp_path):
    """The sidecar dies with streams in flight (its gRPC streams close with it): every
    generation stops within seconds instead of running on to max_tokens.

    Expected to fail (xfail) until issue 14 item 4 makes a Triton client's stream cancellation
    reach the generator through the ensemble; then it passes, and the xfail branch goes."""
    from frontend_fixtures import start_sidecar

    process, base_url = start_sidecar(
        triton_server.grpc_url,
        "tiny",
        tmp_path / "sidecar.log",
        control_secret=triton_server.control_secret,
    )
    metrics = triton_server.metrics_url
    tokens_before = _counter(metrics, "tritonllm_generated_tokens_total")
    # Long enough not to finish on its own within the 5 s the test gives the stop; short
    # enough that, while the stop does not happen, the session's server is idle again soon.
    streams, max_tokens = 4, 600
    try:
        import openai

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        from test_supervision import _start_streams

        _start_streams(client, streams, max_tokens)
        # A stream's first chunk (the role) is no proof that its generation runs yet, and the
        # gauge is published every 50 ms: wait for all of them in the running batch.
        running = wait_for_gauges(metrics, lambda g: g["tritonllm_requests_running"] >= streams, 30)
        assert running["tritonllm_requests_running"] == streams, running
        os.killpg(process.pid, 9)
        process.wait(10)
        gauges = wait_for_gauges(metrics, lambda g: g["tritonllm_requests_running"] == 0, 5)
        generated = _counter(metrics, "tritonllm_generated_tokens_total") - tokens_before
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
        # The next tests share this server: let orphaned generations end first (also when
        # this test failed: they would count as the next test's requests).
        wait_for_gauges(metrics, engine_idle, 120)
    left = gauges["tritonllm_requests_running"]
    if left:
        pytest.xfail(
            f"issue 14 item 4: {left:g} of {streams} generations still running 5 s after the "
            "sidecar's SIGKILL (a Triton client's cancellation does not reach the generator)"
        )
    assert generated < streams * max_tokens / 2, generated  # stopped, not run to the end


# --- /health under a flood of probes ----------------------------------------------------------


def test_health_probes_cannot_load_the_engine(sidecar):
    """200 /health requests in a burst, idle server: each answers from one shared end-to-end
    probe per second at most (Triton's count of llm requests says how many ran)."""

    def llm_requests() -> float:
        text = httpx.get(sidecar.metrics_url, timeout=10).text
        found = re.search(r'^nv_inference_request_success\{model="llm",[^}]*\} (\S+)$', text, re.M)
        return float(found.group(1))

    # Past the health interval (1 s) of the fixture's own /health wait: the burst's first
    # request cannot reuse a cached result, so at least one probe must run.
    time.sleep(1.5)
    before = llm_requests()

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            return [
                r.status_code
                for r in await asyncio.gather(
                    *(http.get(f"{sidecar.root_url}/health") for _ in range(200))
                )
            ]

    started = time.monotonic()
    statuses = asyncio.run(burst())
    elapsed = time.monotonic() - started
    assert statuses == [200] * 200
    probes = llm_requests() - before
    assert 1 <= probes <= elapsed / 1.0 + 2, (probes, elapsed)
