"""This rank's model, built on the meta device and filled from the checkpoint in the
layers' formats: quantized (at load, or as a pre-quantized checkpoint or a .gguf keeps it),
packed for oneDNN on CPU, logged."""

from __future__ import annotations

import logging

import torch

from paged_llm.config import EngineConfig
from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.linear import (
    prepack_for_cpu,
    process_weights_after_loading,
    use_fixed_row_tiles,
)
from paged_llm.layers.quantization import QuantizedLinearMethod, get_quantized_linear_method
from paged_llm.layers.quantization.checkpoint_formats import pre_quantized_checkpoint
from paged_llm.layers.quantization.grouped import GroupQuantizedTensor
from paged_llm.layers.weights import weight_memory
from paged_llm.loader import load_weights
from paged_llm.model_files.gguf_quantized import (
    gguf_source,
    kept_tensor_types,
    quantized_tensors,
)
from paged_llm.models import get_model_class
from paged_llm.models.context import ModelContext
from paged_llm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of ``model`` uninitialized storage on ``device``,
    in place (ties between modules are not kept; `tie_weights` restores them).

    NOTE: not ``Module.to_empty``: its ``empty_like`` of a meta tensor runs torch's Python
    reference, which imports torch.fx's symbolic shapes and sympy on first use (34 MiB and
    0.3 s of every start); ``torch.empty`` of the shape makes the same tensors.
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(storage, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def load_model(config: EngineConfig, tp: TensorParallelGroup) -> LlamaForCausalLM:
    """Build this rank's shard of the model without initializing weights, then fill it
    from the checkpoint."""
    platform = config.platform
    method = get_quantized_linear_method(config.quantization, platform.triton_linear)
    source = gguf_source(config.model_dir) if config.quantization == "gguf" else None
    # transformers name -> GGML type, of the tensors read quantized from the .gguf file:
    # those its conversion left there or, from a float conversion, whose float copies
    # the layers do not read
    kept_types: dict[str, str] = {}
    gguf_tensors: list[GroupQuantizedTensor] = []
    if source is not None:
        kept_types = source.read_from_gguf or kept_tensor_types(
            source.path, config.quantize_embeddings
        )
        if config.pooler is not None:
            kept_types = {n: t for n, t in kept_types.items() if not n.startswith("lm_head.")}
        gguf_tensors = list(quantized_tensors(source.path, config.hf_config, kept_types))
    kept_quantized = set(kept_types)

    def vocab_method(name: str) -> QuantizedLinearMethod | None:
        """The format of the embedding or LM head (``name``): the decoder's, unless not
        asked for or not offered, or the format only takes stored quantized tensors and
        this one is stored float (a .gguf's unquantized tensor; a pre-quantized Hugging
        Face checkpoint's embedding)."""
        if method is None or not (config.quantize_embeddings and method.quantizes_embeddings):
            return None
        return method if method.quantizes_at_load or name in kept_quantized else None

    context = ModelContext(
        device=platform.device,
        max_position=config.max_model_len,
        dtype=config.dtype,
        elementwise=platform.elementwise_kernels.usable(),
        tp=tp,
        quant_method=method,
        embedding_quant_method=vocab_method("model.embed_tokens.weight"),
        lm_head_quant_method=vocab_method("lm_head.weight"),
        lm_head=config.pooler is None,
    )
    model_class = get_model_class(config.hf_config)
    with torch.device("meta"):
        model = model_class(config.hf_config, context)
    materialize(model.to(dtype=config.dtype), platform.device)
    model.tie_weights()
    load_weights(
        model,
        config.model_dir,
        pre_quantized_checkpoint(config.quantization, config.hf_config),
        gguf_tensors,
    )
    # NOTE: the layers hold copies of their parts; the whole repacked tensors go before the
    # heap is trimmed (prepack_for_cpu), or their pages stay in the process (79 MiB here).
    gguf_tensors.clear()
    process_weights_after_loading(model)
    if platform.prepacks_linear_weights:
        prepack_for_cpu(model, config.dtype)
    if config.batch_invariant:
        use_fixed_row_tiles(model)
    if tp.is_first:
        memory = sorted(weight_memory(model).items(), key=lambda item: -item[1])
        total_mib = sum(size for _, size in memory) / 2**20
        if source is not None:
            logger.info(
                "Kept %s packed from %s: %.1f MiB of weights (quantization='dequantize' "
                "loads it as float).",
                " / ".join(sorted(set(kept_types.values()))),
                source.path.name,
                total_mib,
            )
        logger.info(
            "Weights: %.1f MiB%s, %s (%s).",
            total_mib,
            " per rank" if tp.size > 1 else "",
            f"quantization={config.quantization}" if config.quantization else "not quantized",
            ", ".join(
                f"{str(dtype).removeprefix('torch.')} {size / 2**20:.1f} MiB"
                for dtype, size in memory
            ),
        )
    return model.eval()
