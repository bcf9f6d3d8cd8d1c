"""Issue 18's holes, each tried against the real tritonserver and sidecar (issue 15 item 4 too).

One locked-down service for the whole module: tritonserver (restricted APIs, control secret,
private shared memory; one request at a time: 1 running, 0 waiting) and the sidecar in front of it
with two API keys (two tenants), the prefix cache salted per key, CORS for one origin and a 1 s
header timeout. Each test's docstring names the hole it closes; each fails on the code before
issue 18 (the API was open, the regions 0644, any abort matched, the cache shared, the queue
unbounded, connections untimed, 422 documented).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import SERVER_ENV
from frontend_fixtures import start_sidecar, stop_process
from tritonclient.utils import InferenceServerException

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
ORIGIN = "https://chat.example"
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    """(tritonserver, sidecar root URL, model name) of the locked-down service."""
    from tritonllm.triton_server import TritonServer

    logs = tmp_path_factory.mktemp("security-logs")
    env = {
        **SERVER_ENV,
        "TRITONLLM_MAX_RUNNING_REQUESTS": "1",
        "TRITONLLM_MAX_WAITING_REQUESTS": "0",
    }
    server = TritonServer(model_path=tiny_model_dir, env=env, log_path=logs / "tritonserver.log")
    name = Path(tiny_model_dir).name
    try:
        server.start(timeout=300)
        process, base_url = start_sidecar(
            server.grpc_url,
            name,
            logs / "sidecar.log",
            control_secret=server.control_secret,
            extra_args=(
                "--cache-salt-from-api-key",
                f"--cors-allow-origin={ORIGIN}",
                f"--header-timeout={HEADER_TIMEOUT_S}",
            ),
            env={"TRITONLLM_API_KEY": f"{KEY_A},{KEY_B}"},
        )
    except RuntimeError:
        server.stop()
        raise
    yield server, base_url.removesuffix("/v1"), name
    stop_process(process)
    server.stop()


def _auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(root, name, text, key=KEY_A, **extra) -> httpx.Response:
    body = {"model": name, "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(f"{root}/v1/chat/completions", json=body, headers=_auth(key), timeout=60)


def _strings(*values: bytes) -> np.ndarray:
    return np.array(list(values), dtype=np.object_)


def _generator_call(
    url: str, inputs: dict[str, np.ndarray], request_id: str = "", model: str = "generator"
) -> list:
    """(result, error) pairs of one streamed request to ``model``, until its final response."""
    import queue

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for key, array in inputs.items():
        dtype = "BYTES" if array.dtype == np.object_ else "INT32"
        tensor = grpcclient.InferInput(key, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client.async_stream_infer(
        model, tensors, request_id=request_id, enable_empty_final_response=True
    )
    out = []
    try:
        while True:
            result, error = results.get(timeout=60)
            out.append((result, error))
            final = result is not None and result.get_response().parameters.get(
                "triton_final_response"
            )
            if error is not None or (final is not None and final.bool_param):
                return out
    finally:
        client.stop_stream()
        client.close()


def _error_code(error) -> str | None:
    from tritonllm.contract.errors import decode_error

    wire = decode_error(error.message()) if error is not None else None
    return None if wire is None else wire.code.value


# --- 1. Triton's non-inference APIs -------------------------------------------------------------


def test_triton_admin_apis_need_the_admin_key(service):
    """Hole: any client of Triton's ports could register a Python-backend region as system
    shared memory and read another request's prompt from it, or raise the log verbosity."""
    import tritonclient.http as httpclient  # here: the GPU image's tritonclient has no HTTP client

    server, _, _ = service
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    region = f"/{server.shm_prefix}probe"
    for client in (http, grpc):
        with pytest.raises(InferenceServerException):
            client.register_system_shared_memory("steal", region, 1 << 20)
        with pytest.raises(InferenceServerException):
            client.update_log_settings({"log_verbose_level": 1})
        with pytest.raises(InferenceServerException):
            client.get_model_repository_index()
        assert client.is_server_ready()  # health, metadata and inference stay open
    # The launcher's key opens them (the sidecar never needs it).
    status = http.get_system_shared_memory_status(headers=server.admin_headers)
    assert status == [] or isinstance(status, list)
    grpc.get_log_settings(headers=server.grpc_admin_headers)


# --- 2. Private shared memory ---------------------------------------------------------------------


def _regions(server) -> list[Path]:
    pid = server.process.pid
    for shm in (Path(f"/proc/{pid}/root/dev/shm"), Path("/dev/shm")):
        found = sorted(shm.glob(f"{server.shm_prefix}*"))
        if found:
            return found
    return []


def test_python_backend_regions_are_unreadable_by_another_user(service):
    """Hole: the Python backend's /dev/shm regions were mode 0644, and an unprivileged local
    user read a finished request's prompt from them."""
    server, root, name = service
    assert _chat(root, name, "a prompt other users must not read", max_tokens=2).status_code == 200
    regions = _regions(server)
    assert regions, "no Python-backend region found"
    shared = [p for p in regions if p.parent == Path("/dev/shm")]
    assert all(p.stat().st_mode & 0o077 == 0 for p in shared), [
        oct(p.stat().st_mode) for p in shared
    ]
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("reading as another user needs root and setpriv")
    other = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    for region in regions:
        read = subprocess.run([*other, "head", "-c", "16", str(region)], capture_output=True)
        assert read.returncode != 0 and not read.stdout, region


# --- 3. Aborts by their owner only --------------------------------------------------------------


def _victim(root, name, result: dict) -> threading.Thread:
    def run() -> None:
        response = _chat(root, name, "Count to one thousand.", max_tokens=60, ignore_eos=True)
        result["response"] = response

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_running(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(server.metrics_url, timeout=5).text
        if any(
            line.startswith("tritonllm_requests_running") and not line.endswith(" 0")
            for line in text.splitlines()
        ):
            return
        time.sleep(0.02)
    raise AssertionError("the victim never ran")


def test_foreign_and_empty_id_aborts_leave_the_victim_running(service):
    """Hole: any Triton client could abort others' generations: an empty id matched every
    request sent without an id, generated keys (request~N) were guessable, and no secret was
    asked. Now an abort needs the control secret and an empty id or a guessed key matches
    nothing."""
    server, root, name = service
    # A victim sent straight to the ensemble without an id (its key is generated).
    stream = grpcclient.InferenceServerClient(server.grpc_url)
    done = threading.Event()
    finals: list = []

    def callback(result, error) -> None:
        finals.append((result, error))
        if error is not None or result.as_numpy("finish_reason")[0] != b"":
            done.set()

    stream.start_stream(callback=callback)
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)
    tensors = []
    for key, array in {"input_ids": ids, "max_tokens": np.array([200], np.int32)}.items():
        tensor = grpcclient.InferInput(key, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    ignore = grpcclient.InferInput("ignore_eos", [1], "BOOL")
    ignore.set_data_from_numpy(np.array([True]))
    stream.async_stream_infer("generator", [*tensors, ignore], request_id="")
    try:
        _wait_running(server)
        secret = server.control_secret.encode()
        attacks = [
            ({"abort_request_id": _strings(b"")}, "permission_denied"),
            ({"abort_request_id": _strings(b"request~1")}, "permission_denied"),
            (
                {"abort_request_id": _strings(b""), "control_secret": _strings(b"guess")},
                "permission_denied",
            ),
            # Even the service's own secret cannot reach it by an empty or guessed id.
            (
                {"abort_request_id": _strings(b""), "control_secret": _strings(secret)},
                "invalid_value",
            ),
        ]
        for inputs, code in attacks:
            (_, error), *_ = _generator_call(server.grpc_url, inputs)
            assert _error_code(error) == code, inputs
        for guess in ("request~1", "request~2", "~1"):
            inputs = {
                "abort_request_id": _strings(guess.encode()),
                "control_secret": _strings(secret),
            }
            assert _generator_call(server.grpc_url, inputs)[-1][1] is None  # acknowledged
        assert done.wait(60)
    finally:
        stream.stop_stream()
        stream.close()
    result, error = finals[-1]
    assert error is None
    assert result.as_numpy("finish_reason")[0] == b"length"


def test_abort_flood_neither_stalls_generation_nor_health(service):
    """Hole: a flood of unknown-id aborts slowed generation ten-fold (each one rebuilt the
    early-abort memory) and turned /health 503. Refused aborts touch no state; accepted
    unknown ids are remembered in a bounded, O(1) structure."""
    server, root, name = service
    stop = threading.Event()

    def flood(secret: bytes | None) -> None:
        while not stop.is_set():
            inputs = {"abort_request_id": _strings(uuid.uuid4().hex.encode())}
            if secret is not None:
                inputs["control_secret"] = _strings(secret)
            _generator_call(server.grpc_url, inputs)

    threads = [
        threading.Thread(target=flood, args=(s,)) for s in (None, server.control_secret.encode())
    ]
    for thread in threads:
        thread.start()
    try:
        response = _chat(root, name, "Hello there", max_tokens=24, ignore_eos=True)
        health = httpx.get(f"{root}/health", timeout=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert health.status_code == 200, health.text


def test_early_abort_memory_is_bounded_in_size_and_time():
    """Hole: every unknown-id abort was remembered (the table rebuilt on each: O(n) per abort)
    and an empty id matched every request sent without one."""
    from tritonllm.serving.request_table import RequestTable

    table: RequestTable[str] = RequestTable(abort_ttl_s=0.2, max_early_aborts=100)
    table.add("", "anonymous")
    assert table.abort("") == [] and table.keys_of("") == []
    for i in range(10_000):
        table.abort(f"unknown-{i}")
    assert table.num_early_aborts == 100
    assert table.was_aborted("unknown-9999") and not table.was_aborted("unknown-0")
    time.sleep(0.25)
    table.abort("late")
    assert table.num_early_aborts == 1  # the expired ones went with that one abort


# --- 5. Prefix-cache isolation and the API key ---------------------------------------------------

PREFIX = "You are a careful assistant. The secret launch code is 7-4-1-9-0-3. " * 4


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_learns_nothing_from_another_tenants_cached_prefix(service):
    """Hole: cached_tokens (and TTFT) told any client, page by page, whether another client's
    prompt shared its prefix. Each API key now has its own cache namespace."""
    _, root, name = service
    assert _cached(_chat(root, name, PREFIX + "Hi", KEY_A, max_tokens=1)) == 0
    assert _cached(_chat(root, name, PREFIX + "Hi", KEY_B, max_tokens=1)) == 0
    assert _cached(_chat(root, name, PREFIX + "Hello", KEY_A, max_tokens=1)) > 0
    # A client's own cache_salt splits its tenant's namespace; it cannot join another's.
    salted = _chat(root, name, PREFIX + "Hi", KEY_B, max_tokens=1, cache_salt="x")
    assert _cached(salted) == 0


def test_api_key_is_required_except_for_health_and_the_page(service):
    """Issue 15 item 4: with API keys set, every route but /health and / needs a valid
    ``Authorization: Bearer`` key; a missing or wrong one gets OpenAI's 401."""
    _, root, name = service
    for headers in ({}, _auth("wrong"), {"Authorization": KEY_A}):
        response = httpx.get(f"{root}/v1/models", headers=headers, timeout=10)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert KEY_A not in response.text and "wrong" not in response.text
    body = {"model": name, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(f"{root}/v1/chat/completions", json=body, timeout=10).status_code == 401
    assert httpx.get(f"{root}/openapi.json", timeout=10).status_code == 401
    assert httpx.get(f"{root}/v1/models", headers=_auth(KEY_B), timeout=10).status_code == 200
    assert httpx.get(f"{root}/health", timeout=30).status_code == 200
    page = httpx.get(f"{root}/", timeout=10)
    assert page.status_code == 200 and 'id="api-key"' in page.text


# What the official openai JS SDK asks a preflight to allow (it sends its own headers beside the
# key and the JSON type); QA: a fixed list of Authorization and Content-Type refused these.
SDK_REQUEST_HEADERS = (
    "authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-arch,"
    "x-stainless-runtime,x-stainless-runtime-version,x-stainless-package-version,"
    "x-stainless-retry-count,x-stainless-timeout,openai-organization,openai-project,openai-beta"
)


def test_cors_allows_only_the_configured_origin(service):
    """Issue 15 item 4: CORS answers the configured origin (preflight without a key, with the
    openai SDK's own request headers) and no other."""
    _, root, _ = service
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": SDK_REQUEST_HEADERS,
    }
    allowed = httpx.options(
        f"{root}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight}, timeout=10
    )
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{root}/v1/chat/completions",
        headers={"Origin": "https://evil.example", **preflight},
        timeout=10,
    )
    assert "access-control-allow-origin" not in other.headers
    denied = httpx.get(f"{root}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert denied.status_code == 401  # a browser can read the 401
    assert denied.headers["access-control-allow-origin"] == ORIGIN


def test_cors_preflight_of_the_openai_sdk_is_allowed_for_the_origin_only():
    """QA: a browser page of an allowed origin using the official openai JS SDK got a 400
    ("Disallowed CORS headers") on its preflight: the SDK asks for x-stainless-* and openai-*
    headers. Any request header is allowed now, for the configured origins only (in process:
    the preflight never reaches Triton, so no lifespan runs and its URL is never dialled)."""
    from fastapi.testclient import TestClient

    from openai_frontend import create_app

    app = create_app("127.0.0.1:9", "m", api_keys=(KEY_A,), cors_origins=(ORIGIN,))
    client = TestClient(app)
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": SDK_REQUEST_HEADERS,
    }
    allowed = client.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    granted = {h.strip() for h in allowed.headers["access-control-allow-headers"].split(",")}
    assert set(SDK_REQUEST_HEADERS.split(",")) <= {h.lower() for h in granted}
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "Origin" in allowed.headers["vary"]  # caches keep per-origin answers apart
    refused = client.options(
        "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight}
    )
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    # The key is still needed: a header grants nothing but leave to be sent.
    sdk_call = {"Origin": ORIGIN, "x-stainless-os": "Linux", "openai-project": "p"}
    assert client.get("/v1/models", headers=sdk_call).status_code == 401


# --- 6. Admission control and limits ---------------------------------------------------------------


def test_full_queue_answers_429_with_retry_after(service):
    """Hole: the waiting queue was unbounded (744 queued at 1,000 concurrent requests, never a
    429). This server admits 1 request at a time (1 running + 0 waiting)."""
    _, root, name = service
    body = {
        "model": name,
        "messages": [{"role": "user", "content": "Go on"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60, headers=_auth()) as client:
        with client.stream("POST", f"{root}/v1/chat/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(lines)  # started: live in the generator
            refused = client.post(
                f"{root}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}
            )
            rest = [line for line in lines if line]
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert rest[-1] == "data: [DONE]"  # the admitted one went on to its end
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_max_tokens_times_n_is_capped(service):
    """Hole: one request with n=16 and no max_tokens generated 32,624 tokens."""
    _, root, name = service
    response = _chat(root, name, "x", n=16, max_tokens=1100, stream=True)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_tokens"


def test_giant_prompts_are_refused_without_tokenizing(service):
    """Hole: a 4 MiB prompt was tokenized in full (4-6 s of CPU) before the context check
    refused it, stalling every other request. Now a body over 4 MiB gets a 413 unread, and a
    prompt under it that cannot fit the context in characters is refused before tokenizing
    (tokenizing 3 MiB takes seconds here: a refusal well under a second never tokenized)."""
    server, root, name = service
    with httpx.Client(timeout=60, headers=_auth()) as client:

        def small() -> float:
            start = time.perf_counter()
            assert (
                client.post(
                    f"{root}/v1/chat/completions",
                    json={
                        "model": name,
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 4,
                    },
                ).status_code
                == 200
            )
            return time.perf_counter() - start

        baseline = min(small() for _ in range(3))
        huge = json.dumps(
            {"model": name, "messages": [{"role": "user", "content": "a" * (4 << 20)}]}
        ).encode()
        big = {"model": name, "messages": [{"role": "user", "content": "ab " * (1 << 20)}]}
        refusals, bigs, during = [], [], []
        for _ in range(3):
            start = time.perf_counter()
            response = client.post(
                f"{root}/v1/chat/completions",
                content=huge,
                headers={"Content-Type": "application/json"},
            )
            refusals.append(time.perf_counter() - start)
            assert response.status_code == 413
            start = time.perf_counter()
            response = client.post(f"{root}/v1/chat/completions", json=big)
            bigs.append(time.perf_counter() - start)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded"
        stop = threading.Event()

        def attack() -> None:
            with httpx.Client(timeout=60, headers=_auth()) as attacker:
                while not stop.is_set():
                    attacker.post(f"{root}/v1/chat/completions", json=big)

        attackers = [threading.Thread(target=attack) for _ in range(4)]
        for thread in attackers:
            thread.start()
        try:
            during = [small() for _ in range(3)]
        finally:
            stop.set()
            for thread in attackers:
                thread.join()
    # Straight to Triton, the tokenizer model refuses it before tokenizing too.
    start = time.perf_counter()
    (_, error), *_ = _generator_call(
        server.grpc_url, {"text_input": _strings(b"ab " * (1 << 20))}, model="llm"
    )
    direct = time.perf_counter() - start
    assert _error_code(error) == "context_length_exceeded"
    assert min(refusals) < 0.1, refusals  # the bound, fastest of three
    assert direct < 1.0, direct
    assert max(bigs) < 1.0, bigs
    # Others keep their latency (generous: the attack shares this 2-core machine's CPU).
    assert min(during) < baseline * 3 + 0.5, (baseline, during)


def test_half_sent_and_idle_connections_are_closed(service):
    """Hole: connections that never completed their request headers stayed open (120 s and
    more), each holding a socket and a task."""
    _, root, _ = service
    host, port = root.removeprefix("http://").rsplit(":", 1)
    conns = []
    for data in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"):
        conn = socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + 10)
        conn.sendall(data)
        conns.append(conn)
    start = time.monotonic()
    for conn in conns:
        assert conn.recv(1024) == b""  # closed by the server, not by our timeout
        conn.close()
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 9


def _detokenize(url: str, output_ids: list[int]):
    """The ``detokenizer`` model called directly with ``output_ids`` (no prefix, not final)."""
    values = {
        "output_ids": np.array(output_ids, np.int32),
        "prefix_ids": np.array([], np.int32),
        "finish_reason": _strings(b""),
        **{
            k: np.array([0], np.int32)
            for k in ("num_input_tokens", "num_output_tokens", "cached_tokens", "trim_chars")
        },
    }
    inputs = []
    for key, array in values.items():
        dtype = "BYTES" if array.dtype == np.object_ else "INT32"
        tensor = grpcclient.InferInput(key, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    try:
        return client.infer("detokenizer", inputs)
    finally:
        client.close()


def _read_all(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_stalled_or_trickled_request_body_gets_408_and_is_closed(tmp_path):
    """Hole: complete headers announcing a 100-byte body, then one byte, held the connection
    (and a task) open for as long as the client liked (QA: > 75 s; the header timeout covers
    the headers only). Now the whole body must arrive within ``--body-timeout``, whether it
    stalls or trickles a byte at a time: past it, a 408 OpenAI error and the connection is
    closed. A body refused for its size or encoding before it was read, and trickled on after
    the answer, gets the header timeout (it was discarded untimed). A body sent at once is
    still served (here a 404 for an unknown model: no Triton runs, and none is needed
    for any of these answers)."""
    from frontend_fixtures import start_sidecar_without_triton

    timeout_s, header_timeout_s = 1.0, 1.0
    process, port = start_sidecar_without_triton(
        tmp_path / "sidecar.log",
        (f"--body-timeout={timeout_s}", f"--header-timeout={header_timeout_s}"),
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    try:
        stalled = socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 10)
        trickled = socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 10)
        start = time.monotonic()
        stalled.sendall(head + b"{")
        trickled.sendall(head)
        # 33 of the 100 bytes, one each 0.3 s: none is sent near the 1 s deadline, so none is
        # unread when the server closes (which would reset the connection, 408 and all).
        for byte in b'{"model": "tiny", "messages": []}':
            if select.select([trickled], [], [], 0.3)[0]:
                break  # answered
            trickled.sendall(bytes([byte]))
        answers = {}
        for name, conn in (("stalled", stalled), ("trickled", trickled)):
            answers[name] = _read_all(conn)  # "" and EOF: closed by the server
            conn.close()
        elapsed = time.monotonic() - start
        for name, answer in answers.items():
            status_line, _, rest = answer.partition(b"\r\n")
            assert status_line == b"HTTP/1.1 408 Request Timeout", (name, answer)
            head_text, _, body = rest.partition(b"\r\n\r\n")
            assert b"connection: close" in head_text.lower(), (name, answer)
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "request_timeout", error
        assert timeout_s <= elapsed < timeout_s + 5, elapsed
        # A body refused before it was read (413, 415) is discarded as it comes: trickled on
        # after the answer, it held the connection open too. It gets the header timeout.
        refused = {
            413: b"Content-Length: 9000000\r\n",
            415: b"Content-Length: 100\r\nContent-Encoding: gzip\r\n",
        }
        for status, headers in refused.items():
            limit = header_timeout_s + 5
            with socket.create_connection(("127.0.0.1", port), timeout=limit) as conn:
                conn.sendall(head.replace(b"Content-Length: 100\r\n", headers) + b"{")
                answer = b""
                while not answer.endswith(b"}"):  # the whole answer, its JSON body included
                    answer += conn.recv(65536)
                assert answer.startswith(b"HTTP/1.1 %d " % status), answer
                answered, closed = time.monotonic(), False
                try:
                    while not closed and time.monotonic() - answered < limit:
                        if select.select([conn], [], [], 0.2)[0]:
                            closed = conn.recv(65536) == b""
                        else:
                            conn.sendall(b" ")  # 5 bytes a second, while the server takes them
                except (BrokenPipeError, ConnectionResetError):
                    closed = True  # closed with bytes of ours unread
            assert closed, status
        body = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=30).status_code == 404
    finally:
        stop_process(process)


# The tiny Qwen3's vocabulary (logits width) has 151,936 ids, its tokenizer 151,669.
@pytest.mark.parametrize("bad_id", [-1, 151_936, 10**9])
def test_detokenizer_refuses_ids_outside_the_vocabulary(service, bad_id):
    """Hole: negative ids sent straight to the detokenizer wrapped around (decoded from the end
    of the id table). QA: an id past the model's vocabulary, which no generation produces, was
    accepted silently (decoded to nothing). Both are ``invalid_value`` errors naming the id; an
    id the model has but the tokenizer lacks (a padding row a model may sample) still decodes
    to nothing."""
    server, _, _ = service
    with pytest.raises(InferenceServerException) as caught:
        _detokenize(server.grpc_url, [9707, bad_id])
    assert _error_code(caught.value) == "invalid_value"
    assert f"output_ids holds token id {bad_id}," in caught.value.message()
    padded = _detokenize(server.grpc_url, [9707, 151_935])
    assert padded.as_numpy("text_output")[0] == b"Hello"


# --- 7. Error bodies and the OpenAPI document -----------------------------------------------------


def test_openapi_lists_the_real_statuses_and_the_event_stream(service):
    """Hole: /openapi.json listed a 422 that is never returned and none of the real error
    statuses or the SSE response."""
    _, root, _ = service
    document = httpx.get(f"{root}/openapi.json", headers=_auth(), timeout=10).json()
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat
    for status in ("400", "401", "404", "408", "413", "415", "429", "500", "503", "504"):
        schema = chat[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in chat["200"]["content"]
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_schemathesis_finds_no_undocumented_status_or_5xx(service, tmp_path):
    """A bounded schemathesis run (fixed seed) against the sidecar's OpenAPI document: every
    response's status and content type are documented, bodies match their schemas, no 5xx,
    no hang; a normal request succeeds afterwards."""
    _, root, name = service
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        pytest.skip("schemathesis is not installed (pyproject's dev extra)")
    command = [
        st,
        "run",
        f"{root}/openapi.json",
        f"--url={root}",
        f"--header=Authorization: Bearer {KEY_A}",
        "--checks=not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance",
        "--max-examples=8",
        "--seed=18",
        "--request-timeout=30",
        "--workers=1",
        "--phases=examples,fuzzing",
        "--exclude-path-regex=^/health",
    ]
    # In tmp_path: schemathesis keeps a cache directory (.schemathesis/) where it runs.
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    print(run.stdout[-3000:])  # the run's summary (pytest -s shows it)
    assert _chat(root, name, "Hi", max_tokens=2).status_code == 200


def test_launcher_keeps_secrets_off_command_lines(monkeypatch):
    """API keys and the control secret reach the sidecar in its environment (readable by its
    own user only), never on a command line (``ps`` shows those to every local user); every
    tritonserver restart keeps the sidecar's control secret."""
    from tritonllm.launch import build_supervisor, parse_args

    monkeypatch.setenv("TRITONLLM_API_KEY", "k-one, k-two")
    monkeypatch.delenv("TRITONLLM_CONTROL_SECRET", raising=False)
    cfg = parse_args(["--cache-salt-from-api-key", f"--cors-allow-origin={ORIGIN}"])
    assert cfg.api_keys == ("k-one", "k-two") and "k-one" not in repr(cfg)
    supervisor = build_supervisor(cfg, "/models/m", "m")
    command = " ".join(supervisor.sidecar_command)
    env = supervisor.sidecar_env or {}
    secret = env["TRITONLLM_CONTROL_SECRET"]
    assert len(secret) == 64 and env["TRITONLLM_API_KEY"] == "k-one,k-two"
    assert "k-one" not in command and secret not in command
    assert "--cache-salt-from-api-key" in command and ORIGIN in command
    first, restarted = supervisor.new_triton(), supervisor.new_triton()
    assert first.control_secret == restarted.control_secret == secret
    assert first.admin_key != secret
