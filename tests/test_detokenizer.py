"""Stateless incremental detokenization: the deltas of any chunking add up to ``decode``.

Oracle: ``tokenizer.decode(all_ids, skip_special_tokens=True)`` of the Hugging Face tokenizer
loaded from the tiny checkpoint (the one the Triton detokenizer serves).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from tritonllm.tokenization.detokenizer import Detokenizer

PREFIX_WINDOW = 8  # ids of context the generator sends with each response

TEXTS = [
    "Hello world",
    "  hello  world  ",
    "你好，世界！这是一个测试。",
    "👩‍👩‍👧‍👦 family, 🇯🇵🇫🇷 flags, 👍🏽 skin tone, 🤖",
    "café naïve Straße ÅÉÎÕÜ ñ ç Ελληνικά русский العربية हिन्दी 한국어 日本語",
    "code:\n\tdef f(x):\n\t\treturn x  # ok\n\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 ∑∫√∞ ≠ ≤",
]


@pytest.fixture(scope="module")
def detok(tokenizer) -> Detokenizer:
    return Detokenizer(tokenizer)


def stream(detok: Detokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    """Feed ``ids`` in chunks as the generator does; returns every delta."""
    deltas, start, i = [], 0, 0
    while start < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        end = min(len(ids), start + size)
        prefix = ids[max(0, start - PREFIX_WINDOW) : start]
        deltas.append(detok.delta(prefix, ids[start:end], final=end == len(ids)))
        start, i = end, i + 1
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_id_at_a_time_equals_decode_without_replacement_chars(tokenizer, detok, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(detok, ids, [1])
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunkings_equal_decode(tokenizer, detok, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(text)
    for _ in range(20):
        deltas = stream(detok, ids, [rng.randint(1, 6) for _ in range(len(ids))])
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held_back_then_flushed(tokenizer, detok):
    ids = tokenizer.encode("🫠", add_special_tokens=False)
    assert len(ids) == 3  # this emoji's 4 bytes span three byte-level tokens
    assert detok.delta([], ids[:1], final=False) == ""
    assert detok.delta(ids[:1], ids[1:2], final=False) == ""
    assert detok.delta(ids[:2], ids[2:], final=True) == "🫠"
    # A stream that stops mid-character flushes a replacement char, as decode() does.
    assert detok.delta([], ids[:1], final=True) == tokenizer.decode(ids[:1]) == "\ufffd"


def test_special_tokens_are_skipped(tokenizer, detok):
    text = "<|im_start|>assistant\nHi<think>x</think><|im_end|><|endoftext|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == "assistant\nHi<think>x</think>"  # think tags are not special in Qwen3
    assert "".join(stream(detok, ids, [1])) == expected


def test_character_split_around_special_tokens(tokenizer, detok):
    first, *rest = tokenizer.encode("🫠", add_special_tokens=False)
    ids = [first] + [151645] * 5 + rest  # up to 5 empty ids inside a character are covered
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == "🫠"
    for chunk in (1, 2, 3):
        assert "".join(stream(detok, ids, [chunk])) == expected


def test_ids_beyond_tokenizer_decode_to_nothing(tokenizer, detok):
    ids = [9707, len(tokenizer), 151935, 1879]  # model vocab 151936 > tokenizer 151669
    assert detok.delta([], ids, final=True) == tokenizer.decode(ids, skip_special_tokens=True)


def test_batch_delta_matches_delta(tokenizer, detok):
    ids = tokenizer.encode("你好 🤖 world", add_special_tokens=False)
    items = [(ids[:i], ids[i : i + 1], i == len(ids) - 1) for i in range(len(ids))]
    assert detok.batch_delta(items) == [detok.delta(*item) for item in items]


def test_rejects_tokenizer_without_a_supported_decoder():
    backend = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="decoder 'none' is not supported"):
        Detokenizer(PreTrainedTokenizerFast(tokenizer_object=backend))


@st.composite
def ids_and_chunks(draw, vocab_size: int, special_ids: list[int]):
    token = st.one_of(st.integers(0, vocab_size - 1), st.sampled_from(special_ids))
    ids = draw(st.lists(token, min_size=1, max_size=40))
    chunks = draw(st.lists(st.integers(1, 8), min_size=1, max_size=40))
    return ids, chunks


def _max_run(ids: list[int], empty: set[int]) -> int:
    run = best = 0
    for i in ids:
        run = run + 1 if i in empty else 0
        best = max(best, run)
    return best


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_property_any_ids_any_chunking_equal_decode(tokenizer, detok, data):
    specials = sorted(tokenizer.added_tokens_decoder)
    ids, chunks = data.draw(ids_and_chunks(len(tokenizer), specials))
    # Documented limit: 6+ empty (special) ids in a row can push a split character's first
    # bytes out of the 8-id prefix window.
    empty = {i for i in specials if tokenizer.added_tokens_decoder[i].special}
    if _max_run(ids, empty) >= 6:
        return
    deltas = stream(detok, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=40), data=st.data())
def test_property_valid_text_never_yields_replacement_chars(tokenizer, detok, text, data):
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=20))
    deltas = stream(detok, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)
