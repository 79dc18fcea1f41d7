"""N-gram speculative decoding end to end: every request emits the tokens it emits without
speculation (greedy, seeded, with every sampling feature, stop conditions, logprobs, under
preemption and small budgets, n > 1), unseeded samples follow the same distribution, the
rule that verifies a draft against the sampler is exact, blocks and the prefix cache never
keep an unverified token, and the metrics add up."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from scipy.stats import chi2_contingency, chisquare

from paged_llm import LLM, SamplingParams, StructuredOutputsParams
from paged_llm.engine.block_manager import hash_block_tokens
from paged_llm.engine.speculation import num_accepted
from paged_llm.layers.sampler import Sampler, SamplingMetadata
from paged_llm.metrics import Counter, Vector
from paged_llm.outputs import RequestOutput
from tests.conftest import TINY_MODELS, hf_greedy

MAX_MODEL_LEN = 192
# Drafts at every step (the adaptive rule would measure and maybe turn them down), from
# one-token matches: a random model's output repeats tokens, so drafts are proposed often.
EAGER_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
# 12 blocks of 16 tokens of the tiny Llama (2 layers, keys and values of 2 heads of 16
# float32): max_model_len's, room for a few of the 16 sequences below, so some are preempted.
KV_CACHE_MEMORY_BYTES = 12 * 16 * 2 * 2 * 2 * 16 * 4
# The tiny models' eos_token_id (tests/conftest.py).
EOS = 2
# A few tokens: outputs restricted to them cycle, so drafts are mostly accepted.
FEW_TOKENS = [1000, 2000, 3000, 4000]


def copy_heavy_prompts(tokenizer: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    text = [
        "Copy this list: apple, banana, cherry, apple, banana, cherry, apple, banana",
        "Rewrite: the cat sat on the mat. The cat sat on the mat. The cat sat",
        "Hello world",
    ]
    return [tokenizer(t).input_ids for t in text] + [FEW_TOKENS * 3 + [7]]


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def spec_counts(llm: LLM) -> dict[str, Any]:
    return {
        m.name.removeprefix("vllm:spec_decode_"): m.values if isinstance(m, Vector) else m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode") and isinstance(m, (Counter, Vector))
    }


def both(
    model_dir: Path, check: Callable[[LLM], Any], **settings: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """``check`` run on an LLM without and one with speculation; the second's counts (and
    preemptions), after checking that it ended with every block free."""
    with LLM(model_dir, max_model_len=MAX_MODEL_LEN, **settings) as plain:
        without = check(plain)
    with LLM(
        model_dir, max_model_len=MAX_MODEL_LEN, speculative_config=EAGER_NGRAM, **settings
    ) as llm:
        with_speculation = check(llm)
        counts = spec_counts(llm) | {"preemptions": llm.engine.scheduler.num_preemptions}
        block_manager = llm.engine.block_manager
        assert block_manager.num_free_blocks == block_manager.num_blocks
    return without, with_speculation, counts


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
GREEDY_FEW = SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True, allowed_token_ids=FEW_TOKENS
)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_greedy_tokens_are_those_without_speculation_on_every_architecture(
    name: str,
    tiny_model_dir: Callable[[str], Path],
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    model_dir = tiny_model_dir(name)
    prompts = copy_heavy_prompts(tokenizer)
    without, with_speculation, counts = both(
        model_dir, lambda llm: tokens(run(llm, prompts, GREEDY) + run(llm, prompts, GREEDY_FEW))
    )
    assert with_speculation == without
    # Drafts were verified, accepted and rejected: the test saw both paths.
    assert counts["num_accepted_tokens"] > 0
    assert counts["num_draft_tokens"] > counts["num_accepted_tokens"]
    if name == "llama":
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        expected = [[hf_greedy(model, prompt, GREEDY.max_tokens)] for prompt in prompts]
        assert with_speculation[: len(prompts)] == expected


def late_stop_string(tokenizer: transformers.PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """The text of three tokens from the ninth on that does not occur before them."""
    for start in range(8, len(token_ids) - 3):
        before = tokenizer.decode(token_ids[: start + 2])
        window = tokenizer.decode(token_ids[: start + 3])[
            len(tokenizer.decode(token_ids[:start])) :
        ]
        if window not in before:
            return window
    raise AssertionError(f"every window of {token_ids} occurs early")


def test_n_stop_strings_stop_tokens_and_logprobs_under_preemption_and_small_budgets(
    llama_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    """n > 1 needs sampling: seeded, so that the tokens are determined."""
    prompts = copy_heavy_prompts(tokenizer) * 2
    sampled = {"temperature": 0.7, "top_k": 2, "seed": 9, "max_tokens": 32, "ignore_eos": True}
    sampled |= {"allowed_token_ids": FEW_TOKENS, "n": 2}
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN) as plain:
        reference = run(plain, prompts, SamplingParams(**sampled))
    # A stop string that the reference meets late in the first output, and a stop token in
    # the middle of the last one.
    stop = late_stop_string(tokenizer, reference[0].outputs[0].token_ids)
    params = [
        SamplingParams(**sampled, logprobs=2, stop=[stop]),
        SamplingParams(**sampled, logprobs=2),
        SamplingParams(**sampled, include_stop_str_in_output=True, stop=[stop]),
        SamplingParams(**sampled, stop_token_ids=[reference[3].outputs[1].token_ids[9]]),
    ] * 2
    settings = {"max_num_batched_tokens": 24, "kv_cache_memory_bytes": KV_CACHE_MEMORY_BYTES}

    def outputs(llm: LLM) -> list[tuple[Any, ...]]:
        return [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
            for o in run(llm, prompts, params)
            for c in o.outputs
        ]

    without, with_speculation, counts = both(llama_dir, outputs, **settings)
    assert counts["num_accepted_tokens"] > 0
    assert counts["preemptions"] > 0
    assert {reason for *_, reason, _ in without} >= {stop, *params[3].stop_token_ids}
    for plain, speculated in zip(without, with_speculation, strict=True):
        assert speculated[:4] == plain[:4]
        for position_plain, position_speculated in zip(
            plain[4] or [], speculated[4] or [], strict=True
        ):
            assert position_speculated.keys() == position_plain.keys()
            for token, logprob in position_plain.items():
                # NOTE: a draft's logits come from a forward of several tokens, equal to a
                # decode's within float32 rounding: a deep-tail rank among 49k near-equal
                # logprobs may move by one.
                assert abs(position_speculated[token].rank - logprob.rank) <= 1
                assert position_speculated[token].logprob == pytest.approx(
                    logprob.logprob, abs=1e-4
                )


SAMPLED = dict(temperature=0.9, top_k=3, max_tokens=20, ignore_eos=True)
SAMPLING_FEATURES = [
    SamplingParams(**SAMPLED, seed=1),
    SamplingParams(**SAMPLED, seed=2, repetition_penalty=1.3, frequency_penalty=0.2),
    SamplingParams(**SAMPLED, seed=3, presence_penalty=0.5, min_p=0.05, top_p=0.9),
    SamplingParams(**SAMPLED, seed=4, min_tokens=10, logit_bias={1000: 3.0, 2000: 3.0}),
    SamplingParams(**SAMPLED, seed=5, bad_words=["apple"], allowed_token_ids=FEW_TOKENS),
    SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5, ignore_eos=True),
    # EOS allowed and not ignored: it ends a run of accepted draft tokens where it falls.
    SamplingParams(
        temperature=0.9, top_k=4, max_tokens=20, seed=6, allowed_token_ids=[*FEW_TOKENS, EOS]
    ),
]


def test_seeded_samples_with_every_feature_are_those_without_speculation_alone_or_batched(
    llama_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    prompts = copy_heavy_prompts(tokenizer)
    batch = [prompt for prompt in prompts for _ in SAMPLING_FEATURES]
    params = SAMPLING_FEATURES * len(prompts)

    def sampled(llm: LLM) -> tuple[Any, Any]:
        together = tokens(run(llm, batch, params))
        alone = [tokens(run(llm, [batch[i]], params[i]))[0] for i in (0, 7, 16)]
        return together, alone

    (without, _), (with_speculation, alone), counts = both(llama_dir, sampled)
    assert with_speculation == without
    assert alone == [without[i] for i in (0, 7, 16)]
    assert counts["num_accepted_tokens"] > 0
    # Some request of the EOS case stopped on it before max_tokens.
    stopped = [t for (t,), p in zip(without, params, strict=True) if p is SAMPLING_FEATURES[-1]]
    assert any(len(t) < 20 and t[-1] == EOS for t in stopped)


def test_unseeded_samples_follow_the_distribution_they_follow_without_speculation(
    llama_dir: Path,
) -> None:
    """Different engine seeds, so the two runs draw independently: the tokens at each
    position pass a chi-square homogeneity test."""
    params = SamplingParams(temperature=1.0, max_tokens=4, allowed_token_ids=FEW_TOKENS)
    prompts = [FEW_TOKENS * 3] * 300
    samples = []
    for seed, speculative in ((1, None), (2, EAGER_NGRAM)):
        with LLM(
            llama_dir, max_model_len=MAX_MODEL_LEN, seed=seed, speculative_config=speculative
        ) as llm:
            samples.append(tokens(run(llm, prompts, params)))
            if speculative is not None:
                assert spec_counts(llm)["num_accepted_tokens"] > 50
    for position in range(4):
        table = [
            [sum(out[0][position] == token for out in run_samples) for token in FEW_TOKENS]
            for run_samples in samples
        ]
        kept = [column for column in zip(*table, strict=True) if sum(column) > 0]
        assert chi2_contingency(list(zip(*kept, strict=True))).pvalue > 1e-3


def test_verifying_a_draft_against_the_sampler_emits_the_target_distribution() -> None:
    """The acceptance rule alone, on a 5-token vocabulary: a fixed draft of two tokens,
    target rows p0 and p1 (p1 does not depend on the first token here). The first emitted
    token follows p0, the draft token is accepted with probability p0(x), and the token
    after an accepted one follows p1."""
    vocab, samples = 5, 20_000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    probs = logits.softmax(dim=-1)
    draft = [int(probs[0].argmin()), 2]
    rows = logits.repeat(samples, 1)
    metadata = SamplingMetadata(
        temperature=torch.ones(3 * samples),
        seeds=torch.arange(samples).repeat_interleave(3),
        counters=torch.arange(3).repeat(samples),
        all_greedy=False,
    )
    drawn = Sampler()(rows, metadata).token_ids.view(samples, 3).tolist()
    firsts = torch.zeros(vocab)
    seconds = torch.zeros(vocab)
    accepted = 0
    for row in drawn:
        emitted = row[: 1 + num_accepted(row, draft)]
        firsts[emitted[0]] += 1
        if len(emitted) > 1:
            accepted += 1
            seconds[emitted[1]] += 1
    assert chisquare(firsts.numpy(), (probs[0] * samples).numpy()).pvalue > 1e-3
    assert accepted / samples == pytest.approx(float(probs[0, draft[0]]), abs=0.01)
    assert chisquare(seconds.numpy(), (probs[1] * accepted).numpy()).pvalue > 1e-3


def test_the_prefix_cache_holds_only_committed_tokens(
    llama_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    """After a run with many rejected drafts, every cached block is a block of some
    request's committed tokens, and prompts that extend those outputs, served from the cache,
    get the tokens an engine without a cache gives them."""
    prompts = copy_heavy_prompts(tokenizer)
    with LLM(
        llama_dir, max_model_len=MAX_MODEL_LEN, speculative_config=EAGER_NGRAM, block_size=16
    ) as llm:
        outputs = run(llm, prompts, GREEDY) + run(llm, prompts, GREEDY_FEW)
        counts = spec_counts(llm)
        block_manager = llm.engine.block_manager
        committed = set()
        for output in outputs:
            token_ids = output.prompt_token_ids + list(output.outputs[0].token_ids)
            parent = None
            for start in range(0, len(token_ids) - 15, 16):
                parent = hash_block_tokens(parent, token_ids[start : start + 16])
                committed.add(parent)
        assert set(block_manager.cached_blocks) <= committed
        assert len(block_manager.cached_blocks) > len(prompts)
        follow_ups = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outputs]
        cached = tokens(run(llm, follow_ups, GREEDY))
    assert counts["num_draft_tokens"] - counts["num_accepted_tokens"] > 20
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False) as fresh:
        assert tokens(run(fresh, follow_ups, GREEDY)) == cached


def test_the_metrics_add_up(
    llama_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, speculative_config=EAGER_NGRAM) as llm:
        outputs = run(llm, copy_heavy_prompts(tokenizer), GREEDY_FEW)
        counts = spec_counts(llm)
        generated = next(m.value for m in llm.get_metrics() if m.name == "vllm:generation_tokens")
    assert generated == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert sum(counts["num_accepted_tokens_per_pos"]) == counts["num_accepted_tokens"] > 0
    per_position = counts["num_accepted_tokens_per_pos"]
    assert per_position == sorted(per_position, reverse=True) and len(per_position) == 4
    assert counts["num_emitted_tokens"] == counts["num_accepted_tokens"] + counts["num_drafts"]
    assert counts["num_draft_tokens"] <= 4 * counts["num_drafts"]


def test_structured_outputs_do_not_speculate_and_are_unchanged(llama_dir: Path) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,6}"),
    )
    free = SamplingParams(
        temperature=0.0, max_tokens=16, allowed_token_ids=FEW_TOKENS, ignore_eos=True
    )
    prompts = [FEW_TOKENS * 3, FEW_TOKENS * 2]

    def texts(llm: LLM) -> list[str]:
        constrained = run(llm, prompts[:1], params)
        if llm.engine.scheduler.speculator is not None:
            # The constrained request alone proposed nothing to verify.
            assert spec_counts(llm)["num_drafts"] == 0
        outputs = constrained + run(llm, prompts[1:], free)
        return [o.outputs[0].text for o in outputs] + [str(o.outputs[0].token_ids) for o in outputs]

    without, with_speculation, counts = both(llama_dir, texts)
    assert with_speculation == without
    assert counts["num_drafts"] > 0


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            {"speculative_config": {"method": "eagle", "num_speculative_tokens": 2}},
            r"\['method'\]='eagle'",
        ),
        (
            {"speculative_config": {"num_speculative_tokens": 2, "prompt_lookup_mn": 2}},
            r"prompt_lookup_mn",
        ),
        ({"speculative_config": {"num_speculative_tokens": 0}}, r"\['num_speculative_tokens'\]"),
        ({"speculative_config": "ngram"}, r"speculative_config"),
        (
            {"speculative_config": {"num_speculative_tokens": 2}, "runner": "pooling"},
            r"speculative_config.*runner='pooling'",
        ),
        (
            {
                "speculative_config": {"num_speculative_tokens": 2},
                "logits_processors": ["tests.test_logits_processors:CountingProcessor"],
            },
            r"speculative_config with logits_processors",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(
    llama_dir: Path, settings: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(llama_dir, max_model_len=MAX_MODEL_LEN, **settings)


@pytest.mark.gpu
def test_on_cuda_speculation_emits_the_tokens_of_a_run_without_it(
    llama_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    """The GPU path: Triton attention over multi-token queries, decode graphs for the steps
    without drafts, the sampler on the device."""
    prompts = copy_heavy_prompts(tokenizer)
    seeded = SamplingParams(temperature=0.8, top_k=3, seed=4, max_tokens=24, ignore_eos=True)

    def all_tokens(llm: LLM) -> list[Any]:
        return [tokens(run(llm, prompts, p)) for p in (GREEDY, GREEDY_FEW, seeded)]

    without, with_speculation, counts = both(
        llama_dir, all_tokens, device="cuda", dtype="float32", kv_cache_memory_bytes=2**26
    )
    assert with_speculation == without
    assert counts["num_accepted_tokens"] > 0


def test_under_the_adaptive_rule_the_tokens_are_the_same(
    llama_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    """The rule (the default) only decides how much to verify: the probes, the fitted cost
    and each sequence's acceptance change the speed, never the tokens."""
    adaptive = {key: value for key, value in EAGER_NGRAM.items() if key != "adaptive"}
    prompts = copy_heavy_prompts(tokenizer) * 4
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN) as plain:
        expected = tokens(run(plain, prompts, GREEDY_FEW))
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, speculative_config=adaptive) as llm:
        assert llm.engine.scheduler.speculator is not None
        assert tokens(run(llm, prompts, GREEDY_FEW)) == expected
        counts = spec_counts(llm)
    assert counts["num_drafts"] > 0
