"""The inference engine: paged KV cache, radix prefix cache, continuous batching, sampling."""

from tritonllm.engine.client import EngineClient
from tritonllm.engine.engine import EngineStats, LLMEngine
from tritonllm.engine.engine_process import EngineProcess
from tritonllm.engine.engine_thread import EngineThread
from tritonllm.engine.request import RequestOutput

__all__ = [
    "EngineClient",
    "EngineProcess",
    "EngineStats",
    "EngineThread",
    "LLMEngine",
    "RequestOutput",
]
