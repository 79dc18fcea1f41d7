"""One decoder layer's projections in each weight format, timed alone: the CPU kernels
behind ``quantization=`` (see docs/quantization.md).

    python -m benchmarks.linear_kernels --threads 2 [--model llama-3.2-1b] [--routes]

Each layer is a paged_llm `Linear` loaded the way the engine loads it (float32 packed for
oneDNN, bfloat16, int8 and GGUF Q4_1 through csrc_cpu's W8A8 kernel with float32 or
bfloat16 activations, the latter from `cpu_matmul.dequantized_min_rows` rows by the
dequantized bfloat16 weight), plus float32 left to torch's own matmul (MKL), the library the
oneDNN packing replaces, and the kernel's other passes than the one this CPU runs (AVX2,
generic loops), forced, to say what a CPU without AVX-512 VNNI gets. ``--routes`` adds
the two routes of bfloat16 activations forced (the W8A8 kernel, the dequantized weight)
and prints each projection apart, where `cpu_matmul`'s crossovers are read. The layer is
SmolLM2-135M's, or with ``--model`` another published model's (random weights of its
shapes). Each is timed as the best of ``--repeats`` calls after a warm-up: the best, not
the mean, because the machine may be shared.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

import csrc_cpu
from benchmarks.report import format_table
from paged_llm.distributed.model_splits import finest_split
from paged_llm.layers.linear import Linear, prepack_for_cpu
from paged_llm.layers.quantization import cpu_matmul, get_quantized_linear_method
from paged_llm.layers.quantization.grouped import GroupQuantizedLinearMethod, GroupQuantizedTensor
from paged_llm.layers.weights import CheckpointTensor


@dataclass(frozen=True)
class DecoderShape:
    """A published model's sizes (its config.json), which set its projections' shapes."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def projections(self) -> list[tuple[str, int, int, int | None]]:
        """(name, in_features, out_features, input split width) of one decoder layer's
        projections: o and down are row-parallel, their inputs split as the engine splits
        them (`finest_split`), which sets int8's activation blocks there
        (`cpu_matmul.activation_block`)."""
        attention = self.heads * self.head_dim
        parts = finest_split(
            SimpleNamespace(
                num_attention_heads=self.heads,
                num_key_value_heads=self.kv_heads,
                intermediate_size=self.intermediate,
            )
        )
        return [
            ("qkv", self.hidden, attention + 2 * self.kv_heads * self.head_dim, None),
            ("o", attention, self.hidden, attention // parts),
            ("gate_up", self.hidden, 2 * self.intermediate, None),
            ("down", self.intermediate, self.hidden, self.intermediate // parts),
        ]


MODELS = {
    "smollm2-135m": DecoderShape(576, 1536, 9, 3, 64),
    "smollm2-360m": DecoderShape(960, 2560, 15, 5, 64),
    "llama-3.2-1b": DecoderShape(2048, 8192, 32, 8, 64),
    "llama-3.1-8b": DecoderShape(4096, 14336, 32, 8, 128),
}

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


class _ForcedDequantized(nn.Module):
    """A quantized layer's packed weight dequantized to bfloat16 on each call
    (`cpu_matmul.dequantized_matmul`), at any number of rows."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        (self.piece,) = layer.quantized_pieces.values()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_matmul.dequantized_matmul(x, self.piece)


def _dequantized(make: Make) -> Make:
    return lambda weight, dtype, split: _ForcedDequantized(make(weight, dtype, split))


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
# `--routes`: bfloat16 activations by each route, whatever `cpu_matmul.matmul` would choose.
FORCED_ROUTES: dict[str, tuple[Make, torch.dtype]] = {}
if csrc_cpu.load():
    for _isa in csrc_cpu.quantized_matmul_isas()[1:]:
        FORCED_PASSES[f"int8, {_isa} pass"] = (_forced(_int8_layer, _isa), torch.float32)
        FORCED_PASSES[f"gguf Q4_1, {_isa} pass"] = (_forced(_gguf_layer, _isa), torch.float32)
    if (_fastest := cpu_matmul.kernel_isa()) is not None:
        for _name, _make in (("int8", _int8_layer), ("gguf Q4_1", _gguf_layer)):
            FORCED_ROUTES[f"{_name}, bfloat16 act, W8A8 kernel"] = (
                _forced(_make, _fastest),
                torch.bfloat16,
            )
            FORCED_ROUTES[f"{_name}, bfloat16 act, dequantized"] = (
                _dequantized(_make),
                torch.bfloat16,
            )


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
    parser.add_argument(
        "--routes",
        action="store_true",
        help="also bfloat16 activations by the W8A8 kernel and by the dequantized weight, "
        "forced, and each projection's times apart",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = MODELS[args.model].projections()
    weights = {name: torch.randn(n, k) * 0.05 for name, k, n, _ in shapes}
    formats = FORMATS if args.no_forced_passes else {**FORMATS, **FORCED_PASSES}
    if args.routes:
        formats = {**formats, **FORCED_ROUTES}
    # times[label][projection name]: us at each of args.rows
    times: dict[str, dict[str, list[float]]] = {}
    for label, (make, dtype) in formats.items():
        layers = {name: make(weights[name], dtype, split) for name, _, _, split in shapes}
        times[label] = {}
        for name, k, _, _ in shapes:
            times[label][name] = []
            for num_rows in args.rows:
                x = torch.randn(num_rows, k).to(dtype)
                with torch.no_grad():
                    seconds = best_seconds(lambda: layers[name](x), args.repeats)  # noqa: B023
                times[label][name].append(1e6 * seconds)
    names = ", ".join(name for name, _, _, _ in shapes)
    print(f"{args.model} decoder layer projections ({names}), {args.threads} threads")
    headers = ["format", *(f"M={m} us/layer" for m in args.rows)]
    totals = [[label, *np.round(np.sum(list(t.values()), axis=0), 0)] for label, t in times.items()]
    print(format_table(headers, totals))
    if args.routes:
        for name, k, n, _ in shapes:
            print(f"\n{name} ({k} -> {n} features)")
            headers = ["format", *(f"M={m} us" for m in args.rows)]
            labels = ["bfloat16", "int8, bfloat16 act", "gguf Q4_1, bfloat16 act", *FORCED_ROUTES]
            print(format_table(headers, [[lb, *np.round(times[lb][name], 0)] for lb in labels]))


if __name__ == "__main__":
    main()
