"""Stand-ins of `benchmarks/response_path.py` (benchmark harness only, never used by tests):
`SyntheticEngine`, an `EngineClient` that computes nothing, and `FakeTriton`, a
`triton_python_backend_utils` whose calls spin Triton's measured cost; `adapter()` imports the
generator's `model.py` over it."""

from __future__ import annotations

import dataclasses
import importlib.util
import pickle
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Triton's own cost per call (µs), spun on the calling thread with the GIL held; the defaults
# are `--triton 5000`'s numbers on the 2-core box (2026-12-01, shared and loaded): a tensor
# built, a send (plus per tensor sent), is_cancelled, a gauge set / counter increment.
COSTS_US = {"tensor": 10.0, "send": 110.0, "send_tensor": 12.0, "ipc": 25.0}
SEND_RELEASES_GIL = [False]  # --send-sleeps: a send's base cost is slept (GIL released)


SPUN_S = [0.0]  # seconds spun so far (all on the sender thread)


def _spin(us: float) -> None:
    if us <= 0:
        return
    start = time.thread_time()
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass
    SPUN_S[0] += time.thread_time() - start


class FakeTriton(types.ModuleType):
    """Stand-in for `triton_python_backend_utils` (benchmark only): keeps what it is given and
    spins Triton's measured cost of each call (`COSTS_US`)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        __slots__ = ("name", "array")

        def __init__(self, name, array):
            self.name, self.array = name, array
            _spin(COSTS_US["tensor"])

    class InferenceResponse:
        __slots__ = ("output_tensors", "error")

        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class TritonError(Exception):
        pass

    class Logger:
        @staticmethod
        def log_warn(message):
            print(message, file=sys.stderr)

        log_error = log_info = log_warn

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = 0, 1, 2

        class _Metric:
            def set(self, value):
                _spin(COSTS_US["ipc"])

            def increment(self, value):
                _spin(COSTS_US["ipc"])

            def observe(self, value):
                _spin(COSTS_US["ipc"])

        def __init__(self, name, description, kind):
            pass

        def Metric(self, labels=None, buckets=None):  # noqa: N802  (pb_utils' name)
            return self._Metric()


class Sender:
    """A Triton response sender's stand-in: counts responses and tensors, reports finals."""

    __slots__ = ("slot", "on_final", "stats")

    def __init__(self, slot, on_final, stats):
        self.slot, self.on_final, self.stats = slot, on_final, stats

    def send(self, response=None, flags=0):
        tensors = 0 if response is None else len(response.output_tensors)
        if SEND_RELEASES_GIL[0]:
            _spin(tensors * COSTS_US["send_tensor"])
            time.sleep(COSTS_US["send"] * 1e-6)
        else:
            _spin(COSTS_US["send"] + tensors * COSTS_US["send_tensor"])
        if response is not None:
            self.stats["responses"] += 1
            self.stats["tensors"] += tensors
        if flags:
            self.on_final(self.slot)

    def is_cancelled(self):
        _spin(COSTS_US["ipc"])
        self.stats["cancel_checks"] += 1
        return False


class SyntheticEngine:
    """Benchmark harness only (an `EngineClient` that computes nothing): every `step_s` each
    live request gets one token (`(prompt length + 7919 * k) % 151936`, k = 0, 1, ...) until
    `max_tokens`, delivered from its own thread through a decoded step message."""

    def __init__(self, step_s: float) -> None:
        from tritonllm.engine.client import LoopTimes
        from tritonllm.engine.engine_thread import CallbackTable
        from tritonllm.engine.stats import EngineStats

        self.step_s = step_s
        self.routes = CallbackTable()
        self._lock = threading.Lock()
        self._live: dict[str, list[int]] = {}  # id -> [prompt length, sent, max_tokens]
        self._aborted: set[str] = set()
        self._stats = EngineStats(*[0] * len(dataclasses.fields(EngineStats)))
        self._times = LoopTimes()
        self._stop = threading.Event()
        self.outputs = 0
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, name="synthetic-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id, prompt_ids, params, callback):
        self.routes.add(request_id, callback, len(prompt_ids))
        with self._lock:
            self._live[request_id] = [len(prompt_ids), 0, params.max_tokens]

    def abort(self, request_id):
        with self._lock:
            self._aborted.add(request_id)

    def stats(self):
        return self._stats

    def loop_times(self):
        return self._times

    def is_alive(self):
        return not self._stop.is_set()

    def shutdown(self, timeout=10.0):
        self._stop.set()
        self._thread.join(timeout)

    def _rows(self) -> list[tuple]:
        rows = []
        with self._lock:
            for request_id, state in list(self._live.items()):
                num_prompt, sent, limit = state
                if request_id in self._aborted:
                    self._aborted.discard(request_id)
                    del self._live[request_id]
                    rows.append((request_id, [], True, "abort", num_prompt, sent, 0))
                    continue
                token = (num_prompt + 7919 * sent) % 151936
                state[1] = sent = sent + 1
                done = sent >= limit
                if done:
                    del self._live[request_id]
                reason = "length" if done else None
                rows.append((request_id, [token], done, reason, num_prompt, sent, 0))
        return [(*row, None, None, None, 0, 0, row[2]) for row in rows]

    def _run(self) -> None:
        from tritonllm.engine.process_messages import decode_step

        cpu0 = time.thread_time()
        next_step = time.monotonic()
        while not self._stop.is_set():
            next_step += self.step_s
            rows = self._rows()
            if rows:
                stats = dataclasses.astuple(self._stats)
                data = pickle.dumps((rows, stats, dataclasses.astuple(self._times)))
                outputs, _, _ = decode_step(data)
                self.outputs += len(outputs)
                for out in outputs:
                    self.routes.deliver(out)
            self.cpu_s = time.thread_time() - cpu0
            time.sleep(max(0.0, next_step - time.monotonic()))


def adapter():
    """The generator's `model.py`, imported over `_FakeTriton` (this process only)."""
    sys.modules["triton_python_backend_utils"] = FakeTriton("triton_python_backend_utils")
    path = ROOT / "model_repository" / "generator" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("generator_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
