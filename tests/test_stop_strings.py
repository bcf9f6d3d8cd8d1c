"""OpenAI stop strings over token ids: the streamed text ends just before the first stop string.

Oracle: the Hugging Face tokenizer's ``decode`` of each prefix of the ids (the text known after
each token, an incomplete trailing character removed) and ``str.find``: the request stops after
the first token whose text contains a stop string, at the earliest position where one occurs.
The checker's output is run through the real ``Detokenizer`` as the Triton pipeline does, and
through ``text_outputs`` for logprobs: OpenAI's ``logprobs.content`` covers the returned text, so
an id keeps its entry exactly when its bytes start before the end of the returned text's bytes.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tritonllm.engine.stop_strings import StopResult, StopStringChecker, apply_trim
from tritonllm.serving.text_outputs import text_outputs
from tritonllm.tokenization.detokenizer import Detokenizer

PREFIX_WINDOW = 8  # ids of context the generator sends with each response
IM_END = 151645  # <|im_end|>, a special token (decodes to "")

TEXTS = [
    "Hello world, hello again. The end is near; the end.",
    "  spaced   out\n\nlines  \t tabs ",
    "你好，世界！这是一个测试。世界很大。",
    "emoji 🫠 melt 🤖 robot 👍🏽 ok 🫠🫠 done",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∑∫√∞ ≠ ≤ and café naïve",
    "code:\n\tdef f(x):\n\t\treturn x  # ok\n\n",
]


@pytest.fixture(scope="module")
def detok(tokenizer) -> Detokenizer:
    return Detokenizer(tokenizer)


class Stream:
    """What the downstream sees: every step's result, its text delta, and the final output."""

    def __init__(self, detok: Detokenizer, ids: list[int], stops: list[str], chunks: list[int]):
        checker = StopStringChecker(detok, stops)
        self.released: list[int] = []
        self.steps: list[tuple[int, str]] = []  # (ids fed so far, text released so far)
        self.results = []
        self.stopped = False
        text, start, i = "", 0, 0
        while start < len(ids):
            end = min(len(ids), start + chunks[i % len(chunks)])
            result = checker.process(ids[start:end])
            self.results.append(result)
            delta = detok.delta(self.released[-PREFIX_WINDOW:], result.release_ids, result.stopped)
            self.released += result.release_ids
            start, i = end, i + 1
            if result.stopped:
                self.stopped = True
                text += apply_trim(delta, result.trim_chars)
                break
            assert result.trim_chars == 0
            text += delta
            self.steps.append((end, text))
        else:
            rest = checker.flush()
            text += detok.delta(self.released[-PREFIX_WINDOW:], rest, final=True)
            self.released += rest
        self.text = text


def known_texts(tokenizer, ids: list[int]) -> list[str]:
    """Text known after each token: HF decode of the prefix minus an incomplete last char."""
    return [
        tokenizer.decode(ids[: k + 1], skip_special_tokens=True).rstrip("\ufffd")
        for k in range(len(ids))
    ]


def oracle(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """(expected output, ids released on a stop: through the token where the match starts)."""
    texts = known_texts(tokenizer, ids)
    for text in texts:
        hits = [text.find(s) for s in stops if s and s in text]
        if hits:
            pos = min(hits)
            return text[:pos], next(k for k, t in enumerate(texts) if len(t) > pos) + 1
    return tokenizer.decode(ids, skip_special_tokens=True), None


def expected_released(texts: list[str], fed: int, stops: list[str]) -> str:
    """Text of the longest id prefix lying before the longest suffix that could start a stop."""
    text = texts[fed - 1]
    hold = next(
        (p for p in range(len(text)) if any(s.startswith(text[p:]) for s in stops if s)),
        len(text),
    )
    return text[: max((len(t) for t in texts[:fed] if len(t) <= hold), default=0)]


def check(tokenizer, detok, ids: list[int], stops: list[str], chunks: list[int]) -> Stream:
    """Run the checker as the pipeline does and compare everything with the oracle."""
    expected, num_released = oracle(tokenizer, ids, stops)
    stream = Stream(detok, ids, stops, chunks)
    assert stream.text == expected
    assert stream.stopped == (num_released is not None)
    if stream.stopped:
        assert stream.released == ids[:num_released]
    else:
        assert stream.released == ids
    texts = known_texts(tokenizer, ids)
    for fed, released_text in stream.steps:
        assert expected.startswith(released_text)  # no stop-string text is ever sent
        assert released_text == expected_released(texts, fed, stops)  # nothing held needlessly
    return stream


def random_stops(rng: random.Random, text: str) -> list[str]:
    """1-3 stops: substrings of text (some made unmatched by an appended char), or absent."""
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 6)]
        kind = rng.random()
        if kind < 0.25:
            stop += "\x00"  # its prefix occurs: held back, then released
        elif kind < 0.35:
            stop = "never"
        stops.append(stop)
    return stops


@pytest.mark.parametrize("text", TEXTS)
def test_random_stops_one_id_at_a_time_and_in_chunks_match_oracle(tokenizer, detok, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(text)
    for _ in range(12):
        stops = random_stops(rng, text)
        one = check(tokenizer, detok, ids, stops, [1])
        chunked = check(tokenizer, detok, ids, stops, [rng.randint(1, 5) for _ in range(8)])
        assert one.text == chunked.text and one.released == chunked.released


def test_stop_strictly_inside_one_token(tokenizer, detok):
    ids = tokenizer.encode("Say Hello there", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[1]) == "ĠHello"  # " Hello" is one token
    stream = check(tokenizer, detok, ids, ["lo"], [1])
    assert stream.text == "Say Hel"
    final = stream.results[-1]
    assert final.stopped and final.release_ids == [ids[1]] and final.trim_chars == len("lo")
    assert ids[2] not in stream.released


def test_multi_token_stop_is_held_back_while_it_forms(tokenizer, detok):
    ids = tokenizer.encode("Hello world peace now", add_special_tokens=False)
    assert len(ids) == 4  # Hello | world | peace | now
    stream = check(tokenizer, detok, ids, [" world peace"], [1])
    assert [r.release_ids for r in stream.results] == [[ids[0]], [], [ids[1]]]
    assert stream.results[-1].trim_chars == len(" world") and stream.text == "Hello"


def test_later_starting_stop_completing_first_wins(tokenizer, detok):
    ids = tokenizer.encode(" h", add_special_tokens=False) + tokenizer.encode("ello")
    assert tokenizer.decode(ids) == " hello" and len(ids) == 2
    # "ell" is complete after " h|ello" while "hello" is not yet: "ell" stops the request.
    ids = ids[:1] + tokenizer.encode("ell") + tokenizer.encode("o")
    for chunks in ([1], [3]):
        assert check(tokenizer, detok, ids, ["hello", "ell"], chunks).text == " h"


def test_earliest_start_wins_when_both_complete_in_the_same_token(tokenizer, detok):
    ids = tokenizer.encode("Say hello", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "Ġhello"
    for stops in (["ell", "hello"], ["hello", "ell"]):
        assert check(tokenizer, detok, ids, stops, [1]).text == "Say "


def test_stop_starting_in_a_token_that_ends_mid_character(tokenizer, detok):
    byte_char = bytes_to_unicode()
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for b, c in byte_char.items()}
    dash_head = tokenizer.convert_tokens_to_ids("".join(byte_char[b] for b in b" \xe2\x80"))
    assert detok.token_bytes([dash_head]) == b" \xe2\x80"
    ids = tokenizer.encode("x", add_special_tokens=False) + [dash_head, byte_token[0x94]]
    ids += tokenizer.encode("y", add_special_tokens=False)
    assert tokenizer.decode(ids) == "x \u2014y"
    stream = check(tokenizer, detok, ids, [" \u2014"], [1])
    # The downstream flushes the incomplete dash as U+FFFD: " " + U+FFFD are trimmed.
    assert stream.text == "x" and stream.results[-1].trim_chars == 2
    for stops in (["\u2014"], ["\u2014y"], ["x \u2014"], ["y"]):
        check(tokenizer, detok, ids, stops, [1])


def test_split_emoji_stop_and_special_tokens_inside_a_stop(tokenizer, detok):
    ids = tokenizer.encode("ab🫠cd", add_special_tokens=False)
    for stops in (["🫠"], ["b🫠"], ["🫠c"], ["🫠d"], ["ab🫠cd"]):
        check(tokenizer, detok, ids, stops, [1])
    ids = tokenizer.encode("ab", add_special_tokens=False) + [IM_END, IM_END]
    ids += tokenizer.encode("cd", add_special_tokens=False)
    assert check(tokenizer, detok, ids, ["bc"], [1]).text == "a"


def test_flush_releases_a_held_stop_prefix(tokenizer, detok):
    ids = tokenizer.encode("Say Hel", add_special_tokens=False)
    checker = StopStringChecker(detok, ["Hello"])
    assert checker.process(ids).release_ids == ids[:1] and checker.num_held == len(ids) - 1
    assert checker.flush() == ids[1:] and checker.flush() == []
    with pytest.raises(RuntimeError):
        checker.process(ids)


def test_no_stop_strings_release_everything(tokenizer, detok):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    checker = StopStringChecker(detok, ["", ""])
    assert checker.stops == ()
    assert checker.process(ids) == StopResult(ids, 0, False)


def test_process_after_stop_raises(tokenizer, detok):
    checker = StopStringChecker(detok, ["lo"])
    assert checker.process(tokenizer.encode(" Hello", add_special_tokens=False)).stopped
    with pytest.raises(RuntimeError):
        checker.process([1])


def test_apply_trim():
    assert apply_trim("abc", 0) == "abc"
    assert apply_trim("abc", 2) == "a"
    assert apply_trim("abc", 5) == ""
    with pytest.raises(ValueError):
        apply_trim("abc", -1)


ALPHABET = "ab 好🫠𝔘\n"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(ALPHABET, min_size=1, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=10),
    specials=st.lists(st.integers(0, 40), max_size=3),
)
def test_property_random_text_and_stops(tokenizer, detok, text, stops, chunks, specials):
    ids = tokenizer.encode(text, add_special_tokens=False)
    for pos in specials:  # special tokens anywhere, even inside a split character
        ids.insert(pos % (len(ids) + 1), IM_END)
    check(tokenizer, detok, ids, stops, chunks)
    check(tokenizer, detok, ids, stops, [1])


def logprob_ids(detok, ids: list[int], stops: list[str]) -> tuple[str, list[int], list[int]]:
    """(returned text, released ids, ids with a logprobs entry) of ``ids`` fed one per step
    through the checker and ``text_outputs``, as the generator sends each step's ids."""
    checker = StopStringChecker(detok, stops)
    text, released, entered = "", [], []

    def respond(new: list[int], reason: str, trim: int) -> None:
        nonlocal text
        lps = ([-1.0] * len(new), [], [])
        out = text_outputs(detok, new, released[-PREFIX_WINDOW:], reason, trim, logprobs=lps)
        entries = json.loads(out.logprobs_json or "[]")
        assert [bytes(e["bytes"]) for e in entries] == [
            detok.logprob_token_bytes(i) for i in new[: len(entries)]
        ]
        text += out.text
        released.extend(new)
        entered.extend(new[: len(entries)])

    for token in ids:
        result = checker.process([token])
        respond(result.release_ids, "stop" if result.stopped else "", result.trim_chars)
        if result.stopped:
            return text, released, entered
    respond(checker.flush(), "length", 0)
    return text, released, entered


@pytest.mark.parametrize("text", [*TEXTS[:4], "ab🫠cd", "x \u2014y"])
def test_logprobs_end_with_the_text_a_stop_string_cut(tokenizer, detok, text):
    """Every stop string that starts at each character: the ids whose bytes start before the
    returned text's end keep their entries (one straddling the cut too), the later ones none;
    every released id still counts."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    straddled = dropped = 0
    for start in range(len(text)):
        for length in (1, 3):
            stop = text[start : start + length]
            out, released, entered = logprob_ids(detok, ids, [stop])
            assert out == text[: text.index(stop)]
            end = len(out.encode())
            offsets = [len(detok.token_bytes(released[:k])) for k in range(len(released))]
            before = [at < end for at in offsets]  # the id's bytes start before the cut
            assert entered == [i for i, b in zip(released, before, strict=True) if b], stop
            straddled += end < len(detok.token_bytes(entered))
            dropped += len(released) - len(entered)
    assert straddled and dropped  # both cases occur


def test_logprobs_leave_out_a_stop_token_without_text(tokenizer, detok):
    """The special id that stopped a choice (EOS) is no part of its text: no entry; a stop id
    with text, and a special id that ends a choice for another reason, keep theirs."""
    ids = tokenizer.encode("Hello.", add_special_tokens=False)
    lps = ([-1.0] * (len(ids) + 1), [], [])

    def entries(new: list[int], reason: str) -> list[bytes]:
        out = text_outputs(detok, new, [], reason, logprobs=(lps[0][: len(new)], [], []))
        return [bytes(e["bytes"]) for e in json.loads(out.logprobs_json)]

    texts = [detok.token_bytes([i]) for i in ids]
    assert entries([*ids, IM_END], "stop") == texts
    assert entries(ids, "stop") == texts  # the last id ("." as a stop id) is text
    assert entries([*ids, IM_END], "length") == [*texts, b"<|im_end|>"]
    assert entries([IM_END], "stop") == []
