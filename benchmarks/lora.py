"""LoRA adapters for the benchmarks: written by peft for the benchmark's model, and given to
the requests round robin, the same way in every engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Every projection of a decoder layer, as peft names them.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Ranks of adapters 0, 1, 2, ...: alternating, so that a step mixes ranks.
ADAPTER_RANKS = (8, 16)
# Standard deviation of the adapters' A and B entries: large enough that an adapter changes
# the greedy tokens (peft's own initialisation leaves B at zero, a no-op), small enough that
# the model still writes text.
ADAPTER_INIT_STD = 0.05


def write_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    target_modules: list[str],
    seed: int,
    init_std: float = ADAPTER_INIT_STD,
    lora_alpha: int = 16,
    use_rslora: bool = False,
) -> Path:
    """A LoRA adapter of the model in ``model_dir``, written by peft itself into
    ``out_dir``, its A and B entries drawn from N(0, init_std^2)."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora
    )
    adapted = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
    adapted.save_pretrained(str(out_dir))
    return out_dir


def write_benchmark_adapters(model_dir: Path, num_adapters: int, out_dir: Path) -> list[str]:
    """``num_adapters`` adapters of every projection, ranks `ADAPTER_RANKS` in turn, seeded
    by their index; their directories."""
    return [
        str(
            write_peft_adapter(
                model_dir,
                out_dir / f"adapter-{index}",
                rank=ADAPTER_RANKS[index % len(ADAPTER_RANKS)],
                target_modules=list(ALL_PROJECTIONS),
                seed=index,
            )
        )
        for index in range(num_adapters)
    ]


def adapter_rank(adapter_dir: str) -> int:
    """The rank an adapter's ``adapter_config.json`` declares."""
    return int(json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"])


def adapter_index(request_index: int, num_adapters: int) -> int:
    """The adapter of a request: round robin, so that every step mixes the adapters."""
    return request_index % num_adapters


def llm_lora_settings(adapter_dirs: Sequence[str]) -> dict[str, Any]:
    """`LLM` arguments that serve these adapters at once (none: LoRA off)."""
    if not adapter_dirs:
        return {}
    return {
        "enable_lora": True,
        "max_loras": len(adapter_dirs),
        "max_lora_rank": max(adapter_rank(path) for path in adapter_dirs),
    }


def round_robin_lora_requests(adapter_dirs: Sequence[str], num_requests: int) -> list[Any] | None:
    """paged_llm's `LoRARequest` of each of ``num_requests`` requests (`adapter_index`; ids
    from 1); None without adapters."""
    from paged_llm.lora.request import LoRARequest

    if not adapter_dirs:
        return None
    requests = [
        LoRARequest(f"adapter-{index}", index + 1, path) for index, path in enumerate(adapter_dirs)
    ]
    return [requests[adapter_index(i, len(requests))] for i in range(num_requests)]
