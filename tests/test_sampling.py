"""Sampling features through the whole engine on a tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from paged_llm import LLM, SamplingParams
from paged_llm.engine.detokenizer import IncrementalDetokenizer
from paged_llm.engine.request import EngineRequest

MAX_MODEL_LEN = 256
PROMPT = "The library opens at nine in the morning, and the first visitors are usually"
OTHER_PROMPTS = [
    "Rain fell all night over the harbour",
    "A recipe for bread needs flour, water,",
    "The committee met on Tuesday to decide",
    "In the beginning the universe was",
    "Our train was delayed by",
    "She opened the letter and read",
    "Mountains in the north are covered",
    "The best way to learn a language is",
    "When the power went out, we",
    "His favourite number was",
]


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)


def _seeded_tokens(llm: LLM, position: int | None) -> list[int]:
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    prompts = list(OTHER_PROMPTS) if position is not None else []
    params = [unseeded] * len(prompts)
    index = position if position is not None else 0
    prompts.insert(index, PROMPT)
    params.insert(index, SEEDED)
    return llm.generate(prompts, params, use_tqdm=False)[index].outputs[0].token_ids


def test_seeded_request_ignores_batch_companions(llm: LLM, model_dir: Path) -> None:
    alone = _seeded_tokens(llm, None)
    assert _seeded_tokens(llm, 6) == alone
    with LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=2) as narrow:
        assert _seeded_tokens(narrow, 9) == alone
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x (K, V) x 16 tokens = 8 KiB per block:
    # 20 blocks cannot hold eleven growing sequences at once.
    with LLM(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=20 * 8192,
        max_num_batched_tokens=64,
    ) as small:
        assert _seeded_tokens(small, 3) == alone
        assert small.get_engine_metrics().num_preemptions > 0


def test_unseeded_requests_follow_the_llm_seed(model_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        with LLM(model_dir, max_model_len=MAX_MODEL_LEN, seed=seed) as instance:
            return [
                o.outputs[0].token_ids
                for o in instance.generate(OTHER_PROMPTS, params, use_tqdm=False)
            ]

    first = run(0)
    assert run(0) == first
    assert run(1) != first
    assert len({tuple(tokens) for tokens in first}) == len(first)


def test_n_completions_share_prompt_blocks_and_free_them(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    prompt_ids = llm.tokenizer(PROMPT * 3)["input_ids"]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    request = engine.add_request(EngineRequest("n-test", None, prompt_ids, params))
    parent = request.seqs[0]
    outputs = []
    while not all(seq.block_table for seq in request.seqs):
        outputs.extend(engine.step())
    num_full_prompt_blocks = (len(prompt_ids) - 1) // bm.block_size
    shared = parent.block_table[:num_full_prompt_blocks]
    assert num_full_prompt_blocks >= 2
    for seq in request.seqs:
        assert seq.block_table[:num_full_prompt_blocks] == shared
        # The shared blocks keep one hash chain (the children take the parent's).
        assert (
            seq.block_hashes[:num_full_prompt_blocks]
            == parent.block_hashes[:num_full_prompt_blocks]
        )
    assert [bm.blocks[b].ref_count for b in shared] == [4] * num_full_prompt_blocks
    while engine.has_unfinished():
        outputs.extend(engine.step())
    (output,) = outputs
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    assert all(len(c.token_ids) == 6 for c in output.outputs)
    assert bm.num_free_blocks == bm.num_blocks


def test_n_completions_through_generate(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True, seed=3)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    (again,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in output.outputs)
    # Each sibling draws from its own seed, the same in every run.
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def _reference_logprobs(
    hf_model: transformers.PreTrainedModel, token_ids: list[int]
) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_and_prompt_logprobs_equal_transformers_with_a_warm_cache(
    llm: LLM, hf_model: transformers.PreTrainedModel
) -> None:
    long_prompt = " ".join(OTHER_PROMPTS)
    plain = SamplingParams(max_tokens=1)
    # Warm the prefix cache with the same prompt first.
    llm.generate(long_prompt, plain, use_tqdm=False)
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    (output,) = llm.generate(long_prompt, params, use_tqdm=False)
    # Cached blocks have no logits: a request owing prompt logprobs recomputes its prompt,
    # while the cache stays warm for everyone else.
    assert output.num_cached_tokens == 0
    assert llm.generate(long_prompt, plain, use_tqdm=False)[0].num_cached_tokens > 0
    completion = output.outputs[0]
    reference = _reference_logprobs(hf_model, output.prompt_token_ids + completion.token_ids)
    prompt_ids = output.prompt_token_ids

    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        _check_position(
            output.prompt_logprobs[position], prompt_ids[position], reference[position - 1], 2
        )

    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for i, token in enumerate(completion.token_ids):
        row = reference[len(prompt_ids) - 1 + i]
        _check_position(completion.logprobs[i], token, row, 3)
        total += float(row[token])
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_prompt_logprobs_are_exact_across_prefill_chunks(
    model_dir: Path, hf_model: transformers.PreTrainedModel
) -> None:
    budget = 16
    with LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget) as chunked:
        (output,) = chunked.generate(
            " ".join(OTHER_PROMPTS), SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
        )
    prompt_ids = output.prompt_token_ids
    # Several chunks, so rows are scored chunk by chunk and none twice or never.
    assert len(prompt_ids) > 3 * budget
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt_ids)
    reference = _reference_logprobs(hf_model, prompt_ids)
    for position in range(1, len(prompt_ids)):
        _check_position(
            output.prompt_logprobs[position], prompt_ids[position], reference[position - 1], 1
        )


@pytest.mark.parametrize("block_size", [4, 16])
def test_prompt_logprobs_from_a_start_position_use_the_prefix_cache(
    model_dir: Path, hf_model: transformers.PreTrainedModel, block_size: int
) -> None:
    """lm-eval's pattern: a continuation scored after a context another request computed."""
    context = " ".join(OTHER_PROMPTS)
    with LLM(model_dir, max_model_len=MAX_MODEL_LEN, block_size=block_size) as llm:
        context_ids = llm.get_tokenizer().encode(context)
        llm.generate({"prompt_token_ids": context_ids}, SamplingParams(max_tokens=1))
        prompt_ids = [*context_ids, 11, 12, 13, 14, 15]
        start = len(context_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=start)
        (output,) = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
        # Served from the cache up to the last block wholly before the scored positions'
        # inputs (position start - 1 gives token start's logits).
        assert output.num_cached_tokens == (start - 1) // block_size * block_size > 0
        (full,) = llm.generate(
            {"prompt_token_ids": prompt_ids},
            SamplingParams(max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
        )
        assert full.num_cached_tokens == 0
    assert output.prompt_logprobs is not None and full.prompt_logprobs is not None
    assert len(output.prompt_logprobs) == len(prompt_ids)
    assert output.prompt_logprobs[:start] == [None] * start
    reference = _reference_logprobs(hf_model, prompt_ids)
    for position in range(start, len(prompt_ids)):
        _check_position(
            output.prompt_logprobs[position], prompt_ids[position], reference[position - 1], 1
        )
        # NOTE: the cached run computes a query of a few tokens, attended as decodes; the
        # full run a prefill: equal within float rounding, which may move a deep-tail rank
        # among 49k near-equal logprobs by one.
        cached, computed = output.prompt_logprobs[position], full.prompt_logprobs[position]
        assert cached is not None and computed is not None and cached.keys() == computed.keys()
        for token, logprob in computed.items():
            assert abs(cached[token].rank - logprob.rank) <= 1
            assert cached[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)


def test_a_bad_prompt_logprobs_start_names_the_request(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs_start must be an integer >= 0, and 0"):
        SamplingParams(prompt_logprobs_start=3)
    with pytest.raises(ValueError, match=r"prompt_logprobs_start must be an integer >= 0"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=3)
    with pytest.raises(
        ValueError,
        match=r"Request 1: prompt_logprobs_start=3 is past the prompt's last position, 2",
    ):
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [5, 6, 7]}], params)


def _check_position(entry: dict, token: int, reference_row: torch.Tensor, num_top: int) -> None:
    assert token in entry
    assert entry[token].logprob == pytest.approx(float(reference_row[token]), abs=1e-4)
    # A rank counts the tokens above; those within float32 noise of this one may fall on
    # either side (a far-tail token of 49,152 often ties with others).
    value = float(reference_row[token])
    fewest_above = int((reference_row > value + 1e-5).sum())
    most_above = int((reference_row > value - 1e-5).sum()) - 1
    assert fewest_above + 1 <= entry[token].rank <= max(fewest_above, most_above) + 1
    top = reference_row.topk(num_top)
    for rank, (value, top_id) in enumerate(
        zip(top.values.tolist(), top.indices.tolist(), strict=True), 1
    ):
        assert entry[top_id].logprob == pytest.approx(value, abs=1e-4)
        if top_id != token:
            assert entry[top_id].rank == rank
    assert set(entry) <= set(top.indices.tolist()) | {token}


def _greedy_text(llm: LLM, **fields: object) -> tuple[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **fields)
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    return completion.text, completion.token_ids


def test_stop_strings_across_token_boundaries(llm: LLM) -> None:
    text, token_ids = _greedy_text(llm)
    pieces = [llm.tokenizer.decode(token_ids[:i]) for i in range(len(token_ids) + 1)]
    # A stop string made of the end of token 3's text and the start of token 4's.
    boundary = len(pieces[3])
    stop = text[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and text.find(stop) == boundary - 2, "pick another boundary"

    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop=["never there", stop]
    )
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert completion.text == text[: boundary - 2]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == token_ids[:4]

    params.include_stop_str_in_output = True
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert completion.text == text[: boundary + 2]


def test_stop_token_ids_min_tokens_and_logit_bias(llm: LLM) -> None:
    _, token_ids = _greedy_text(llm)
    forced = token_ids[5] + 1
    biased = SamplingParams(temperature=0, max_tokens=20, logit_bias={forced: 100.0})
    completion = llm.generate(PROMPT, biased, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [forced] * 20

    biased.stop_token_ids = [forced]
    completion = llm.generate(PROMPT, biased, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [forced]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", forced)

    biased.min_tokens = 4
    completion = llm.generate(PROMPT, biased, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 5 and completion.token_ids[-1] == forced
    assert forced not in completion.token_ids[:4]

    eos = next(iter(llm.eos_token_ids))
    to_eos = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0}, min_tokens=3)
    completion = llm.generate(PROMPT, to_eos, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 4 and completion.token_ids[-1] == eos
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_allowed_tokens_special_tokens_and_text(llm: LLM) -> None:
    tokenizer = llm.tokenizer
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>")]
    ordinary = tokenizer(" café 世界 🎉 done")["input_ids"]
    allowed = sorted(set(specials + ordinary))
    for skip in (True, False):
        params = SamplingParams(
            temperature=1.0,
            seed=11,
            max_tokens=40,
            allowed_token_ids=allowed,
            ignore_eos=True,
            skip_special_tokens=skip,
        )
        completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert set(completion.token_ids) <= set(allowed)
        assert set(completion.token_ids) & set(specials), "draw some special tokens"
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_equals_a_full_decode(llm: LLM, skip_special_tokens: bool) -> None:
    tokenizer = llm.tokenizer
    text = "naïve café — 世界 🎉<|im_end|> done\n\tok <|im_start|>x"
    token_ids = tokenizer(text)["input_ids"]
    prompt = tokenizer("Say:")["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, True)
    pieces = [detokenizer.update(token) for token in token_ids]
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == detokenizer.text == expected
    assert all("\ufffd" not in piece for piece in pieces)


def test_bad_words_are_never_generated(llm: LLM) -> None:
    _text, token_ids = _greedy_text(llm)
    word = llm.tokenizer.decode(token_ids[2:4]).strip()
    assert word
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word])
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    banned = llm.processor._bad_words_token_ids(params)
    for sequence in banned:
        size = len(sequence)
        windows = [
            completion.token_ids[i : i + size] for i in range(len(completion.token_ids) - size + 1)
        ]
        assert sequence not in windows
    assert completion.token_ids != token_ids


class _ReferenceConstraints(transformers.LogitsProcessor):
    """vLLM's order on top of transformers: logit bias, then transformers' repetition
    penalty (prompt and output tokens), then presence / frequency over output tokens."""

    def __init__(
        self,
        prompt_len: int,
        bias: dict[int, float],
        repetition: float,
        presence: float,
        frequency: float,
    ) -> None:
        self.prompt_len, self.bias = prompt_len, bias
        self.repetition = transformers.RepetitionPenaltyLogitsProcessor(repetition)
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[:, token] += value
        scores = self.repetition(input_ids, scores)
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
        return scores - self.frequency * counts.to(scores.dtype) - self.presence * (counts > 0)


@pytest.mark.parametrize(
    ("repetition", "presence", "frequency"),
    [(1.8, 0.0, 0.0), (1.0, -2.0, 0.0), (1.0, 0.0, 2.0), (1.3, 1.0, 1.0)],
)
def test_penalized_greedy_decoding_equals_the_reference(
    llm: LLM,
    hf_model: transformers.PreTrainedModel,
    repetition: float,
    presence: float,
    frequency: float,
) -> None:
    prompt_ids = llm.tokenizer(PROMPT)["input_ids"]
    max_tokens = 24
    # Five strongly biased tokens crowd out the rest: greedy decoding cycles among them,
    # which is what the penalties act on.
    bias = {token: 20.0 for token in (500, 1500, 2500, 3500, 4500)}

    def ours(**penalties: float) -> list[int]:
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logit_bias=bias, **penalties
        )
        return (
            llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )

    penalized = ours(
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency
    )
    processor = _ReferenceConstraints(len(prompt_ids), bias, repetition, presence, frequency)
    with torch.no_grad():
        reference = hf_model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([processor]),
        )[0, len(prompt_ids) :].tolist()
    assert len(reference) == max_tokens
    assert penalized == reference
    assert penalized != ours(), "the penalties should matter here"


def test_chat_renders_exactly_the_chat_template(llm: LLM) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    expected = llm.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True
    )
    expected_ids = list(expected) if isinstance(expected, list) else expected["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.chat([conversation, conversation[1:]], params, use_tqdm=False)
    assert outputs[0].prompt_token_ids == expected_ids
    assert outputs[0].prompt == llm.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    assert len(outputs) == 2 and outputs[1].prompt_token_ids != expected_ids

    continued = [*conversation, {"role": "assistant", "content": "It is"}]
    (output,) = llm.chat(
        continued, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    assert output.prompt.endswith("It is")
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(continued, params, continue_final_message=True)


def test_defaults_come_from_generation_config(model_dir: Path, tmp_path: Path) -> None:
    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    generation = {
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_new_tokens": 7,
    }
    (local / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 2}))
    with LLM(local, max_model_len=MAX_MODEL_LEN) as instance:
        defaults = instance.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.3, 0.9, 20)
        assert (defaults.repetition_penalty, defaults.max_tokens) == (1.1, 7)
        (output,) = instance.generate(PROMPT, use_tqdm=False)
        assert len(output.outputs[0].token_ids) <= 7
