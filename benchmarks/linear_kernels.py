"""One linear layer of SmolLM2-135M in each weight format, timed alone: the CPU kernels
behind ``quantization=`` (see docs/quantization.md).

    python -m benchmarks.linear_kernels --threads 2

Each layer is a paged_llm `Linear` loaded the way the engine loads it (float32 packed for
oneDNN, bfloat16, int8 and GGUF Q4_1 through csrc_cpu's W8A8 kernel with float32 or
bfloat16 activations, the latter from `cpu_matmul.dequantized_min_rows` rows by the
dequantized bfloat16 weight), plus float32 left to torch's own matmul (MKL), the library the
oneDNN packing replaces, and the kernel's other passes than the one this CPU runs (AVX2,
generic loops), forced, to say what a CPU without AVX-512 VNNI gets. Each is timed as the
best of ``--repeats`` calls after a warm-up: the best, not the mean, because the machine
may be shared.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import csrc_cpu
from benchmarks.report import format_table
from paged_llm.layers.linear import Linear, prepack_for_cpu
from paged_llm.layers.quantization import cpu_matmul, get_quantized_linear_method
from paged_llm.layers.quantization.grouped import GroupQuantizedLinearMethod, GroupQuantizedTensor
from paged_llm.layers.weights import CheckpointTensor

# (name, in_features, out_features, input split width) of one SmolLM2-135M decoder layer's
# projections: o and down are row-parallel, their inputs split at multiples of 192 and 512
# (its 9 heads and MLP of 1,536 over the 3 ranks it splits into at most), and the int8
# kernels round those per 64 features, the others per 128 (`cpu_matmul.activation_block`).
SHAPES = [
    ("qkv", 576, 960, None),
    ("o", 576, 576, 192),
    ("gate_up", 576, 3072, None),
    ("down", 1536, 576, 512),
]

Make = Callable[[torch.Tensor, torch.dtype, int | None], nn.Module]


def _float_layer(
    weight: torch.Tensor, dtype: torch.dtype, _input_split_width: int | None
) -> nn.Module:
    layer = Linear(weight.shape[1], weight.shape[0], False).to(dtype)
    layer.weight.data.copy_(weight)
    prepack_for_cpu(layer, dtype)
    return layer


def _mkl_layer(
    weight: torch.Tensor, dtype: torch.dtype, _input_split_width: int | None
) -> nn.Module:
    # Left unpacked, the layer runs torch's own matmul: MKL on x86, what oneDNN replaces.
    layer = Linear(weight.shape[1], weight.shape[0], False).to(dtype)
    layer.weight.data.copy_(weight)
    return layer


def _int8_layer(
    weight: torch.Tensor, dtype: torch.dtype, input_split_width: int | None
) -> nn.Module:
    method = get_quantized_linear_method("int8", triton=False)
    layer = Linear(weight.shape[1], weight.shape[0], False, method).to(dtype)
    layer.input_split_width = input_split_width
    layer.load_weight(layer.weight, CheckpointTensor("weight", weight), None)
    method.process_weights_after_loading(layer)
    return layer


def _gguf_layer(
    weight: torch.Tensor, dtype: torch.dtype, input_split_width: int | None
) -> nn.Module:
    import gguf

    from paged_llm.model_files.gguf_quantized import repack

    qtype = gguf.GGMLQuantizationType.Q4_1
    blocks = gguf.quants.quantize(weight.numpy(), qtype)
    method = get_quantized_linear_method("gguf", triton=False)
    assert isinstance(method, GroupQuantizedLinearMethod)
    layer = Linear(weight.shape[1], weight.shape[0], False, method).to(dtype)
    layer.input_split_width = input_split_width
    tensor = GroupQuantizedTensor("weight", repack(blocks, "Q4_1", tuple(weight.shape)))
    method.load_quantized(layer, tensor, None)
    method.process_weights_after_loading(layer)
    return layer


class _ForcedPass(nn.Module):
    """A quantized layer's packed weight multiplied by one pass of the kernel."""

    def __init__(self, layer: nn.Module, isa: str) -> None:
        super().__init__()
        (self.piece,) = layer.quantized_pieces.values()
        self.isa = isa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_matmul.packed_matmul(x, self.piece, self.isa)


def _forced(make: Make, isa: str) -> Make:
    return lambda weight, dtype, split: _ForcedPass(make(weight, dtype, split), isa)


# The formats the engine runs here; `FORCED_PASSES` adds the kernel's other passes.
FORMATS: dict[str, tuple[Make, torch.dtype]] = {
    "float32 (oneDNN)": (_float_layer, torch.float32),
    "float32 (MKL)": (_mkl_layer, torch.float32),
    "bfloat16": (_float_layer, torch.bfloat16),
    "int8, float32 act": (_int8_layer, torch.float32),
    "int8, bfloat16 act": (_int8_layer, torch.bfloat16),
    "gguf Q4_1, float32 act": (_gguf_layer, torch.float32),
    "gguf Q4_1, bfloat16 act": (_gguf_layer, torch.bfloat16),
}
FORCED_PASSES: dict[str, tuple[Make, torch.dtype]] = {}
if csrc_cpu.load():
    for _isa in csrc_cpu.quantized_matmul_isas()[1:]:
        FORCED_PASSES[f"int8, {_isa} pass"] = (_forced(_int8_layer, _isa), torch.float32)
        FORCED_PASSES[f"gguf Q4_1, {_isa} pass"] = (_forced(_gguf_layer, _isa), torch.float32)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--no-forced-passes",
        action="store_true",
        help="only the formats the engine runs here (the generic loops take seconds a call "
        "at prefill sizes)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k) * 0.05 for name, k, n, _ in SHAPES}
    headers = ["format", *(f"M={m} us/layer" for m in args.rows)]
    rows = []
    formats = FORMATS if args.no_forced_passes else {**FORMATS, **FORCED_PASSES}
    for label, (make, dtype) in formats.items():
        layers = {name: make(weights[name], dtype, split) for name, _, _, split in SHAPES}
        times = []
        for num_rows in args.rows:
            total = 0.0
            for name, k, _, _ in SHAPES:
                x = torch.randn(num_rows, k).to(dtype)
                with torch.no_grad():
                    total += best_seconds(lambda: layers[name](x), args.repeats)  # noqa: B023
            times.append(1e6 * total)
        rows.append([label, *np.round(times, 0)])
    print(f"SmolLM2-135M decoder layer projections (qkv, o, gate_up, down), {args.threads} threads")
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
