"""One decoder-only transformer for Qwen3, Qwen2 and Llama.

The three differ only in config-driven details: Qwen3 applies a per-head RMSNorm to q and k
before RoPE, Qwen2 has q/k/v biases, Llama may use Llama 3 RoPE frequency scaling. Module
names mirror Hugging Face's (`model.layers.N.self_attn...`), so the loader only has to fuse
q/k/v and gate/up.

With a tensor-parallel group (`tp`) each rank builds its shard of the model
(`distributed.ModelShard`): its attention heads and MLP columns (column-parallel q/k/v and
gate/up, row-parallel o and down, `layers.parallel`), a vocabulary-parallel embedding and LM
head. Without one (size 1) the layers are the plain single-device ones.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.attention.base import AttentionBackend, AttentionMetadata
from tritonllm.config import ModelConfig
from tritonllm.distributed import ModelShard, TensorParallelGroup
from tritonllm.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLUMLP
from tritonllm.layers.fused import LayerKernels
from tritonllm.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding


class BackendRef:
    """Shared, late-bound handle to the attention backend (the KV cache is sized after the
    weights are loaded, so the backend exists only after the model)."""

    backend: AttentionBackend | None = None


class Attention(nn.Module):
    """Fused qkv projection, optional q/k norm, RoPE, paged attention, output projection.

    With `tp`, the heads of `shard` only (`cfg` stays the full model's shape): qkv_proj holds
    their rows, o_proj their columns (row-parallel: one all-reduce).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        backend_ref: BackendRef,
        kernels: LayerKernels,
        tp: TensorParallelGroup | None = None,
        shard: ModelShard | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        local = cfg if shard is None else shard.local_config(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            local.num_heads,
            local.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        mode = kernels.linear_mode
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, mode=mode
        )
        self.o_proj: Linear
        if tp is None:
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, mode=mode)
        else:
            self.o_proj = RowParallelLinear(
                self.q_size, cfg.hidden_size, cfg.o_proj_bias, tp, mode=mode
            )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels.fused)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels.fused)
        self._rotary = [rotary]  # a list, so the shared module is not registered per layer
        self._backend_ref = backend_ref

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions `[T]` int64, hidden `[T, hidden_size]` → `[T, hidden_size]`."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # Qwen3's q/k norms run inside the rotary layer: one kernel for both on CUDA, which
        # also stores the new K/V into the cache when the backend allows it.
        backend = self._backend_ref.backend
        if backend is None:
            raise RuntimeError("CausalLM.set_attention_backend() must be called first")
        target = backend.fused_kv_store_target(self.layer_id)
        stored = False
        if target is None:
            q, k = self._rotary[0](positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k, stored = self._rotary[0].rotate_and_store(
                positions, q, k, v, self.q_norm, self.k_norm, target
            )
        out = backend.forward(q, k, v, self.layer_id, kv_stored=stored)
        return self.o_proj(out.reshape(T, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm block: `h += attn(norm(h)); h += mlp(norm(h))`, as a residual stream.

    The layer returns its MLP output and the residual separately and the next norm adds them
    (vLLM/SGLang's form), so each residual add shares a kernel with the norm after it.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        backend_ref: BackendRef,
        kernels: LayerKernels,
        tp: TensorParallelGroup | None = None,
        shard: ModelShard | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary, backend_ref, kernels, tp, shard)
        if shard is None:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, kernels)
        else:
            width = shard.intermediate.size
            self.mlp = SwiGLUMLP(cfg.hidden_size, width, kernels, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.fused)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the residual stream.

        Args:
            positions: `[T]` int64.
            hidden: `[T, hidden_size]`, the previous layer's MLP output (the embeddings in
                layer 0).
            residual: `[T, hidden_size]`, the stream before `hidden` is added; None in layer 0.

        Returns:
            `(mlp_out, residual)`: the layer's output hidden state is `mlp_out + residual`,
            left for the next norm to add (both `[T, hidden_size]`, the model dtype).
        """
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.` submodule)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        backend_ref: BackendRef,
        kernels: LayerKernels,
        tp: TensorParallelGroup | None = None,
        shard: ModelShard | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding
        if tp is None or shard is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(
                shard.vocab, shard.vocab_rows, cfg.hidden_size, tp
            )
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, kernels.fused
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary_emb, backend_ref, kernels, tp, shard)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.fused)


class CausalLM(nn.Module):
    """Decoder-only causal LM over a paged KV cache (Qwen3ForCausalLM / Qwen2 / Llama).

    Call `set_attention_backend` before the first forward. The model runner calls
    `backend.prepare(meta)` before each forward (kept outside so CUDA graphs can capture the
    forward alone).

    Args:
        cfg: the model's shape.
        max_positions: rows of the RoPE cache (default: `cfg.max_position_embeddings`).
        kernels: which Triton kernels the layers run on CUDA (default `LayerKernels()`: the
            layer kernels on, cuBLAS GEMMs).
        tp: this rank's tensor-parallel group (None: the whole model on one device); the rank
            builds its shard, `self.shard` (`ModelShard.of`).

    Raises:
        ValueError: a tensor-parallel size the model's heads cannot be split into.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        kernels: LayerKernels | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        kernels = kernels or LayerKernels()
        self.config = cfg
        self.shard = None if tp is None else ModelShard.of(cfg, tp.rank, tp.size)
        self.backend_ref = BackendRef()
        self.model = DecoderModel(
            cfg,
            max_positions or cfg.max_position_embeddings,
            self.backend_ref,
            kernels,
            tp,
            self.shard,
        )
        mode = kernels.linear_mode
        self.lm_head: Linear
        if tp is None or self.shard is None:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, mode=mode)
        else:
            rows = self.shard.vocab_rows
            self.lm_head = ParallelLMHead(cfg.hidden_size, rows, cfg.vocab_size, tp, mode=mode)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.backend_ref.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the new tokens of a batch through the model.

        Args:
            input_ids: `[T]` int64, new tokens of all sequences, concatenated.
            positions: `[T]` int64, their absolute positions.
            meta: the batch's attention metadata (already passed to `backend.prepare`).
            logits_indices: `[B]` int64, rows of T whose next-token logits are wanted.

        Returns:
            `[B, vocab_size]` logits in the model's dtype (bfloat16 on GPU, float32 on CPU): the
            sampler reads them as they are or makes the float32 copy it needs (a float32 copy
            here cost a 4-byte write and re-read of every logit each decode step).
        """
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        # The last residual add and the final norm, for the rows whose logits are wanted only.
        if residual is None:
            hidden = self.model.norm(hidden[logits_indices])
        else:
            hidden, _ = self.model.norm(hidden[logits_indices], residual[logits_indices])
        return self.lm_head(hidden)
