"""`LLM(batch_invariant=True)`: a token's logits do not depend on how its context reached
the model, so seeded outputs and their logprobs are bit-identical however they were run."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paged_llm import LLM, SamplingParams

MAX_MODEL_LEN = 160
_rng = random.Random(0)
# A shared 40-token prefix (the prefix cache serves it on a second run), then suffixes long
# enough to pass Mistral's 48-token window.
SHARED = [_rng.randrange(100, 40000) for _ in range(40)]
PROMPTS = [
    {"prompt_token_ids": SHARED + [_rng.randrange(100, 40000) for _ in range(length)]}
    for length in (5, 17, 30, 44, 9, 23)
]
PARAMS = [
    SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True, logprobs=2)
    for seed in range(len(PROMPTS))
]
Result = tuple[list[int], list[dict[int, float]]]


def _run(llm: LLM, indices: list[int]) -> list[Result]:
    outputs = llm.generate(
        [PROMPTS[i] for i in indices], [PARAMS[i] for i in indices], use_tqdm=False
    )
    results = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None
        logprobs = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        results.append((completion.token_ids, logprobs))
    return results


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_seeded_outputs_and_logprobs_are_bit_identical_however_they_are_run(
    tiny_model_dir: Callable[[str], Path], name: str
) -> None:
    check_bit_identical_however_run(tiny_model_dir(name), kv_element_bytes=4)


def check_bit_identical_however_run(
    model_dir: Path, kv_element_bytes: int, **llm_settings: Any
) -> None:
    """batch_invariant=True: seeded tokens and logprobs from the prefix cache or not, alone
    or batched, chunked and preempted, all bit-identical."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    ) * kv_element_bytes
    everything = list(range(len(PROMPTS)))

    def build(**settings: Any) -> LLM:
        return LLM(
            model_dir,
            max_model_len=MAX_MODEL_LEN,
            batch_invariant=True,
            **llm_settings,
            **settings,
        )

    with build() as llm:
        batched = _run(llm, everything)
        # The second run's prompts come from the prefix cache, and shorter prefills follow.
        assert _run(llm, everything) == batched
        assert llm.get_engine_metrics().prefix_cache_hit_tokens > 0
        assert [_run(llm, [i])[0] for i in (1, 3)] == [batched[1], batched[3]]
    # Other companions in each step, 16-token prefill chunks, nothing cached, and a pool of
    # 24 blocks (16 tokens each) where six sequences of up to 108 tokens preempt each other.
    with build(
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=24 * 16 * block_bytes,
    ) as constrained:
        assert _run(constrained, everything[::-1]) == batched[::-1]
        assert constrained.get_engine_metrics().num_preemptions > 0


def test_batch_invariance_is_validated(llama_dir: Path) -> None:
    model_dir = llama_dir
    with pytest.raises(ValueError, match=r"batch_invariant must be a bool, got 'yes'"):
        LLM(model_dir, batch_invariant="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch_invariant=True is implemented for tensor_paral"):
        LLM(model_dir, batch_invariant=True, tensor_parallel_size=2)
