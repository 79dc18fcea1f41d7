"""Greedy tokens equal transformers' for every architecture, under every kind of batching."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from paged_llm import LLM, SamplingParams
from paged_llm.engine.core import EngineMetrics
from paged_llm.outputs import RequestOutput
from tests.conftest import TINY_MODELS, hf_greedy

TEXT = (
    "The history of astronomy is the story of people looking up. Long before telescopes, "
    "shepherds and sailors learned the patterns of the stars, and farmers timed their "
    "planting by the rising of particular constellations. The Babylonians kept careful "
    "records of planetary positions on clay tablets, and Greek thinkers such as "
    "Aristarchus and Hipparchus tried to explain what they saw with geometry. Much later, "
    "Copernicus placed the Sun at the centre of the system, Kepler found that orbits are "
    "ellipses, and Galileo turned a small telescope to the sky and saw the moons of "
    "Jupiter. Each discovery changed how people understood their own place in the world, "
    "and each one began with somebody who wrote down what they observed, night after "
    "night, and then asked why the numbers came out the way they did. Today, large survey "
    "telescopes record billions of stars, and the same questions remain."
)
PROMPT_LENGTHS = [5, 150, 12, 97, 33, 64, 7, 121, 48, 80, 20]
MAX_TOKENS = [9, 17, 30, 5, 24, 12, 40, 8, 21, 15, 11]
SHARED_PREFIX_LEN = 70  # four full blocks of 16 and then some


def _prompts(tokenizer: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= max(PROMPT_LENGTHS)
    # Rotate the text so that prompts of different lengths also start differently.
    return [
        ids[i * 7 :][:n] if len(ids[i * 7 :]) >= n else ids[:n]
        for i, n in enumerate(PROMPT_LENGTHS)
    ]


def _shared_prefix_prompts(tokenizer: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    ids = tokenizer(TEXT)["input_ids"]
    prefix = ids[:SHARED_PREFIX_LEN]
    return [
        prefix + ids[SHARED_PREFIX_LEN + 3 * i : SHARED_PREFIX_LEN + 3 * i + 4 + i]
        for i in range(len(PROMPT_LENGTHS))
    ]


SCENARIOS: dict[str, dict] = {
    "default": {},
    # A 32-token budget chunks every long prompt and mixes its chunks with decodes.
    "chunked-prefill": {"max_num_batched_tokens": 32},
    # Room for 14 blocks: a few sequences at once, so running ones must be preempted.
    "preemption": {"max_model_len": 224, "num_blocks": 14},
    # Admitting few sequences at a time lets later ones find earlier ones' blocks.
    "prefix-hits": {"max_num_seqs": 3, "shared_prefix": True},
}


def scenario_settings(model_dir: Path, scenario: str) -> tuple[dict[str, Any], bool]:
    """The LLM keyword arguments of ``scenario`` for the tiny model in ``model_dir``, and
    whether it runs the shared-prefix prompts."""
    settings = dict(SCENARIOS[scenario])
    shared_prefix = settings.pop("shared_prefix", False)
    num_blocks = settings.pop("num_blocks", None)
    settings.setdefault("max_model_len", 256)
    if num_blocks is not None:
        # Tiny models: 2 layers x 2 kv heads x head_dim x 4 bytes, K and V.
        config = transformers.AutoConfig.from_pretrained(model_dir)
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        bytes_per_block = (
            2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * 16
        )
        settings["kv_cache_memory_bytes"] = num_blocks * bytes_per_block
    return settings, shared_prefix


# Tests that start processes (seconds each on 2 cores) run two scenarios in one LLM where
# they combine: a 32-token budget over a 14-block cache chunks every long prompt and
# preempts too.
SCENARIO_GROUPS: dict[str, tuple[str, ...]] = {
    "default": ("default",),
    "chunked-prefill+preemption": ("chunked-prefill", "preemption"),
    "prefix-hits": ("prefix-hits",),
}


def group_settings(model_dir: Path, group: str) -> tuple[dict[str, Any], bool]:
    """`scenario_settings` of every scenario of ``SCENARIO_GROUPS[group]`` together."""
    settings: dict[str, Any] = {}
    shared_prefix = False
    for scenario in SCENARIO_GROUPS[group]:
        scenario_kwargs, shared_prefix = scenario_settings(model_dir, scenario)
        settings.update(scenario_kwargs)
    return settings, shared_prefix


def generate_greedy(
    llm: LLM, prompts: list[list[int]]
) -> tuple[list[RequestOutput], EngineMetrics]:
    """``MAX_TOKENS`` greedy tokens for each prompt, and the engine's counters after."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outputs, llm.get_engine_metrics()


def check_scenario(
    scenario: str,
    outputs: list[RequestOutput],
    metrics: EngineMetrics,
    expected: list[list[int]],
) -> None:
    """The tokens are transformers', and the scenario did what it is there for."""
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if scenario == "preemption":
        assert metrics.num_preemptions > 0
    if scenario == "prefix-hits":
        assert metrics.prefix_cache_hit_tokens > 0
        assert sum(o.num_cached_tokens for o in outputs) > 0


@pytest.fixture(scope="module")
def references(
    tiny_model_dir: Callable[[str], Path], tokenizer: transformers.PreTrainedTokenizerBase
) -> Callable[[str, bool], tuple[list[list[int]], list[list[int]]]]:
    cache: dict[tuple[str, bool], tuple[list[list[int]], list[list[int]]]] = {}

    def get(name: str, shared_prefix: bool) -> tuple[list[list[int]], list[list[int]]]:
        key = (name, shared_prefix)
        if key not in cache:
            prompts = _shared_prefix_prompts(tokenizer) if shared_prefix else _prompts(tokenizer)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(name), dtype=torch.float32
            ).eval()
            expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
            cache[key] = (prompts, expected)
        return cache[key]

    return get


@pytest.mark.parametrize(
    ("arch", "scenario", "attention_backend"),
    [(arch, scenario, "cpu") for arch in TINY_MODELS for scenario in SCENARIOS]
    # The torch backend, the cpu backend's fallback where its C++ kernel cannot be built
    # (tests/layers/test_attention.py checks it against the reference in the default run).
    + [
        pytest.param(arch, scenario, "torch", marks=pytest.mark.slow)
        for arch in TINY_MODELS
        for scenario in SCENARIOS
    ]
    # The Triton kernels, under the interpreter on CPU (30-40 s each, so in the slow run;
    # tests/csrc_triton checks each kernel against torch in the default one): GQA with
    # chunked prefill, sliding window with prefix hits, head_dim 32 with chunked prefill.
    + [
        pytest.param(arch, scenario, "triton", marks=pytest.mark.slow)
        for arch, scenario in [
            ("llama", "chunked-prefill"),
            ("mistral", "prefix-hits"),
            ("qwen3", "chunked-prefill"),
        ]
    ],
)
def test_greedy_matches_transformers(
    arch: str,
    scenario: str,
    attention_backend: str,
    tiny_model_dir: Callable[[str], Path],
    references: Callable[[str, bool], tuple[list[list[int]], list[list[int]]]],
) -> None:
    settings, shared_prefix = scenario_settings(tiny_model_dir(arch), scenario)
    prompts, expected = references(arch, shared_prefix)
    with LLM(tiny_model_dir(arch), attention_backend=attention_backend, **settings) as llm:
        outputs, metrics = generate_greedy(llm, prompts)
    check_scenario(scenario, outputs, metrics, expected)
