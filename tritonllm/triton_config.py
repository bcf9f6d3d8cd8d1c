"""Configuration of the Triton models, from config.pbtxt parameters and ``TRITONLLM_*`` variables.

This is the one place where the Triton model repository reads its settings. Every engine knob
is a field of ``EngineConfig``; each can be set by the environment variable
``TRITONLLM_<FIELD>`` or by the config.pbtxt parameter ``<field>`` (the environment wins, so
``make serve``, the tests and the docker image can override the repository without editing it):

=====================================  ===================================================
``TRITONLLM_MODEL`` / ``model``        served Hugging Face directory (weights + tokenizer);
                                       relative paths are relative to the project root;
                                       default ``models/smollm2-135m-instruct`` (converted by
                                       the first ``make serve`` or ``make default-model``)
``TRITONLLM_DEVICE`` / ``device``      ``cpu``, ``cuda`` or ``cuda:N``; default ``cuda`` when
                                       torch sees a GPU, else ``cpu``
``TRITONLLM_DTYPE``                    ``float32`` | ``bfloat16`` | ``float16``; default by device
``TRITONLLM_PAGE_SIZE``                tokens per KV page (16 on CPU, 64 on CUDA)
``TRITONLLM_NUM_PAGES``                KV pages in the pool (default: derived by the engine)
``TRITONLLM_MAX_RUNNING_REQUESTS``     most requests in one batch
``TRITONLLM_MAX_PREFILL_TOKENS``       per-step token budget of a prefill batch
``TRITONLLM_PREFILL_DELAY_STEPS``      most decode steps new requests wait to share a prefill
                                       step (0 on CPU, 8 on CUDA; ``engine/scheduler.py``)
``TRITONLLM_MIXED_STEPS``              ``true``/``false``: decoding requests ride along in
                                       prefill steps (default true; ``engine/scheduler.py``)
``TRITONLLM_ENABLE_PREFIX_CACHE``      ``true``/``false``: radix prefix cache
``TRITONLLM_ATTENTION_BACKEND``        ``auto`` (default) | ``torch`` | ``flashinfer`` | ``triton``
``TRITONLLM_MAX_MODEL_LEN``            prompt + output limit in tokens (default: the model's)
``TRITONLLM_SEED``                     sampler seed for requests without their own
``TRITONLLM_GPU_MEMORY_UTILIZATION``   fraction of free GPU memory for the KV pool
``TRITONLLM_CUDA_GRAPH``               ``true``/``false``: CUDA-graph decode (default: by device)
``TRITONLLM_CUDA_GRAPH_MAX_BS``        largest decode batch captured as a CUDA graph
``TRITONLLM_OVERLAP_SCHEDULE``         ``true``/``false``: overlap scheduling (default: by device)
``TRITONLLM_METRICS_INTERVAL_MS``      generator: most ms between custom-metric updates (50)
``TRITONLLM_MAX_RESPONSES_PER_S``      generator: response budget shared by all streaming
                                       requests (by all instances: each paces its share);
                                       under load several tokens go per response
                                       (``serving/pacer.py``: a response through ``llm``
                                       costs 2.5, one through ``llm_fused`` 1); 0 disables
                                       pacing (default 5000: BENCHMARKS.md, "The fused
                                       ensemble")
``TRITONLLM_SENDER_THREADS``           generator: threads sending responses at once, each
                                       request from one of them (4 with the engine in its own
                                       process, 1 with the engine on the stub's thread)
``TRITONLLM_MAX_WAITING_REQUESTS``     generator: requests that may wait beyond the
                                       ``max_running_requests`` running ones; more get
                                       ``server_overloaded`` (the sidecar's 429) (256)
``TRITONLLM_CONTROL_SECRET``           the secret an abort control request must carry (the
                                       launcher generates one per start); environment only,
                                       never a parameter (the model config is readable
                                       through Triton's model-config API); unset: aborts are
                                       not authenticated
``TRITONLLM_ENGINE_PROCESS``           generator: ``true``: run the engine in its own process
                                       (``engine/engine_process.py``: a GIL of its own),
                                       ``false``: on a thread of the Python stub; default: a
                                       process when the device is CUDA, else the thread
``TRITONLLM_FUSED_LAYERS``             ``true``/``false``: the layers' Triton kernels on CUDA
                                       (default true; ``layers/fused.py``)
``TRITONLLM_LINEAR_KERNEL``            GEMMs of <= 256 rows on CUDA: ``cublas`` (default),
                                       ``auto``, ``triton`` (``layers/linear.py``)
``TRITONLLM_PDL``                      ``true``/``false``: programmatic dependent launch of the
                                       Triton kernels on sm_90+ (default true;
                                       ``kernels/pdl.py``)
``TRITONLLM_TENSOR_CORE_DECODE_MIN_BATCH``
                                       FlashInfer decode batches of at least this many
                                       sequences use its tensor-core kernels (64)
``TRITONLLM_GRAMMAR_THREADS``          structured outputs: threads that fill token masks
                                       (default: 80% of the cores, as llguidance's own)
``TRITONLLM_GRAMMAR_BACKEND``          structured outputs: ``auto`` (default: xgrammar fills
                                       the masks of JSON schemas of its subset, llguidance
                                       all others) or ``llguidance`` (all)
``TRITONLLM_DEFER_GRAMMAR_SAMPLING``   ``true``/``false``: a grammar step's masks fill while
                                       the engine builds the next step (default true;
                                       ``engine/model_runner.py``)
``TRITONLLM_GRAMMAR_COMPILE_TIMEOUT_S``
                                       structured outputs: most seconds a request waits for
                                       its grammar to compile; then it fails and the
                                       compiler restarts (default 60)
``TRITONLLM_ENGINE_PROFILE``           diagnostics: a file path; the engine process runs its
                                       loop under cProfile and writes the stats there every
                                       10 s and at exit (``engine/engine_process.py``)
``TRITONLLM_TENSOR_PARALLEL_SIZE``     ranks the model is split across (default 1): one
                                       process per rank, on GPUs ``device``, ``device + 1``,
                                       ... (NCCL) or all on the CPU (gloo); always runs the
                                       engine in processes (``tritonllm/distributed/``)
=====================================  ===================================================

Any other ``EngineConfig`` field is read the same way (``TRITONLLM_`` + its upper-case name).
Empty values count as unset; ``none`` sets an optional field to None. No other module of the
engine reads the environment: every setting reaches its user as a constructor argument.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from tritonllm.default_model import BUILD_HINT, DEFAULT_MODEL_DIR, DEFAULT_MODEL_RELPATH
from tritonllm.triton_server import REPO_ROOT

ENV_PREFIX = "TRITONLLM_"
CONTROL_SECRET_ENV = ENV_PREFIX + "CONTROL_SECRET"
DEFAULT_MODEL = DEFAULT_MODEL_RELPATH


@dataclass(frozen=True)
class ServingConfig:
    """Knobs of the Triton generator's response path (not of the engine).

    Attributes:
        metrics_interval_s: most seconds between two updates of the ``tritonllm_*`` metrics
            while requests run (they are also updated at once after a request finishes).
        max_responses_per_s: response budget of ``tritonllm.serving.pacer.ResponsePacer``
            (responses/s over all streaming requests, in its cost units: a response that a
            detokenizer step follows, through ``llm``, costs ``DETOKENIZED_RESPONSE_COST`` = 2.5,
            one the generator answers as text, through ``llm_fused``, 1; 0 disables pacing).
            The default, 5000, is 5,000 responses/s through ``llm_fused`` and 2,000 through
            ``llm``: a higher budget sends more responses than the path after the generator
            carries, and the queue that then forms after the generator costs throughput and
            TTFT (BENCHMARKS.md, "Response budget" and "The fused ensemble").
        sender_threads: threads of the generator that send responses at once (each request
            always from the same one; ``serving.response_streamer``); None: ``senders``'
            default.
        engine_process: run the engine in a child process (``EngineProcess``) rather than on a
            thread of the generator's Python stub (``EngineThread``); None: a process when the
            engine's device is CUDA (the stub's GIL bounds a fast GPU engine, ARCHITECTURE.md
            "Platform facts"), the thread otherwise; a tensor-parallel engine always runs in
            processes. See ``use_engine_process``.
        max_waiting_requests: sequences (choices: a request of n counts n) that may wait for
            admission beyond the engine's ``max_running_requests``; a request that finds both
            full is refused (``server_overloaded``).
        control_secret: what the generator's abort control requests must carry and what the
            models' own aborts send (None: aborts are not authenticated).
    """

    metrics_interval_s: float = 0.05
    max_responses_per_s: float = 5000.0
    engine_process: bool | None = None
    sender_threads: int | None = None
    max_waiting_requests: int = 256
    control_secret: str | None = dataclass_field(default=None, repr=False)

    def senders(self, own_process: bool) -> int:
        """The generator's sender threads: ``sender_threads``, else 4 when the engine runs in
        its own process (a send waits for tritonserver without the GIL, so sends from several
        threads overlap: BENCHMARKS.md "The fused ensemble") and 1 when it runs on a thread of
        the stub (more threads would take the GIL from the engine's own thread)."""
        if self.sender_threads is not None:
            return self.sender_threads
        return 4 if own_process else 1

    def use_engine_process(
        self, device: str, tensor_parallel_size: int = 1, instances: int = 1
    ) -> bool:
        """Whether the generator runs an engine on ``device`` (``cpu``, ``cuda``, ``cuda:N``)
        split across ``tensor_parallel_size`` ranks in its own process (always, for more than
        one rank: each rank is a process; and for more than one generator instance: they share
        it, ``serving.shared_engine``).

        Raises:
            ValueError: ``engine_process`` false with more than one rank or instance.
        """
        if instances > 1:
            if self.engine_process is False:
                raise ValueError(
                    f"engine_process=false cannot serve {instances} generator instances (they"
                    " share one engine process; set instance_group count to 1 or engine_process"
                    " to true)"
                )
            return True
        if tensor_parallel_size > 1:
            if self.engine_process is False:
                raise ValueError(
                    f"engine_process=false cannot run tensor_parallel_size={tensor_parallel_size}"
                    " (each tensor-parallel rank is a process)"
                )
            return True
        if self.engine_process is None:
            return device.split(":")[0] == "cuda"
        return self.engine_process


def instance_count(model_config: str | Mapping[str, Any]) -> int:
    """The instances Triton runs of a model: the sum of its ``instance_group`` counts (JSON, as
    Triton hands ``args["model_config"]`` to a Python model, or the parsed dict); 1 without
    any."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    groups = config.get("instance_group") or []
    return max(1, sum(int(group.get("count", 1)) for group in groups))


def model_parameters(model_config: str | Mapping[str, Any]) -> dict[str, str]:
    """The ``parameters`` of a Triton model config as plain ``{key: string_value}``.

    Args:
        model_config: ``args["model_config"]`` of a Python model's ``initialize`` (a JSON
            string) or the parsed dict.
    """
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    params = config.get("parameters") or {}
    return {key: str(value.get("string_value", "")) for key, value in params.items()}


def _setting(name: str, params: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """The raw value of setting ``name``: env ``TRITONLLM_<NAME>``, else parameter ``name``."""
    for value in (env.get(ENV_PREFIX + name.upper()), params.get(name)):
        if value is not None and value.strip() != "":
            return value.strip()
    return None


def resolve_model_path(
    params: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """The served model directory: ``TRITONLLM_MODEL``, parameter ``model``, or the default.

    Relative paths are taken relative to the project root (``REPO_ROOT``), not to the working
    directory of tritonserver. The directory is not checked here.
    """
    env = os.environ if env is None else env
    path = Path(_setting("model", params or {}, env) or DEFAULT_MODEL).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def served_model_dir(
    params: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """``resolve_model_path``, checked: the directory the Triton models load at start-up.

    Raises:
        FileNotFoundError: the directory does not exist; for the built-in default, the message
            says how to build it.
    """
    path = resolve_model_path(params, env)
    if path.is_dir():
        return path
    if path == DEFAULT_MODEL_DIR:
        raise FileNotFoundError(
            f"the built-in default model {path} has not been built yet: {BUILD_HINT}"
        )
    raise FileNotFoundError(
        f"model directory {path} does not exist (set {ENV_PREFIX}MODEL or the config.pbtxt "
        "parameter 'model' to a Hugging Face model directory)"
    )


def _parse(text: str, annotation: str, name: str) -> Any:
    """Convert a setting's text by its dataclass annotation (``int``, ``float | None``, ...)."""
    if "None" in annotation and text.lower() == "none":
        return None
    try:
        if "bool" in annotation:
            lowered = text.lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(text)
            return lowered in ("1", "true", "yes", "on")
        if "int" in annotation:
            return int(text)
        if "float" in annotation:
            return float(text)
    except ValueError:
        raise ValueError(
            f"setting {name!r} (env {ENV_PREFIX}{name.upper()}): bad value {text!r}"
        ) from None
    return text


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(
    params: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    default_device: str | None = None,
) -> Any:
    """Build the ``EngineConfig`` of the served model from parameters and the environment.

    Args:
        params: config.pbtxt parameters (see ``model_parameters``).
        env: environment (default ``os.environ``).
        default_device: the device when none is set; None: "cuda" when torch sees a GPU, else
            "cpu" (this imports torch: the tokenizer stub, which only reads the context
            length, passes "cpu" instead).
    Returns:
        ``tritonllm.config.EngineConfig``.
    Raises:
        ValueError: a setting that does not parse, or that ``EngineConfig`` rejects.
    """
    from tritonllm.config import EngineConfig

    params = params or {}
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {"model": str(resolve_model_path(params, env))}
    for field in fields(EngineConfig):
        if field.name == "model":
            continue
        text = _setting(field.name, params, env)
        if text is not None:
            # A field that defaults to None (derived when unset) takes "none" too.
            annotation = str(field.type) + (" | None" if field.default is None else "")
            kwargs[field.name] = _parse(text, annotation, field.name)
        elif field.name == "device":
            kwargs["device"] = default_device or _default_device()
    return EngineConfig(**kwargs)


def serving_config(
    params: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
) -> ServingConfig:
    """The generator's ``ServingConfig`` (``TRITONLLM_METRICS_INTERVAL_MS``,
    ``TRITONLLM_MAX_RESPONSES_PER_S``, ``TRITONLLM_ENGINE_PROCESS``,
    ``TRITONLLM_SENDER_THREADS``, ``TRITONLLM_MAX_WAITING_REQUESTS``; ``TRITONLLM_CONTROL_SECRET``
    from the environment only).

    Raises:
        ValueError: a value that is not a number (a boolean for ``engine_process``), or
            ``sender_threads`` < 1.
    """
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    interval = _setting("metrics_interval_ms", params or {}, env)
    if interval is not None:
        kwargs["metrics_interval_s"] = _parse(interval, "float", "metrics_interval_ms") / 1e3
    budget = _setting("max_responses_per_s", params or {}, env)
    if budget is not None:
        kwargs["max_responses_per_s"] = _parse(budget, "float", "max_responses_per_s")
    threads = _setting("sender_threads", params or {}, env)
    if threads is not None:
        kwargs["sender_threads"] = _parse(threads, "int", "sender_threads")
        if kwargs["sender_threads"] < 1:
            raise ValueError(f"setting 'sender_threads' must be >= 1, got {threads!r}")
    process = _setting("engine_process", params or {}, env)
    if process is not None:
        kwargs["engine_process"] = _parse(process, "bool | None", "engine_process")
    waiting = _setting("max_waiting_requests", params or {}, env)
    if waiting is not None:
        kwargs["max_waiting_requests"] = _parse(waiting, "int", "max_waiting_requests")
    secret = env.get(CONTROL_SECRET_ENV, "").strip()
    if secret:
        kwargs["control_secret"] = secret
    return ServingConfig(**kwargs)
