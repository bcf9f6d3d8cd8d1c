"""``python -m openai_frontend --workers N`` (``openai_frontend/workers.py``): N sidecar
processes on one port, in front of the real tritonserver.

- two workers stream what one worker streams (greedy, concurrent), the requests land on both,
  and each worker holds a generator lease of its own;
- ``/metrics`` counts every worker's requests, whichever worker answers the scrape, under the
  names one worker exports;
- SIGTERM to the parent drains both workers (their streams finish) and it exits 0; a
  SIGKILLed worker makes the parent stop the other and exit non-zero at once, and no
  generation is left running in the generator;
- a hung worker (SIGSTOPped: alive, silent) is SIGKILLed once its heartbeat is
  ``--worker-timeout`` seconds old, and then the same happens as for a killed one; the
  heartbeat never fires while the workers serve streams, drain or stop;
- ``--workers`` below 1, or a ``--worker-timeout`` within the heartbeat interval, is a usage
  error; one worker (the default) is one process.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from frontend_fixtures import Sidecar, start_sidecar, stop_process
from openai_helpers import engine_idle, wait_for_gauges
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from openai_frontend import app as sidecar_app
from openai_frontend.app import parse_args
from openai_frontend.workers import HEARTBEAT_INTERVAL_S, listening_sockets
from tritonllm.processes import child_pids

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


def _start(triton_server, tiny_model_dir, log_path: Path, *flags: str) -> Sidecar:
    """A sidecar with two workers (and ``flags``) in front of ``triton_server``."""
    name = Path(tiny_model_dir).name
    process, base_url = start_sidecar(
        triton_server.grpc_url,
        name,
        log_path,
        control_secret=triton_server.control_secret,
        extra_args=("--workers=2", *flags),
    )
    # /health answered from one worker; wait for the other too (uvicorn's startup line).
    deadline = time.monotonic() + 60
    while log_path.read_text().count("Application startup complete") < 2:
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return Sidecar(process, base_url, name, triton_server.metrics_url, log_path)


@pytest.fixture(scope="module")
def two_workers(triton_server, tiny_model_dir, tmp_path_factory):
    """A two-worker sidecar shared by this module's tests that leave it running."""
    running = _start(triton_server, tiny_model_dir, tmp_path_factory.mktemp("logs") / "sc.log")
    yield running
    stop_process(running.process)


def _workers(sidecar: Sidecar) -> list[int]:
    workers = child_pids(sidecar.process.pid)
    assert len(workers) == 2, (workers, sidecar.log_tail())
    return workers


def _metrics_dir(worker: int) -> Path:
    """The worker's ``PROMETHEUS_MULTIPROC_DIR`` (from its environment)."""
    for entry in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError(f"worker {worker} has no PROMETHEUS_MULTIPROC_DIR")


def _worker_value(metrics_dir: Path, kind: str, pid: int, sample: str, **labels: str) -> float:
    """The sum of ``sample`` (with ``labels``) in one worker's own file of ``kind`` (``counter``,
    ``gauge_livesum``): what that worker alone counted."""
    path = metrics_dir / f"{kind}_{pid}.db"
    if not path.exists():
        return 0.0
    return sum(
        s.value
        for metric in MultiProcessCollector.merge([str(path)], accumulate=True)
        for s in metric.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


def _chat_requests(metrics_dir: Path, workers: list[int]) -> dict[int, float]:
    return {
        pid: _worker_value(metrics_dir, "counter", pid, "openai_requests_total", route=CHAT)
        for pid in workers
    }


async def _stream_chats(base_url: str, model: str, prompts: list[str], max_tokens: int):
    """Stream one greedy chat per prompt, all at once (one connection each); returns each
    one's (text, finish_reason, completion tokens)."""
    limits = httpx.Limits(max_keepalive_connections=0)  # no connection reused across requests
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def one(prompt: str) -> tuple[str, str | None, int | None]:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            text, finish, tokens = [], None, None
            async with http.stream("POST", f"{base_url}/chat/completions", json=body) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    for choice in chunk["choices"]:
                        text.append(choice["delta"].get("content") or "")
                        finish = choice["finish_reason"] or finish
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            return "".join(text), finish, tokens

        return await asyncio.gather(*(one(p) for p in prompts))


def test_two_workers_stream_what_one_streams_on_both_workers(two_workers, sidecar):
    workers = _workers(two_workers)
    metrics_dir = _metrics_dir(workers[0])
    before = _chat_requests(metrics_dir, workers)
    prompts = [f"Count to {i + 3}, then say hello." for i in range(24)]
    answers = asyncio.run(_stream_chats(two_workers.base_url, two_workers.model_name, prompts, 12))
    assert all(finish == "length" and tokens == 12 for _, finish, tokens in answers), answers
    # Greedy: the same text as one worker gives (and as each prompt alone, test_openai_chat).
    one_worker = asyncio.run(_stream_chats(sidecar.base_url, sidecar.model_name, prompts, 12))
    assert answers == one_worker
    # Each worker answered some of them; together, each request once.
    after = _chat_requests(metrics_dir, workers)
    served = {pid: after[pid] - before[pid] for pid in workers}
    assert sum(served.values()) == len(prompts) and min(served.values()) > 0, served
    # A lease of its own per worker (a worker's death aborts only its own generations).
    leases = dict(
        re.findall(r"process (\d+) holds generator lease (\S+)", two_workers.log_tail(10**6))
    )
    assert sorted(map(int, leases)) == workers and len(set(leases.values())) == 2, leases
    assert "did not answer" not in two_workers.log_tail(10**6)  # no heartbeat missed


def _scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url.removesuffix('/v1')}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_the_requests_of_every_worker(two_workers, sidecar):
    """N requests: ``openai_requests_total`` and the token counters grow by N (and N × tokens)
    in every scrape, whichever worker answers it (fresh connections spread over both)."""
    workers = _workers(two_workers)
    route = (("route", CHAT), ("status", "200"))
    before = _scrape(two_workers.base_url)
    n, max_tokens = 10, 3
    prompts = [f"Say {i}." for i in range(n)]
    asyncio.run(_stream_chats(two_workers.base_url, two_workers.model_name, prompts, max_tokens))
    served = _chat_requests(_metrics_dir(workers[0]), workers)
    assert min(served.values()) > 0, served  # both workers counted some

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    for _ in range(6):  # several scrapes, on fresh connections: both workers answer some
        deadline = time.monotonic() + 10
        while True:  # a request is counted just after its last byte: poll briefly
            after = _scrape(two_workers.base_url)
            if delta("openai_requests_total", route) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert delta("openai_requests_total", route) == n
        assert delta("openai_generation_tokens_total") == n * max_tokens
        assert delta("openai_e2e_request_latency_seconds_count", (("route", CHAT),)) == n
        assert delta("openai_time_to_first_token_seconds_count") == n
        assert after[("openai_requests_in_flight", ())] == 0  # live workers, summed; idle
    # The same families as one worker's registry exports (its own *_created samples and the
    # process_* / python_* collectors of one process aside).
    one = {name for name, _ in _scrape(sidecar.base_url) if name.startswith("openai_")}
    many = {name for name, _ in after if name.startswith("openai_")}
    assert many == {name for name in one if not name.endswith("_created")}


def _live_streams(metrics_dir: Path, workers: list[int]) -> dict[int, float]:
    return {
        pid: _worker_value(metrics_dir, "gauge_livesum", pid, "openai_requests_in_flight")
        for pid in workers
    }


def _stream_until_both_workers_serve(sidecar: Sidecar, n: int, max_tokens: int):
    """Start batches of ``n`` streams in the background until both workers are answering
    some (the kernel picks a connection's worker by a hash: a few can land on one); returns
    the queue of their ends (``test_supervision._consume``), how many were started, and the
    workers."""
    from test_supervision import _consume

    workers = _workers(sidecar)
    metrics_dir = _metrics_dir(workers[0])
    client = openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)
    results: queue.Queue = queue.Queue()
    for batch in range(1, 6):
        first_chunks = threading.Barrier(n + 1)
        for _ in range(n):
            args = (client, max_tokens, first_chunks, results)
            threading.Thread(target=_consume, args=args, daemon=True).start()
        first_chunks.wait(60)
        if min(_live_streams(metrics_dir, workers).values()) > 0:
            return results, batch * n, workers
    raise AssertionError(f"not both workers serving: {_live_streams(metrics_dir, workers)}")


def _long_streams_on_both_workers(sidecar: Sidecar):
    """`_stream_until_both_workers_serve` with streams too long to end within the seconds a
    test gives a stop, once the generator runs every one of them."""
    results, started, workers = _stream_until_both_workers_serve(sidecar, 4, max_tokens=600)
    running = wait_for_gauges(
        sidecar.metrics_url, lambda g: g["tritonllm_requests_running"] >= started, 30
    )
    assert running["tritonllm_requests_running"] == started, running
    return results, started, workers


def test_sigterm_drains_every_worker_then_exits_0(triton_server, tiny_model_dir, tmp_path):
    sidecar = _start(triton_server, tiny_model_dir, tmp_path / "sc.log", "--drain-timeout=60")
    try:
        max_tokens = 200
        results, started, workers = _stream_until_both_workers_serve(sidecar, 4, max_tokens)
        metrics_dir = _metrics_dir(workers[0])
        signalled = time.monotonic()
        os.kill(sidecar.process.pid, signal.SIGTERM)
        # Draining: a new request gets the drain's 503 from whichever worker takes it (once
        # the forwarded signal reached it).
        body = {"model": sidecar.model_name, "messages": MESSAGES, "max_tokens": 1}
        deadline = time.monotonic() + 5
        while True:
            answer = httpx.post(f"{sidecar.base_url}/chat/completions", json=body, timeout=10)
            if answer.status_code == 503 or time.monotonic() > deadline:
                break
        assert answer.status_code == 503, answer.text
        assert sidecar.process.wait(60) == 0, sidecar.log_tail()
        drained_s = time.monotonic() - signalled
        ends = [results.get(timeout=10) for _ in range(started)]
        assert ends == [("ok", "length", max_tokens)] * started, ends
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
        assert not metrics_dir.exists()  # the parent removed it
        assert drained_s < 60
    finally:
        stop_process(sidecar.process)


def test_a_sigkilled_worker_stops_the_sidecar_and_its_generations(
    triton_server, tiny_model_dir, tmp_path
):
    """The killed worker's lease ends its generations; the parent SIGINTs the other worker
    (which aborts its own) and exits 1 for the launcher's supervisor to restart the sidecar."""
    metrics = triton_server.metrics_url
    sidecar = _start(triton_server, tiny_model_dir, tmp_path / "sc.log")
    try:
        results, started, workers = _long_streams_on_both_workers(sidecar)
        killed = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        assert sidecar.process.wait(10) == 1, sidecar.log_tail()
        assert time.monotonic() - killed < 5.0
        assert not Path(f"/proc/{workers[1]}").exists() or _zombie(workers[1])
        gauges = wait_for_gauges(metrics, lambda g: g["tritonllm_requests_running"] == 0, 5)
        assert gauges["tritonllm_requests_running"] == 0, gauges
        ends = [results.get(timeout=10) for _ in range(started)]
        assert all(end[0] == "error" or end[1] == "abort" for end in ends), ends
        assert "exited with signal 9 unasked" in sidecar.log_tail()
    finally:
        stop_process(sidecar.process)
        # The next tests share this server: let whatever this test left end first.
        wait_for_gauges(metrics, engine_idle, 120)


def test_a_hung_worker_is_killed_and_stops_the_sidecar_and_its_generations(
    triton_server, tiny_model_dir, tmp_path
):
    """A SIGSTOPped worker neither exits nor answers, and the kernel still gives it new
    connections: once its heartbeat is ``--worker-timeout`` seconds old the parent SIGKILLs it,
    SIGINTs the other worker, ends the killed one's generator lease (it had no lease request
    open: its generations would run on for the generator's grace) and exits 1."""
    metrics = triton_server.metrics_url
    timeout_s = 2
    log_path = tmp_path / "sc.log"
    sidecar = _start(triton_server, tiny_model_dir, log_path, f"--worker-timeout={timeout_s}")
    try:
        results, started, workers = _long_streams_on_both_workers(sidecar)
        hung = time.monotonic()
        os.kill(workers[0], signal.SIGSTOP)
        assert sidecar.process.wait(timeout_s + 10) == 1, sidecar.log_tail()
        assert time.monotonic() - hung < timeout_s + HEARTBEAT_INTERVAL_S + 4.0
        assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in workers)
        silent = re.search(rf"worker {workers[0]} did not answer for (\d+) s", sidecar.log_tail())
        assert silent and int(silent[1]) >= timeout_s, sidecar.log_tail()
        assert f"worker {workers[0]} exited with signal 9" in sidecar.log_tail()  # SIGKILLed
        gauges = wait_for_gauges(metrics, lambda g: g["tritonllm_requests_running"] == 0, 5)
        assert gauges["tritonllm_requests_running"] == 0, gauges
        # None ran to its end. The hung worker's streams fail; the other worker, stopped with
        # SIGINT, aborts its own before it exits, so they end with "abort" (drain.py).
        ends = [results.get(timeout=10) for _ in range(started)]
        assert any(end[0] == "error" for end in ends), ends
        assert all(end[0] == "error" or end[1] == "abort" for end in ends), ends
    finally:
        stop_process(sidecar.process)
        wait_for_gauges(metrics, engine_idle, 120)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_fewer_than_one_worker_is_a_usage_error(workers, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--workers", workers])
    assert exit_.value.code == 2
    assert "--workers: expected an integer >= 1" in capsys.readouterr().err
    assert parse_args([]).workers == 1


def test_a_worker_count_or_timeout_that_is_no_number_is_a_usage_error(capsys):
    for flag, text in (("--workers", "not an integer: 'abc'"), ("--worker-timeout", "seconds")):
        with pytest.raises(SystemExit) as exit_:
            parse_args([flag, "abc"])
        assert exit_.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument {flag}: " in error and text in error and "invalid" not in error, error


@pytest.mark.parametrize("timeout", ["1", "0.5", "0", "-2"])
def test_a_worker_timeout_within_the_heartbeat_interval_is_a_usage_error(timeout, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--worker-timeout", timeout])
    assert exit_.value.code == 2
    assert "--worker-timeout: must be more than 1 s" in capsys.readouterr().err
    assert parse_args(["--worker-timeout", "2.5"]).worker_timeout == 2.5


def test_every_worker_is_given_the_parents_start_as_the_model_cards_created(monkeypatch):
    """``GET /v1/models`` answers one ``created`` whichever worker serves it: the parent
    passes its own start time (``--created``) to all of them."""
    started: list[list[str]] = []

    def serve(argv, sockets, timeout_s, end_lease):
        started.append(list(argv))
        for sock in sockets:
            sock.close()
        return 0

    monkeypatch.setattr(sidecar_app.workers, "serve", serve)
    monkeypatch.setattr(sidecar_app.time, "time", lambda: 1_700_000_000.5)
    with pytest.raises(SystemExit) as exit_:
        sidecar_app.main(["--workers", "2", "--port", "0", "--model-name", "m"])
    assert exit_.value.code == 0
    assert started == [
        ["--workers", "2", "--port", "0", "--model-name", "m", "--created=1700000000"]
    ]
    assert parse_args(started[0]).created == 1_700_000_000
    assert parse_args([]).created is None


def test_each_worker_gets_a_socket_on_the_one_port_and_a_used_port_fails():
    """Port 0: the system's choice, the same for every worker's socket; a port in use fails,
    another sidecar's SO_REUSEPORT group included (one worker would not share it either)."""
    sockets = listening_sockets("127.0.0.1", 0, 3)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and len({sock.fileno() for sock in sockets}) == 3
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", ports.pop(), 2)
    finally:
        for sock in sockets:
            sock.close()


def test_one_worker_is_one_process(sidecar):
    """The default: the sidecar serves by itself, nothing forked."""
    assert child_pids(sidecar.process.pid) == []
