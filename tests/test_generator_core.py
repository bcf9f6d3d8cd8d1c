"""The generator's Triton-agnostic core (``serving.generator_core``): request and choice
bookkeeping, control requests, cancellation and error codes, with a recording engine front and
response sink in place of Triton (the real sender thread runs)."""

from __future__ import annotations

import json
import threading
import time
import types

import numpy as np
import pytest

from tritonllm.contract.errors import ErrorCode, decode_error
from tritonllm.engine.request import RequestOutput
from tritonllm.serving.generator_core import GeneratorCore

TIMEOUT = 10.0


class RecordingEngine:
    """An engine front that records what the core asks of it; tests feed its outputs."""

    def __init__(self) -> None:
        self.submitted: dict[str, tuple] = {}
        self.aborted: list[str] = []
        self.alive = True
        self.fail_submit: Exception | None = None
        self.steps = 0  # the engine's num_steps, as health probes report it

    def submit(self, key, prompt_ids, params, callback) -> None:
        if self.fail_submit is not None:
            raise self.fail_submit
        self.submitted[key] = (prompt_ids, params, callback)

    def abort(self, key) -> None:
        self.aborted.append(key)

    def is_alive(self) -> bool:
        return self.alive

    def stats(self):
        return types.SimpleNamespace(num_steps=self.steps)

    def loop_times(self):
        return None

    def shutdown(self) -> None:
        self.alive = False

    def emit(self, key, *outputs) -> None:
        callback = self.submitted[key][2]
        for output in outputs:
            callback(output)


class Sink:
    """A response sink recording (chunk, final) pairs and error messages."""

    response_cost = 1.0

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.errors: list[str] = []
        self.cancelled = False
        self.gone = False
        self._cv = threading.Condition()

    def send(self, chunk, final) -> None:
        if self.gone:
            raise RuntimeError("stream closed")
        with self._cv:
            self.sent.append((chunk, final))
            self._cv.notify_all()

    def send_error(self, message) -> None:
        with self._cv:
            self.errors.append(message)
            self._cv.notify_all()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def send_info(self, max_model_len, engine_steps) -> None:
        with self._cv:
            self.sent.append(({"max_model_len": max_model_len, "engine_steps": engine_steps}, True))
            self._cv.notify_all()

    @property
    def done(self) -> bool:
        return bool(self.errors) or any(final for _, final in self.sent)

    def wait(self, condition=None) -> None:
        with self._cv:
            assert self._cv.wait_for(condition or (lambda: self.done), TIMEOUT)

    def error(self):
        (message,) = self.errors
        return decode_error(message)


@pytest.fixture
def core():
    engine = RecordingEngine()
    ticks: list = []
    core = GeneratorCore(
        engine,
        on_tick=lambda *args: ticks.append(args),
        parent_alive=lambda: True,
        log_warning=lambda text: None,
        log_error=print,
        metrics_interval_s=0.01,
        cancel_check_s=0.0,  # every output asks (no budget): the checks' effects are tested
        cancel_checks_per_s=float("inf"),
        max_model_len=4096,
    ).start()
    core.ticks = ticks
    yield core
    core.finalize()


def eventually(condition) -> None:
    """Poll ``condition`` (set from the sender thread) until it holds."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)


def ids(*values, dtype=np.int32):
    return np.array(values, dtype=dtype)


def out(key, new_ids, index=0, reason=None, last=None, **extra):
    finished = reason is not None
    return RequestOutput(
        key,
        list(new_ids),
        finished,
        reason,
        num_prompt_tokens=3,
        num_output_tokens=len(new_ids),
        cached_tokens=0,
        index=index,
        request_finished=finished if last is None else last,
        **extra,
    )


def test_choices_carry_their_index_and_the_final_flag_comes_with_request_finished(core):
    sink = Sink()
    core.execute("r", {"input_ids": ids(1, 2, 3), "n": ids(2)}, "", sink)
    params = core.engine.submitted["r"][1]
    assert params.n == 2
    core.engine.emit(
        "r",
        out("r", [5], index=1),
        out("r", [7], index=0),
        out("r", [6], index=1, reason="length", last=False),  # one choice ends: not final
        out("r", [8], index=0, reason="stop", last=True),
    )
    sink.wait()
    per_choice = {0: [], 1: []}
    for chunk, _ in sink.sent:  # (outputs that piled up may share a response)
        per_choice[chunk.index] += chunk.output_ids
    assert per_choice == {0: [7, 8], 1: [5, 6]}
    finals = [(c.index, c.finish_reason, final) for c, final in sink.sent if c.finish_reason]
    assert finals == [(1, "length", False), (0, "stop", True)]  # the final flag comes last
    assert sink.sent[-1][1] and all(c.with_index for c, _ in sink.sent)
    assert len(core.requests) == 0


def test_a_cancelled_client_is_aborted_and_gets_its_final_flag_at_once(core):
    sink = Sink()
    core.execute("c", {"input_ids": ids(1)}, "", sink)
    sink.cancelled = True
    core.engine.emit("c", out("c", [4]))
    sink.wait()
    assert core.engine.aborted == ["c"] and sink.sent == [(None, True)]
    core.engine.emit("c", out("c", [], reason="abort"))  # the engine's late final is dropped
    eventually(lambda: len(core.requests) == 0)
    assert sink.sent == [(None, True)]


def test_a_stream_that_is_gone_aborts_the_generation(core):
    sink = Sink()
    core.execute("g", {"input_ids": ids(1)}, "", sink)
    sink.gone = True
    core.engine.emit("g", out("g", [4]))
    eventually(lambda: core.engine.aborted)
    assert core.engine.aborted == ["g"]


def test_abort_control_request_aborts_every_live_key_of_that_id_and_answers(core):
    first, second, control = Sink(), Sink(), Sink()
    core.execute("same", {"input_ids": ids(1)}, "", first)
    core.execute("same", {"input_ids": ids(2)}, "", second)  # a reused id gets its own key
    keys = sorted(core.engine.submitted)
    assert keys[0] != keys[1] and "same" in keys
    core.execute("ctl", {"abort_request_id": np.array([b"same"], dtype=object)}, "", control)
    assert sorted(core.engine.aborted) == keys and control.sent == [(None, True)]


def test_an_abort_that_overtakes_its_request_ends_it_on_arrival(core):
    control, sink = Sink(), Sink()
    core.execute("ctl", {"abort_request_id": np.array([b"early"], dtype=object)}, "", control)
    core.execute("early", {"input_ids": ids(1, 2)}, "", sink)
    ((chunk, final),) = sink.sent
    assert final and chunk.finish_reason == "abort" and chunk.num_input_tokens == 2
    assert "early" not in core.engine.submitted


def _lease(name: str) -> dict:
    return {"client_lease": np.array([name.encode()], dtype=object)}


def _core(**settings) -> GeneratorCore:
    """A started core over a ``RecordingEngine`` with ``settings``; the caller finalizes it."""
    return GeneratorCore(
        RecordingEngine(), lambda *a: None, lambda: True, print, print, **settings
    ).start()


def test_the_live_limit_counts_choices():
    """A request of n choices is n sequences in the engine: with a limit of 3, a request of 2
    choices and one of 1 fill it, and the next request is refused (server_overloaded); once
    the first finishes, one is taken again."""
    core = _core(max_live_requests=3)
    try:
        two, one, refused, later = Sink(), Sink(), Sink(), Sink()
        stream = np.array([True])
        core.execute("two", {"input_ids": ids(1), "n": ids(2), "stream": stream}, "", two)
        core.execute("one", {"input_ids": ids(1)}, "", one)
        core.execute("no", {"input_ids": ids(1)}, "", refused)
        assert refused.error().code is ErrorCode.SERVER_OVERLOADED
        assert set(core.engine.submitted) == {"two", "one"}
        core.engine.emit("two", out("two", [5], 0, "length", last=False))
        core.engine.emit("two", out("two", [6], 1, "length", last=True))
        two.wait()
        eventually(lambda: len(core.requests) == 1)
        core.execute("later", {"input_ids": ids(1)}, "", later)
        assert not later.errors and "later" in core.engine.submitted
    finally:
        core.finalize()


def test_a_cancelled_lease_aborts_the_requests_it_covers_and_no_other(core):
    lease, replaced = Sink(), Sink()
    core.execute("lease-a", _lease("side"), "", replaced)
    core.execute("lease-b", _lease("side"), "", lease)  # the same id again replaces it
    assert replaced.sent == [(None, True)] and lease.sent == []
    covered = {rid: Sink() for rid in ("side/1", "side/2", "side")}
    others = {rid: Sink() for rid in ("sidecar/1", "other/1")}
    for rid, sink in {**covered, **others}.items():
        core.execute(rid, {"input_ids": ids(1, 2)}, "", sink)
    time.sleep(0.05)
    assert core.engine.aborted == []  # a live lease aborts nothing
    lease.cancelled = True  # its client went away
    lease.wait()
    eventually(lambda: len(core.engine.aborted) == 2)
    assert sorted(core.engine.aborted) == ["side/1", "side/2"]
    assert lease.sent == [(None, True)]
    # aborted in the engine: a client still there sees finish_reason "abort"
    for rid in ("side/1", "side/2"):
        core.engine.emit(rid, out(rid, [], reason="abort"))
        covered[rid].wait()
        ((chunk, final),) = covered[rid].sent
        assert final and chunk.finish_reason == "abort"
    for sink in (covered["side"], *others.values()):
        assert sink.sent == []


def test_a_lease_is_renewed_and_ends_when_its_client_stops_renewing_it():
    """A lease request left unrenewed is answered after lease_s (tritonserver's shutdown waits
    for open requests); a client that renews keeps its requests, one that stops loses them after
    the grace period."""
    core = _core(metrics_interval_s=0.01, lease_check_s=0.01, lease_s=0.1, lease_grace_s=0.3)
    engine = core.engine
    try:
        work = Sink()
        core.execute("kept/1", {"input_ids": ids(1)}, "", work)
        lease = Sink()
        core.execute("l0", _lease("kept"), "", lease)
        for i in range(1, 6):  # renewed as soon as answered, for about 0.5 s
            lease.wait()
            lease = Sink()
            core.execute(f"l{i}", _lease("kept"), "", lease)
        assert engine.aborted == [] and work.sent == []
        lease.wait()  # answered, and not renewed
        eventually(lambda: engine.aborted == ["kept/1"])
    finally:
        core.finalize()


def test_a_sink_is_never_asked_whether_it_was_cancelled_after_its_final_response():
    """Lease renewals (Triton's execute thread) close the older lease request while the sender
    thread's tick asks the open one whether it was cancelled; Triton 2.51 crashes when a sender
    is asked that after its final response (seen in CI as a SIGSEGV). Each question here takes
    a millisecond, as an IPC round trip does: a final response sent meanwhile would overlap it."""
    violations = []

    class SlowFinalSink(Sink):
        def is_cancelled(self) -> bool:
            done = self.done
            time.sleep(0.001)  # the question is on its way to tritonserver
            if done or self.done:
                violations.append("is_cancelled during or after the final response")
            return False

    core = _core(metrics_interval_s=0.0005, lease_check_s=0.0)
    try:
        for i in range(200):
            core.execute(f"l{i}", _lease("busy"), "", SlowFinalSink())
            time.sleep(0.0005)
    finally:
        core.finalize()
    assert violations == []


@pytest.mark.parametrize("name", ["", "a/b"])
def test_a_lease_id_must_be_non_empty_without_the_separator(core, name):
    sink = Sink()
    core.execute("l", _lease(name), "", sink)
    assert sink.error().code == ErrorCode.INVALID_VALUE and sink.error().param == "client_lease"


def test_a_lease_needs_the_control_secret():
    core = _core(control_secret="s3")
    try:
        refused, taken = Sink(), Sink()
        core.execute("l1", _lease("x"), "", refused)
        assert refused.error().code == ErrorCode.PERMISSION_DENIED
        secret = {"control_secret": np.array([b"s3"], dtype=object)}
        core.execute("l2", {**_lease("x"), **secret}, "", taken)
        assert taken.sent == [] and taken.errors == []
    finally:
        core.finalize()
    assert taken.sent == [(None, True)]  # unloading ends the lease


def test_health_probe_reports_engine_liveness_and_aborts_nothing(core):
    live = Sink()
    core.execute("live", {"input_ids": ids(1)}, "", live)
    probe = Sink()
    core.execute("p", {"health_probe": np.array([True])}, "", probe)
    assert probe.sent == [({"max_model_len": 4096, "engine_steps": 0}, True)]
    assert core.engine.aborted == []
    core.engine.steps = 7  # the engine stepped: the next probe says so
    later = Sink()
    core.execute("p", {"health_probe": np.array([True])}, "", later)
    assert later.sent == [({"max_model_len": 4096, "engine_steps": 7}, True)]
    core.engine.alive = False
    dead = Sink()
    core.execute("p", {"health_probe": np.array([True])}, "", dead)
    assert dead.error().code is ErrorCode.ENGINE_UNAVAILABLE
    assert core.engine.aborted == [] and len(core.requests) == 1


@pytest.mark.parametrize(
    ("inputs", "code", "param"),
    [
        ({"temperature": np.array([3.0], np.float32)}, ErrorCode.INVALID_VALUE, "temperature"),
        ({"n": ids(2), "stream": np.array([False])}, ErrorCode.INVALID_VALUE, "n"),
        ({"max_tokens": ids(1, 2)}, ErrorCode.INVALID_INPUT, "max_tokens"),
        ({"stop": np.array([b"\xff"], dtype=object)}, ErrorCode.INVALID_INPUT, "stop"),
        (
            {"sampling_parameters": np.array([b'{"lora_name": "x"}'], dtype=object)},
            ErrorCode.UNSUPPORTED_PARAMETER,
            "sampling_parameters.lora_name",
        ),
    ],
)
def test_request_errors_keep_their_code_and_param(core, inputs, code, param):
    sink = Sink()
    core.execute("bad", {"input_ids": ids(1), **inputs}, "", sink)
    error = sink.error()
    assert (error.code, error.param) == (code, param)
    assert not core.engine.submitted


def test_a_request_without_input_ids_is_a_missing_input(core):
    sink = Sink()
    core.execute("x", {"max_tokens": ids(2)}, "", sink)
    assert (sink.error().code, sink.error().param) == (ErrorCode.MISSING_INPUT, "input_ids")


def test_engine_failures_are_server_errors(core):
    core.engine.fail_submit = RuntimeError("the engine process died (killed by SIGKILL)")
    alive, dead = Sink(), Sink()
    core.execute("a", {"input_ids": ids(1)}, "", alive)
    assert alive.error().code is ErrorCode.INTERNAL_ERROR
    core.engine.alive = False
    core.execute("b", {"input_ids": ids(1)}, "", dead)
    assert dead.error().code is ErrorCode.ENGINE_UNAVAILABLE
    assert "killed by SIGKILL" in dead.error().message
    core.engine.alive, core.engine.fail_submit = True, None
    failed = Sink()
    core.execute("c", {"input_ids": ids(1), "n": ids(2)}, "", failed)
    core.engine.emit("c", out("c", [], reason="error", last=True, error="engine error: boom"))
    failed.wait()
    assert failed.error().code is ErrorCode.INTERNAL_ERROR
    assert failed.error().message == "engine error: boom"


def test_echo_text_starts_each_choice_once(core):
    sink = Sink()
    echo = np.array([b"Once upon"], dtype=object)
    core.execute("e", {"input_ids": ids(1), "n": ids(2), "echo_text": echo}, "", sink)
    core.engine.emit(
        "e",
        out("e", [5], index=0),
        out("e", [6], index=0),
        out("e", [7], index=1, reason="length", last=False),
        out("e", [8], index=0, reason="length", last=True),
    )
    sink.wait()
    echoes = [(c.index, c.echo_text) for c, _ in sink.sent if c.echo_text is not None]
    assert sorted(echoes) == [(0, "Once upon"), (1, "Once upon")]
    first_of_0 = next(c for c, _ in sink.sent if c.index == 0)
    assert first_of_0.echo_text == "Once upon"


def test_prompt_scores_go_out_once_per_choice_with_its_next_chunk(core):
    """The engine reports a choice's prompt scores in its first output, which may release no
    id (held by a stop string): they go out with the next chunk sent, never twice."""
    sink = Sink()
    core.execute("s", {"input_ids": ids(4, 5, 6), "prompt_logprobs": ids(1)}, "", sink)
    scores = {"prompt_logprobs": [-1.0, -2.0], "prompt_top_logprobs": [{9: -0.5}, {5: -0.1}]}
    core.engine.emit(
        "s",
        out("s", [], **scores),  # ids held back: no chunk is due yet
        out("s", [7]),
        out("s", [8], reason="length"),
    )
    sink.wait()
    carrying = [c for c, _ in sink.sent if c.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is sink.sent[0][0]
    (chunk,) = carrying
    assert chunk.prompt_ids == [4, 5, 6] and chunk.prompt_num_top == 1
    assert chunk.prompt_logprobs == [-1.0, -2.0]
    assert chunk.prompt_top_logprobs == [{9: -0.5}, {5: -0.1}]


def test_latencies_are_measured_per_choice_and_request_and_handed_to_the_tick(core):
    sink = Sink()
    core.execute("l", {"input_ids": ids(1), "n": ids(2)}, "", sink)
    core.engine.emit("l", out("l", [5], index=0), out("l", [6], index=1))
    eventually(lambda: len(sink.sent) == 2)
    time.sleep(0.05)
    core.engine.emit("l", out("l", [7, 8], index=0, reason="length", last=False, queue_time_s=0.25))
    core.engine.emit("l", out("l", [9], index=1, reason="stop", last=True, queue_time_s=0.5))
    sink.wait()
    eventually(lambda: sum(len(t[4].e2e_s) for t in core.ticks) == 1)
    samples = [t[4] for t in core.ticks]
    ttft = [v for s in samples for v in s.ttft_s]
    itl = [v for s in samples for v in s.itl_s]
    assert len(ttft) == 2 and all(v >= 0 for v in ttft)
    assert len(itl) == 2 and all(v >= 0.02 for v in itl)  # 50 ms apart; 2 ids: half each
    assert sorted(v for s in samples for v in s.queue_s) == [0.25, 0.5]
    (e2e,) = [v for s in samples for v in s.e2e_s]
    assert e2e >= max(ttft) + 0.05


def test_request_key_goes_out_only_when_it_differs_from_the_request_id(core):
    named, anonymous = Sink(), Sink()
    core.execute("named", {"input_ids": ids(1)}, "", named)
    core.execute("", {"input_ids": ids(1)}, "", anonymous)
    (key,) = [k for k in core.engine.submitted if k != "named"]
    core.engine.emit("named", out("named", [3], reason="length"))
    core.engine.emit(key, out(key, [3], reason="length"))
    named.wait()
    anonymous.wait()
    assert named.sent[0][0].request_key is None
    assert anonymous.sent[0][0].request_key == key and key


def test_vllm_parameters_merge_with_tensors_and_must_agree(core):
    agree = Sink()
    sampling = np.array([json.dumps({"temperature": "0.5", "max_tokens": "7"}).encode()], object)
    inputs = {"input_ids": ids(1), "sampling_parameters": sampling}
    core.execute("v", inputs, json.dumps({"temperature": 0.5, "top_k": "3"}), agree)
    params = core.engine.submitted["v"][1]
    assert (params.temperature, params.max_tokens, params.top_k) == (0.5, 7, 3)
    clash = Sink()
    inputs = {"input_ids": ids(1), "temperature": np.array([0.9], np.float32)}
    core.execute("w", inputs, json.dumps({"temperature": "0.5"}), clash)
    assert (clash.error().code, clash.error().param) == (ErrorCode.INVALID_VALUE, "temperature")


def test_unloading_fails_live_requests_as_unavailable():
    engine = RecordingEngine()
    core = GeneratorCore(engine, lambda *a: None, lambda: True, print, print).start()
    sink = Sink()
    core.execute("u", {"input_ids": ids(1)}, "", sink)
    core.finalize()
    assert sink.error().code is ErrorCode.ENGINE_UNAVAILABLE and not engine.alive


# --- the detokenizer's cancellation watch ---------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cancel_watch_asks_at_most_every_interval_and_reports_once():
    from tritonllm.serving.cancel_watch import CancelWatch

    clock, asked = Clock(), []
    watch = CancelWatch(interval_s=0.5, ttl_s=100.0, clock=clock)

    def asks(answer):
        return lambda: asked.append(clock.now) or answer

    assert not watch.should_abort("a", False, asks(False))  # first response: asked
    clock.now = 0.2
    assert not watch.should_abort("a", False, asks(True))  # too soon: not asked
    clock.now = 0.6
    assert watch.should_abort("a", False, asks(True))  # cancelled: abort now
    clock.now = 1.5
    assert not watch.should_abort("a", False, asks(True))  # reported once
    assert asked == [0.0, 0.6]
    assert not watch.should_abort("a", True, asks(True))  # its final: forgotten
    assert len(watch) == 0


def test_cancel_watch_needs_no_abort_for_a_final_response_and_forgets_stale_ids():
    from tritonllm.serving.cancel_watch import CancelWatch

    clock = Clock()
    watch = CancelWatch(interval_s=0.5, ttl_s=10.0, clock=clock)
    assert not watch.should_abort("done", True, lambda: True)  # ended anyway: no abort
    assert not watch.should_abort("lost", False, lambda: False)
    assert len(watch) == 1
    clock.now = 25.0  # "lost" never sent its final response here
    assert not watch.should_abort("other", False, lambda: False)
    assert len(watch) == 1  # only "other" is left


def test_cancellation_checks_are_budgeted_over_all_live_requests():
    """Each check is an IPC round trip on the sender thread: with many live requests every one
    is asked less often, so the checks per second stay under the budget; a cancelled client
    is still found and aborted."""

    class CountingSink(Sink):
        calls = 0

        def is_cancelled(self) -> bool:
            CountingSink.calls += 1
            return self.cancelled

    engine = RecordingEngine()
    core = GeneratorCore(
        engine,
        on_tick=lambda *args: None,
        parent_alive=lambda: True,
        log_warning=lambda text: None,
        log_error=print,
        metrics_interval_s=0.01,
        cancel_check_s=0.0,
        cancel_checks_per_s=100.0,
    ).start()
    try:
        sinks = [CountingSink() for _ in range(50)]  # each asked at most every 0.5 s
        for i, sink in enumerate(sinks):
            core.execute(f"r{i}", {"input_ids": ids(1)}, "", sink)
        start = time.monotonic()
        # At least 1 s, and on until the first check (a busy CI box may starve the sender
        # thread for a while; CI once saw none in the first second).
        while (elapsed := time.monotonic() - start) < 1.0 or (
            CountingSink.calls == 0 and elapsed < 30.0
        ):
            for i in range(50):
                engine.emit(f"r{i}", out(f"r{i}", [7]))
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        assert 0 < CountingSink.calls <= 100.0 * elapsed + 50  # + one first check each
        sinks[3].cancelled = True
        sinks[3].wait()
        assert sinks[3].sent[-1] == (None, True) and "r3" in engine.aborted
    finally:
        core.finalize()


def test_several_sender_threads_keep_every_stream_exact_and_in_order():
    """With responses sent from several threads at once, each request's responses still come
    in order, every id exactly once, the final flag last."""
    threads = set()

    class ThreadSink(Sink):
        def send(self, chunk, final) -> None:
            threads.add(threading.current_thread().name)
            super().send(chunk, final)

    engine = RecordingEngine()
    core = GeneratorCore(
        engine,
        on_tick=lambda *args: None,
        parent_alive=lambda: True,
        log_warning=lambda text: None,
        log_error=print,
        sender_threads=4,
    ).start()
    try:
        sinks = {f"r{i}": ThreadSink() for i in range(24)}
        for key, sink in sinks.items():
            core.execute(key, {"input_ids": ids(1)}, "", sink)
        for step in range(30):
            for key in sinks:
                reason = "length" if step == 29 else None
                engine.emit(key, out(key, [step], reason=reason))
        for sink in sinks.values():
            sink.wait()
        eventually(lambda: len(core.requests) == 0)
        assert len(threads) > 1  # the responses did leave from several threads
        for sink in sinks.values():
            assert [f for _, f in sink.sent] == [False] * (len(sink.sent) - 1) + [True]
            assert [t for chunk, _ in sink.sent for t in chunk.output_ids] == list(range(30))
    finally:
        core.finalize()


# ---- instances sharing one engine (siblings) ----------------------------------------------------


class SiblingEngine(RecordingEngine):
    """A ``RecordingEngine`` of one instance of a shared engine: ``broadcast`` hands the payload
    to every other instance's ``on_control``, as the engine process does."""

    def __init__(self, group: list) -> None:
        super().__init__()
        self.group, self.on_control, self.num_clients, self.live_limit = group, None, None, None
        group.append(self)

    def broadcast(self, payload) -> None:
        for other in self.group:
            if other is not self and other.on_control is not None:
                other.on_control(payload)


def _siblings(n: int = 2, **settings) -> list[GeneratorCore]:
    group: list = []
    return [
        GeneratorCore(
            SiblingEngine(group),
            lambda *a: None,
            lambda: True,
            print,
            print,
            instances=n,
            **settings,
        ).start()
        for _ in range(n)
    ]


def test_an_abort_by_id_reaches_the_instance_that_has_the_request():
    a, b = _siblings()
    try:
        b.execute("far", {"input_ids": ids(1, 2)}, "", Sink())
        control = Sink()
        a.execute("ctl", {"abort_request_id": np.array([b"far"], dtype=object)}, "", control)
        assert control.sent == [(None, True)]
        assert b.engine.aborted == ["far"] and a.engine.aborted == []
        # one still on its way to the other instance is remembered there too
        a.execute("ctl2", {"abort_request_id": np.array([b"later"], dtype=object)}, "", Sink())
        late = Sink()
        b.execute("later", {"input_ids": ids(1, 2)}, "", late)
        ((chunk, final),) = late.sent
        assert final and chunk.finish_reason == "abort" and "later" not in b.engine.submitted
    finally:
        a.finalize()
        b.finalize()


def test_a_lease_renewed_at_one_instance_is_renewed_at_all_and_its_end_aborts_everywhere():
    settings = {"metrics_interval_s": 0.01, "lease_check_s": 0.01, "lease_s": 5.0}
    a, b = _siblings(lease_grace_s=0.3, **settings)
    try:
        on_a, on_b = Sink(), Sink()
        a.execute("w1", {"input_ids": ids(1)}, "", Sink())  # another client's request
        a.execute("side/1", {"input_ids": ids(1)}, "", Sink())
        b.execute("side/2", {"input_ids": ids(1)}, "", Sink())
        a.execute("l0", _lease("side"), "", on_a)
        b.execute("l1", _lease("side"), "", on_b)  # the renewal lands on the other instance
        assert on_a.sent == [(None, True)] and on_b.sent == []  # the older request answered
        for i in range(6):  # renewed every 0.1 s, for twice the grace, always on b
            time.sleep(0.1)
            older, on_b = on_b, Sink()
            b.execute(f"r{i}", _lease("side"), "", on_b)
            assert older.sent == [(None, True)]
        assert a.engine.aborted == [] and b.engine.aborted == []  # b's renewals count on a
        on_b.cancelled = True  # the lease's client went away: b sees it
        on_b.wait()
        eventually(lambda: a.engine.aborted == ["side/1"] and b.engine.aborted == ["side/2"])
    finally:
        a.finalize()
        b.finalize()


def test_the_live_limit_is_handed_to_the_shared_engine():
    """Each instance refuses beyond the limit by itself; the shared engine enforces it over
    all instances (``test_shared_engine``), so each hands it the limit."""
    a, b = _siblings(max_live_requests=3)
    try:
        assert a.engine.live_limit == b.engine.live_limit == 3
    finally:
        a.finalize()
        b.finalize()


def test_a_health_probe_fails_on_every_instance_once_one_lost_the_engine():
    a, b = _siblings()
    try:
        for core in (a, b):
            core.engine.num_clients = None  # not announced yet: the engine's liveness counts
            probe = Sink()
            core.execute("h", {"health_probe": np.array([True])}, "", probe)
            assert probe.sent == [({"max_model_len": 0, "engine_steps": 0}, True)]
        for core in (a, b):
            core.engine.num_clients = 1  # the engine announced one client of two
            probe = Sink()
            core.execute("h", {"health_probe": np.array([True])}, "", probe)
            error = probe.error()
            assert error.code == ErrorCode.ENGINE_UNAVAILABLE
            assert "1 of the generator's 2 instances" in error.message
    finally:
        a.finalize()
        b.finalize()
