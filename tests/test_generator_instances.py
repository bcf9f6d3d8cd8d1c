"""Several instances of the generator (Triton instance_group count 2) sharing one engine
process, on a real tritonserver (CPU). Oracles: Hugging Face transformers' greedy decoding, the
kernel's process table (one engine, two stubs that both served), finish reasons and the KV
gauges after aborts and a lease that ends.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from test_engine_helpers import hf_greedy
from test_engine_process import _spawned_engines
from test_triton_models import GREEDY, PROMPTS, Stream, wait_metric

from tritonllm.triton_server import MODEL_REPOSITORY, TritonServer

INSTANCES = 2


@pytest.fixture(scope="module")
def instances_server(tiny_model_dir, tmp_path_factory):
    """tritonserver whose generator has two instances (the engine in a child process)."""
    from conftest import SERVER_ENV

    log = tmp_path_factory.mktemp("logs") / "tritonserver-instances.log"
    server = TritonServer(
        model_path=tiny_model_dir, env=dict(SERVER_ENV), log_path=log, generator_instances=INSTANCES
    )
    try:
        yield server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
    finally:
        copy = server.served_repository
        server.stop()
    # the repository copy with the instance count is gone (its symlinks only)
    assert not copy.exists() and server.served_repository == MODEL_REPOSITORY
    assert (MODEL_REPOSITORY / "generator" / "1" / "model.py").is_file()


def test_triton_serves_the_copy_with_the_instance_count(instances_server):
    copy = instances_server.served_repository
    assert copy != MODEL_REPOSITORY and (copy / "generator" / "config.pbtxt").is_file()
    config = requests.get(
        f"http://{instances_server.http_url}/v2/models/generator/config",
        headers=instances_server.admin_headers,
        timeout=10,
    ).json()
    assert [group["count"] for group in config["instance_group"]] == [INSTANCES]


def _generator_stubs(server_pid: int) -> list[int]:
    """Pids of the generator's Python stubs (children of tritonserver running its model.py)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == server_pid and any(b"/generator/" in arg for arg in cmdline):
            pids.append(int(proc.name))
    return pids


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _finish(stream: Stream, rid: str, first: dict | None = None) -> list[dict]:
    outputs = [first] if first else []
    while True:
        got, out, final = stream.next(timeout=60)
        assert got == rid
        if out is not None:
            outputs.append(out)
        if final:
            return outputs


def test_two_instances_share_one_engine_and_stream_hf_greedy(instances_server, tokenizer):
    stubs = _generator_stubs(instances_server.process.pid)
    assert len(stubs) == INSTANCES, "one stub per generator instance"
    engines = _spawned_engines(instances_server.process.pid)
    assert len(engines) == 1, "the instances share one engine process"
    model = str(instances_server.model_path)
    before = {pid: _cpu_s(pid) for pid in stubs}

    wants = {}  # transformers' greedy text per prompt (here: its model cache is not threadsafe)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        wants[prompt] = tokenizer.decode(hf_greedy(model, ids, 48)[0], skip_special_tokens=True)

    def one(i: int) -> tuple[str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        want = wants[prompt]
        stream = Stream(instances_server.grpc_url)
        try:
            rid = stream.send("llm_fused", {"text_input": prompt, "max_tokens": 48, **GREEDY})
            text = "".join(o["text_output"][0].decode() for o in _finish(stream, rid))
        finally:
            stream.close()
        return text, want

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(32)))
    for text, want in results:
        assert text == want
    # Triton handed requests to both instances: each stub did a share of the response work
    # (about 1,500 responses; an idle stub's own ticks are a small part of it).
    used = {pid: _cpu_s(pid) - before[pid] for pid in stubs}
    total = sum(used.values())
    assert all(seconds > 0.25 * total for seconds in used.values()), used
    assert _spawned_engines(instances_server.process.pid) == engines


def test_aborts_by_id_reach_requests_on_either_instance(instances_server):
    """Long requests land on both instances; an abort control request (also landing on either)
    ends each with finish_reason "abort", and the KV pages come back."""
    streams = [Stream(instances_server.grpc_url) for _ in range(6)]
    control = Stream(instances_server.grpc_url)
    try:
        rids, firsts = [], []
        for i, stream in enumerate(streams):
            rid = stream.send(
                "llm",
                {"text_input": PROMPTS[i % len(PROMPTS)], "max_tokens": 2000, **GREEDY},
                request_id=f"abort-{uuid.uuid4().hex}",
            )
            rids.append(rid)
        for stream in streams:
            firsts.append(stream.next()[1])
        secret = instances_server.control_secret
        for rid in rids:
            control.send("generator", {"abort_request_id": rid, "control_secret": secret})
        control.collect(count=len(rids))
        for stream, rid, first in zip(streams, rids, firsts, strict=True):
            outputs = _finish(stream, rid, first)
            assert outputs[-1]["finish_reason"][0] == b"abort"
            assert int(outputs[-1]["num_output_tokens"][0]) < 2000
    finally:
        for stream in [*streams, control]:
            stream.close()
    wait_metric(instances_server, "tritonllm_requests_running", 0, timeout=5.0)
    wait_metric(instances_server, "tritonllm_kv_pages_used", 0, timeout=5.0)


def test_a_lease_that_ends_aborts_its_requests_on_every_instance(instances_server):
    """A lease (as the sidecar holds one) renewed on one stream while its requests run on
    others; when its client goes away (the lease stream is cancelled) every request of the
    lease ends with "abort", whichever instance it ran on."""
    secret = instances_server.control_secret
    lease = f"lease{uuid.uuid4().hex[:8]}"
    holder = Stream(instances_server.grpc_url)
    streams = [Stream(instances_server.grpc_url) for _ in range(6)]
    try:
        holder.send("generator", {"client_lease": lease, "control_secret": secret})
        rids = [
            stream.send(
                "llm",
                {"text_input": PROMPTS[i % len(PROMPTS)], "max_tokens": 2000, **GREEDY},
                request_id=f"{lease}/{i}",
            )
            for i, stream in enumerate(streams)
        ]
        firsts = [stream.next()[1] for stream in streams]
        for _ in range(4):  # renewed as the sidecar does, landing on either instance
            time.sleep(0.3)
            holder.send("generator", {"client_lease": lease, "control_secret": secret})
        holder.close(cancel=True)  # the client went away
        for stream, rid, first in zip(streams, rids, firsts, strict=True):
            outputs = _finish(stream, rid, first)
            assert outputs[-1]["finish_reason"][0] == b"abort"
    finally:
        for stream in streams:
            stream.close()
    wait_metric(instances_server, "tritonllm_requests_running", 0, timeout=5.0)
