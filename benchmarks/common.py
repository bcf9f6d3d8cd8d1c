"""Shared pieces of the benchmarks: the workload, the default checkpoint, result tables and the
dated sections appended to BENCHMARKS.md.

The workload is the one nano-vllm's `bench.py` and mini-sglang publish (BENCHMARKS.md,
methodology): `random.seed(0)`, then every prompt's token ids, then every output length, each
length uniform in [100, 1024]. Drawing in that order is what reproduces their token totals.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "qwen3-0.6b"

# Token totals of the published workload for 256 requests (ARCHITECTURE.md, "Platform facts").
PUBLISHED_PROMPT_TOKENS = 142_827
PUBLISHED_OUTPUT_TOKENS = 133_966

BENCHMARKS_HEADER = """\
# Benchmarks

Each section below is one run, appended by `python -m benchmarks.offline` or
`python -m benchmarks.online`, with its command line, hardware, date and git commit. On the
offline GPU host (ARCHITECTURE.md, "Platform facts"): `source .devpack/activate.sh`, then both commands; building the
checkpoint there needs `qwen.tiktoken` (the `dashscope` package, or a copy of its `resources/`
folder on `PYTHONPATH` as `dashscope/resources/qwen.tiktoken`).

Methodology:

- **Checkpoint.** Qwen3-0.6B's exact shape with seeded random weights
  (`tritonllm.build_model`, shape `qwen3-0.6b`); random weights cost the same compute as real
  ones. bf16 on GPU, float32 on CPU.
- **Offline workload** (nano-vllm / mini-sglang's): `random.seed(0)`; 256 prompts of
  `randint(100, 1024)` ids drawn from `randint(0, 10000)`, then 256 output lengths
  `randint(100, 1024)`; `ignore_eos`, so every request emits exactly its output length
  (142,827 prompt and 133,966 output tokens). Temperature 0.6 like nano-vllm (sampling does not
  change the token counts). One short warm-up request, then all requests are submitted at once
  and timed to the last token (`torch.cuda.synchronize` on both ends).
- **Bandwidth bound.** Device-to-device copy bandwidth is measured in the same run (bytes read
  plus written over time, best of several). With all requests admitted at once, every decode
  step reads the weights once plus the K and V of every live sequence's cached tokens; the sum
  over the decode schedule divided by the copy bandwidth is the least time any engine can take.
  Results are reported as a fraction of that bound. Prefill is not counted (it is compute-bound).
- **Hugging Face peer.** `transformers` `generate` on the same checkpoint and device on a subset
  of the requests, as one left-padded batch that runs to the longest output length; its
  throughput counts the workload's tokens (padding and overrun excluded).
- **Online.** tritonserver + the OpenAI sidecar on local ports; closed-loop streaming chat
  clients at each concurrency level with fixed output lengths (`ignore_eos`, `max_tokens`).
  TTFT is the time to the first content chunk; TPOT is (last - first chunk) / (completion tokens
  - 1) per request; chunk ITL is the gap between content chunks (a chunk may carry several
  tokens). The offline engine runs the same prompts with the same concurrency cap in the same
  run, as the ceiling the serving path is compared with.
- **Platform ceiling** (`benchmarks/ceiling.py`, `benchmarks.online --ceiling`). A decoupled
  Python model that streams one-token responses, with the generator's tensors, from as many
  sender threads per instance as the generator has (`--ceiling-sender-threads`, default 4, the
  generator's with its engine in its own process). Runs up to 2026-12-07 09:40 UTC used one
  thread, while the generator has sent from 4 since "The fused ensemble" (2026-12-06): their
  ceilings under-measure the platform as the generator uses it. The model runs alone and inside
  an ensemble shaped like `llm` (a Python step before it and a detokenizer-like step after it,
  with the detokenizer's dynamic batching); closed-loop gRPC streams from the sidecar's client
  in several processes; responses received in a fixed window per concurrency level. The online
  table gives the generator's responses/s (`tritonllm_responses_total`) as a fraction of the
  ensemble's ceiling at the same concurrency.
"""


@dataclass(frozen=True)
class Workload:
    """A list of requests: prompt token ids and the exact number of tokens each must generate.

    Attributes:
        prompts: one list of token ids per request.
        output_lens: tokens to generate per request (with `ignore_eos`).
    """

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all requests."""
        return sum(self.output_lens)

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, n: int) -> Workload:
        """The first `n` requests."""
        return Workload(self.prompts[:n], self.output_lens[:n])


def random_workload(
    num_requests: int = 256,
    min_len: int = 100,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    max_token_id: int = 10_000,
    seed: int = 0,
    min_output_len: int | None = None,
) -> Workload:
    """The nano-vllm benchmark workload (prompt ids first, then output lengths; see module doc).

    Seeds the global `random` module, as nano-vllm does. For the defaults and 256 requests the
    totals are 142,827 prompt and 133,966 output tokens.
    """
    random.seed(seed)
    prompts = [
        [random.randint(0, max_token_id) for _ in range(random.randint(min_len, max_input_len))]
        for _ in range(num_requests)
    ]
    low = min_len if min_output_len is None else min_output_len
    output_lens = [random.randint(low, max_output_len) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


def ensure_model(model: str | None, shape: str = "qwen3-0.6b") -> Path:
    """The checkpoint to benchmark: `model` if given, else `models/<shape>`, built when missing.

    Raises:
        FileNotFoundError: `model` was given but has no config.json.
    """
    if model is not None:
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return path
    from tritonllm.build_model import build_model, is_complete_model_dir

    path = REPO_ROOT / "models" / shape
    if not is_complete_model_dir(path):
        print(f"building random-weight checkpoint {shape} into {path} ...", flush=True)
    return build_model(path, shape=shape)


def log(message: str) -> None:
    """Progress on stderr (flushed), so a run cut short still shows how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def default_device() -> str:
    """`cuda` when torch sees a GPU, else `cpu`."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU), so wall-clock timings cover it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def hardware(device: str) -> str:
    """A one-line description: the GPU name (when `device` is CUDA) and the CPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpu = f"{cpu} ({os.cpu_count()} cores)"
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        return f"{torch.cuda.get_device_name(index)}; CPU {cpu}"
    return f"CPU only; {cpu}"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def git_commit() -> str:
    """The short commit of the checkout (+ `-dirty` with local changes); `$TRITONLLM_GIT_COMMIT`
    where there is no git repository (a copied working tree); else `unknown`."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TRITONLLM_GIT_COMMIT", "unknown")


def command_line() -> str:
    """This process' command line as one would type it (`python -m benchmarks.X ...`)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def fmt(value: float | int | None, digits: int = 1) -> str:
    """A table cell: thousands separators for ints, `digits` decimals for floats, `-` for None."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_bytes(n: float, suffix: str = "B") -> str:
    """Bytes (or bytes/s with `suffix="B/s"`) in decimal units: `15.07 TB`, `1.192 GB`."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}{suffix}"
    return f"{n:.4g} {suffix}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table: the first column left-aligned (labels), the rest right-aligned."""
    align = ["---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def format_section(title: str, device: str, table: str, notes: Sequence[str] = ()) -> str:
    """A dated BENCHMARKS.md section: title, command line, hardware, date, commit, table, notes."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"## {title} ({now})",
        "",
        f"- command: `{command_line()}`",
        f"- hardware: {hardware(device)}",
        f"- date: {now}; git commit: `{git_commit()}`",
        "",
        table,
    ]
    if notes:
        parts += [""] + [f"- {n}" for n in notes]
    return "\n".join(parts) + "\n"


def append_section(section: str, path: Path | str = BENCHMARKS_MD) -> Path:
    """Append `section` to `path`, creating the file with the methodology header first."""
    path = Path(path)
    if not path.exists():
        path.write_text(BENCHMARKS_HEADER)
    with path.open("a") as f:
        f.write("\n" + section)
    return path


def argument_parser(
    description: str, engine_arg_help: str, publishes: bool = True
) -> argparse.ArgumentParser:
    """A parser with the flags the benchmarks share: model, device, attention backend, extra
    engine fields, temperature and, for a tool that ``publishes`` a BENCHMARKS.md section
    (see ``publish``), where the results go (``--no-append``, ``--benchmarks-md``)."""
    device = default_device()
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", help="HF model directory (default: build models/<--shape>)")
    p.add_argument(
        "--shape",
        default="qwen3-0.6b",
        help="without --model: the random-weight checkpoint to build (tritonllm.build_model "
        "shapes, e.g. qwen3-8b)",
    )
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default=device)
    p.add_argument(
        "--attention-backend", default="flashinfer" if device.startswith("cuda") else "torch"
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        type=field_value,
        help=engine_arg_help,
    )
    if publishes:
        p.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
        p.add_argument("--benchmarks-md", default=str(BENCHMARKS_MD))
    return p


def field_value(text: str) -> str:
    """argparse type of `--engine-arg`: `FIELD=VALUE` with a non-empty FIELD.

    Raises:
        argparse.ArgumentTypeError: no `=`, or nothing before it.
    """
    field, sep, _ = text.partition("=")
    if not sep or not field.strip():
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return text


def engine_args(args: argparse.Namespace) -> dict[str, str]:
    """The `--engine-arg FIELD=VALUE` flags as `{field: value}` (strings, as `TRITONLLM_*`)."""
    return dict(kv.split("=", 1) for kv in args.engine_arg)


def publish(title: str, table: str, notes: Sequence[str], args: argparse.Namespace) -> Path | None:
    """Print `table` and `notes`; append them as a dated section to `args.benchmarks_md`
    unless `args.no_append`. Returns the file appended to, if any."""
    print(table)
    for note in notes:
        print(f"- {note}")
    if args.no_append:
        return None
    path = append_section(format_section(title, args.device, table, notes), args.benchmarks_md)
    print(f"appended to {path}")
    return path


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0-100, linear interpolation, as numpy's default); None if empty."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
