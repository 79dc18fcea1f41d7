"""The LoRA adapter of each request at intake: one per prompt, and whether it can run."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from paged_llm.config import EngineConfig
from paged_llm.exceptions import RequestError
from paged_llm.inputs import LoRARequest
from paged_llm.model_files.lora_adapter import check_lora_adapter


def lora_per_prompt(
    lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: None or one `LoRARequest` for all, or the list."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(
            "lora_request must be a LoRARequest, a list with one (or None) per prompt, or "
            f"None, got {type(lora_request).__name__}."
        )
    if len(lora_request) != num_prompts:
        raise ValueError(
            f"Got {len(lora_request)} lora_request entries for {num_prompts} prompts; pass one "
            "LoRARequest for all prompts or a list with exactly one (or None) per prompt."
        )
    return list(lora_request)


class LoRARequestChecker:
    """Checks the adapters of requests against one engine; each adapter's files once."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Adapters checked so far, by id: their path, and why they cannot run (or None).
        self._checked: dict[int, tuple[str, RequestError | None]] = {}

    def check(self, lora_request: LoRARequest | None) -> None:
        """An adapter runs when LoRA is on, its id is positive and names one path, and its
        files pass `check_lora_adapter` (read once per adapter)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(
                f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}.",
                parameter="lora_request",
            )
        lora = self.config.lora
        if lora is None:
            raise RequestError(
                f"lora_request {lora_request.lora_name!r} needs an LLM built with "
                "enable_lora=True (and max_lora_rank at least the adapter's rank).",
                parameter="lora_request",
            )
        lora_id = lora_request.lora_int_id
        path = str(lora_request.lora_path)
        checked = self._checked.get(lora_id)
        if checked is None:
            error = None
            try:
                check_lora_adapter(path, lora.max_lora_rank, self.config.hf_config)
            except ValueError as cause:
                error = RequestError(str(cause), parameter="lora_request")
            checked = self._checked[lora_id] = (path, error)
        known_path, error = checked
        if known_path != path:
            raise RequestError(
                f"lora_int_id={lora_id} names adapter {known_path!r} already, and this "
                f"request gives it {path!r}; give each adapter its own lora_int_id.",
                parameter="lora_request",
                value=lora_id,
            )
        if error is not None:
            raise error
