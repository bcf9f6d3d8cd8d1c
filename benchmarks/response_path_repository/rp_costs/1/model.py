"""What each ``pb_utils`` call of the generator's response path costs in a real Python stub.

One request with input ``count`` = N: the stub times, each N times in a row, the calls the
generator's sender thread makes per response (``model_repository/generator/1/model.py``): the
generator's 7 output tensors built (``pb_utils.Tensor``), an ``InferenceResponse`` of them,
``send`` of such a response (N non-final responses the client receives), ``send`` of a response
of 4 tensors (``output_ids``, ``prefix_ids``, ``finish_reason``, ``num_output_tokens``),
``is_cancelled()``, a gauge's ``set``, a counter's ``increment`` and a histogram's ``observe``
(one per response sent: the generator's latency histograms); then ``send_4`` again from 2 and 4
threads at once, each thread on its own request (the client's earlier requests with ``count`` 0,
held open until then): wall µs per response over all threads, below the single thread's when
``send`` releases the GIL while it waits for tritonserver; and ``send_4`` on one thread while a
second thread calls ``observe`` without pause (``send_4_beside_observe``, with the observes it
made per second, ``observes_per_s_beside_send``): a send slowed as much as by an observe of its
own means that ``observe`` holds the GIL while it waits. The final response's ``report`` output
is a JSON object: µs per call of each.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
COUNTS = ("num_input_tokens", "num_output_tokens", "cached_tokens", "trim_chars")


def _tensors(k, full=True):
    tensors = [
        pb_utils.Tensor("output_ids", np.asarray([k % 1000], dtype=np.int32)),
        pb_utils.Tensor("prefix_ids", np.asarray(list(range(8)), dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([b""], dtype=object)),
    ]
    names = COUNTS if full else ("num_output_tokens",)
    return tensors + [pb_utils.Tensor(n, np.array([k], np.int32)) for n in names]


class TritonPythonModel:
    def initialize(self, args):
        self.gauge_family = pb_utils.MetricFamily("rp_gauge", "bench", pb_utils.MetricFamily.GAUGE)
        self.gauge = self.gauge_family.Metric(labels={"model": "rp"})
        self.counter_family = pb_utils.MetricFamily(
            "rp_counter", "bench", pb_utils.MetricFamily.COUNTER
        )
        self.counter = self.counter_family.Metric(labels={"model": "rp"})
        self.histogram_family = pb_utils.MetricFamily(
            "rp_histogram", "bench", pb_utils.MetricFamily.HISTOGRAM
        )
        self.histogram = self.histogram_family.Metric(
            labels={"model": "rp"}, buckets=[0.001, 0.01, 0.1, 1.0]
        )
        self.helpers = []  # senders of requests with count 0, for the threaded sends

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "count").as_numpy()[0])
            sender = request.get_response_sender()
            if count == 0:
                self.helpers.append(sender)
                continue
            us = {}

            def timed(name, fn, count=count, us=us):
                start = time.perf_counter()
                for k in range(count):
                    fn(k)
                us[name] = 1e6 * (time.perf_counter() - start) / count

            built = _tensors(0)
            timed("tensors_7", _tensors)
            timed("tensors_4", lambda k: _tensors(k, full=False))
            timed("response_7", lambda k, t=built: pb_utils.InferenceResponse(output_tensors=t))
            timed("send_7", lambda k, s=sender: s.send(pb_utils.InferenceResponse(_tensors(k)), 0))
            timed(
                "send_4",
                lambda k, s=sender: s.send(pb_utils.InferenceResponse(_tensors(k, full=False)), 0),
            )
            timed("is_cancelled", lambda k, s=sender: s.is_cancelled())
            timed("gauge_set", lambda k: self.gauge.set(k))
            timed("counter_increment", lambda k: self.counter.increment(1))
            timed("histogram_observe", lambda k: self.histogram.observe(0.005))
            stop, observed = threading.Event(), [0]

            def observe_until_stopped(stop=stop, observed=observed):
                while not stop.is_set():
                    self.histogram.observe(0.005)
                    observed[0] += 1

            observer = threading.Thread(target=observe_until_stopped)
            observer.start()
            start = time.perf_counter()
            timed(
                "send_4_beside_observe",
                lambda k, s=sender: s.send(pb_utils.InferenceResponse(_tensors(k, full=False)), 0),
            )
            stop.set()
            observer.join()
            us["observes_per_s_beside_send"] = observed[0] / (time.perf_counter() - start)
            for threads in (2, 4):
                if len(self.helpers) < threads:
                    break

                def part(s, n=count // threads):
                    for k in range(n):
                        s.send(pb_utils.InferenceResponse(_tensors(k, full=False)), 0)

                workers = [threading.Thread(target=part, args=(s,)) for s in self.helpers[:threads]]
                start = time.perf_counter()
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
                elapsed = time.perf_counter() - start
                us[f"send_4_threads{threads}"] = 1e6 * elapsed / (count // threads * threads)
            for helper in self.helpers:
                helper.send(flags=FINAL)
            self.helpers = []
            report = pb_utils.Tensor("report", np.array([json.dumps(us).encode()], dtype=object))
            sender.send(pb_utils.InferenceResponse(output_tensors=[report]), FINAL)
        return None
