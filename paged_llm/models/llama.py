"""The Llama decoder family: Llama, Mistral, and (through two switches) Qwen2 and Qwen3.

Qwen2 is Llama with biases on the q/k/v projections; Qwen3 is Llama with an RMSNorm on
each query and key head before the rotation.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn

from paged_llm.distributed.model_splits import finest_split
from paged_llm.layers.activation import SiluAndMul
from paged_llm.layers.attention import Attention, AttentionMetadata
from paged_llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from paged_llm.layers.layernorm import RMSNorm
from paged_llm.layers.linear import PackedLinear, RowParallelLinear, RowShard
from paged_llm.layers.rotary import RotaryEmbedding, StepRotation, rope_parameters
from paged_llm.models.context import ModelContext


def _head_dim(config: Any) -> int:
    head_dim: int = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    return head_dim


def _sliding_window(config: Any, layer_index: int) -> int | None:
    """The layer's sliding window, following the config's conventions."""
    window: int | None = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: whole query heads split evenly, and whole KV
    heads split, or replicated when there are fewer than ranks."""

    def __init__(
        self,
        config: Any,
        context: ModelContext,
        layer_index: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        tp = context.tp
        self.head_dim = _head_dim(config)
        q_shard, self.num_heads = RowShard.of_heads(tp, config.num_attention_heads, self.head_dim)
        kv_shard, self.num_kv_heads = RowShard.of_heads(
            tp, config.num_key_value_heads, self.head_dim
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, [q_shard, kv_shard, kv_shard], qkv_bias, context.quant_method
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            o_bias,
            tp,
            context.quant_method,
            finest_split=finest_split(config),
        )
        self.rotary = rotary
        norm = functools.partial(RMSNorm, self.head_dim, config.rms_norm_eps, context.elementwise)
        self.q_norm = norm() if qk_norm else None
        self.k_norm = norm() if qk_norm else None
        self.attn = Attention(
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=_sliding_window(config, layer_index),
        )

    def forward(
        self, rotation: StepRotation, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rotation, q, k)
        attended = self.attn(q, k, v, metadata)
        out: torch.Tensor = self.o_proj(attended.view(num_tokens, self.q_size))
        return out


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, context: ModelContext) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        shard = RowShard.of_rows(context.tp, size)
        self.gate_up_proj = PackedLinear(
            config.hidden_size, [shard, shard], bias, context.quant_method
        )
        self.down_proj = RowParallelLinear(
            size,
            config.hidden_size,
            bias,
            context.tp,
            context.quant_method,
            finest_split=finest_split(config),
        )
        self.act = SiluAndMul(context.elementwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        context: ModelContext,
        layer_index: int,
        rotary: RotaryEmbedding,
        **attn_flags: bool,
    ) -> None:
        super().__init__()
        norm = functools.partial(
            RMSNorm, config.hidden_size, config.rms_norm_eps, context.elementwise
        )
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, context, layer_index, rotary, **attn_flags)
        self.post_attention_layernorm = norm()
        self.mlp = LlamaMLP(config, context)

    def forward(
        self,
        rotation: StepRotation,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotation, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack: embedding, layers, final norm."""

    def __init__(
        self,
        config: Any,
        context: ModelContext,
        rotary: RotaryEmbedding,
        attn_flags: dict[str, bool],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            context.tp,
            context.dtype,
            context.embedding_quant_method,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, context, i, rotary, **attn_flags)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, context.elementwise)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer with Llama's layout and Hugging Face's parameter names."""

    # Checkpoint names that load into one slice of a packed projection.
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias: ClassVar[bool | None] = None  # None: the config's attention_bias decides
    qk_norm: ClassVar[bool] = False

    def __init__(self, config: Any, context: ModelContext) -> None:
        super().__init__()
        self.config = config
        attention_bias = getattr(config, "attention_bias", False)
        attn_flags = {
            "qkv_bias": attention_bias if self.qkv_bias is None else self.qkv_bias,
            "o_bias": attention_bias if self.qkv_bias is None else False,
            "qk_norm": self.qk_norm,
        }
        # One table for all layers; each forward looks up its positions once.
        self.rotary = RotaryEmbedding(
            _head_dim(config),
            context.max_position,
            rope_parameters(config),
            context.device,
            context.elementwise,
        )
        self.model = LlamaModel(config, context, self.rotary, attn_flags)
        self.lm_head = (
            ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                context.tp,
                context.dtype,
                context.lm_head_quant_method,
            )
            if context.lm_head
            else None
        )
        # Checkpoint tensors this model has no place for and reads past.
        self.unused_checkpoint_weights: tuple[str, ...] = (
            () if context.lm_head else ("lm_head.weight",)
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so; call again after
        `model_loading.materialize`, which gives the two separate tensors."""
        if self.lm_head is not None and getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden_size]`` of a flat batch of ``T`` tokens."""
        hidden: torch.Tensor = self.model.embed_tokens(input_ids)
        rotation = self.rotary.step_rotation(positions, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(rotation, hidden, residual, metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of ``hidden``'s rows over the vocabulary (None on ranks other than 0)."""
        assert self.lm_head is not None, "a pooling model computes no logits"
        logits: torch.Tensor | None = self.lm_head(hidden)
        return logits
