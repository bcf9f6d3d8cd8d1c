"""A shared engine: one `EngineProcess(listen=True)` serving further `EngineConnection`s (the
instances of a generator with instance_group count > 1), and the election of the instance that
starts it (`serving.shared_engine`). Oracles: Hugging Face transformers' greedy decoding, each
client's own outputs (ids, counts, finish reasons), and the kernel's process table.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Client, Listener

import pytest
from test_engine_helpers import checkpoint, hf_greedy, prompts
from test_engine_thread import GREEDY, TIMEOUT, Collector

from tritonllm.config import EngineConfig
from tritonllm.engine import engine_child
from tritonllm.engine.client import LoopTimes
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.engine_child import ListenAddress
from tritonllm.engine.engine_process import EngineConnection, EngineProcess
from tritonllm.engine.process_messages import CLIENTS, READY, decode_message
from tritonllm.sampling_params import SamplingParams
from tritonllm.serving import shared_engine

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def _config() -> EngineConfig:
    return EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=256)


@pytest.fixture(scope="module")
def shared():
    owner = EngineProcess(_config(), listen=True)
    yield owner
    owner.shutdown()


def _started(sink: Collector, rid: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not sink.outputs.get(rid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.outputs.get(rid), f"{rid} never started"


def test_clients_of_one_engine_get_their_own_outputs_under_their_own_ids(shared):
    """Three clients submit the same ids at once: each gets exactly its own requests' outputs,
    equal to transformers' greedy ids, and they shared the engine's batches."""
    assert shared.listen_address is not None
    clients = [shared] + [EngineConnection(shared.listen_address) for _ in range(2)]
    try:
        ps = prompts([4, 9, 13, 2, 21, 7], seed=44)
        sinks = [Collector() for _ in clients]

        def submit(job):
            c, i = job
            # client c's request i gets prompt (i + c) so that a crossed output shows
            clients[c].submit(f"r{i}", ps[(i + c) % len(ps)], GREEDY, sinks[c])

        jobs = [(c, i) for c in range(len(clients)) for i in range(len(ps))]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(submit, jobs))
        for c, sink in enumerate(sinks):
            sink.wait([f"r{i}" for i in range(len(ps))])
            assert set(sink.outputs) == {f"r{i}" for i in range(len(ps))}
            for i in range(len(ps)):
                prompt = ps[(i + c) % len(ps)]
                assert sink.ids(f"r{i}") == hf_greedy(checkpoint("qwen3"), prompt, 12)[0]
                outs = sink.outputs[f"r{i}"]
                assert sum(o.finished for o in outs) == 1
                assert outs[-1].num_prompt_tokens == len(prompt)
        assert shared.stats().max_batch_size_seen > len(ps)  # clients' requests shared steps
        assert all(c.is_alive() for c in clients)
    finally:
        for c in clients[1:]:
            c.shutdown()


def test_aborts_reach_only_the_clients_own_request(shared):
    other = EngineConnection(shared.listen_address)
    try:
        mine, theirs = Collector(), Collector()
        shared.submit("same", [1, 2, 3], LONG, mine)
        other.submit("same", [1, 2, 3], GREEDY, theirs)
        _started(mine, "same")
        other.abort("same")  # other's request: it may already be done, never shared's
        theirs.wait(["same"])
        assert not mine.finished("same")
        shared.abort("same")
        mine.wait(["same"])
        assert mine.outputs["same"][-1].finish_reason == "abort"
    finally:
        other.shutdown()


def test_a_broadcast_reaches_every_other_client_once(shared):
    got: list[list] = [[], [], []]
    clients = [shared] + [EngineConnection(shared.listen_address) for _ in range(2)]
    try:
        for c, box in zip(clients, got, strict=True):
            c.on_control = box.append
        clients[1].broadcast(("abort_id", "x"))
        shared.broadcast(("lease_ended", "y"))
        # the child forwards between steps; a request makes it step
        sink = Collector()
        shared.submit("tick", [1, 2], GREEDY, sink)
        sink.wait(["tick"])
        deadline = time.monotonic() + TIMEOUT
        while sum(map(len, got)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        # one each from the other two senders; between senders the order is not kept
        assert got[0] == [("abort_id", "x")] and got[1] == [("lease_ended", "y")]
        assert sorted(got[2]) == [("abort_id", "x"), ("lease_ended", "y")]
    finally:
        for c in clients[1:]:
            c.shutdown()


def test_a_client_that_leaves_has_its_requests_aborted_and_the_engine_serves_on(shared):
    other = EngineConnection(shared.listen_address)
    sink = Collector()
    for i in range(3):
        other.submit(f"gone{i}", [1, 2, 3 + i], LONG, sink)
    _started(sink, "gone0")
    other.shutdown()
    assert not other.is_alive()
    with pytest.raises(RuntimeError):
        other.submit("late", [1, 2], GREEDY, sink)
    deadline = time.monotonic() + TIMEOUT
    while shared.stats().num_running and time.monotonic() < deadline:
        mine = Collector()
        shared.submit("probe", [4, 5], SamplingParams(max_tokens=1), mine)
        mine.wait(["probe"])
    assert shared.stats().num_running == 0  # the leaver's 400-token requests were aborted
    assert all(not o.finished for o in sink.outputs.get("gone0", []))  # no output after it left


def test_a_client_without_requests_gets_the_stats_only_now_and_then(shared):
    """While another client's request decodes, a client with nothing in the engine is sent
    a step message (its stats) at most every IDLE_CLIENT_STATS_S, not one every step."""
    idle = EngineConnection(shared.listen_address)
    try:
        sink = Collector()
        seen, begin = set(), time.monotonic()
        shared.submit("busy", [1, 2, 3], LONG, sink)
        while not sink.finished("busy") and time.monotonic() - begin < TIMEOUT:
            seen.add(idle.loop_times().loops)
            time.sleep(0.002)
        elapsed = time.monotonic() - begin
        assert len(sink.ids("busy")) == LONG.max_tokens  # one step message per step here
        assert len(seen) <= elapsed / engine_child.IDLE_CLIENT_STATS_S + 3
    finally:
        idle.shutdown()


def test_every_client_learns_how_many_clients_the_engine_serves(shared):
    def wait_for(front, n):
        deadline = time.monotonic() + TIMEOUT
        while front.num_clients != n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert front.num_clients == n

    first = EngineConnection(shared.listen_address)
    second = EngineConnection(shared.listen_address)
    for front in (shared, first, second):
        wait_for(front, 3)
    second.shutdown()
    # the engine notices between steps; a request makes it step
    sink = Collector()
    shared.submit("count", [1, 2], GREEDY, sink)
    sink.wait(["count"])
    for front in (shared, first):
        wait_for(front, 2)
    first.shutdown()
    wait_for(shared, 1)


def test_the_shared_live_limit_counts_choices(shared):
    """A limit of 3 live sequences: one client's request of 2 choices and the other's of 1
    fill it, so a third request is refused."""
    other = EngineConnection(shared.listen_address)
    shared.live_limit = other.live_limit = 3
    two = SamplingParams(max_tokens=400, ignore_eos=True, n=2)
    try:
        mine, theirs = Collector(), Collector()
        shared.submit("c1", [1, 2], two, mine)
        _started(mine, "c1")
        other.submit("c2", [1, 2], LONG, theirs)
        _started(theirs, "c2")
        other.submit("c3", [1, 2], LONG, theirs)
        theirs.wait(["c3"])
        (refused,) = theirs.outputs["c3"]
        assert refused.error_code == "server_overloaded"
    finally:
        shared.live_limit = other.live_limit = None
        shared.abort("c1")
        other.abort("c2")
        other.shutdown()


def test_the_live_limit_holds_over_all_clients(shared):
    """Two clients, a limit of 3 live requests: the fourth and fifth submits (of either
    client) end at once with code server_overloaded; once one ends, a new one is taken."""
    other = EngineConnection(shared.listen_address)
    shared.live_limit = other.live_limit = 3
    try:
        mine, theirs = Collector(), Collector()
        shared.submit("l1", [1, 2], LONG, mine)
        other.submit("l2", [1, 2], LONG, theirs)
        shared.submit("l3", [1, 2], LONG, mine)
        for rid in ("l1", "l3"):
            _started(mine, rid)
        _started(theirs, "l2")
        other.submit("l4", [1, 2], LONG, theirs)
        shared.submit("l5", [1, 2], LONG, mine)
        theirs.wait(["l4"])
        mine.wait(["l5"])
        for sink, rid in ((theirs, "l4"), (mine, "l5")):
            (refused,) = sink.outputs[rid]
            assert refused.finish_reason == "error" and refused.error_code == "server_overloaded"
            assert "limit of 3 sequences" in refused.error
        shared.abort("l1")
        mine.wait(["l1"])
        other.submit("l6", [1, 2], GREEDY, theirs)
        theirs.wait(["l6"])
        assert theirs.outputs["l6"][-1].finish_reason == "length"
    finally:
        shared.live_limit = None
        for rid in ("l2", "l3"):
            (other if rid == "l2" else shared).abort(rid)
        other.shutdown()


def _stalled_client(shared):
    """A raw client of the engine that reads its READY message and then nothing (as a stub
    stopped by SIGSTOP or a debugger does)."""
    address = shared.listen_address
    conn = Client(address.address, "AF_UNIX", authkey=address.authkey)
    conn.recv()
    return conn


BLOB = bytes(range(256)) * (4 << 12)  # 1 MiB


def test_a_client_that_stops_reading_holds_up_no_other(shared):
    """8 MiB of broadcasts, more than a socket's buffer holds, are forwarded to a client that
    stopped reading: the engine serves the others on (it blocked in the write before), and
    the stalled client later reads every message intact and in order."""
    stalled = _stalled_client(shared)
    try:
        for i in range(8):
            shared.broadcast(("blob", i, BLOB))
        sink = Collector()
        shared.submit("past-stalled", prompts([6], seed=3)[0], GREEDY, sink)
        sink.wait(["past-stalled"])
        assert (
            sink.ids("past-stalled")
            == hf_greedy(checkpoint("qwen3"), prompts([6], seed=3)[0], 12)[0]
        )
        # Idle with a backlog: the engine retries the write, it does not step for it.
        loops = shared.loop_times().loops
        time.sleep(1.0)
        assert shared.loop_times().loops - loops <= 2
        got = []
        while len(got) < 8:
            message = decode_message(stalled.recv_bytes())
            if len(message) == 2 and message[1][0] == "blob":
                assert message[1][2] == BLOB
                got.append(message[1][1])
        assert got == list(range(8))
    finally:
        stalled.close()


def test_a_client_that_never_reads_is_dropped_at_the_backlog_limit(shared):
    """Past CLIENT_BACKLOG_LIMIT bytes of unread messages the engine drops the client (the
    others learn the number of clients fell) and serves on."""
    stalled = _stalled_client(shared)
    try:
        deadline = time.monotonic() + TIMEOUT
        while shared.num_clients != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.num_clients == 2
        for i in range(engine_child.CLIENT_BACKLOG_LIMIT // len(BLOB) + 2):
            shared.broadcast(("blob", i, BLOB))
        sink = Collector()
        shared.submit("after-drop", [1, 2], GREEDY, sink)
        sink.wait(["after-drop"])
        while shared.num_clients != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.num_clients == 1
        with pytest.raises((EOFError, OSError)):  # what it holds, then the end
            while True:
                stalled.recv_bytes()
    finally:
        stalled.close()


def test_a_wrong_key_is_refused_and_the_engine_serves_on(shared):
    wrong = ListenAddress(shared.listen_address.address, b"not the key")
    with pytest.raises((multiprocessing.AuthenticationError, OSError, EOFError)):
        EngineConnection(wrong)
    sink = Collector()
    shared.submit("after-wrong-key", [1, 2], GREEDY, sink)
    sink.wait(["after-wrong-key"])


def test_clients_fail_their_requests_when_the_engine_dies():
    owner = EngineProcess(_config(), listen=True)
    other = EngineConnection(owner.listen_address)
    sink = Collector()
    other.submit("doomed", [1, 2, 3], LONG, sink)
    _started(sink, "doomed")
    owner._process.kill()
    sink.wait(["doomed"])
    assert sink.outputs["doomed"][-1].finish_reason == "error"
    assert sink.outputs["doomed"][-1].error_code == "engine_unavailable"
    assert not other.is_alive()
    owner.shutdown()


def test_one_instance_starts_the_engine_and_the_others_connect(tmp_path):
    """Three threads stand for three generator stubs of one model: one builds the engine, the
    others connect to it; a request through each is served; the rendezvous is gone after."""
    key = f"test-{time.monotonic_ns()}"
    fronts: list = [None] * 3
    errors: list[BaseException] = []

    def open_one(i: int) -> None:
        try:
            fronts[i] = shared_engine.open_shared_engine(_config(), key, directory=tmp_path)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 3)
    assert not errors, errors
    owners = [f for f in fronts if isinstance(f, EngineProcess)]
    assert len(owners) == 1 and sum(isinstance(f, EngineConnection) for f in fronts) == 2
    try:
        for front in fronts:
            sink = Collector()
            front.submit("same-id", [3, 1, 4, 1, 5], GREEDY, sink)
            sink.wait(["same-id"])
            assert sink.ids("same-id") == hf_greedy(checkpoint("qwen3"), [3, 1, 4, 1, 5], 12)[0]
    finally:
        for front in fronts:
            if front is not owners[0]:
                front.shutdown()
        owners[0].shutdown()
    assert not list(tmp_path.iterdir())  # the owner removed its rendezvous and lock files


def test_an_owner_removes_files_left_by_a_process_that_is_gone(tmp_path):
    """A tritonserver killed before its owner cleaned up leaves its lock and rendezvous files;
    the next owner removes those of processes that are gone, and no others."""
    gone = _pid_that_exited()
    stale = [tmp_path / f"tritonllm-engine-{gone}-generator-1.{ext}" for ext in ("lock", "json")]
    alive = [tmp_path / f"tritonllm-engine-{os.getpid()}-other-1.{ext}" for ext in ("lock", "json")]
    unscoped = tmp_path / "tritonllm-engine-test-unscoped.lock"
    for path in [*stale, *alive, unscoped]:
        path.write_text("{}")
    key = shared_engine.engine_key(os.getpid(), f"generator-{time.monotonic_ns()}")
    owner = shared_engine.open_shared_engine(_config(), key, directory=tmp_path)
    try:
        assert isinstance(owner, EngineProcess)
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in [*alive, unscoped])
    finally:
        owner.shutdown()


def _pid_that_exited() -> int:
    """The pid of a child process that has exited and been reaped (no process has it now,
    unless the system reused it meanwhile)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_client_accepted_during_a_step_is_announced_while_the_engine_idles(tmp_path):
    """CI saw the owner count 1 client for 60 s after a second one got its READY: a client
    accepted while the loop stepped was greeted at the top of `receive`, whose read of the
    wake-up pipe took that client's wake-up, and the idle loop then waited for a command with
    the announcement pending. Built here without the race: the client is accepted (its wake-up
    written) before an idle `receive`, which must return so that `send_step` announces 2."""
    owner_commands, child_commands = multiprocessing.Pipe(duplex=False)
    child_results, owner_results = multiprocessing.Pipe(duplex=False)
    authkey = os.urandom(16)
    listener = Listener(str(tmp_path / "engine.sock"), "AF_UNIX", authkey=authkey)
    clients = engine_child._Clients(owner_commands, owner_results, listener)
    engine = LLMEngine(_config())
    joined = Client(str(tmp_path / "engine.sock"), "AF_UNIX", authkey=authkey)
    try:
        assert select.select([clients._wake_r], [], [], TIMEOUT)[0]  # accepted, wake-up written
        clients._greet(engine)  # the step's greeting: READY sent, the wake-up read
        assert joined.recv()[0] == READY
        received = []  # (a daemon thread: before the fix, receive never returned)
        idle = threading.Thread(
            target=lambda: received.append(clients.receive(engine, True)), daemon=True
        )
        idle.start()
        idle.join(timeout=10.0)
        assert received == [[]], "the idle loop waited with a client's announcement pending"
        clients.send_step([], engine.stats(), LoopTimes(0.0, 0.0, 0.0, 1))
        announcements = [
            m[1]
            for m in (decode_message(child_results.recv_bytes()) for _ in range(2))
            if len(m) == 2
        ]
        assert announcements == [(CLIENTS, 2)]
    finally:
        joined.close()
        listener.close()
        for connection in (owner_commands, child_commands, child_results, owner_results):
            connection.close()
