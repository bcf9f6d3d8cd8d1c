"""Decoder-only transformer models (Qwen3, Qwen2, Llama) and their safetensors loader."""

from tritonllm.models.decoder import CausalLM
from tritonllm.models.loader import load_model, safetensors_files

__all__ = ["CausalLM", "load_model", "safetensors_files"]
