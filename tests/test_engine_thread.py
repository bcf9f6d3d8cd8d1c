"""EngineThread: thread-safe submit/abort, callbacks, synchronous validation, error isolation."""

from __future__ import annotations

import threading
import time

import pytest
from test_engine_helpers import checkpoint, hf_greedy, prompts

from tritonllm.config import EngineConfig
from tritonllm.engine import EngineThread, LLMEngine
from tritonllm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TIMEOUT = 60.0


class Collector:
    """Thread-safe sink of RequestOutputs; `wait(ids)` blocks until each id has finished (its
    output with `request_finished`: every choice ended)."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}
        self._cv = threading.Condition()

    def __call__(self, out) -> None:
        with self._cv:
            self.outputs.setdefault(out.request_id, []).append(out)
            self._cv.notify_all()

    def finished(self, rid: str) -> bool:
        outs = self.outputs.get(rid)
        return bool(outs) and outs[-1].request_finished

    def wait(self, ids) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: all(self.finished(r) for r in ids), TIMEOUT)

    def ids(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]


@pytest.fixture
def thread():
    engine = LLMEngine(EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=256))
    et = EngineThread(engine)
    yield et
    et.shutdown()
    assert not et.is_alive()


def test_concurrent_submissions_from_many_threads(thread):
    ps = prompts([4, 9, 13, 2, 21, 7], seed=20)
    sink = Collector()
    workers = [
        threading.Thread(target=thread.submit, args=(f"r{i}", p, GREEDY, sink))
        for i, p in enumerate(ps)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sink.wait([f"r{i}" for i in range(len(ps))])
    for i, p in enumerate(ps):
        assert sink.ids(f"r{i}") == hf_greedy(checkpoint("qwen3"), p, 12)[0]
        last = sink.outputs[f"r{i}"][-1]
        assert last.finish_reason == "length" and last.num_output_tokens == 12
        assert sum(o.finished for o in sink.outputs[f"r{i}"]) == 1
    assert thread.stats().num_running == 0
    times = thread.loop_times()
    assert times.loops >= 12  # one loop per step, 12 decode steps at least
    assert 0 < times.cpu_s and times.callback_s < times.busy_s
    assert thread.stats().gpu_wait_s <= times.busy_s
    # Every prompt token was computed by a prefill step (no shared prefixes, no preemption).
    stats = thread.stats()
    assert 1 <= stats.num_prefill_steps < stats.num_steps
    assert stats.prefill_tokens == sum(len(p) for p in ps)


def test_invalid_submit_raises_synchronously_and_thread_keeps_serving(thread):
    sink = Collector()
    with pytest.raises(ValueError, match="top_p"):
        thread.submit("bad", [1, 2], SamplingParams(top_p=1.5), sink)
    with pytest.raises(ValueError, match="max_model_len"):
        thread.submit("long", [1] * 500, SamplingParams(max_tokens=100), sink)
    thread.submit("good", [1, 2, 3], GREEDY, sink)
    with pytest.raises(ValueError, match="already in use"):
        thread.submit("good", [1, 2, 3], GREEDY, sink)
    sink.wait(["good"])
    assert "bad" not in sink.outputs and thread.is_alive()


def test_abort_through_thread_reports_abort_and_frees_pages(thread):
    sink = Collector()
    started = threading.Event()

    def on_output(out):
        sink(out)
        started.set()

    thread.submit(
        "long", prompts([10])[0], SamplingParams(max_tokens=400, ignore_eos=True), on_output
    )
    assert started.wait(TIMEOUT)
    thread.abort("long")
    sink.wait(["long"])
    last = sink.outputs["long"][-1]
    assert last.finish_reason == "abort" and last.num_output_tokens < 400
    stats = thread.stats()
    assert stats.num_running == 0 and stats.free_pages + stats.evictable_pages == stats.total_pages
    thread.abort("unknown-id")  # ignored
    thread.submit("after", [5, 6], GREEDY, sink)
    sink.wait(["after"])


def test_engine_error_fails_requests_in_flight_but_not_the_thread(thread, monkeypatch):
    runner = thread.engine.runner
    real_run = runner.run
    calls = {"n": 0}

    def flaky_run(batch, before_sample=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real_run(batch, before_sample)

    monkeypatch.setattr(runner, "run", flaky_run)
    sink = Collector()
    thread.submit("x", [1, 2, 3], GREEDY, sink)
    sink.wait(["x"])
    last = sink.outputs["x"][-1]
    assert last.finish_reason == "error" and "simulated kernel failure" in last.error
    thread.submit("y", [1, 2, 3], GREEDY, sink)
    sink.wait(["y"])
    assert sink.outputs["y"][-1].finish_reason == "length"
    assert thread.stats().free_pages + thread.stats().evictable_pages == thread.stats().total_pages


def test_n_choices_reach_the_request_callback_by_index(thread):
    sink = Collector()
    thread.submit("multi", [3, 4, 5], SamplingParams(max_tokens=5, n=3, seed=1), sink)
    sink.wait(["multi"])
    outs = sink.outputs.pop("multi")
    finals = [o.index for o in outs if o.finished]
    assert sorted(finals) == [0, 1, 2]  # each choice finished once, under the request's id
    assert [o.request_finished for o in outs].count(True) == 1 and outs[-1].request_finished
    for index in range(3):
        assert sum(len(o.new_token_ids) for o in outs if o.index == index) == 5
    thread.submit("multi", [3, 4, 5], GREEDY, sink)  # the id is free again
    sink.wait(["multi"])


def test_outputs_made_before_a_failed_step_are_not_lost():
    """An abort queued before a step that raises (e.g. CUDA OOM) still reaches its caller."""
    engine = LLMEngine(
        EngineConfig(model=str(checkpoint("qwen3", True)), page_size=4, num_pages=64)
    )
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5))
    engine.step()
    engine.abort("a")

    def fail(batch, before_sample=None):
        raise RuntimeError("out of memory")

    engine.runner.run = fail
    with pytest.raises(RuntimeError):
        engine.step()
    finals = {o.request_id: o.finish_reason for o in engine.abort_all("engine error")}
    assert finals == {"a": "abort", "b": "error"}
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.used_pages == stats.evictable_pages


def test_request_ids_are_opaque_and_unique_while_live():
    """The choice index is a field, never part of an id: "x#0" and "x" are two requests."""
    engine = LLMEngine(
        EngineConfig(model=str(checkpoint("qwen3", True)), page_size=4, num_pages=64)
    )
    engine.add_request("x#0", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=5, n=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=5))


def test_a_step_that_hangs_makes_the_thread_not_alive_until_it_returns():
    """A step blocked past `stall_timeout_s` (a hung engine): `is_alive()` turns False (the
    sidecar's health probe then fails); once the step returns the thread is alive again and
    the request completes."""
    engine = LLMEngine(EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=256))
    release, blocked = threading.Event(), threading.Event()
    real_step = engine.step

    def hanging_step():
        if not blocked.is_set():
            blocked.set()
            release.wait(TIMEOUT)
        return real_step()

    engine.step = hanging_step
    et = EngineThread(engine, stall_timeout_s=0.5)
    try:
        sink = Collector()
        et.submit("hung", [1, 2, 3, 4], GREEDY, sink)
        assert blocked.wait(TIMEOUT)
        deadline = time.monotonic() + 10
        while et.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not et.is_alive()
        release.set()
        sink.wait(["hung"])
        assert sink.outputs["hung"][-1].finish_reason == "length"
        assert et.is_alive()
    finally:
        release.set()
        et.shutdown()
