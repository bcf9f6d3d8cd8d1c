"""`load_tokenizer`: a checkpoint's Hugging Face tokenizer without importing torch.

``AutoTokenizer`` resolves the tokenizer class through ``AutoConfig``, and transformers'
configuration module imports torch (about 2 s and 150-200 MB per process). The tokenizer and
detokenizer stubs need neither torch nor a model config: they only need the class that the
checkpoint's ``tokenizer_config.json`` names (``tokenizer_class``), which transformers exports
by that name (``Qwen2Tokenizer``, ``TokenizersBackend``, ``LlamaTokenizerFast``, ...). This
loads that class directly, the same ``from_pretrained`` call ``AutoTokenizer`` makes once it has
found it, and falls back to ``AutoTokenizer`` when the config names no class, or one that
transformers does not export (a custom class, ``trust_remote_code``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tokenizer_class_name(model_dir: str | Path) -> str | None:
    """The ``tokenizer_class`` of ``model_dir``'s ``tokenizer_config.json``, or None when the
    file or the key is missing (or unreadable)."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name else None


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a local checkpoint directory, as ``AutoTokenizer.from_pretrained``
    loads it, without importing torch when the class is one transformers exports.

    Raises:
        OSError / ValueError: as ``from_pretrained`` does (no tokenizer files, a broken file).
    """
    import transformers

    name = tokenizer_class_name(model_dir)
    cls = getattr(transformers, name, None) if name is not None else None
    if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
        return cls.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


__all__ = ["load_tokenizer", "tokenizer_class_name"]
