"""`EngineRequest`: one validated request as every engine takes it.

The front end builds it once (`paged_llm.frontend.input_processor`); an in-process engine,
a tensor-parallel one and a data-parallel replica all take the same object. A new kind of
request (LoRA, pooling, speculative settings) is a field here, set in the intake.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_llm.inputs import LoRARequest
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A prompt, tokenized and checked against the model, and how to complete it: a
    generation (`SamplingParams`), a beam search (`BeamSearchParams`), or a pooling request
    (`PoolingParams`, its task and pooler resolved by the intake)."""

    request_id: str
    # The prompt's text, where the caller gave one (reported back in the output).
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams | PoolingParams
    # Token sequences that are never generated: ``params.bad_words``, tokenized.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # What the engine reports of it while it runs: `LLMEngine.add_request` takes
    # ``params.output_kind``; `LLM`'s calls want the finished result only.
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # The LoRA adapter it runs under (checked at intake); None: the base model.
    lora_request: LoRARequest | None = None
