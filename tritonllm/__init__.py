"""tritonllm: a streaming LLM service on NVIDIA Triton Inference Server (see ARCHITECTURE.md)."""

__version__ = "0.1.0"
