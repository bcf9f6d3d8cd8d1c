"""Transformer building blocks shared by the decoder models."""

from tritonllm.layers.linear import Linear
from tritonllm.layers.mlp import SwiGLUMLP
from tritonllm.layers.norm import RMSNorm
from tritonllm.layers.rotary import RotaryEmbedding, rope_inv_freq

__all__ = ["Linear", "RMSNorm", "RotaryEmbedding", "SwiGLUMLP", "rope_inv_freq"]
