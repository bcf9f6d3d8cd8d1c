"""The Hugging Face fast tokenizer of a GGUF file, with llama.cpp's pre-tokenizer.

transformers reads a GGUF file's vocabulary, merges, special tokens and chat template
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), but always builds GPT-2's byte-level
pre-tokenizer. llama.cpp picks the pre-tokenizer by the file's ``tokenizer.ggml.pre`` key
instead; for SmolLM2 (``smollm``) it first isolates every digit (``\\p{N}``) and only then applies
GPT-2's pattern (``llama-vocab.cpp``, the regex list of ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``), as
SmolLM2's own ``tokenizer.json`` does with a ``Digits(individual_digits=True)`` step before
``ByteLevel``. Without it, whitespace runs before digits group differently (``"\\n\\n1."``: GPT-2
alone splits the two newlines apart, llama.cpp keeps them one token), so prompts such as numbered
lists would not be the ids the model was trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import pre_tokenizers

GGUF_PRE_KEY = "tokenizer.ggml.pre"


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# llama.cpp pre-tokenizer name -> the equivalent `tokenizers` pre-tokenizer. Others are refused
# rather than silently tokenized with GPT-2's rule.
GGUF_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt2": _gpt2,
    "smollm": _digits_then_gpt2,
}


def gguf_string_field(gguf_path: str | Path, key: str) -> str | None:
    """The string metadata value ``key`` of a GGUF file (None when absent).

    Raises:
        ValueError: the value is not a string.
    """
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if not isinstance(value, str):
        raise ValueError(f"GGUF key {key!r} of {gguf_path} is not a string: {value!r}")
    return value


def load_gguf_tokenizer(gguf_path: str | Path, model_max_length: int | None = None) -> Any:
    """The fast tokenizer stored in ``gguf_path``, with the pre-tokenizer llama.cpp uses for it.

    Args:
        gguf_path: a ``.gguf`` file with a ``gpt2`` (byte-level BPE) tokenizer.
        model_max_length: the context length to record (None: leave transformers' value).
    Returns:
        A ``transformers`` fast tokenizer (chat template, special tokens and ids as in the file).
    Raises:
        ValueError: the file's ``tokenizer.ggml.pre`` is not one of ``GGUF_PRE_TOKENIZERS``.
    """
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    pre = gguf_string_field(path, GGUF_PRE_KEY) or "gpt2"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"{path.name}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})"
        )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.backend_tokenizer.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    if model_max_length is not None:
        tokenizer.model_max_length = model_max_length
    return tokenizer
