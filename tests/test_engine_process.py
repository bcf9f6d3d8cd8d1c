"""EngineProcess: the engine in a spawned child process behind EngineThread's interface.

Oracles: Hugging Face transformers' greedy decoding, the engine's thread mode (`EngineThread`,
`LLMEngine.check_request`) for seeded sampling and validation, the kernel's process table for
the child's lifetime, and a real tritonserver for the generator's process mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_engine_helpers import checkpoint, hf_greedy, prompts
from test_engine_thread import GREEDY, TIMEOUT, Collector

from tritonllm.config import EngineConfig
from tritonllm.engine import EngineProcess, EngineThread, LLMEngine
from tritonllm.engine.client import EngineClient, LoopTimes
from tritonllm.engine.process_messages import decode_step, encode_step
from tritonllm.engine.request import RequestOutput
from tritonllm.engine.request_limits import RequestLimits
from tritonllm.processes import child_pids
from tritonllm.sampling_params import SamplingParams
from tritonllm.triton_server import REPO_ROOT


class StartCollector(Collector):
    """A `Collector` whose `started` event is set by the first output."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def __call__(self, out) -> None:
        super().__call__(out)
        self.started.set()


def _config(num_pages: int = 256) -> EngineConfig:
    return EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=num_pages)


@pytest.fixture(scope="module")
def process():
    ep = EngineProcess(_config())
    yield ep
    ep.shutdown()
    assert not ep.is_alive() and ep._process.exitcode == 0  # stopped, not killed


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (zombies, which hold nothing, count as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _serve_through_the_client_interface(client: EngineClient) -> None:
    """What the Triton generator does with an engine, through `EngineClient` only: submit,
    read stats and loop times, abort, check liveness; the outputs follow the interface's
    contract (greedy ids equal transformers', one final output per request)."""
    prompt = prompts([9], seed=31)[0]
    sink = Collector()
    client.submit("c-greedy", prompt, GREEDY, sink)
    client.submit("c-abort", prompt, SamplingParams(max_tokens=400, ignore_eos=True), sink)
    client.abort("c-abort")
    client.abort("c-unknown")  # ignored
    sink.wait(["c-greedy", "c-abort"])
    assert sink.ids("c-greedy") == hf_greedy(checkpoint("qwen3"), prompt, 12)[0]
    assert sink.outputs["c-abort"][-1].finish_reason == "abort"
    assert [sum(o.finished for o in sink.outputs[r]) for r in sink.outputs] == [1, 1]
    assert client.is_alive()
    stats, times = client.stats(), client.loop_times()
    assert stats.num_running == 0 and stats.num_steps > 0 and times.loops > 0
    with pytest.raises(ValueError, match="top_p"):
        client.submit("c-bad", prompt, SamplingParams(top_p=1.5), sink)


def test_engine_thread_and_engine_process_serve_one_client_interface(process):
    """Both implementations of `EngineClient` pass the same interface-level scenario."""
    thread = EngineThread(LLMEngine(_config()))
    try:
        for client in (thread, process):
            _serve_through_the_client_interface(client)
    finally:
        thread.shutdown()
    assert not thread.is_alive()


def test_greedy_ids_of_concurrent_submissions_equal_hf(process):
    ps = prompts([4, 9, 13, 2, 21, 7], seed=30)
    sink = Collector()
    with ThreadPoolExecutor(len(ps)) as pool:  # submit() from several threads at once
        list(pool.map(lambda i: process.submit(f"g{i}", ps[i], GREEDY, sink), range(len(ps))))
    sink.wait([f"g{i}" for i in range(len(ps))])
    for i, p in enumerate(ps):
        assert sink.ids(f"g{i}") == hf_greedy(checkpoint("qwen3"), p, 12)[0]
        outs = sink.outputs[f"g{i}"]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 12
        assert outs[-1].num_prompt_tokens == len(p)
        assert sum(o.finished for o in outs) == 1
    stats = process.stats()
    assert stats.num_running == 0 and stats.max_batch_size_seen > 1  # they shared a batch
    times = process.loop_times()
    assert times.loops >= 12 and 0 < times.cpu_s and times.callback_s < times.busy_s


def test_invalid_submit_raises_synchronously_and_the_process_keeps_serving(process):
    sink = Collector()
    with pytest.raises(ValueError, match="top_p"):
        process.submit("bad", [1, 2], SamplingParams(top_p=1.5), sink)
    with pytest.raises(ValueError, match="max_model_len"):
        process.submit("long", [1] * 500, SamplingParams(max_tokens=100), sink)
    with pytest.raises(ValueError, match="token ids"):
        process.submit("vocab", [1, 5000], GREEDY, sink)
    process.submit("good", [1, 2, 3], GREEDY, sink)
    with pytest.raises(ValueError, match="already in use"):
        process.submit("good", [1, 2, 3], GREEDY, sink)
    sink.wait(["good"])
    assert set(sink.outputs) == {"good"} and process.is_alive()


def test_parent_side_validation_equals_the_engine_check():
    """`RequestLimits` (what the parent validates with) refuses exactly what
    `LLMEngine.check_request` refuses, with the same message."""
    engine = LLMEngine(_config(num_pages=9))  # 8 usable pages of 4 tokens
    limits = RequestLimits.of(engine)
    cases = [
        ([1, 2, 3], SamplingParams(max_tokens=5)),
        ([], SamplingParams()),
        ([1, 4096, -1], SamplingParams()),
        ([1] * 400, SamplingParams(max_tokens=200)),
        ([1] * 20, SamplingParams(max_tokens=13)),  # 33 tokens: 8 pages, fits
        ([1] * 20, SamplingParams(max_tokens=14)),  # 9 pages: over the pool
        ([1] * 20, SamplingParams(max_tokens=None)),
        ([1] * 40, SamplingParams(max_tokens=None)),  # no room left in the pool
        ([1, 2], SamplingParams(n=3, max_tokens=4)),
        ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=(3, 4096))),  # past the vocab
    ]

    def outcome(check, ids, params):
        try:
            check(ids, params)
        except ValueError as exc:
            return str(exc)
        return None

    results = [outcome(limits.check, i, p) for i, p in cases]
    assert results == [outcome(engine.check_request, i, p) for i, p in cases]
    assert results[0] is None and results[4] is None and results[6] is None
    # (Invalid sampling values never get this far: a SamplingParams is valid once built.)
    assert sum(r is not None for r in results) == 6
    assert (
        results[-1]
        == f"stop_token_ids must be in [0, {engine.model_config.vocab_size}), got [4096]"
    )


def test_abort_reports_abort_and_frees_pages(process):
    sink = StartCollector()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    process.submit("long", prompts([10], seed=31)[0], long, sink)
    assert sink.started.wait(TIMEOUT)
    process.abort("long")
    sink.wait(["long"])
    last = sink.outputs["long"][-1]
    assert last.finish_reason == "abort" and last.num_output_tokens < 400
    deadline = time.monotonic() + TIMEOUT  # stats arrive with the step message
    while process.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = process.stats()
    assert stats.num_running == 0 and stats.free_pages + stats.evictable_pages == stats.total_pages
    process.abort("unknown-id")  # ignored
    process.submit("after", [5, 6], GREEDY, sink)
    sink.wait(["after"])


def test_a_callback_may_abort_its_own_request(process):
    """Commands posted on the receiver thread (from a callback) are deferred, not lost."""
    sink = Collector()

    def abort_on_first(out):
        sink(out)
        if len(sink.outputs["self-abort"]) == 1:
            process.abort("self-abort")

    long = SamplingParams(max_tokens=400, ignore_eos=True)
    process.submit("self-abort", [3, 1, 4, 1, 5], long, abort_on_first)
    sink.wait(["self-abort"])
    assert sink.outputs["self-abort"][-1].finish_reason == "abort"


def test_n_choices_reach_the_request_callback_as_in_thread_mode(process):
    params = SamplingParams(max_tokens=6, n=3, seed=7, ignore_eos=True)
    sink = Collector()
    process.submit("multi", [3, 4, 5], params, sink)
    sink.wait(["multi"])
    reference = Collector()
    thread = EngineThread(LLMEngine(_config()))
    try:
        thread.submit("multi", [3, 4, 5], params, reference)
        reference.wait(["multi"])
    finally:
        thread.shutdown()

    def choices(collector):
        outs = collector.outputs.pop("multi")
        return [[t for o in outs if o.index == i for t in o.new_token_ids] for i in range(3)]

    got = choices(sink)
    assert got == choices(reference)
    assert len({tuple(ids) for ids in got}) > 1  # seed + i: different choices
    process.submit("multi", [3, 4, 5], GREEDY, sink)  # the id is free again
    sink.wait(["multi"])


def test_step_message_round_trip():
    outs = [
        RequestOutput("a", [5], False, None, 3, 1, 0),
        RequestOutput("b", [], True, "error", 2, 0, 0, error="boom", index=1),
        RequestOutput("c", [9, 8], True, "stop", 4, 2, 4, [-0.5, -1.0], [{9: -0.5}, {8: -1.0}]),
    ]
    outs[2].trim_chars = 3
    engine = LLMEngine(_config(num_pages=9))
    times = LoopTimes(1.5, 1.0, 0.25, 7)
    decoded, stats, decoded_times = decode_step(encode_step(outs, engine.stats(), times))
    assert decoded == outs and stats == engine.stats() and decoded_times == times


def test_failing_engine_build_raises_in_the_constructor_with_the_reason(tmp_path):
    with pytest.raises(
        RuntimeError, match="engine failed to start: FileNotFoundError.*config.json"
    ):
        EngineProcess(EngineConfig(model=str(tmp_path / "missing"), page_size=4))


def test_killed_child_fails_requests_in_flight_and_later_submits_raise():
    ep = EngineProcess(_config())
    sink = StartCollector()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    ep.submit("victim", [1, 2, 3, 4], long, sink)
    ep.submit("victims", [5, 6, 7], SamplingParams(max_tokens=400, n=2, ignore_eos=True), sink)
    assert sink.started.wait(TIMEOUT)
    os.kill(ep.pid, signal.SIGKILL)
    sink.wait(["victim", "victims"])  # n > 1: one error output under the request's own id
    for rid in ("victim", "victims"):
        last = sink.outputs[rid][-1]
        assert last.finish_reason == "error" and "SIGKILL" in last.error
        assert last.error_code == "engine_unavailable"
    assert sum(o.finished for outs in sink.outputs.values() for o in outs) == 2
    assert not ep.is_alive()
    # The gauges a server exports from stats() no longer show the dead engine's requests.
    stats = ep.stats()
    assert stats.num_running == 0 and stats.used_pages == 0
    assert stats.free_pages == stats.total_pages > 0
    with pytest.raises(RuntimeError, match="engine process died"):
        ep.submit("later", [1, 2], GREEDY, sink)
    ep.abort("victim")  # ignored, no hang
    start = time.monotonic()
    ep.shutdown()
    assert time.monotonic() - start < 5.0


def test_engine_made_on_a_short_lived_thread_serves_after_it_ends_and_shuts_down():
    """PR_SET_PDEATHSIG fires when the creating *thread* exits: the receiver thread, not the
    caller's, starts the child, so a caller thread that ends does not take the engine along."""
    made = []
    maker = threading.Thread(target=lambda: made.append(EngineProcess(_config())))
    maker.start()
    maker.join()
    ep = made[0]
    time.sleep(0.2)
    assert ep.is_alive()
    sink = Collector()
    prompt = prompts([6], seed=32)[0]
    ep.submit("x", prompt, GREEDY, sink)
    sink.wait(["x"])
    assert sink.ids("x") == hf_greedy(checkpoint("qwen3"), prompt, 12)[0]
    pid = ep.pid
    ep.shutdown()
    assert not ep.is_alive() and not _alive(pid) and ep._process.exitcode == 0
    with pytest.raises(RuntimeError, match="shut down"):
        ep.submit("y", [1, 2], GREEDY, sink)


@pytest.mark.gpu
def test_cuda_engine_process_greedy_ids_equal_hf():
    """On CUDA (CUDA-graph decode and overlap scheduling by default, float32 on the triton
    backend): concurrent greedy requests through the child give transformers' greedy ids."""
    config = EngineConfig(
        model=checkpoint("qwen3"), device="cuda", dtype="float32", gpu_memory_utilization=0.2
    )
    ep = EngineProcess(config)
    try:
        ps = prompts([5, 17, 3, 30, 9, 12, 1, 24], seed=33)
        sink = Collector()
        for i, p in enumerate(ps):
            ep.submit(f"c{i}", p, GREEDY, sink)
        sink.wait([f"c{i}" for i in range(len(ps))])
        for i, p in enumerate(ps):
            assert sink.ids(f"c{i}") == hf_greedy(checkpoint("qwen3"), p, 12)[0], i
        assert ep.stats().max_batch_size_seen > 1
        assert ep.stats().gpu_wait_s <= ep.loop_times().busy_s
    finally:
        ep.shutdown()
    assert ep._process.exitcode == 0


PARENT_SCRIPT = """
import sys, threading
from tritonllm.config import EngineConfig
from tritonllm.engine import EngineProcess
from tritonllm.sampling_params import SamplingParams

if __name__ == "__main__":
    ep = EngineProcess(EngineConfig(model=sys.argv[1], page_size=4, num_pages=256))
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    for i in range(10**6):  # keep the child stepping until this process is killed
        first, done = threading.Event(), threading.Event()
        ep.submit(f"r{i}", [1, 2, 3], params, lambda out: (first.set(), out.finished and done.set()))
        if i == 0:
            first.wait(60)
            print(ep.pid, flush=True)
        done.wait(60)
"""


def test_child_exits_when_its_parent_is_sigkilled():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, checkpoint("qwen3")],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"parent printed {line!r}"
        engine = int(line)
        children = child_pids(parent.pid)  # the engine and multiprocessing's resource tracker
        assert engine in children
        assert Path(f"/proc/{engine}/comm").read_text().strip() == "tritonllm-engin"
        parent.kill()
        parent.wait()
        for pid in children:
            assert _wait_gone(pid), f"{pid} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


# A Triton stub in miniature, started by SERVER_SCRIPT (tritonserver's part): its engine is told
# the server's pid, it runs the stub's own orphan watch, then its main thread blocks for good
# holding the GIL (PyDLL keeps it), as a pb_utils call into a dead server can.
STUB_SCRIPT = """
import ctypes, os, sys
from tritonllm.config import EngineConfig
from tritonllm.engine import EngineProcess
from tritonllm.serving.orphan_watch import exit_when_orphaned

if __name__ == "__main__":
    server = os.getppid()
    exit_when_orphaned(server)
    config = EngineConfig(model=sys.argv[1], page_size=4, num_pages=64)
    ep = EngineProcess(config, server_pid=None if sys.argv[2] == "off" else server)
    print(os.getpid(), ep.pid, flush=True)
    ctypes.PyDLL(None).pause()
"""
SERVER_SCRIPT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
time.sleep(600)
"""


def _stub_under_a_server(watch: str) -> tuple[subprocess.Popen, int, int]:
    """(the server process, its stub's pid, the stub's engine's pid)."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, STUB_SCRIPT, checkpoint("qwen3"), watch],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = server.stdout.readline()
    assert len(line.split()) == 2, f"the stub printed {line!r}"
    stub, engine = map(int, line.split())
    return server, stub, engine


@pytest.mark.parametrize("watch", ["on", "off"])
def test_the_engine_ends_a_stub_that_outlives_its_server_holding_the_gil(watch):
    """SIGKILL of the server while its stub's thread holds the GIL for good: the stub's own
    orphan watch cannot run, and the engine (whose parent the stub is) kills the stub and
    exits (``server_pid``). Without the engine's watch ("off") both outlive the server, as
    the ranks of the CI run of 2026-12-06 outlived a SIGKILLed tritonserver by 15 s."""
    from tritonllm.engine.engine_child import ORPHANED_PARENT_GRACE_S

    server, stub, engine = _stub_under_a_server(watch)
    try:
        server.kill()
        server.wait()
        # One deadline for both: with the watch off, each pid waited out its own, 30 s in all.
        deadline = time.monotonic() + ORPHANED_PARENT_GRACE_S + 10.0
        gone = [_wait_gone(pid, timeout=deadline - time.monotonic()) for pid in (stub, engine)]
        assert gone == ([True, True] if watch == "on" else [False, False]), gone
    finally:
        for pid in (stub, engine):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


WRONG_SERVER_SCRIPT = """
import os, sys, time
from tritonllm.config import EngineConfig
from tritonllm.engine import EngineProcess
from tritonllm.engine.engine_child import ORPHANED_PARENT_GRACE_S

if __name__ == "__main__":
    config = EngineConfig(model=sys.argv[1], page_size=4, num_pages=64)
    ep = EngineProcess(config, server_pid=os.getpid())  # not this process' parent
    time.sleep(ORPHANED_PARENT_GRACE_S + 2.0)
    print("alive", ep.is_alive(), flush=True)
    ep.shutdown()
"""


def test_a_server_pid_that_is_not_the_parents_parent_is_not_watched():
    """A ``server_pid`` that is not the parent's parent (a wrong pid, or no ``/proc`` to see
    it) must not read as an orphaned parent: the engine would kill a healthy parent."""
    done = subprocess.run(
        [sys.executable, "-c", WRONG_SERVER_SCRIPT, checkpoint("qwen3")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "alive True"), done.stderr[-2000:]


# ---- the generator in process mode on a real tritonserver -------------------------------------


@pytest.fixture(scope="module")
def process_server(tiny_model_dir, tmp_path_factory):
    """tritonserver whose generator runs its engine in a child process (on CPU)."""
    from conftest import SERVER_ENV

    from tritonllm.triton_server import TritonServer

    log = tmp_path_factory.mktemp("logs") / "tritonserver-engine-process.log"
    env = {**SERVER_ENV, "TRITONLLM_ENGINE_PROCESS": "1"}
    server = TritonServer(model_path=tiny_model_dir, env=env, log_path=log)
    try:  # stopped also when it fails to start (its stubs may be running)
        yield server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
    finally:
        server.stop()


def _spawned_engines(pgid: int) -> list[int]:
    """Pids of the engine processes (named by `EngineProcess`) in process group `pgid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, fields = stat.read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        fields = fields.split()
        if int(fields[2]) == pgid and fields[0] != "Z" and name.endswith("(tritonllm-engin"):
            pids.append(int(stat.parent.name))
    return pids


def test_triton_generator_in_process_mode_streams_hf_greedy_and_aborts(process_server, tokenizer):
    """The generator's own Triton tests (HF-greedy stream, abort control request freeing the KV
    pages) pass with its engine in a child process."""
    from test_triton_models import Stream, wait_metric
    from test_triton_models import (
        test_abort_control_request_frees_kv_at_once as check_abort_frees_kv,
    )
    from test_triton_models import (
        test_grpc_stream_equals_non_stream_equals_hf_greedy as check_stream_equals_hf,
    )

    engines = _spawned_engines(process_server.process.pid)
    assert len(engines) == 1, "the generator's engine should run in one spawned process"
    model = str(process_server.model_path)
    stream = Stream(process_server.grpc_url)
    try:
        check_stream_equals_hf(stream, tokenizer, lambda ids, n: hf_greedy(model, ids, n)[0])
        check_abort_frees_kv(process_server, stream, tokenizer)
        # The child's loop times reach the metrics.
        wait_metric(process_server, "tritonllm_engine_busy_seconds_total", bool, timeout=2.0)
    finally:
        stream.close()
    assert _spawned_engines(process_server.process.pid) == engines  # one engine all along


def test_triton_generator_reports_a_dead_engine_as_a_server_error(process_server):
    """After the engine process is killed: the request in flight, a new request and the
    health probe (the sidecar's /health) fail with code engine_unavailable (the sidecar's 503,
    not a 400 or a 500), and the gauges no longer count the dead engine's requests. Runs last:
    it kills the engine."""
    from test_triton_models import GREEDY, InferenceServerException, Stream, metric, wait_metric

    (engine,) = _spawned_engines(process_server.process.pid)
    stream = Stream(process_server.grpc_url)
    try:
        stream.send("llm", {"text_input": "Hello", "max_tokens": 2000, **GREEDY})
        stream.next()  # streaming
        os.kill(engine, signal.SIGKILL)
        in_flight = '"code":"engine_unavailable".*"message":"the engine process died'
        with pytest.raises(InferenceServerException, match=in_flight):
            while True:
                stream.next()
        stream.send("llm", {"text_input": "Hello again", "max_tokens": 2, **GREEDY})
        dead = '"code":"engine_unavailable".*"message":"the engine process died'
        with pytest.raises(InferenceServerException, match=dead):
            stream.next()
        stream.send("generator", {"health_probe": True})
        probe = '"code":"engine_unavailable".*"message":"the engine is not running"'
        with pytest.raises(InferenceServerException, match=probe):
            stream.next()
    finally:
        stream.close()
    wait_metric(process_server, "tritonllm_requests_running", 0, timeout=2.0)
    assert metric(process_server, "tritonllm_kv_pages_used") == 0


def test_a_stalled_child_is_not_alive_until_it_resumes():
    """SIGSTOP (a hung engine) with a request in flight: `is_alive()` turns False after the
    stall timeout (the sidecar's health probe then fails); SIGCONT: alive again, and the
    request completes."""
    ep = EngineProcess(_config(), stall_timeout_s=1.0)
    try:
        sink = StartCollector()
        ep.submit("slow", [1, 2, 3, 4], SamplingParams(max_tokens=500, ignore_eos=True), sink)
        assert sink.started.wait(TIMEOUT)
        os.kill(ep.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while ep.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ep.is_alive()
        os.kill(ep.pid, signal.SIGCONT)
        sink.wait(["slow"])
        assert sink.outputs["slow"][-1].finish_reason == "length"
        assert ep.is_alive()  # nothing in flight: idle is not a stall
    finally:
        os.kill(ep.pid, signal.SIGCONT)
        ep.shutdown()


def test_engine_profile_writes_the_engine_loops_cprofile_stats(tmp_path):
    """`EngineConfig.engine_profile=<file>` (`TRITONLLM_ENGINE_PROFILE` for the generator): the
    child runs its loop under cProfile and leaves pstats there at exit, with the engine's step
    in it."""
    import pstats

    path = tmp_path / "engine.prof"
    ep = EngineProcess(dataclasses.replace(_config(), engine_profile=str(path)))
    try:
        done = Collector()
        ep.submit("p", prompts([7], seed=3)[0], GREEDY, done)
        done.wait(["p"])
        assert len(done.ids("p")) == 12
    finally:
        ep.shutdown()
    assert ep._process.exitcode == 0
    stats = pstats.Stats(str(path))
    assert any(func[2] == "step" and func[0].endswith("engine.py") for func in stats.stats)
