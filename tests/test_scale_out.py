"""Two replicas of the service (tritonserver + sidecar, the tiny model: A run by the launcher,
B the session's) behind a real nginx running the shipped ``deploy/nginx/tritonllm.conf``, on
loopback, under 64 streaming clients, after A's supervision is tried:

0. A's launcher holds no torch; A's generator stub is SIGKILLed with streams in flight: they
   fail at once with a 503, and A's launcher restarts its tritonserver;
1. requests alternate between the replicas freely, one client's included (the sidecar holds no
   state that ties a client to a replica);
2. replica A gets SIGTERM mid-way: its /health and new requests sent to it get 503, its streams
   in flight finish whole, new requests go to B, not one request through nginx fails (a long
   request sent to A directly keeps A draining);
3. then every process of A is SIGKILLed (a grace period that ran out): the long request dies
   with it, every request started afterwards succeeds on B, and no process of A is left.

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
import openai
import pytest
from process_helpers import stub_pid
from test_launch import _kill_marked, _marked_env, _marked_processes, _wait_none_marked
from test_supervision import Launcher, _small_process, _start_streams

from tritonllm.contract.limits import MAX_REQUEST_OUTPUT_TOKENS
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


def _one_request(
    http: httpx.Client, url: str, model: str, max_tokens: int
) -> tuple[bool, str, str]:
    """One streamed completion: (whole and exact, replica, what was wrong or "")."""
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "stream": True}
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


def _client_loop(
    index: int, url: str, model: str, stop: threading.Event, results: list[Result]
) -> None:
    with httpx.Client(timeout=httpx.Timeout(120.0)) as http:
        n = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok, upstream, detail = _one_request(http, url, model, 4 + (index + n) % 8)
            except httpx.HTTPError as exc:
                ok, upstream, detail = False, "", f"{type(exc).__name__}: {exc}"
            results.append(Result(index, started, time.monotonic(), upstream, ok, detail))
            n += 1


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _replica_args(model: Path, name: str, port: int) -> list[str]:
    args = [f"--model={model}", f"--model-name={name}", f"--port={port}", "--drain-timeout=120"]
    args += ["--unhealthy-timeout=3", "--health-interval=0.5"]  # quick supervision
    return args + [f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics")]


def _held_request(base_url: str, model: str, outcome: dict) -> None:
    """A long request straight to one replica (as many choices of 1,900 tokens as the cap on a
    request's output tokens allows, 8; the tiny model's max_model_len is 2,048): it keeps that
    replica's drain going until the test SIGKILLs it, as a Kubernetes grace period ends."""
    n = MAX_REQUEST_OUTPUT_TOKENS // 1900
    body = {"model": model, "prompt": "Hold", "max_tokens": 1900, "n": n, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
            outcome["status"] = r.status_code
            for line in r.iter_lines():
                outcome["last"] = line
        outcome["ended"] = "whole" if outcome.get("last") == "data: [DONE]" else "cut"
    except httpx.HTTPError as exc:
        outcome["ended"] = f"broken: {type(exc).__name__}"


def test_replicas_behind_nginx_drain_and_die_without_failing_requests(
    tiny_model_dir, sidecar, tmp_path
):
    """Replica A is a launcher; replica B is the session's tritonserver and sidecar."""
    nginx = _nginx_binary()
    env, entry = _marked_env()
    port_a, port_b, lb_port = free_port(), int(sidecar.root_url.rsplit(":", 1)[1]), free_port()
    addr_a, addr_b = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
    config = tmp_path / "nginx.conf"
    config.write_text(nginx_config(tmp_path, lb_port, [port_a, port_b]))
    lb = replica_a = None
    stop, results, held = threading.Event(), [], {}
    url = f"http://127.0.0.1:{lb_port}/v1/completions"
    threads = [
        threading.Thread(
            target=_client_loop, args=(i, url, sidecar.model_name, stop, results), daemon=True
        )
        for i in range(CLIENTS)
    ]
    try:
        replica_a = Launcher(_replica_args(tiny_model_dir, sidecar.model_name, port_a), env)
        lb = subprocess.Popen(
            [nginx, "-p", str(tmp_path), "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        replica_a.wait_for("Ctrl-C", 300)

        # 0. Supervision, before any load: A's launcher holds neither torch nor transformers.
        # A SIGKILLed generator stub: Triton never answers its requests in flight again; A's
        # sidecar fails them at once with a 503 (its idle timeout is 300 s), its /health turns
        # 503, and A's launcher restarts tritonserver.
        no_torch, rss_mib = _small_process(replica_a.process.pid)
        assert no_torch and rss_mib < 150, rss_mib
        direct = openai.OpenAI(
            base_url=f"http://{addr_a}/v1", api_key="unused", max_retries=0, timeout=120
        )
        streams = _start_streams(direct, 3, max_tokens=1900)
        os.kill(stub_pid(replica_a.triton_pid(), "generator"), signal.SIGKILL)
        ends = [streams.get(timeout=60) for _ in range(3)]
        for kind, error, _ in ends:
            assert kind == "error" and error.code == "service_unavailable", ends
        failed_in = max(seconds for _, _, seconds in ends)
        assert failed_in < 20, ends
        # /health turned 503: the launcher says so once it stayed 503 for --unhealthy-timeout
        # (a single GET here races the launcher's own restart and the 1 s health cache).
        # Or tritonserver itself aborted on its stub's death (Triton 2.51 sometimes does: exit
        # code -6) and the launcher saw it exit: either way it restarts tritonserver.
        replica_a.wait_for(("tritonserver unhealthy for", "tritonserver exited"), 30)
        restart_from = time.monotonic()
        replica_a.wait_for("tritonserver restarted; healthy", 300)
        restarted_in = time.monotonic() - restart_from
        print(
            f"\nsupervision: launcher RSS {rss_mib} MiB; streams failed {failed_in:.1f} s after "
            f"their stub's SIGKILL; tritonserver restarted, healthy in {restarted_in:.1f} s"
        )

        wait_http_ok(f"http://127.0.0.1:{lb_port}/health", 30, lb, "nginx")
        up_at = time.monotonic()
        for thread in threads:
            thread.start()

        # 1. Both replicas serve; a client's consecutive requests go to either.
        _wait(lambda: len(results) >= CLIENTS, 120, "no traffic")
        answered = {r.upstream for r in results}
        assert answered == {addr_a, addr_b}, answered
        per_client = {}
        for r in list(results):
            per_client.setdefault(r.client, set()).add(r.upstream)
        assert any(len(seen) == 2 for seen in per_client.values()), per_client

        # 2. SIGTERM to A mid-way: A drains (the held request keeps it draining), its streams
        # in flight finish, B takes every new request, nothing fails.
        holder = threading.Thread(
            target=_held_request, args=(f"http://{addr_a}", sidecar.model_name, held)
        )
        holder.start()
        _wait(lambda: "last" in held, 60, "the held request got no first chunk")
        term_at = time.monotonic()
        replica_a.process.send_signal(signal.SIGTERM)
        _wait(
            lambda: httpx.get(f"http://{addr_a}/health", timeout=10).status_code == 503,
            10,
            "A's /health is not 503 while draining",
        )
        refused = httpx.post(
            f"http://{addr_a}/v1/completions",
            json={"model": sidecar.model_name, "prompt": "Hi", "max_tokens": 2},
            timeout=30,
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert refused.headers["retry-after"] and refused.headers["connection"] == "close"

        def a_went_quiet() -> bool:  # A's streams in flight at the SIGTERM have all ended
            ends = [r.ended for r in list(results) if r.upstream == addr_a]
            now = time.monotonic()
            return now - term_at > 2.0 and now - max(ends) > 1.5

        _wait(a_went_quiet, 60, "A keeps finishing requests long after its SIGTERM")
        _wait(  # under load a request takes seconds: let some that started in the drain end
            lambda: sum(r.started > term_at + 1.0 for r in list(results)) >= 8,
            120,
            "no request that started during A's drain has ended",
        )
        drained_at = time.monotonic()
        snapshot = list(results)
        failed = [r for r in snapshot if not r.ok]
        assert failed == [], failed[:5]
        in_flight_on_a = [r for r in snapshot if r.upstream == addr_a and r.ended > term_at]
        assert in_flight_on_a, "no stream was in flight on A at its SIGTERM"
        late = [r for r in snapshot if r.started > term_at + 1.0]
        assert late and {r.upstream for r in late} == {addr_b}
        assert replica_a.process.poll() is None and "ended" not in held  # still draining

        # 3. The grace period is over: every process of A is SIGKILLed. The held request dies
        # with it; nginx routes every new request around A.
        groups = [replica_a.triton_pid()]  # tritonserver's and the sidecar's process groups
        groups += [int(p) for p in re.findall(r"sidecar pid (\d+)", "".join(replica_a.output))]
        killed_at = time.monotonic()
        os.kill(replica_a.process.pid, signal.SIGKILL)  # the launcher (in the test's group)
        for pgid in groups:
            os.killpg(pgid, signal.SIGKILL)
        holder.join(60)
        assert held["ended"] != "whole", held
        time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join(150)
        after = [r for r in results if r.started > killed_at]
        assert after and all(r.ok for r in after), [r for r in after if not r.ok][:5]
        assert {r.upstream for r in after} == {addr_b}
        assert all(r.ok for r in results), [r for r in results if not r.ok][:5]
        assert _wait_none_marked(entry, 30) == {}
        print(
            f"\nscale-out: {len(results)} requests through nginx, none failed; "
            f"{len(in_flight_on_a)} in flight on A at its SIGTERM finished; "
            f"{len(late)} started during A's drain and {len(after)} after its SIGKILL, all "
            f"on B; seconds: load {term_at - up_at:.1f}, drain {drained_at - term_at:.1f}, "
            f"after the kill {time.monotonic() - killed_at:.1f}"
        )
    finally:
        stop.set()
        if replica_a is not None and replica_a.process.poll() is None:
            replica_a.process.kill()
        _kill_marked(entry)
        if lb is not None:
            stop_process_group(lb, 10)
        assert not _marked_processes(entry)


if __name__ == "__main__":  # print the rendered config: python tests/test_scale_out.py
    sys.stdout.write(nginx_config(Path("/tmp/nginx"), 8080, [9000, 9001]))
