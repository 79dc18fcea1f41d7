"""`LoRARequest`, as ``vllm.lora.request`` names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request (vLLM's ``vllm.lora.request.LoRARequest``, its field
    names and rules): ``lora_path`` is a directory in PEFT's format (adapter_config.json and
    adapter_model.safetensors), and ``lora_int_id`` (>= 1) identifies the adapter in the
    engine: requests with the same id share its slot and their prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}.")
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
