"""The offline Qwen3 tokenizer, its chat template and prompt rendering.

Oracles: Qwen3's published ids and special tokens, tiktoken itself on the same BPE ranks, the
Qwen3 chat format, and Hugging Face save/load.
"""

from __future__ import annotations

import unicodedata

import pytest
from fixtures_model import qwen3_tokenizer  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tritonllm.tokenization.chat import render_prompt, validate_messages
from tritonllm.tokenization.qwen_tokenizer import (
    QWEN3_ADDED_TOKENS,
    QWEN_PRETOKENIZE_REGEX,
    load_tiktoken_ranks,
    qwen_tiktoken_path,
    save_qwen3_tokenizer,
)

SAMPLES = [
    "Hello world",
    "你好，世界",
    "  hello  world  ",
    "Numbers 1234567 and 3.14159, dates 2024-01-31.",
    "def f(x):\n\treturn x ** 2  # comment\n\n\n",
    "Ünïcödé àccents: café, naïve, Straße, Ελληνικά, русский, العربية, हिन्दी",
    "emoji 👩‍👩‍👧‍👦 🇯🇵 🤖 and ZWJ",
    "I'm sure they'll've DONE it's 'quoted'",
    "\r\n mixed \u00a0 spaces\u3000and\ttabs   ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nreason\n</think>\n\n",
]


@pytest.fixture(scope="module")
def tiktoken_encoding():
    """tiktoken on the same ranks and pattern: the reference BPE."""
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.Encoding(
        name="qwen",
        pat_str=QWEN_PRETOKENIZE_REGEX,
        mergeable_ranks=load_tiktoken_ranks(qwen_tiktoken_path()),
        special_tokens={},
    )


def test_known_qwen_ids(qwen3_tokenizer):  # noqa: F811
    assert qwen3_tokenizer.encode("Hello world") == [9707, 1879]
    assert qwen3_tokenizer.encode("你好，世界") == [108386, 3837, 99489]


def test_added_tokens_at_qwen3_ids_with_special_flags(qwen3_tokenizer):  # noqa: F811
    decoder = qwen3_tokenizer.added_tokens_decoder
    assert len(qwen3_tokenizer) == 151669
    for offset, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        token_id = 151643 + offset
        assert decoder[token_id].content == content
        assert decoder[token_id].special is special
        assert qwen3_tokenizer.convert_tokens_to_ids(content) == token_id
    assert [c for c, _ in QWEN3_ADDED_TOKENS][-2:] == ["<think>", "</think>"]
    assert qwen3_tokenizer.eos_token == "<|im_end|>" and qwen3_tokenizer.eos_token_id == 151645
    assert qwen3_tokenizer.pad_token == "<|endoftext|>" and qwen3_tokenizer.pad_token_id == 151643
    assert qwen3_tokenizer.bos_token is None


def test_no_bos_or_eos_added(qwen3_tokenizer):  # noqa: F811
    assert qwen3_tokenizer("Hello world")["input_ids"] == [9707, 1879]


def test_special_token_text_is_one_token(qwen3_tokenizer):  # noqa: F811
    ids = qwen3_tokenizer.encode("a<|im_start|>b<think>c")
    assert 151644 in ids and 151667 in ids


@pytest.mark.parametrize("text", SAMPLES)
def test_matches_tiktoken_on_samples(qwen3_tokenizer, tiktoken_encoding, text):  # noqa: F811
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    plain = plain.replace("<think>", "").replace("</think>", "")
    plain = unicodedata.normalize("NFC", plain)  # Qwen's HF tokenizer normalizes NFC first
    assert qwen3_tokenizer.encode(plain) == tiktoken_encoding.encode_ordinary(plain)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_matches_tiktoken_on_random_text(qwen3_tokenizer, tiktoken_encoding, text):  # noqa: F811
    text = unicodedata.normalize("NFC", text)
    if any(content in text for content, _ in QWEN3_ADDED_TOKENS):
        return
    ids = qwen3_tokenizer.encode(text)
    assert ids == tiktoken_encoding.encode_ordinary(text)
    assert qwen3_tokenizer.decode(ids) == text


def test_save_and_reload_gives_same_tokenizer(qwen3_tokenizer, tmp_path):  # noqa: F811
    save_qwen3_tokenizer(qwen3_tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES:
        assert reloaded.encode(text) == qwen3_tokenizer.encode(text)
    assert reloaded.eos_token_id == 151645 and reloaded.pad_token_id == 151643
    assert sorted(reloaded.all_special_ids) == sorted(qwen3_tokenizer.all_special_ids)
    assert {i: (t.content, t.special) for i, t in reloaded.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in qwen3_tokenizer.added_tokens_decoder.items()
    }
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _chat(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_qwen3_turns(qwen3_tokenizer):  # noqa: F811
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert _chat(qwen3_tokenizer, messages) == expected
    assert _chat(qwen3_tokenizer, messages, add_generation_prompt=True) == (
        expected + "<|im_start|>assistant\n"
    )


def test_chat_template_enable_thinking_false_prefills_empty_think(qwen3_tokenizer):  # noqa: F811
    messages = [{"role": "user", "content": "Hi"}]
    text = _chat(qwen3_tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_chat_template_strips_reasoning_of_earlier_assistant_turns(qwen3_tokenizer):  # noqa: F811
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]
    assert _chat(qwen3_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_keeps_reasoning_after_last_query(qwen3_tokenizer):  # noqa: F811
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"},
    ]
    assert _chat(qwen3_tokenizer, messages) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n"
    )


def test_chat_template_groups_tool_responses(qwen3_tokenizer):  # noqa: F811
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    assert _chat(qwen3_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\ncalling<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2"
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_prompt_text_input_is_raw(qwen3_tokenizer):  # noqa: F811
    text = "  Hello world\n"
    ids = render_prompt(qwen3_tokenizer, text_input=text)
    assert ids == qwen3_tokenizer.encode(text, add_special_tokens=False)
    assert qwen3_tokenizer.decode(ids) == text
    assert render_prompt(qwen3_tokenizer, text_input="") == []


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_render_prompt_messages_use_template(qwen3_tokenizer, enable_thinking):  # noqa: F811
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "你好"}]
    ids = render_prompt(qwen3_tokenizer, messages=messages, enable_thinking=enable_thinking)
    text = _chat(
        qwen3_tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert ids == qwen3_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 151644  # <|im_start|>
    generation_prompt = qwen3_tokenizer.encode("<|im_start|>assistant\n")
    empty_think = qwen3_tokenizer.encode("<think>\n\n</think>\n\n")
    tail = generation_prompt if enable_thinking else generation_prompt + empty_think
    assert ids[-len(tail) :] == tail


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"text_input": "a", "messages": [{"role": "user", "content": "b"}]},
        {"text_input": 3},
        {"messages": []},
        {"messages": "hello"},
        {"messages": ["hello"]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "wizard", "content": "x"}]},
    ],
)
def test_render_prompt_rejects_invalid_input(qwen3_tokenizer, kwargs):  # noqa: F811
    with pytest.raises(ValueError):
        render_prompt(qwen3_tokenizer, **kwargs)


def test_validate_messages_drops_extra_keys():
    messages = [{"role": "user", "content": "x", "name": "bob"}]
    assert validate_messages(messages) == [{"role": "user", "content": "x"}]
