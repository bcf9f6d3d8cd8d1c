"""Build a Qwen3-compatible Hugging Face fast tokenizer offline, from ``qwen.tiktoken``.

The ``dashscope`` wheel ships ``dashscope/resources/qwen.tiktoken``: the 151,643 byte-level BPE
ranks (``base64(token_bytes) rank`` per line) that Qwen2/Qwen3 tokenizers are built from. This
module turns them into a ``tokenizers`` BPE model with Qwen2's pipeline (NFC normalizer, Qwen's
pre-tokenizer regex, GPT-2 byte-level alphabet), registers Qwen3's 26 added tokens at their exact
ids 151643..151668 and wraps it as a ``transformers`` fast tokenizer with a Qwen3 chat template.

BPE merges are recovered from the ranks the way tiktoken applies them: the merge that creates a
token is the last step of byte-pair merging its own bytes with only lower-ranked tokens allowed
(the reconstruction described in tiktoken's ``educational`` module). One merge per token, at the
token's rank, so Hugging Face's merge-priority BPE reproduces tiktoken's rank-priority BPE.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tritonllm.tokenization.chat import QWEN3_CHAT_TEMPLATE

# Qwen2/Qwen3 pre-tokenizer pattern (digits split one by one, unlike GPT-4's \p{N}{1,3}).
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order from 151643, with their `special` flag (tokenizer_config.json).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_EOS_TOKEN = "<|im_end|>"
QWEN3_PAD_TOKEN = "<|endoftext|>"
QWEN3_EOS_TOKEN_ID = 151645
QWEN3_PAD_TOKEN_ID = 151643
QWEN3_MODEL_MAX_LENGTH = 131072


def qwen_tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken``: ``$TRITONLLM_QWEN_TIKTOKEN`` if set, else the copy inside the
    installed ``dashscope`` package (hosts without dashscope, e.g. an offline GPU host, can carry
    the file and point the variable at it).

    Raises:
        FileNotFoundError: dashscope is not installed or lacks the file
            (``pip install dashscope``, the ``build`` extra of this project).
    """
    override = os.environ.get("TRITONLLM_QWEN_TIKTOKEN")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "qwen.tiktoken ships in the 'dashscope' wheel: pip install dashscope"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("dashscope is installed but has no resources/qwen.tiktoken")


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one ``base64(token bytes) rank`` pair per line.

    Raises:
        ValueError: a line is malformed or the ranks are not exactly 0..n-1.
    """
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if not line:
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"malformed tiktoken line {line[:60]!r} in {path}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"ranks in {path} are not a permutation of 0..{len(ranks) - 1}")
    return ranks


def _byte_pair_merge(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's BPE of ``token``: merge the lowest-ranked adjacent pair while its rank < max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One BPE merge per multi-byte token, in rank order (see the module docstring).

    Raises:
        ValueError: a token cannot be built from two lower-ranked tokens (not a BPE vocabulary).
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        # Fast path: when a single split has both halves in the vocabulary, it must be the merge.
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        if len(splits) != 1:
            parts = _byte_pair_merge(token, ranks, rank)
            if len(parts) != 2:
                raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two tokens")
            splits = [(parts[0], parts[1])]
        merges.append(splits[0])
    return merges


def build_backend_tokenizer(tiktoken_path: str | Path | None = None) -> Tokenizer:
    """The raw ``tokenizers.Tokenizer``: Qwen2's BPE pipeline plus Qwen3's 26 added tokens.

    Ids 0..151642 are the BPE ranks; ids 151643..151668 are ``QWEN3_ADDED_TOKENS`` in order.
    """
    ranks = load_tiktoken_ranks(tiktoken_path or qwen_tiktoken_path())
    byte_encoder = bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(byte_encoder[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = [(to_unicode(left), to_unicode(right)) for left, right in recover_merges(ranks)]
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    if len(vocab) != QWEN3_FIRST_ADDED_ID:
        raise ValueError(f"expected {QWEN3_FIRST_ADDED_ID} BPE ranks, got {len(vocab)}")
    # Added one at a time, in order, so each lands at the next free id.
    for content, special in QWEN3_ADDED_TOKENS:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        if backend.token_to_id(content) != QWEN3_FIRST_ADDED_ID + offset:
            raise ValueError(
                f"added token {content} did not land at id {QWEN3_FIRST_ADDED_ID + offset}"
            )
    return backend


@lru_cache(maxsize=2)
def _cached_backend(tiktoken_path: str) -> Tokenizer:
    return build_backend_tokenizer(tiktoken_path)


def build_qwen3_tokenizer(tiktoken_path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A Qwen3-compatible fast tokenizer, built offline (a few seconds; the BPE is cached).

    eos ``<|im_end|>`` (151645), pad ``<|endoftext|>`` (151643), no bos, no unk, Qwen3's chat
    template (``enable_thinking`` supported). ``save_pretrained`` writes a directory that
    ``AutoTokenizer.from_pretrained`` reloads offline.

    Raises:
        FileNotFoundError: no ``qwen.tiktoken`` (see ``qwen_tiktoken_path``).
    """
    path = str(Path(tiktoken_path) if tiktoken_path else qwen_tiktoken_path())
    specials = [content for content, special in QWEN3_ADDED_TOKENS if special]
    return PreTrainedTokenizerFast(
        tokenizer_object=_cached_backend(path),
        eos_token=QWEN3_EOS_TOKEN,
        pad_token=QWEN3_PAD_TOKEN,
        additional_special_tokens=[
            t for t in specials if t not in (QWEN3_EOS_TOKEN, QWEN3_PAD_TOKEN)
        ],
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=QWEN3_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


def save_qwen3_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer files like Qwen3's: ``tokenizer.json`` + ``tokenizer_config.json``.

    The config names ``Qwen2Tokenizer`` (what Qwen3 checkpoints use), so ``AutoTokenizer`` loads
    it with Qwen2's pipeline in any transformers >= 4.51, and lists ``added_tokens_decoder``.
    """
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(
        tokenizer_class="Qwen2Tokenizer",
        bos_token=None,
        unk_token=None,
        errors="replace",
        # transformers 4.x name of extra_special_tokens
        additional_special_tokens=config.get("extra_special_tokens"),
        added_tokens_decoder={
            str(QWEN3_FIRST_ADDED_ID + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
        },
    )
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
