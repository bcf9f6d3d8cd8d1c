"""The platform ceiling's decoupled stream: ``max_tokens`` one-token responses per request.

``execute`` only hands each request to a sender thread, the requests in turn over
``CEILING_SENDER_THREADS`` threads (environment; default 1), each request always to the same one
as the generator's ``ResponseStreamer`` does. A thread sends one response to each of its live
requests in turn (round robin) with the tensors the generator sends per response (n = 1, no
logprobs): ``output_ids`` [1], ``prefix_ids`` (up to 8 ids sent before), ``finish_reason``
(``""``; ``"length"`` with the last one, which carries the final flag), ``num_output_tokens``,
and in the first and last responses only ``num_input_tokens`` and ``cached_tokens`` (0);
``trim_chars`` (0) is left out as the generator leaves it out. A request that asks for
``text_output`` and not ``output_ids`` (``ceiling_fused``, shaped like ``llm_fused``) gets the
token written out as ``text_output`` in place of ``output_ids`` and ``prefix_ids``, as the
generator then answers text. Nothing else runs: the
responses per second it reaches are Triton's own limit for one Python model instance whose
responses leave from that many threads (the generator sends from 4 when its engine runs in its
own process, ``ServingConfig.senders``).
"""

import os
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PREFIX_LEN = 8  # = tritonllm.serving.stream_state.PREFIX_LEN
VOCAB = 151936
_STOP = object()


class _Stream:
    """One live request: its sender, prompt length, tokens to send, tokens sent, last ids."""

    __slots__ = ("sender", "num_input", "max_tokens", "sent", "recent", "text")

    def __init__(self, sender, num_input, max_tokens, text):
        self.sender = sender
        self.text = text
        self.num_input = num_input
        self.max_tokens = max_tokens
        self.sent = 0
        self.recent = []


def _scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        # As in the generator: once tritonserver is gone a pb_utils call never returns and
        # would keep this stub alive, so the thread stops sending when the parent changed.
        self.parent_pid = os.getppid()
        count = int(os.environ.get("CEILING_SENDER_THREADS", "1"))
        if count < 1:
            raise pb_utils.TritonModelException(f"CEILING_SENDER_THREADS must be >= 1: {count}")
        self.queues = [queue.SimpleQueue() for _ in range(count)]
        self.next_queue = 0
        self.threads = [
            threading.Thread(target=self._run, args=(q,), name=f"ceiling-sender-{i}", daemon=True)
            for i, q in enumerate(self.queues)
        ]
        for thread in self.threads:
            thread.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            max_tokens = _scalar(request, "max_tokens")
            if max_tokens < 1:
                error = pb_utils.TritonError(
                    f"ceiling_stream: max_tokens must be >= 1, got {max_tokens}"
                )
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
                continue
            wanted = request.requested_output_names()
            text = "text_output" in wanted and "output_ids" not in wanted
            self.queues[self.next_queue].put(_Stream(sender, int(ids.size), max_tokens, text))
            self.next_queue = (self.next_queue + 1) % len(self.queues)
        return None

    def _run(self, incoming):
        live = []
        while True:
            try:
                item = incoming.get(block=not live)
                while True:
                    if item is _STOP:
                        return
                    live.append(item)
                    item = incoming.get_nowait()
            except queue.Empty:
                pass
            if os.getppid() != self.parent_pid:
                return
            for stream in live:
                self._send_next(stream)
            live = [s for s in live if s.sent < s.max_tokens]

    def _send_next(self, stream):
        token = (stream.num_input + 7919 * stream.sent) % VOCAB
        stream.sent += 1
        final = stream.sent == stream.max_tokens
        if stream.sent == 1 or final:
            counts = (stream.num_input, stream.sent, 0)
            names = ("num_input_tokens", "num_output_tokens", "cached_tokens")
        else:
            counts, names = (stream.sent,), ("num_output_tokens",)
        if stream.text:
            tensors = [pb_utils.Tensor("text_output", np.array([str(token).encode()], object))]
        else:
            tensors = [
                pb_utils.Tensor("output_ids", np.asarray([token], dtype=np.int32)),
                pb_utils.Tensor("prefix_ids", np.asarray(stream.recent, dtype=np.int32)),
            ]
        reason = np.array([b"length" if final else b""], dtype=object)
        tensors.append(pb_utils.Tensor("finish_reason", reason))
        tensors += [
            pb_utils.Tensor(n, np.array([c], dtype=np.int32))
            for n, c in zip(names, counts, strict=True)
        ]
        stream.recent = (stream.recent + [token])[-PREFIX_LEN:]
        try:
            stream.sender.send(
                pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0
            )
        except Exception:  # the stream is gone: stop sending to it
            stream.sent = stream.max_tokens

    def finalize(self):
        for q in self.queues:
            q.put(_STOP)
        for thread in self.threads:
            thread.join(5.0)
