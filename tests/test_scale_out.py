"""Two replicas (``python -m tritonllm.launch``, the tiny model) behind a real nginx running the
shipped ``deploy/nginx/tritonllm.conf``, on loopback, under 64 streaming clients:

1. requests alternate between the replicas freely, one client's included (the sidecar holds no
   state that ties a client to a replica);
2. replica A gets SIGTERM mid-way: its streams in flight finish whole, new requests go to B,
   not one request fails, and A exits 0 with no process left;
3. A is started again and takes traffic, then all of its processes are SIGKILLed: the streams
   it held die with it, and every request started after the kill succeeds on B.

nginx comes from Debian's package (``.ci/run`` installs it). On a development machine without
it the test skips; in CI (``CI`` set) a missing nginx fails it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from test_launch import _kill_marked, _marked_env, _marked_processes, _wait_none_marked
from test_supervision import Launcher

from tritonllm.triton_server import free_port, stop_process_group, wait_http_ok

REPO_ROOT = Path(__file__).resolve().parent.parent
NGINX_CONF = REPO_ROOT / "deploy" / "nginx" / "tritonllm.conf"
CLIENTS = 64


def _nginx_binary() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is missing in CI: .ci/run installs Debian's nginx package")
        pytest.skip("nginx is not installed (Debian: apt-get install nginx; .ci/run does it)")
    return found


def nginx_config(tmp: Path, listen_port: int, replica_ports: list[int]) -> str:
    """The shipped config with loopback upstreams and port, inside a minimal main config."""
    site = NGINX_CONF.read_text()
    servers = "".join(
        f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;\n" for p in replica_ports
    )
    site, count = re.subn(r"(?m)^    server \S+:\d+ [^;]*;\n", "", site)
    assert count == 2, "deploy/nginx/tritonllm.conf: expected two example upstream servers"
    site = site.replace("upstream tritonllm {\n", "upstream tritonllm {\n" + servers)
    site, count = re.subn(r"listen \d+;", f"listen 127.0.0.1:{listen_port};", site)
    assert count == 1
    temp = "".join(
        f"    {kind}_temp_path {tmp}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"daemon off;\nworker_processes 1;\npid {tmp}/nginx.pid;\n"
        f"error_log {tmp}/error.log warn;\nevents {{ worker_connections 1024; }}\n"
        f"http {{\n    access_log {tmp}/access.log;\n{temp}{site}\n}}\n"
    )


@dataclass
class Result:
    client: int
    started: float
    ended: float
    upstream: str  # the replica that answered (the last one nginx tried)
    ok: bool
    detail: str


def _one_request(http: httpx.Client, url: str, max_tokens: int) -> tuple[bool, str, str]:
    """One streamed completion: (whole and exact, replica, what was wrong or "")."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", url, json=body) as response:
        upstream = response.headers.get("x-upstream", "").split(",")[-1].strip()
        if response.status_code != 200:
            return False, upstream, f"HTTP {response.status_code}: {response.read()[:300]!r}"
        finish, usage, done = None, None, False
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return False, upstream, f"in-band error {chunk['error']}"
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    if not done or usage is None or finish not in ("length", "stop"):
        return False, upstream, f"incomplete: done={done} finish={finish} usage={usage}"
    if finish == "length" and usage["completion_tokens"] != max_tokens:
        return False, upstream, f"usage {usage} for max_tokens {max_tokens}"
    return True, upstream, ""


def _client_loop(index: int, url: str, stop: threading.Event, results: list[Result]) -> None:
    with httpx.Client(timeout=httpx.Timeout(120.0)) as http:
        n = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok, upstream, detail = _one_request(http, url, 4 + (index + n) % 8)
            except httpx.HTTPError as exc:
                ok, upstream, detail = False, "", f"{type(exc).__name__}: {exc}"
            results.append(Result(index, started, time.monotonic(), upstream, ok, detail))
            n += 1


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _replica_args(model: Path, port: int) -> list[str]:
    args = [f"--model={model}", "--model-name=tiny", f"--port={port}", "--drain-timeout=60"]
    return args + [f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics")]


def test_replicas_behind_nginx_drain_and_die_without_failing_requests(tiny_model_dir, tmp_path):
    nginx = _nginx_binary()
    env_a, entry_a = _marked_env()
    env_b, entry_b = _marked_env()
    port_a, port_b, lb_port = free_port(), free_port(), free_port()
    addr_a, addr_b = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
    config = tmp_path / "nginx.conf"
    config.write_text(nginx_config(tmp_path, lb_port, [port_a, port_b]))
    lb = replica_a = replica_b = None
    stop, results = threading.Event(), []
    threads = [
        threading.Thread(
            target=_client_loop,
            args=(i, f"http://127.0.0.1:{lb_port}/v1/completions", stop, results),
            daemon=True,
        )
        for i in range(CLIENTS)
    ]
    try:
        replica_a = Launcher(_replica_args(tiny_model_dir, port_a), env_a)
        replica_b = Launcher(_replica_args(tiny_model_dir, port_b), env_b)
        lb = subprocess.Popen(
            [nginx, "-p", str(tmp_path), "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        replica_a.wait_for("Ctrl-C", 300)
        replica_b.wait_for("Ctrl-C", 300)
        wait_http_ok(f"http://127.0.0.1:{lb_port}/health", 30, lb, "nginx")
        up_at = time.monotonic()
        for thread in threads:
            thread.start()

        # 1. Both replicas serve; a client's consecutive requests go to either.
        _wait(lambda: len(results) >= CLIENTS, 120, "no traffic")
        answered = {r.upstream for r in results}
        assert answered == {addr_a, addr_b}, answered
        per_client = {}
        for r in results:
            per_client.setdefault(r.client, set()).add(r.upstream)
        assert any(len(seen) == 2 for seen in per_client.values()), per_client

        # 2. SIGTERM to A mid-way: A drains, B takes the new requests, nothing fails.
        term_at = time.monotonic()
        replica_a.process.send_signal(signal.SIGTERM)
        assert replica_a.process.wait(120) == 0, "".join(replica_a.output)[-3000:]
        drained_at = time.monotonic()
        assert _wait_none_marked(entry_a, 30) == {}
        time.sleep(1.0)  # B alone for a while
        snapshot = list(results)
        failed = [r for r in snapshot if not r.ok]
        assert failed == [], failed[:5]
        in_flight_on_a = [r for r in snapshot if r.upstream == addr_a and r.ended > term_at]
        assert in_flight_on_a, "no stream was in flight on A at its SIGTERM"
        late = [r for r in snapshot if r.started > term_at + 1.0]
        assert late and {r.upstream for r in late} == {addr_b}
        print(
            f"\nscale-out: {len(snapshot)} requests before the restart, none failed; "
            f"{len(in_flight_on_a)} in flight on A at SIGTERM finished; A drained in "
            f"{drained_at - term_at:.1f} s"
        )

        # 3. A comes back and takes traffic; then every process of A is SIGKILLed.
        replica_a = Launcher(_replica_args(tiny_model_dir, port_a), env_a)
        restart_at = time.monotonic()
        replica_a.wait_for("Ctrl-C", 300)
        back = time.monotonic()
        _wait(
            lambda: any(r.upstream == addr_a and r.started > back for r in list(results)),
            60,
            "A takes no traffic after its restart",
        )
        groups = [replica_a.triton_pid()]  # tritonserver's and the sidecar's process groups
        groups += [int(p) for p in re.findall(r"sidecar pid (\d+)", "".join(replica_a.output))]
        killed_at = time.monotonic()
        os.kill(replica_a.process.pid, signal.SIGKILL)  # the launcher (in the test's group)
        for pgid in groups:
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join(150)
        after = [r for r in results if r.started > killed_at + 0.5]
        assert after and all(r.ok for r in after), [r for r in after if not r.ok][:5]
        assert {r.upstream for r in after} == {addr_b}
        lost = [r for r in results if not r.ok]
        assert all(r.started < killed_at < r.ended + 0.5 for r in lost), lost[:5]
        print(
            f"scale-out: {len(results)} requests in all; {len(lost)} streams died with A's "
            f"SIGKILL (in flight on it), {len(after)} started after it, all on B and whole; "
            f"seconds: load {term_at - up_at:.1f}, drain {drained_at - term_at:.1f}, "
            f"restart {back - restart_at:.1f}, kill {time.monotonic() - killed_at:.1f}"
        )
    finally:
        stop.set()
        for replica, entry in ((replica_a, entry_a), (replica_b, entry_b)):
            if replica is not None and replica.process.poll() is None:
                replica.process.terminate()
                try:
                    replica.process.wait(90)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
            _kill_marked(entry)
        if lb is not None:
            stop_process_group(lb, 10)
        assert not _marked_processes(entry_a) and not _marked_processes(entry_b)


if __name__ == "__main__":  # print the rendered config: python tests/test_scale_out.py
    sys.stdout.write(nginx_config(Path("/tmp/nginx"), 8080, [9000, 9001]))
