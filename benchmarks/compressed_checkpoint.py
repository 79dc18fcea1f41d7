"""Write a compressed-tensors checkpoint of a model with the compressed-tensors library
itself: every linear layer but the LM head quantized with min-max scales (llm-compressor's
default observer, without calibration data), saved as llm-compressor saves it. The tests'
checkpoints and the pre-quantized perplexity of docs/quantization.md come from here.

    python -m benchmarks.compressed_checkpoint --out /tmp/smollm2-w4g64 --bits 4 --group-size 64
    python -m benchmarks.perplexity --model /tmp/smollm2-w4g64

Needs the compressed-tensors library (in paged_llm's [test] extra); loading the result in
paged_llm does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from paged_llm.model_files import DEFAULT_MODEL, resolve_model


def write_compressed_checkpoint(
    model_dir: Path,
    out: Path,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    compression: str,
) -> None:
    """Quantize ``model_dir``'s linear layers (per output channel for ``group_size`` None)
    and save them in ``compression`` (e.g. "pack-quantized") with its tokenizer to ``out``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=symmetric,
        strategy="channel" if group_size is None else "group",
        group_size=group_size,
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data
        if group_size is None:
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        else:
            groups = weight.unflatten(-1, (-1, group_size))
            low, high = groups.amin(-1), groups.amax(-1)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=compression)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128, help="0: per output channel")
    parser.add_argument("--symmetric", action="store_true")
    parser.add_argument("--format", default="pack-quantized")
    args = parser.parse_args()
    write_compressed_checkpoint(
        resolve_model(args.model).path,
        args.out,
        args.bits,
        args.symmetric,
        args.group_size or None,
        args.format,
    )


if __name__ == "__main__":
    main()
