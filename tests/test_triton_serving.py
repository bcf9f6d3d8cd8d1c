"""The generator's Triton-agnostic response path: coalescing, stream state, request table,
sender thread, request inputs and metric values (no tritonserver needed)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from tritonllm.engine.request import RequestOutput
from tritonllm.sampling_params import SamplingParams
from tritonllm.serving.coalesce import coalesce, merged
from tritonllm.serving.inputs import generate_request, scalar
from tritonllm.serving.metrics import ENGINE_GAUGES, gauge_values
from tritonllm.serving.request_table import RequestTable
from tritonllm.serving.response_streamer import ResponseStreamer
from tritonllm.serving.stream_state import PREFIX_LEN, StreamState


def sampling_params(inputs: dict) -> SamplingParams:
    """The sampling params the generator builds from these sampling inputs."""
    return generate_request({"input_ids": np.array([1], np.int32), **inputs}).params


def out(rid: str, ids: list[int], n_out: int, reason: str | None = None) -> RequestOutput:
    return RequestOutput(
        rid,
        ids,
        reason is not None,
        reason,
        num_prompt_tokens=5,
        num_output_tokens=n_out,
        cached_tokens=2,
    )


def test_coalesce_merges_each_request_in_order_and_keeps_the_last_counts():
    merged = coalesce(
        [
            out("a", [1], 1),
            out("b", [7], 1),
            out("a", [2], 2),
            out("a", [3], 3, "length"),
            out("b", [8], 2),
        ]
    )
    assert [m.request_id for m in merged] == ["a", "b"]
    a, b = merged
    assert (a.new_token_ids, a.num_output_tokens, a.finished, a.finish_reason) == (
        [1, 2, 3],
        3,
        True,
        "length",
    )
    assert (b.new_token_ids, b.num_output_tokens, b.finished) == ([7, 8], 2, False)


def test_merged_copies_the_last_output_and_joins_logprobs_and_prompt_scores():
    first = out("a", [1], 1)
    first.logprobs, first.top_logprobs = [-0.5], [{1: -0.5}]
    first.prompt_logprobs, first.prompt_top_logprobs = [-1.0], [{4: -1.0}]
    second = out("a", [2], 2)
    second.logprobs, second.top_logprobs = [-0.25], [{2: -0.25}]
    abort = out("a", [], 2, "abort")  # a final abort carries no ids and no logprobs
    before = [dict(vars(o)) for o in (first, second, abort)]
    result = merged([first, second, abort])
    assert [vars(o) for o in (first, second, abort)] == before  # the inputs are left as they are
    assert (result.new_token_ids, result.logprobs, result.top_logprobs) == (
        [1, 2],
        [-0.5, -0.25],
        [{1: -0.5}, {2: -0.25}],
    )
    assert (result.prompt_logprobs, result.prompt_top_logprobs) == ([-1.0], [{4: -1.0}])
    assert (result.finished, result.finish_reason, result.num_output_tokens) == (True, "abort", 2)
    plain = merged([out("b", [7], 1), out("b", [8], 2)])  # no logprobs: ids only
    assert (plain.new_token_ids, plain.logprobs, plain.prompt_logprobs) == ([7, 8], None, None)


def test_coalesce_drops_outputs_after_a_final_one():
    (merged,) = coalesce([out("a", [], 4, "abort"), out("a", [9], 5)])
    assert merged.finish_reason == "abort" and merged.new_token_ids == []


@pytest.mark.parametrize(
    "chunks", [[[1], [2], [3]], [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10]], [[i] for i in range(20)]]
)
def test_stream_state_prefix_is_the_previous_output_ids(chunks):
    state, sent, seen = StreamState(stream=True), [], []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        chunk = state.on_output(out("r", ids, len(seen) + len(ids), "stop" if last else None))
        assert chunk.prefix_ids == seen[-PREFIX_LEN:]  # never prompt ids
        assert chunk.final == last and chunk.finish_reason == ("stop" if last else "")
        seen += ids
        sent += chunk.output_ids
    assert sent == seen


def test_stream_false_sends_one_chunk_with_all_ids():
    state = StreamState(stream=False)
    assert state.on_output(out("r", [1], 1)) is None
    assert state.on_output(out("r", [2, 3], 3)) is None
    chunk = state.on_output(out("r", [4], 4, "length"))
    assert (chunk.output_ids, chunk.prefix_ids, chunk.final) == ([1, 2, 3, 4], [], True)
    assert (chunk.num_input_tokens, chunk.num_output_tokens, chunk.cached_tokens) == (5, 4, 2)


def test_prompt_counts_go_in_a_choices_first_and_final_chunks_only():
    """num_input_tokens / cached_tokens never change, so only a choice's first and final
    responses carry them (fewer tensors per response); a one-chunk stream carries them."""
    state = StreamState()
    flags = [state.on_output(out("r", [t], t + 1)).with_counts for t in range(4)]
    flags.append(state.on_output(out("r", [9], 5, "stop")).with_counts)
    assert flags == [True, False, False, False, True]
    assert StreamState().on_output(out("r", [1], 1, "length")).with_counts
    assert StreamState(stream=False).on_output(out("r", [1], 1, "length")).with_counts


def test_stream_state_reports_engine_errors():
    failed = RequestOutput("r", [], True, "error", 5, 0, 0, error="engine error: boom")
    assert StreamState().on_output(failed).error == "engine error: boom"


def test_request_table_keys_are_unique_per_live_request():
    table = RequestTable()
    first = table.add("req", "A")
    second = table.add("req", "B")
    anonymous = table.add("", "C")
    assert first == "req" and second != first and anonymous
    assert sorted(table.keys_of("req")) == sorted([first, second])
    assert table.pop(first) == "A" and table.get(first) is None
    assert table.add("req", "D") == "req"  # free again once the first finished
    assert len(table) == 3


def test_streamer_coalesces_outputs_that_pile_up_while_sending():
    delivered, release = [], threading.Event()
    first_batch = threading.Event()

    def deliver(batch):
        delivered.append([(o.request_id, list(o.new_token_ids)) for o in batch])
        first_batch.set()
        release.wait(5)  # a slow response path

    streamer = ResponseStreamer(deliver, tick=lambda: None, interval_s=0.01).start()
    streamer.put(out("a", [1], 1))
    assert first_batch.wait(5)
    for token in (2, 3, 4):  # arrive while the sender is busy
        streamer.put(out("a", [token], token))
    streamer.put(out("b", [9], 1, "stop"))
    release.set()
    streamer.stop()
    assert delivered == [[("a", [1])], [("a", [2, 3, 4]), ("b", [9])]]
    # Three responses; the sender was busy for the 0.01+ s the first deliver blocked, with
    # little CPU time spent (it was blocked, not computing).
    times = streamer.times()
    assert times.responses == 3
    assert times.busy_s > 0 and times.cpu_s <= times.busy_s + 0.05


def test_streamer_ticks_after_a_finish_and_survives_errors():
    ticks, errors = threading.Event(), []

    def deliver(batch):
        raise RuntimeError("send failed")

    streamer = ResponseStreamer(deliver, tick=ticks.set, interval_s=60.0, on_error=errors.append)
    streamer.start()
    ticks.wait(5)
    ticks.clear()
    streamer.put(out("a", [1], 1, "length"))
    assert ticks.wait(5)  # long before the 60 s interval
    streamer.stop()
    assert errors and "send failed" in errors[0]


def test_sampling_params_from_inputs_matches_the_dataclass():
    params = sampling_params(
        {
            "max_tokens": np.array([7], np.int32),
            "temperature": np.array([0.5], np.float32),
            "top_k": np.array([3], np.int32),
            "seed": np.array([42], np.int64),
            "stop_token_ids": np.array([1, 2], np.int32),
            "ignore_eos": np.array([True]),
            "repetition_penalty": np.array([1.1], np.float32),
            "top_p": None,
        }
    )
    assert params == SamplingParams(
        max_tokens=7,
        temperature=float(np.float32(0.5)),
        top_k=3,
        seed=42,
        stop_token_ids=(1, 2),
        ignore_eos=True,
        repetition_penalty=float(np.float32(1.1)),
    )
    assert type(params.max_tokens) is int and type(params.seed) is int


@pytest.mark.parametrize(
    "inputs",
    [
        {"temperature": np.array([-1.0], np.float32)},
        {"max_tokens": np.array([-1], np.int32)},
        {"max_tokens": np.array([1, 2], np.int32)},
    ],
)
def test_bad_sampling_inputs_raise_value_error(inputs):
    with pytest.raises(ValueError):
        sampling_params(inputs)


def test_max_tokens_has_one_encoding_absent_or_a_number():
    """Absent: until EOS, a stop or the context limit; a number >= 1: the limit; 0: prefill
    only (score or echo the prompt), never "no limit"; negative values are refused."""
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, .*got -3"):
        sampling_params({"max_tokens": np.array([-3], np.int32)})
    assert sampling_params({"max_tokens": np.array([0], np.int32)}).max_tokens == 0
    assert sampling_params({}).max_tokens is None
    assert sampling_params({"max_tokens": np.array([5], np.int32)}).max_tokens == 5


def test_scalar_decodes_bytes_and_defaults():
    assert scalar(np.array([b"abc"], dtype=object), "x", str) == "abc"
    assert scalar(None, "stream", bool, default=True) is True


def test_string_inputs_that_are_not_utf8_name_the_input():
    """A Triton client may send any bytes: the error names the input (the generator's answer
    to a request), not the codec."""
    with pytest.raises(ValueError, match="input 'stop' is not valid UTF-8"):
        sampling_params({"stop": np.array([b"ok", b"\xff\xfe"], dtype=object)})
    with pytest.raises(ValueError, match="input 'abort_request_id' is not valid UTF-8"):
        scalar(np.array([b"\xff"], dtype=object), "abort_request_id", str)


def test_kv_pages_used_excludes_reclaimable_prefix_cache_pages():
    stats = SimpleNamespace(
        used_pages=10,
        evictable_pages=4,
        cached_pages=6,
        total_pages=100,
        num_running=1,
        num_waiting=2,
        max_batch_size_seen=3,
    )
    values = gauge_values(stats)
    assert set(values) == {spec.name for spec, _ in ENGINE_GAUGES}
    assert values["tritonllm_kv_pages_used"] == 6
    assert values["tritonllm_kv_pages_total"] == 100
    assert values["tritonllm_batch_size_max"] == 3


def test_pacer_holds_tokens_until_the_request_is_due_and_never_delays_the_final():
    from tritonllm.serving.pacer import ResponsePacer

    pacer = ResponsePacer(max_responses_per_s=20.0)  # 2 live requests → one response per 0.1 s
    assert [o.new_token_ids for o in pacer.admit([out("a", [1], 1), out("b", [5], 1)], 0.0)] == [
        [1],
        [5],
    ]  # first responses go out at once (TTFT)
    assert pacer.admit([out("a", [2], 2)], 0.05) == []
    assert pacer.admit([out("a", [3], 3)], 0.06) == []
    assert pacer.next_due() == pytest.approx(0.1)
    (due,) = pacer.admit([], 0.1)
    assert (due.new_token_ids, due.num_output_tokens) == ([2, 3], 3)  # coalesced
    (final,) = pacer.admit([out("b", [6], 2, "stop")], 0.11)
    assert final.finished and final.new_token_ids == [6]
    assert pacer.next_due() is None


def test_pacer_releases_every_token_once_in_order_over_many_passes():
    """Outputs held over many sender passes come out merged, each id exactly once and in
    order, a request's final output never held; whatever the arrival pattern."""
    import random

    from tritonllm.serving.pacer import ResponsePacer

    rng = random.Random(0)
    pacer = ResponsePacer(max_responses_per_s=200.0)
    lengths = {f"r{i}": rng.randint(1, 40) for i in range(12)}
    made = dict.fromkeys(lengths, 0)
    sent: dict[str, list[int]] = {rid: [] for rid in lengths}
    now, longest = 0.0, 0
    while any(made[r] < n for r, n in lengths.items()) or pacer.next_due() is not None:
        batch = []
        for rid, n in lengths.items():
            if made[rid] < n and rng.random() < 0.7:
                made[rid] += 1
                reason = "length" if made[rid] == n else None
                batch.append(out(rid, [made[rid]], made[rid], reason))
        released = pacer.admit(batch, now)
        finals = {o.request_id for o in batch if o.finished}
        assert finals <= {o.request_id for o in released if o.finished}  # never held
        longest = max([longest, *(len(o.new_token_ids) for o in released)])
        for o in released:
            sent[o.request_id] += o.new_token_ids
            assert o.num_output_tokens == len(sent[o.request_id])  # the last counts
            if o.finished:
                assert sent[o.request_id] == list(range(1, lengths[o.request_id] + 1))
        now += 0.004
    assert all(ids == list(range(1, lengths[r] + 1)) for r, ids in sent.items())
    assert longest > 3  # tokens were held and coalesced


def test_pacer_spends_the_budget_in_each_request_s_cost():
    """A detokenized stream (cost 2.5) and a text stream (cost 1) share a budget of 35 units/s:
    each gets a response every (2.5 + 1) / 35 = 0.1 s; once the costly one finished, the other
    every 1 / 35 s."""
    from tritonllm.serving.pacer import DETOKENIZED_RESPONSE_COST, ResponsePacer

    costs = {"ids": DETOKENIZED_RESPONSE_COST, "text": 1.0}
    asked = []
    pacer = ResponsePacer(
        max_responses_per_s=35.0, cost=lambda rid: asked.append(rid) or costs[rid]
    )
    assert len(pacer.admit([out("ids", [1], 1), out("text", [5], 1)], 0.0)) == 2
    assert pacer.admit([out("ids", [2], 2), out("text", [6], 2)], 0.05) == []
    assert pacer.next_due() == pytest.approx(0.1)
    assert len(pacer.admit([], 0.1)) == 2
    (final,) = pacer.admit([out("ids", [3], 3, "stop")], 0.12)  # finals are never held
    assert final.finished
    assert len(pacer.admit([out("text", [7], 3)], 0.2)) == 1  # due at 0.2
    pacer.admit([out("text", [8], 4)], 0.201)
    assert pacer.next_due() == pytest.approx(0.2 + 1 / 35)  # alone: its own cost only
    assert sorted(asked) == ["ids", "text"]  # each asked once


def test_pacer_disabled_sends_everything():
    from tritonllm.serving.pacer import ResponsePacer

    pacer = ResponsePacer(max_responses_per_s=0)
    for t in range(3):
        assert len(pacer.admit([out("a", [t], t + 1)], 0.0)) == 1


def test_an_abort_that_overtakes_its_request_is_remembered():
    table = RequestTable(abort_ttl_s=60.0)
    assert table.abort("early") == []
    assert table.was_aborted("early") and not table.was_aborted("early")  # consumed
    key = table.add("live", "entry")
    assert table.abort("live") == [key] and not table.was_aborted("live")
    expired = RequestTable(abort_ttl_s=0.0)
    expired.abort("x")
    assert not expired.was_aborted("x")


def test_coalesce_keeps_the_output_that_ends_a_request_behind_its_other_choices():
    """Choice 1 finishes first, choice 0 (which appeared first) ends the request: the merged
    output with `request_finished` must come after choice 1's, or the final flag would be sent
    before choice 1's last response."""
    outs = [
        RequestOutput("r", [1], False, None, 5, 1, 0, index=0),
        RequestOutput("r", [7], True, "length", 5, 1, 0, index=1),
        RequestOutput("r", [2], True, "stop", 5, 2, 0, index=0, request_finished=True),
    ]
    merged = coalesce(outs)
    assert [(m.index, m.new_token_ids, m.request_finished) for m in merged] == [
        (1, [7], False),
        (0, [1, 2], True),
    ]


def test_logit_bias_input_is_openais_json_object_in_any_of_the_three_places():
    """The ``logit_bias`` input, ``sampling_parameters`` and the request's parameters all take
    OpenAI's object {"<token id>": bias}; the params hold it as (id, bias) pairs."""
    want = SamplingParams(logit_bias={7: -100.0, 12: 2.5})
    text = '{"12": 2.5, "7": -100}'
    assert sampling_params({"logit_bias": np.array([text.encode()], dtype=object)}) == want
    from_json = sampling_params(
        {"sampling_parameters": np.array(['{"logit_bias": {"7": "-100", "12": 2.5}}'], object)}
    )
    assert from_json == want
    request = generate_request(
        {"input_ids": np.array([1], np.int32)}, {"logit_bias": {"7": -100, "12": 2.5}}
    )
    assert request.params == want
    # The same object in two places is one value; two different ones are refused.
    both = generate_request(
        {"input_ids": np.array([1], np.int32), "logit_bias": np.array([text], dtype=object)},
        {"logit_bias": text},
    )
    assert both.params == want
    with pytest.raises(ValueError, match="logit_bias is given twice"):
        generate_request(
            {"input_ids": np.array([1], np.int32), "logit_bias": np.array([text], dtype=object)},
            {"logit_bias": {"7": -99}},
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"x": 1}', "logit_bias keys must be distinct token ids"),
        ('{"7.0": 1}', "logit_bias keys must be distinct token ids"),
        ('{"7": "strong"}', r"logit_bias\[7\] must be a finite number"),
        ('{"7": null}', r"logit_bias\[7\] must be a finite number"),
        ("[[7, 1]]", "logit_bias must be a JSON object"),
        ("not json", "logit_bias must be a JSON object"),
        ('{"7": 101}', r"logit_bias\[7\] must be in \[-100, 100\]"),
        ('{"-7": 1}', "logit_bias must be keyed by non-negative token ids"),
        ('{"7": 1, "07": 2}', "logit_bias keys must be distinct token ids"),
    ],
)
def test_bad_logit_bias_input_is_invalid_value_naming_it(text, message):
    with pytest.raises(ValueError, match=message) as info:
        sampling_params({"logit_bias": np.array([text], dtype=object)})
    assert (info.value.code.value, info.value.param) == ("invalid_value", "logit_bias")


class _Histogram:
    """A stand-in histogram metric: records observed values and the thread observing them."""

    def __init__(self, fail_on: float | None = None) -> None:
        self.values: list[float] = []
        self.threads: set[str] = set()
        self.fail_on = fail_on

    def observe(self, value: float) -> None:
        if value == self.fail_on:
            raise RuntimeError("tritonserver refused")
        self.values.append(value)
        self.threads.add(threading.current_thread().name)


def test_histogram_observer_observes_every_sample_off_the_calling_thread():
    from tritonllm.serving.metrics import HistogramObserver, LatencySamples

    ttft, itl = _Histogram(), _Histogram(fail_on=-1.0)
    errors: list[str] = []
    observer = HistogramObserver([(ttft, "ttft_s"), (itl, "itl_s")], lambda: True, 8, errors.append)
    observer.put(LatencySamples(ttft_s=[0.1], itl_s=[0.01, 0.02]))
    observer.put(LatencySamples())  # an idle tick queues nothing
    observer.put(LatencySamples(itl_s=[-1.0]))  # a failing observe is logged, not fatal
    observer.put(LatencySamples(ttft_s=[0.2], itl_s=[0.03]))
    observer.close()
    assert ttft.values == [0.1, 0.2] and itl.values == [0.01, 0.02, 0.03]
    assert ttft.threads == itl.threads == {"tritonllm-observe"}
    assert len(errors) == 1 and "tritonserver refused" in errors[0]
    assert observer.dropped == 0


def test_histogram_observer_stops_once_the_server_is_gone_and_bounds_its_backlog():
    from tritonllm.serving.metrics import HistogramObserver, LatencySamples

    # Server gone: nothing more is observed (a pb_utils call would never return).
    gone = _Histogram()
    observer = HistogramObserver([(gone, "e2e_s")], lambda: False)
    observer.put(LatencySamples(e2e_s=[1.0]))
    observer.close(timeout=2)
    assert gone.values == []
    # A stuck observe: at most max_pending ticks wait, the rest is dropped and counted.
    release = threading.Event()

    class _Stuck(_Histogram):
        def observe(self, value: float) -> None:
            release.wait(10)
            super().observe(value)

    stuck = _Stuck()
    errors: list[str] = []
    observer = HistogramObserver([(stuck, "queue_s")], lambda: True, 2, errors.append)
    for i in range(6):
        observer.put(LatencySamples(queue_s=[float(i), float(i)]))
    # the thread holds the first tick; two wait; the other three ticks (6 samples) are dropped
    assert observer.dropped in (6, 8)
    assert len(errors) == 1 and "dropped" in errors[0]  # told once
    release.set()
    observer.close()
    assert len(stuck.values) == 12 - observer.dropped
