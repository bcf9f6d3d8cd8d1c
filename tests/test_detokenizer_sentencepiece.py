"""The stateless detokenizer on SentencePiece-style tokenizers: deltas add up to ``decode``.

Two tokenizers are trained offline with the ``tokenizers`` library on a small corpus:

- ``metaspace``: BPE with a ``Metaspace`` pre-tokenizer and decoder (``▁`` for spaces; the
  decoder drops every ``▁`` of the text's first token);
- ``llama``: Llama 2's layout: the normalizer prepends ``▁`` and turns spaces into it, BPE with
  ``byte_fallback`` (``<0x00>`` .. ``<0xFF>`` in the vocabulary, so characters outside it, emoji
  and CJK here, become UTF-8 bytes split over several tokens), decoder
  ``Replace(▁, " ") → ByteFallback → Fuse → Strip(" ", 1, 0)``.

Oracle: the Hugging Face tokenizer's ``decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE, WordPiece
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

from tritonllm.tokenization.detokenizer import Detokenizer

PREFIX_WINDOW = 8
SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "Hello world, this is a small corpus for a SentencePiece-style tokenizer.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "  leading and trailing spaces  , double  spaces, tabs\tand\nnew lines.",
    "Numbers 1234567 and 3.14159, dates 2024-01-31, café naïve Straße.",
    "def f(x):\n    return x ** 2  # comment",
] * 20
ASCII_TEXTS = [
    "Hello world",
    " Hello world",
    "  hello  world  ",
    "The capital of France is Paris.",
    "def f(x):\n    return x ** 2",
    "café naïve Straße 3.14159",
]
# Outside the trained alphabet: byte-fallback tokens (3- and 4-byte characters split over ids).
BYTE_TEXTS = ["你好，世界", "emoji 👩‍👩‍👧‍👦 🇯🇵 🤖!", " 🫠 melting", "日本語 and Ελληνικά"]


def _trained(pre_tokenizer, normalizer=None) -> Tokenizer:
    tok = Tokenizer(BPE(unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    alphabet = sorted(set("".join(CORPUS).replace(" ", "\u2581")) | {"\u2581"})
    trainer = BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet, limit_alphabet=200
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = _trained(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always"))
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return _wrap(tok)


def llama_tokenizer() -> PreTrainedTokenizerFast:
    normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trained = json.loads(_trained(None, normalizer).to_str())["model"]
    # Llama 2's vocabulary: the specials, then the 256 byte tokens, then the learned pieces.
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return _wrap(tok)


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def spm(request) -> tuple[PreTrainedTokenizerFast, Detokenizer]:
    tokenizer = metaspace_tokenizer() if request.param == "metaspace" else llama_tokenizer()
    return tokenizer, Detokenizer(tokenizer)


@pytest.fixture(scope="module")
def llama() -> tuple[PreTrainedTokenizerFast, Detokenizer]:
    tokenizer = llama_tokenizer()
    return tokenizer, Detokenizer(tokenizer)


def stream(detok: Detokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    """Feed ``ids`` in chunks as the generator does (up to 8 prefix ids); every delta."""
    deltas, start, i = [], 0, 0
    while start < len(ids):
        end = min(len(ids), start + chunk_sizes[i % len(chunk_sizes)])
        prefix = ids[max(0, start - PREFIX_WINDOW) : start]
        deltas.append(detok.delta(prefix, ids[start:end], final=end == len(ids)))
        start, i = end, i + 1
    return deltas


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", ASCII_TEXTS)
def test_one_id_at_a_time_keeps_every_space(spm, text):
    """Spaces inside and at the end survive, the first token's ``▁`` is dropped as decode
    drops it, whichever chunk the first token arrives in."""
    tokenizer, detok = spm
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = _decode(tokenizer, ids)
    assert expected.strip() == text.strip()
    assert "".join(stream(detok, ids, [1])) == expected
    rng = random.Random(text)
    for _ in range(20):
        chunks = [rng.randint(1, 5) for _ in range(len(ids))]
        assert "".join(stream(detok, ids, chunks)) == expected


@pytest.mark.parametrize("text", BYTE_TEXTS)
def test_characters_split_over_byte_fallback_tokens_never_show_u_fffd(llama, text):
    tokenizer, detok = llama
    ids = tokenizer.encode(text, add_special_tokens=False)
    byte_ids = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_ids) >= 3  # the test needs characters split over byte tokens
    for chunks in ([1], [2], [3, 1], [5]):
        deltas = stream(detok, ids, chunks)
        assert "".join(deltas) == _decode(tokenizer, ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_leading_special_tokens_do_not_move_the_start_rule(spm):
    """The start rule applies to the first token decode keeps, after any skipped specials."""
    tokenizer, detok = spm
    body = tokenizer.encode(" Hello  world", add_special_tokens=False)
    bos, eos = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])
    for ids in ([bos] + body, [bos, bos, eos] + body + [eos], body[:1] + [eos] + body[1:]):
        for chunk in (1, 2, 3):
            assert "".join(stream(detok, ids, [chunk])) == _decode(tokenizer, ids)


def test_unsupported_decoder_fails_to_load_with_its_name():
    tok = Tokenizer(WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="WordPiece"):
        Detokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))
    tok.decoder = decoders.Sequence([decoders.Strip(" ", 1, 0), decoders.Fuse()])
    with pytest.raises(ValueError, match="Strip"):
        Detokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=30), data=st.data())
def test_property_any_text_any_chunking_equals_decode(spm, text, data):
    tokenizer, detok = spm
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = tokenizer.convert_tokens_to_ids(SPECIALS)
    for _ in range(data.draw(st.integers(0, 3))):  # specials anywhere, as a model may emit them
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    if not ids:
        return
    chunks = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=20))
    deltas = stream(detok, ids, chunks)
    assert "".join(deltas) == _decode(tokenizer, ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_property_random_ids_equal_decode(spm, data):
    """Random vocabulary ids (no byte tokens: those can form invalid UTF-8, whose U+FFFD count
    ``ByteFallback`` decides per byte) and specials, any chunking."""
    tokenizer, detok = spm
    pieces = [i for t, i in tokenizer.get_vocab().items() if not t.startswith("<0x")]
    ids = data.draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=30))
    chunks = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=20))
    assert "".join(stream(detok, ids, chunks)) == _decode(tokenizer, ids)
