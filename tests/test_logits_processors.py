"""Custom logits processors through the whole engine on a tiny model: vLLM v1's
`LogitsProcessor` classes (by class and by name), the persistent batch they see under
chunked prefill, preemption and n > 1, where they run among the sampler's steps,
`validate_params` as per-request errors, and vLLM 0's per-request callables."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from paged_llm import LLM, BeamSearchParams, SamplingParams
from paged_llm.config import VllmConfig
from paged_llm.exceptions import VLLMValidationError
from paged_llm.logits_processors import load_logits_processors
from paged_llm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    process_dict_updates,
)

MAX_MODEL_LEN = 128
PROMPTS = [
    "The library opens at nine",
    "Rain fell all night over the harbour",
    "A recipe for bread needs",
    "Our train was delayed by",
]


def _keep_only(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """Rows ``rows`` of ``logits`` allow only their token of ``tokens``, in place."""
    if not rows:
        return
    row_index = torch.tensor(rows, device=logits.device)
    token_index = torch.tensor(tokens, device=logits.device)
    kept = logits[row_index, token_index].clone()
    logits[row_index] = -math.inf
    logits[row_index, token_index] = kept


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's DummyLogitsProcessor: a request with ``extra_args["target_token"]`` draws only
    that token."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.req_info: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.req_info,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("target_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        _keep_only(logits, list(self.req_info), list(self.req_info.values()))
        return logits


class RandomPathTokenProcessor(LogitsProcessor):
    """Claims to be argmax-invariant, and is not: it forces
    ``extra_args["random_path_token"]``, so the rows it reaches show in the outputs."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.req_info,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("random_path_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        _keep_only(logits, list(self.req_info), list(self.req_info.values()))
        return logits


FIRST_COUNTED = 1000


class CountingProcessor(LogitsProcessor):
    """Forces token ``FIRST_COUNTED + 10 * extra_args["id"] + len(output so far)`` from its
    own mirror of the rows: an output comes out right only if every step's rows and the
    live output lists were right. Checks the batch size and the update calls as it goes."""

    instances: ClassVar[list[CountingProcessor]] = []

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[int, list[int]]] = {}
        self.batch_size = 0
        self.num_updates = 0
        self.num_moves = 0
        CountingProcessor.instances.append(self)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.num_updates += 1
        if batch_update is not None:
            self.batch_size = batch_update.batch_size
            self.num_moves += len(batch_update.moved)
        process_dict_updates(self.rows, batch_update, self._new_state)
        assert all(0 <= row < self.batch_size for row in self.rows)

    @staticmethod
    def _new_state(
        params: SamplingParams, prompt: list[int] | None, output: list[int]
    ) -> tuple[int, list[int]] | None:
        request = (params.extra_args or {}).get("id")
        return None if request is None else (request, output)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.batch_size
        rows = list(self.rows)
        tokens = [
            FIRST_COUNTED + 10 * request + len(output) for request, output in self.rows.values()
        ]
        logits[rows] = -math.inf
        logits[rows, tokens] = 0.0
        return logits


def _greedy(max_tokens: int = 6, **extra_args: object) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None
    )


@pytest.fixture(scope="module")
def processor_llm(llama_dir: Path) -> Iterator[LLM]:
    """One LLM with a processor given by its qualified name, and an argmax-invariant one."""
    with LLM(
        llama_dir,
        max_model_len=MAX_MODEL_LEN,
        logits_processors=[
            "tests.test_logits_processors.TargetTokenProcessor",
            RandomPathTokenProcessor,
        ],
    ) as instance:
        yield instance


def _token_ids(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(completion.token_ids) for o in outputs for completion in o.outputs]


def test_a_processor_forces_the_target_of_the_requests_that_set_it_and_no_other(
    processor_llm: LLM, llm: LLM, one_thread: None
) -> None:
    params = [_greedy(target_token=77), _greedy(), _greedy(target_token=4242), _greedy()]
    forced = _token_ids(processor_llm, PROMPTS, params)
    assert forced[0] == [77] * 6 and forced[2] == [4242] * 6
    plain = _token_ids(llm, PROMPTS, [_greedy()] * 4)
    assert [forced[1], forced[3]] == [plain[1], plain[3]]
    assert forced[0] != plain[0]


def test_the_processor_is_built_once_on_the_engine_with_its_settings(processor_llm: LLM) -> None:
    runner = processor_llm.engine.model_runner  # type: ignore[union-attr]
    assert runner.logits_processors is not None
    target, random_path = runner.logits_processors.processors
    assert type(target).__name__ == "TargetTokenProcessor"
    assert isinstance(random_path, RandomPathTokenProcessor)
    config = target.vllm_config
    assert config.model_config.get_vocab_size() == 49152
    assert config.model_config.max_model_len == MAX_MODEL_LEN
    assert config.scheduler_config.max_num_seqs == processor_llm.config.scheduler.max_num_seqs
    assert config.cache_config.num_gpu_blocks == runner.num_blocks
    assert config.cache_config.block_size == processor_llm.config.block_size
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.device_config.device == target.device == torch.device("cpu")


def test_logprobs_stay_those_of_the_raw_distribution(
    processor_llm: LLM, llm: LLM, one_thread: None
) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=1, logprobs=0, extra_args={"target_token": 77}
    )
    (output,) = processor_llm.generate(PROMPTS[0], params, use_tqdm=False)
    (completion,) = output.outputs
    assert completion.token_ids == [77] and completion.logprobs is not None
    forced_logprob = completion.logprobs[0][77].logprob
    # The model's own logprob of 77 after the prompt, as a prompt logprob.
    prompt_ids = list(output.prompt_token_ids or [])
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (scored,) = llm.generate({"prompt_token_ids": [*prompt_ids, 77]}, scoring, use_tqdm=False)
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[-1] is not None
    raw_logprob = scored.prompt_logprobs[-1][77].logprob
    assert forced_logprob < -1.0
    assert forced_logprob == pytest.approx(raw_logprob, abs=1e-4)


def test_argmax_invariant_processors_run_on_the_random_path_only(
    processor_llm: LLM, llm: LLM, one_thread: None
) -> None:
    random = SamplingParams(
        temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, extra_args={"random_path_token": 55}
    )
    params = [_greedy(random_path_token=55), random, _greedy(), random]
    tokens = _token_ids(processor_llm, PROMPTS, params)
    plain = _token_ids(llm, PROMPTS[:1], [_greedy()])
    assert tokens[0] == plain[0]
    assert tokens[1] == tokens[3] == [55] * 6


def test_validate_params_refuses_that_request_alone(processor_llm: LLM, one_thread: None) -> None:
    params = [_greedy(target_token=77), _greedy(target_token="x"), _greedy()]
    outputs = processor_llm.generate(PROMPTS[:3], params, use_tqdm=False, on_error="skip")
    assert outputs[0].outputs[0].token_ids == [77] * 6
    assert outputs[1].error is not None and not outputs[1].outputs
    assert "logits processor TargetTokenProcessor refused the request" in outputs[1].error
    assert "target_token must be a token id, got 'x'" in outputs[1].error
    assert outputs[1].error_parameter == "extra_args"
    assert outputs[2].error is None and len(outputs[2].outputs[0].token_ids) == 6
    before = processor_llm.get_engine_metrics()
    with pytest.raises(ValueError, match=r"Request 1: logits processor TargetTokenProcessor .*'x'"):
        processor_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert processor_llm.get_engine_metrics().num_requests == before.num_requests


def test_rows_follow_requests_through_chunked_prefill_preemption_and_n(
    llama_dir: Path, llm: LLM, one_thread: None
) -> None:
    prompt_lengths = [30, 12, 41, 20, 35, 9, 25, 17]
    max_tokens = [20, 7, 15, 25, 10, 18, 12, 9]
    prompts = [
        {"prompt_token_ids": [300 + 7 * i + j for j in range(n)]}
        for i, n in enumerate(prompt_lengths)
    ]
    params = [
        SamplingParams(max_tokens=m, ignore_eos=True, extra_args={"id": i})
        for i, m in enumerate(max_tokens)
    ]
    # Two requests that no processor touches, and one of two sequences.
    params[3] = _greedy(max_tokens[3])
    params[6] = _greedy(max_tokens[6])
    params[5] = SamplingParams(
        n=2, temperature=1.0, max_tokens=max_tokens[5], ignore_eos=True, extra_args={"id": 5}
    )
    CountingProcessor.instances.clear()
    # 8 KiB blocks: 7 of them cannot hold three growing sequences, and 16-token steps chunk
    # every longer prompt.
    with LLM(
        llama_dir,
        max_model_len=64,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=7 * 8192,
        logits_processors=[CountingProcessor],
    ) as counted:
        outputs = counted.generate(prompts, params, use_tqdm=False)
        metrics = counted.get_engine_metrics()
    (processor,) = CountingProcessor.instances
    assert metrics.num_preemptions > 0 and processor.num_moves > 0
    assert processor.num_updates == metrics.num_steps
    plain = llm.generate([prompts[3], prompts[6]], [params[3], params[6]], use_tqdm=False)
    for i, output in enumerate(outputs):
        if i in (3, 6):
            expected = plain[0 if i == 3 else 1].outputs[0].token_ids
        else:
            expected = [FIRST_COUNTED + 10 * i + k for k in range(max_tokens[i])]
        assert [c.token_ids for c in output.outputs] == [expected] * (2 if i == 5 else 1)


def test_per_request_callables_apply_to_their_rows_only(llm: LLM, one_thread: None) -> None:
    def force_55(output_token_ids: list[int], logits_row: torch.Tensor) -> torch.Tensor:
        logits_row[:] = -math.inf
        logits_row[55] = 0.0
        return logits_row

    def count_from_prompt(
        prompt_token_ids: list[int], output_token_ids: list[int], logits_row: torch.Tensor
    ) -> torch.Tensor:
        new = torch.full_like(logits_row, -math.inf)
        new[prompt_token_ids[0] + len(output_token_ids)] = 0.0
        return new

    prompts = [{"prompt_token_ids": [400 + i, 7, 8, 9]} for i in range(4)]
    params = [
        _greedy(),
        SamplingParams(temperature=0, max_tokens=6, logits_processors=[force_55]),
        SamplingParams(temperature=0, max_tokens=6, logits_processors=[count_from_prompt]),
        SamplingParams(
            temperature=0, max_tokens=6, logits_processors=[count_from_prompt, force_55]
        ),
    ]
    tokens = _token_ids(llm, prompts, params)
    assert tokens[0] == _token_ids(llm, prompts[:1], [_greedy()])[0]
    assert tokens[1] == [55] * 6
    assert tokens[2] == [402 + k for k in range(6)]
    assert tokens[3] == [55] * 6
    with pytest.raises(VLLMValidationError, match=r"logits_processors must be None or a list of"):
        SamplingParams(logits_processors=[42])  # type: ignore[list-item]


def test_processors_load_by_either_qualified_name_form() -> None:
    (dotted,) = load_logits_processors(["tests.test_logits_processors.CountingProcessor"])
    (colon,) = load_logits_processors(["tests.test_logits_processors:CountingProcessor"])
    assert dotted is colon and dotted.__qualname__ == "CountingProcessor"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([lambda ids, logits: logits], r"logits_processors must be a list of LogitsProcessor sub"),
        (TargetTokenProcessor, r"logits_processors must be a list of LogitsProcessor subclasses"),
        ([LogitsProcessor], r"logits_processors must be a list"),
        (["no_such_module_here.Processor"], r"cannot import 'no_such_module_here.Processor' \(Mod"),
        (["tests.test_logits_processors:Missing"], r"cannot import .*:Missing' \(AttributeError"),
        (
            ["collections.OrderedDict"],
            r"'collections.OrderedDict' is <class .*not a LogitsProcessor",
        ),
        (["Processor"], r"'Processor' is not a fully qualified class name"),
    ],
)
def test_an_invalid_processor_is_a_value_error_at_construction(
    llama_dir: Path, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, max_model_len=MAX_MODEL_LEN, logits_processors=value)


def test_a_processor_runs_on_rank_zero_of_two(llama_dir: Path, llm: LLM) -> None:
    params = [_greedy(target_token=77), _greedy()]
    with LLM(
        llama_dir,
        max_model_len=MAX_MODEL_LEN,
        tensor_parallel_size=2,
        logits_processors=[TargetTokenProcessor],
    ) as two_ranks:
        tokens = _token_ids(two_ranks, PROMPTS[:2], params)
    assert tokens[0] == [77] * 6
    assert tokens[1] == _token_ids(llm, PROMPTS[1:2], [_greedy()])[0]


def test_beam_search_runs_beside_processors_untouched(
    processor_llm: LLM, llm: LLM, one_thread: None
) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    with_processors = processor_llm.beam_search(PROMPTS[:2], params)
    plain = llm.beam_search(PROMPTS[:2], params)
    assert [[s.tokens for s in o.sequences] for o in with_processors] == [
        [s.tokens for s in o.sequences] for o in plain
    ]


@pytest.mark.slow
def test_each_data_parallel_replica_builds_its_own(llama_dir: Path, llm: LLM) -> None:
    params = [_greedy(target_token=77), _greedy(), _greedy(target_token=99), _greedy()]
    with LLM(
        llama_dir,
        max_model_len=MAX_MODEL_LEN,
        data_parallel_size=2,
        logits_processors=["tests.test_logits_processors:TargetTokenProcessor"],
    ) as replicated:
        tokens = _token_ids(replicated, PROMPTS, params)
    plain = _token_ids(llm, PROMPTS, [_greedy()] * 4)
    assert tokens == [[77] * 6, plain[1], [99] * 6, plain[3]]
