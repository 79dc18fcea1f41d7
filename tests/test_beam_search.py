"""`LLM.beam_search` on a tiny random model, against a beam search that recomputes every
beam's whole sequence with transformers (tests/beam_reference.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import xgrammar

from paged_llm import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from paged_llm.engine.request import EngineRequest
from tests.beam_reference import ReferenceBeam, TopCandidates, reference_beam_search

# NOTE: the tiny model gains nothing from a second thread (see tests/test_cli.py).

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_MODEL_LEN = 64
PROMPTS = ["The lighthouse keeper counted the ships", "Seven small boats"]


@pytest.fixture(scope="module")
def hf_model(llama_dir: Path) -> transformers.PreTrainedModel:
    path = llama_dir
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_top(hf_model: transformers.PreTrainedModel) -> TopCandidates:
    def top(sequences: list[list[int]], count: int) -> list[list[tuple[int, float]]]:
        with torch.no_grad():
            logits = hf_model(torch.tensor(sequences), logits_to_keep=1).logits[:, -1].float()
        logprobs, token_ids = torch.log_softmax(logits, dim=-1).topk(count)
        return [
            list(zip(ids, lps, strict=True))
            for ids, lps in zip(token_ids.tolist(), logprobs.tolist(), strict=True)
        ]

    return top


@pytest.fixture(scope="module")
def eos_model_dir(
    llama_dir: Path,
    tokenizer: transformers.PreTrainedTokenizerBase,
    hf_top: TopCandidates,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The tiny model with an EOS it emits: the runner-up of the greedy path's third token,
    so that beams of every width meet it."""
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    greedy = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True)
    (path,) = reference_beam_search(hf_top, prompt, greedy, frozenset(), MAX_MODEL_LEN)
    (top,) = hf_top([path.tokens], 2)
    path_dir = tmp_path_factory.mktemp("eos-llama")
    shutil.copytree(llama_dir, path_dir, dirs_exist_ok=True)
    config = json.loads((path_dir / "generation_config.json").read_text())
    config["eos_token_id"] = top[1][0]
    (path_dir / "generation_config.json").write_text(json.dumps(config))
    return path_dir


@pytest.fixture(scope="module")
def model_dir(eos_model_dir: Path) -> Path:
    """The module's `llm` runs the model with an EOS it emits."""
    return eos_model_dir


def prompt_ids(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


def check_against_reference(
    llm: LLM, outputs: list[BeamSearchOutput], params: BeamSearchParams, hf_top: TopCandidates
) -> None:
    for prompt, output in zip(prompt_ids(llm), outputs, strict=True):
        expected = reference_beam_search(
            hf_top, prompt, params, llm.eos_token_ids, llm.config.max_model_len
        )
        got = [
            ReferenceBeam(seq.tokens, seq.cum_logprob, seq.finish_reason or "")
            for seq in output.sequences
        ]
        assert [(b.tokens, b.finish_reason) for b in got] == [
            (b.tokens, b.finish_reason) for b in expected
        ]
        assert [b.cum_logprob for b in got] == pytest.approx(
            [b.cum_logprob for b in expected], abs=1e-4
        )


@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("beam_width", [1, 2, 4])
def test_beam_search_equals_the_reference(
    llm: LLM, hf_top: TopCandidates, beam_width: int, ignore_eos: bool, length_penalty: float
) -> None:
    params = BeamSearchParams(
        beam_width=beam_width, max_tokens=6, ignore_eos=ignore_eos, length_penalty=length_penalty
    )
    outputs = llm.beam_search(PROMPTS, params)
    check_against_reference(llm, outputs, params, hf_top)
    for prompt, output in zip(prompt_ids(llm), outputs, strict=True):
        assert len(output.sequences) == beam_width
        for seq in output.sequences:
            generated = seq.tokens[len(prompt) :]
            assert seq.tokens[: len(prompt)] == prompt
            # One dict per generated token, over the 2 * beam_width candidates of its step.
            assert [len(position) for position in seq.logprobs] == [2 * beam_width] * len(generated)
            chosen = [
                position[t].logprob for position, t in zip(seq.logprobs, generated, strict=True)
            ]
            assert sum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-5)
            assert seq.text == llm.tokenizer.decode(
                seq.tokens[:-1] if seq.finish_reason == "stop" else seq.tokens
            )
    assert not llm.engine.has_unfinished()


def test_an_eos_ended_beam_completes_and_competes_by_its_length(llm: LLM) -> None:
    """At length_penalty 0.5 the short beam that ended with EOS (at its third token) beats
    the full-length ones; at 2 the long ones win."""
    (eos,) = llm.eos_token_ids - {llm.tokenizer.eos_token_id}
    params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5)
    (output,) = llm.beam_search(PROMPTS[0], params)
    best = output.sequences[0]
    assert (best.finish_reason, best.stop_reason, best.tokens[-1]) == ("stop", eos, eos)
    assert output.sequences[1].finish_reason == "length"
    eos_text = llm.tokenizer.decode([eos])
    assert not best.text.endswith(eos_text)
    params.include_stop_str_in_output = True
    (output,) = llm.beam_search(PROMPTS[0], params)
    assert output.sequences[0].text.endswith(eos_text)
    (output,) = llm.beam_search(PROMPTS[0], BeamSearchParams(2, 6, length_penalty=2.0))
    assert [seq.finish_reason for seq in output.sequences] == ["length", "length"]


def test_beam_width_one_equals_greedy_generate(llm: LLM) -> None:
    prompts = [*PROMPTS, {"prompt_token_ids": [7, 8, 9, 10]}]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    outputs = llm.beam_search(prompts, BeamSearchParams(1, 8, ignore_eos=True))
    prompts_ids = [*prompt_ids(llm), [7, 8, 9, 10]]
    got = [
        out.sequences[0].tokens[len(ids) :] for out, ids in zip(outputs, prompts_ids, strict=True)
    ]
    assert got == expected


def test_all_blocks_are_free_after_a_beam_search(llm: LLM) -> None:
    block_manager = llm.engine.block_manager
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=8))
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "settings",
    [
        # Blocks of 4 tokens take 2 KiB; 6 of them hold one max_model_len sequence, not the
        # eight beams of the two prompts: beams are preempted or parked. A token budget of 6
        # chunks the forks' recomputation.
        {"kv_cache_memory_bytes": 6 * 2048, "max_num_batched_tokens": 6},
        {"kv_cache_memory_bytes": 6 * 2048, "enable_prefix_caching": False},
        # One prompt's beams at a time.
        {"max_num_seqs": 4, "max_num_batched_tokens": 6},
    ],
    ids=["small-cache-and-budget", "small-cache-no-prefix-caching", "four-seqs"],
)
def test_memory_pressure_and_batching_change_nothing(
    eos_model_dir: Path, hf_top: TopCandidates, settings: dict[str, int | bool]
) -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=6)
    with LLM(eos_model_dir, max_model_len=24, block_size=4, **settings) as small:
        outputs = small.beam_search(PROMPTS, params)
        check_against_reference(small, outputs, params, hf_top)
        if "kv_cache_memory_bytes" in settings:
            assert small.get_engine_metrics().num_preemptions > 0
        block_manager = small.engine.block_manager
        assert block_manager.num_free_blocks == block_manager.num_blocks


def test_beams_stop_at_max_model_len(llm: LLM, hf_top: TopCandidates) -> None:
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 3))
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, params)
    expected = reference_beam_search(hf_top, prompt, params, llm.eos_token_ids, MAX_MODEL_LEN)
    assert [seq.tokens for seq in output.sequences] == [beam.tokens for beam in expected]
    assert all(len(seq.tokens) == MAX_MODEL_LEN for seq in output.sequences)
    assert {seq.finish_reason for seq in output.sequences} == {"length"}


def test_a_beam_search_runs_beside_generations_in_one_batch(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, n=2)
    (expected_beams,) = llm.beam_search(PROMPTS[0], params)
    (expected_samples,) = llm.generate(PROMPTS[1], sampled, use_tqdm=False)
    engine = llm.engine
    ids = prompt_ids(llm)
    engine.add_request(EngineRequest("beams", None, ids[0], params))
    engine.add_request(EngineRequest("samples", None, ids[1], sampled))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((output.request_id, output) for output in engine.step())
    beams = outputs["beams"].outputs
    assert [ids[0] + beam.token_ids for beam in beams] == [
        seq.tokens for seq in expected_beams.sequences
    ]
    assert [c.token_ids for c in outputs["samples"].outputs] == [
        c.token_ids for c in expected_samples.outputs
    ]


def test_above_temperature_zero_the_drawn_token_joins_the_candidates(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=6, temperature=5.0, ignore_eos=True)
    outputs = llm.beam_search(PROMPTS, params)
    widths = set()
    for prompt, output in zip(prompt_ids(llm), outputs, strict=True):
        scores = []
        for seq in output.sequences:
            generated = seq.tokens[len(prompt) :]
            widths.update(len(position) for position in seq.logprobs)
            chosen = [
                position[t].logprob for position, t in zip(seq.logprobs, generated, strict=True)
            ]
            assert sum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-5)
            scores.append(seq.cum_logprob / len(seq.tokens))
        assert scores == sorted(scores, reverse=True)
    # A draw at temperature 5 mostly falls outside the 4 most likely tokens.
    assert 5 in widths and widths <= {4, 5}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 0}, r"BeamSearchParams.beam_width must be an integer >= 1, got 0"),
        ({"beam_width": True}, r"BeamSearchParams.beam_width must be an integer >= 1, got True"),
        ({"beam_width": 2.0}, r"beam_width must be an integer >= 1, got 2.0"),
        ({"max_tokens": 0}, r"BeamSearchParams.max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": None}, r"BeamSearchParams.max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, r"BeamSearchParams.temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, r"temperature must be a finite number >= 0, got nan"),
        ({"length_penalty": float("inf")}, r"length_penalty must be a finite number, got inf"),
        ({"length_penalty": "1"}, r"length_penalty must be a finite number, got '1'"),
        ({"ignore_eos": 1}, r"BeamSearchParams.ignore_eos must be a bool, got 1"),
        ({"include_stop_str_in_output": None}, r"include_stop_str_in_output must be a bool"),
    ],
)
def test_bad_beam_search_params_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})  # type: ignore[arg-type]


def test_bad_beam_search_requests_are_refused_before_any_work(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    too_long = {"prompt_token_ids": [5] * MAX_MODEL_LEN}
    before = llm.get_engine_metrics()
    with pytest.raises(
        ValueError,
        match=rf"Request 1: the prompt has {MAX_MODEL_LEN} tokens, but max_model_len="
        rf"{MAX_MODEL_LEN} leaves room for at most {MAX_MODEL_LEN - 1} prompt tokens",
    ):
        llm.beam_search(["fine", too_long], params)
    with pytest.raises(ValueError, match=r"Request 0: the prompt is empty"):
        llm.beam_search([""], params)
    with pytest.raises(ValueError, match=r"Request 0: prompt token id 49152 is outside"):
        llm.beam_search({"prompt_token_ids": [49152]}, params)
    with pytest.raises(ValueError, match=r"params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search("fine", SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams, got Beam"):
        llm.generate(["fine"], [params])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"beam_width=65 exceeds max_num_seqs=64"):
        llm.beam_search("fine", BeamSearchParams(beam_width=65, max_tokens=4))
    params.beam_width = 0  # changed after it was checked
    with pytest.raises(ValueError, match=r"BeamSearchParams.beam_width must be an integer >= 1"):
        llm.beam_search("fine", params)
    assert llm.get_engine_metrics().num_requests == before.num_requests


def test_vllm_s_call_forms(llm: LLM, eos_model_dir: Path) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    expected = llm.beam_search(PROMPTS, params)
    text_prompts = [{"prompt": prompt} for prompt in PROMPTS]
    for outputs in (
        llm.beam_search(text_prompts, params, None, False, concurrency_limit=1),
        llm.beam_search(PROMPTS, params, use_tqdm=True, concurrency_limit=5),
    ):
        for output, reference in zip(outputs, expected, strict=True):
            assert [s.tokens for s in output.sequences] == [s.tokens for s in reference.sequences]
            assert [s.cum_logprob for s in output.sequences] == pytest.approx(
                [s.cum_logprob for s in reference.sequences], abs=1e-4
            )
    with pytest.raises(ValueError, match=r"lora_request must be a LoRARequest"):
        llm.beam_search(PROMPTS, params, lora_request=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"concurrency_limit must be None or an integer >= 1"):
        llm.beam_search(PROMPTS, params, concurrency_limit=0)
    with (
        LLM(eos_model_dir, max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True) as bare,
        pytest.raises(ValueError, match=r"Beam search decodes .* skip_tokenizer_init=True"),
    ):
        bare.beam_search({"prompt_token_ids": [5, 6, 7]}, params)


# ----- structured outputs on beams ------------------------------------------------------

# A regex and a JSON schema short enough for beams of 12 tokens to complete.
BEAM_CONSTRAINTS = {
    "regex": StructuredOutputsParams(regex=r"(cat|dog|owl)s? [0-9]{1,2}"),
    "json": StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        disable_any_whitespace=True,
    ),
}


def grammar_masked_top(
    hf_model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    constraint: StructuredOutputsParams,
    eos_token_ids: frozenset[int],
    prompt_len: int,
) -> TopCandidates:
    """The reference's candidates under a grammar: each sequence's matcher replayed from
    scratch over its generated tokens, its mask applied to transformers' logits, the top
    tokens the grammar allows of the distribution it leaves."""
    vocab_size = max(hf_model.config.vocab_size, len(tokenizer))
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
    )
    compiler = xgrammar.GrammarCompiler(info)
    if constraint.regex is not None:
        compiled = compiler.compile_regex(constraint.regex)
    else:
        compiled = compiler.compile_json_schema(constraint.json, any_whitespace=False)

    def top(sequences: list[list[int]], count: int) -> list[list[tuple[int, float]]]:
        with torch.no_grad():
            logits = hf_model(torch.tensor(sequences), logits_to_keep=1).logits[:, -1].float()
        bitmask = xgrammar.allocate_token_bitmask(len(sequences), vocab_size)
        for row, tokens in enumerate(sequences):
            matcher = xgrammar.GrammarMatcher(compiled)
            assert all(matcher.accept_token(token) for token in tokens[prompt_len:])
            matcher.fill_next_token_bitmask(bitmask, row)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
        logprobs, token_ids = torch.log_softmax(logits, dim=-1).topk(count)
        return [
            [(t, lp) for t, lp in zip(ids, lps, strict=True) if lp != float("-inf")]
            for ids, lps in zip(token_ids.tolist(), logprobs.tolist(), strict=True)
        ]

    return top


def _follows(constraint: StructuredOutputsParams, text: str) -> bool:
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    document = json.loads(text)
    return isinstance(document, dict) and isinstance(document.get("n"), int)


@pytest.mark.parametrize("beam_width", [1, 2, 3])
@pytest.mark.parametrize("kind", sorted(BEAM_CONSTRAINTS))
def test_constrained_beams_equal_a_reference_that_masks_each_beam(
    llm: LLM,
    hf_model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    kind: str,
    beam_width: int,
) -> None:
    """Each fork continues a copy of its parent's matcher: the reference replays every
    beam's matcher from scratch instead."""
    constraint = BEAM_CONSTRAINTS[kind]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=12, structured_outputs=constraint)
    outputs = llm.beam_search(PROMPTS, params)
    num_complete = 0
    for prompt, output in zip(prompt_ids(llm), outputs, strict=True):
        top = grammar_masked_top(hf_model, tokenizer, constraint, llm.eos_token_ids, len(prompt))
        expected = reference_beam_search(top, prompt, params, llm.eos_token_ids, MAX_MODEL_LEN)
        assert [(s.tokens, s.finish_reason) for s in output.sequences] == [
            (b.tokens, b.finish_reason) for b in expected
        ]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(
            [b.cum_logprob for b in expected], abs=1e-4
        )
        for seq in output.sequences:
            if seq.finish_reason == "stop":
                num_complete += 1
                assert _follows(
                    constraint, llm.get_tokenizer().decode(seq.tokens[len(prompt) : -1])
                )
    assert num_complete > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_complete_grammar_ends_its_beam_under_ignore_eos(llm: LLM) -> None:
    choices = ["yes", "no", "maybe"]
    params = BeamSearchParams(
        beam_width=3,
        max_tokens=8,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    for prompt, output in zip(prompt_ids(llm), llm.beam_search(PROMPTS, params), strict=True):
        assert {seq.finish_reason for seq in output.sequences} == {"stop"}
        texts = [llm.get_tokenizer().decode(s.tokens[len(prompt) : -1]) for s in output.sequences]
        assert set(texts) <= set(choices)


def test_constrained_beams_under_memory_pressure_change_nothing(
    eos_model_dir: Path, llm: LLM
) -> None:
    constraint = BEAM_CONSTRAINTS["regex"]
    params = BeamSearchParams(beam_width=3, max_tokens=10, structured_outputs=constraint)
    expected = [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS, params)]
    settings = {"kv_cache_memory_bytes": 6 * 2048, "max_num_batched_tokens": 6}
    with LLM(eos_model_dir, max_model_len=24, block_size=4, **settings) as small:
        outputs = small.beam_search(PROMPTS, params)
        assert small.get_engine_metrics().num_preemptions > 0
    assert [[s.tokens for s in o.sequences] for o in outputs] == expected


def test_an_invalid_beam_constraint_is_refused_before_any_work(llm: LLM) -> None:
    params = BeamSearchParams(
        beam_width=2, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed")
    )
    before = llm.get_engine_metrics()
    with pytest.raises(ValueError, match=r"StructuredOutputsParams.regex is not valid"):
        llm.beam_search(PROMPTS, params)
    with pytest.raises(ValueError, match=r"BeamSearchParams.structured_outputs must be a Struct"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    assert llm.get_engine_metrics().num_requests == before.num_requests
