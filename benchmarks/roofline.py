"""Matmul roofline of this machine and the FLOPs a workload needs.

The roofline is the best matmul GFLOP/s measured on a few GEMMs shaped like the model's
(skinny decode batches, prefill chunks) plus one large square GEMM, through every GEMM
library torch offers on the device: ``torch.matmul`` (MKL on x86 CPUs, cuBLAS on GPUs) and,
on CPU, oneDNN with a prepacked weight (what paged_llm's CPU linear layers use). On AMD
CPUs MKL takes a generic code path and oneDNN is about twice as fast, so taking the best of
the two keeps the roofline the machine's, not one library's. For bfloat16 on a CPU without
bfloat16 GEMM instructions (no oneDNN bfloat16), torch's bfloat16 matmul is a generic loop,
so the roofline is the best way the machine has to multiply bfloat16 weights: float32 GEMMs
over converted weight chunks ("float32 GEMM", `paged_llm.layers.linear.multiply_as_float32`). A workload's FLOPs
count the weight matmuls only, 2 FLOPs per weight per computed token; attention's
QK^T and PV products are excluded, as are norms, activations and the embedding lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.engines import synchronize
from paged_llm.layers.linear import multiply_as_float32, onednn_linear_available


@dataclass(frozen=True)
class MatmulParams:
    """Weights that take part in matmuls: the decoder layers' linear layers ("body") and
    the LM head (counted even when it is tied to the embedding: it is still multiplied)."""

    body: int
    lm_head: int
    hidden_size: int
    intermediate_size: int
    qkv_size: int
    vocab_size: int


@dataclass(frozen=True)
class GemmResult:
    library: str
    m: int
    k: int
    n: int
    seconds: float

    @property
    def gflops(self) -> float:
        return 2 * self.m * self.k * self.n / self.seconds / 1e9


def matmul_params(model_dir: str) -> MatmulParams:
    """Count the model's matmul weights on the meta device (no memory, no weights read)."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lm_head = model.get_output_embeddings()
    body = sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not lm_head
    )
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return MatmulParams(
        body=body,
        lm_head=lm_head.weight.numel(),
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        qkv_size=(text.num_attention_heads + 2 * text.num_key_value_heads) * head_dim,
        vocab_size=text.vocab_size,
    )


def workload_flops(
    params: MatmulParams, computed_prompt_tokens: int, output_tokens: int, num_requests: int
) -> float:
    """Weight-matmul FLOPs of a run.

    Prompt tokens go through the body only, except each request's last prompt token, whose
    logits give the first output token. Every output token but the last is fed back
    through the body, and each output token comes from one LM-head product. So a request
    with P computed prompt tokens and O output tokens costs
    2 x (body x (P + O - 1) + lm_head x O).
    """
    body_tokens = computed_prompt_tokens + output_tokens - num_requests
    return 2.0 * (params.body * body_tokens + params.lm_head * output_tokens)


def gemm_shapes(params: MatmulParams, device: str) -> list[tuple[int, int, int]]:
    """(M tokens, K, N) GEMMs like the model's: decode batches of 1 and 64 tokens and a
    512-token prefill chunk against the QKV, gate+up and down projections, a 64-row LM
    head, and a large square GEMM that shows the machine's peak."""
    hidden, inter = params.hidden_size, params.intermediate_size
    weights = [(hidden, params.qkv_size), (hidden, 2 * inter), (inter, hidden)]
    shapes = [(m, k, n) for m in (1, 64, 512) for k, n in weights]
    shapes.append((64, hidden, params.vocab_size))
    square = 8192 if device == "cuda" else 2048
    shapes.append((square, square, square))
    return shapes


def gemm_libraries(device: str, dtype: torch.dtype) -> list[str]:
    if device == "cpu" and dtype == torch.bfloat16 and not onednn_linear_available(dtype):
        # NOTE: torch.matmul alone is left out here: its generic bfloat16 loop measured
        # 0.2-1 GFLOP/s on a 2-core AVX2 EPYC (and 7 minutes for the square GEMM).
        return ["float32 GEMM"]
    libraries = ["torch.matmul"]
    if device == "cpu" and onednn_linear_available(dtype):
        libraries.append("onednn")
    return libraries


def time_gemm(
    library: str, m: int, k: int, n: int, dtype: torch.dtype, device: str, repeats: int = 5
) -> GemmResult:
    """Best time of ``repeats`` timings, each averaged over enough calls to last ~50 ms."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    if library == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), 64)

        def multiply() -> None:
            torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    elif library == "float32 GEMM":
        weight = b.t().contiguous()

        def multiply() -> None:
            multiply_as_float32(a, weight, None)

    else:

        def multiply() -> None:
            torch.matmul(a, b, out=out)

    def timed(calls: int) -> float:
        synchronize(device)
        started = time.perf_counter()
        for _ in range(calls):
            multiply()
        synchronize(device)
        return (time.perf_counter() - started) / calls

    calls = max(1, int(0.05 / max(timed(1), 1e-7)))
    best = min(timed(calls) for _ in range(repeats))
    return GemmResult(library, m, k, n, best)


def measure_roofline(
    params: MatmulParams, dtype: torch.dtype, device: str
) -> tuple[float, list[GemmResult]]:
    """The machine's best matmul GFLOP/s over ``gemm_shapes`` and GEMM libraries, and every
    measurement."""
    with torch.inference_mode():
        results = [
            time_gemm(library, m, k, n, dtype, device)
            for library in gemm_libraries(device, dtype)
            for m, k, n in gemm_shapes(params, device)
        ]
    if device == "cuda":
        # Hand the GEMM buffers back before the engines size their KV caches.
        torch.cuda.empty_cache()
    return max(r.gflops for r in results), results


def best_by_library(results: list[GemmResult]) -> dict[str, float]:
    best: dict[str, float] = {}
    for result in results:
        best[result.library] = max(best.get(result.library, 0.0), result.gflops)
    return best
