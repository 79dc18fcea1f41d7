"""LoRA adapters written by peft, served in mixed batches: greedy tokens equal transformers +
peft run one prompt at a time, under every engine path that changes a step's shape."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged_llm import LLM, SamplingParams
from paged_llm.exceptions import RequestError
from paged_llm.lora.request import LoRARequest
from tests.conftest import peft_greedy, write_peft_adapter

MAX_TOKENS = 8
MAX_MODEL_LEN = 64  # the `llm` fixture's
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, targets, rsLoRA): different ranks, packed slices adapted alone and together.
ADAPTERS = [
    (8, ["q_proj", "v_proj"], False),
    (16, ALL_TARGETS, False),
    (4, ["o_proj", "gate_proj", "down_proj"], True),
]


def token_prompts(
    num: int, seed: int = 0, lengths: tuple[int, ...] = (5, 23, 9, 40, 3, 17)
) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, 40000, (lengths[i % len(lengths)],), generator=generator).tolist()
        for i in range(num)
    ]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": prompt} for prompt in prompts]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory):
    """``adapters(arch)``: the `ADAPTERS` of that architecture's tiny model, as requests."""
    made: dict[str, list[LoRARequest]] = {}

    def make(arch: str) -> list[LoRARequest]:
        if arch not in made:
            made[arch] = [
                LoRARequest(
                    f"{arch}-{i}",
                    i + 1,
                    str(
                        write_peft_adapter(
                            tiny_model_dir(arch),
                            tmp_path_factory.mktemp(f"{arch}-adapter-{i}"),
                            rank=rank,
                            target_modules=targets,
                            seed=i,
                            use_rslora=rslora,
                        )
                    ),
                )
                for i, (rank, targets, rslora) in enumerate(ADAPTERS)
            ]
        return made[arch]

    return make


def expected_tokens(
    model_dir: Path, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int
) -> list[list[int]]:
    """peft's tokens for each prompt under its adapter, one adapter (and prompt) at a time."""
    expected: list[list[int]] = [[] for _ in prompts]
    for lora in {lora for lora in loras}:
        rows = [i for i, other in enumerate(loras) if other == lora]
        tokens = peft_greedy(
            model_dir,
            None if lora is None else Path(lora.lora_path),
            [prompts[i] for i in rows],
            max_tokens,
        )
        for row, completion in zip(rows, tokens, strict=True):
            expected[row] = completion
    return expected


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_mixed_batch_of_more_adapters_than_slots_equals_peft(
    arch: str, tiny_model_dir: Callable[[str], Path], adapters: Callable, one_thread: None
) -> None:
    model_dir = tiny_model_dir(arch)
    loras = [*adapters(arch), None]
    prompts = token_prompts(8)
    assigned = [loras[i % len(loras)] for i in range(len(prompts))]
    with LLM(model_dir, max_model_len=128, enable_lora=True, max_loras=2) as llm:
        outputs = llm.generate(as_inputs(prompts), greedy(), use_tqdm=False, lora_request=assigned)
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens(
        model_dir, prompts, assigned, MAX_TOKENS
    )
    assert [o.lora_request for o in outputs] == assigned
    assert [o.outputs[0].lora_request for o in outputs] == assigned


def test_chunked_prefill_and_preemption_change_nothing(
    llama_dir: Path, adapters: Callable, one_thread: None
) -> None:
    loras = [*adapters("llama"), None]
    prompts = token_prompts(8, seed=1, lengths=(30, 45, 12, 50))
    assigned = [loras[i % len(loras)] for i in range(len(prompts))]
    # 8 KiB blocks: 8 of them cannot hold four growing sequences, and 16-token steps chunk
    # every longer prompt; one adapter slot makes the adapters take turns.
    with LLM(
        llama_dir,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=8 * 8192,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
    ) as llm:
        outputs = llm.generate(
            as_inputs(prompts), greedy(12), use_tqdm=False, lora_request=assigned
        )
        assert llm.get_engine_metrics().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens(
        llama_dir, prompts, assigned, 12
    )


def test_the_prefix_cache_never_shares_kv_between_adapters(
    llama_dir: Path, adapters: Callable, one_thread: None
) -> None:
    # The second adapter touches k and v: KV cached under the base model is wrong for it.
    lora = adapters("llama")[1]
    (shared,) = token_prompts(1, seed=2, lengths=(70,))
    prompts = [[*shared, 500 + i] for i in range(3)]
    with LLM(llama_dir, max_model_len=128, enable_lora=True) as llm:
        base = llm.generate(as_inputs(prompts[:1]), greedy(), use_tqdm=False)[0]
        first = llm.generate(as_inputs(prompts[1:2]), greedy(), use_tqdm=False, lora_request=lora)[
            0
        ]
        second = llm.generate(as_inputs(prompts[2:]), greedy(), use_tqdm=False, lora_request=lora)[
            0
        ]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    expected = expected_tokens(llama_dir, prompts, [None, lora, lora], MAX_TOKENS)
    assert [base.outputs[0].token_ids, first.outputs[0].token_ids] == expected[:2]
    assert second.outputs[0].token_ids == expected[2]


def test_a_seeded_request_draws_the_same_tokens_alone_and_among_other_adapters(
    llama_dir: Path, adapters: Callable, one_thread: None
) -> None:
    loras = adapters("llama")
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, n=2)
    prompts = token_prompts(4, seed=3)
    with LLM(llama_dir, max_model_len=128, enable_lora=True, max_loras=3) as llm:
        (alone,) = llm.generate(
            as_inputs(prompts[:1]), seeded, use_tqdm=False, lora_request=loras[0]
        )
        batched = llm.generate(
            as_inputs(prompts),
            [seeded, greedy(), greedy(), greedy()],
            use_tqdm=False,
            lora_request=[loras[0], loras[1], None, loras[2]],
        )
    assert [c.token_ids for c in batched[0].outputs] == [c.token_ids for c in alone.outputs]


def test_beam_search_and_chat_take_an_adapter(
    llama_dir: Path, adapters: Callable, one_thread: None
) -> None:
    from paged_llm.sampling_params import BeamSearchParams

    lora = adapters("llama")[1]
    prompt = token_prompts(1, seed=4)[0]
    with LLM(llama_dir, max_model_len=128, enable_lora=True) as llm:
        (adapted,) = llm.beam_search(
            [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=6), lora
        )
        (plain,) = llm.beam_search(
            [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=6)
        )
        chat = llm.chat(
            [{"role": "user", "content": "hi"}], greedy(), use_tqdm=False, lora_request=lora
        )
    # A width-1 beam search is greedy.
    assert (
        adapted.sequences[0].tokens[len(prompt) :]
        == expected_tokens(llama_dir, [prompt], [lora], 6)[0]
    )
    assert adapted.sequences[0].tokens != plain.sequences[0].tokens
    assert chat[0].lora_request == lora


def test_bad_adapters_are_the_errors_of_their_requests(
    llama_dir: Path, adapters: Callable, tmp_path: Path
) -> None:
    good = adapters("llama")[0]
    wide = adapters("llama")[1]  # rank 16
    missing = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    with LLM(llama_dir, max_model_len=64, enable_lora=True, max_lora_rank=8) as llm:
        outputs = llm.generate(
            as_inputs(token_prompts(3)),
            greedy(4),
            use_tqdm=False,
            on_error="skip",
            lora_request=[good, wide, missing],
        )
        assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 4
        assert "max_lora_rank" in outputs[1].error and outputs[1].error_parameter == "lora_request"
        assert "nowhere" in outputs[2].error
        with pytest.raises(RequestError, match=r"Request 1: .*max_lora_rank"):
            llm.generate(
                as_inputs(token_prompts(2)), greedy(4), use_tqdm=False, lora_request=[good, wide]
            )
        renamed = LoRARequest("renamed", good.lora_int_id, wide.lora_path)
        with pytest.raises(RequestError, match="own lora_int_id"):
            llm.generate(
                as_inputs(token_prompts(1)), greedy(4), use_tqdm=False, lora_request=renamed
            )


def test_an_adapter_needs_enable_lora(llm: LLM, adapters: Callable) -> None:
    with pytest.raises(RequestError, match="enable_lora=True"):
        llm.generate(
            as_inputs(token_prompts(1)),
            greedy(4),
            use_tqdm=False,
            lora_request=adapters("llama")[0],
        )


def test_lora_ids_start_at_one() -> None:
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("base", 0, "somewhere")


def test_the_gpu_path_adds_adapters_with_the_triton_kernels(
    llama_dir: Path, adapters: Callable, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's start-up and batching over CPU tensors, kernels under the Triton interpreter:
    the adapters go through csrc_triton's shrink and expand."""
    import csrc_triton
    from tests.fake_gpu import FakeGpuPlatform

    calls = []
    shrink = csrc_triton.lora_shrink
    monkeypatch.setattr(csrc_triton, "lora_shrink", lambda *a: calls.append(1) or shrink(*a))
    loras = [*adapters("llama")[:2], None]
    prompts = token_prompts(3, seed=6)
    with LLM(
        llama_dir,
        device=FakeGpuPlatform(),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_lora=True,
        max_loras=2,
    ) as llm:
        outputs = llm.generate(as_inputs(prompts), greedy(4), use_tqdm=False, lora_request=loras)
    assert calls
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens(
        llama_dir, prompts, loras, 4
    )


def test_logprobs_are_the_adapted_models_and_structured_outputs_apply(
    llama_dir: Path, adapters: Callable, one_thread: None
) -> None:
    import peft
    import transformers

    from paged_llm import StructuredOutputsParams

    lora = adapters("llama")[1]
    (prompt,) = token_prompts(1, seed=7, lengths=(20,))
    choices = ["alpha", "beta", "gamma"]
    with LLM(llama_dir, max_model_len=64, enable_lora=True) as llm:
        (scored,) = llm.generate(
            as_inputs([prompt]),
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
            lora_request=lora,
        )
        chosen = llm.generate(
            ["Pick one:"] * 3,
            SamplingParams(
                temperature=1.0, seed=0, structured_outputs=StructuredOutputsParams(choice=choices)
            ),
            use_tqdm=False,
            lora_request=[lora, None, adapters("llama")[0]],
        )
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, lora.lora_path)
    with torch.no_grad():
        expected = torch.log_softmax(adapted(torch.tensor([prompt])).logits[0], dim=-1)
    ours = [
        entry[token].logprob
        for entry, token in zip(scored.prompt_logprobs[1:], prompt[1:], strict=True)
    ]
    torch.testing.assert_close(
        torch.tensor(ours), expected[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-4, rtol=0
    )
    assert all(output.outputs[0].text in choices for output in chosen)


def test_embeddings_under_an_adapter_are_the_adapted_models(
    llama_dir: Path, adapters: Callable, one_thread: None
) -> None:
    import peft
    import transformers

    lora = adapters("llama")[1]
    prompts = token_prompts(3, seed=8)
    with LLM(llama_dir, runner="pooling", max_model_len=64, enable_lora=True) as llm:
        outputs = llm.embed(as_inputs(prompts), use_tqdm=False, lora_request=[lora, None, lora])
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, lora.lora_path)
    for prompt, output, under in zip(prompts, outputs, [True, False, True], strict=True):
        adapter = contextlib.nullcontext() if under else adapted.disable_adapter()
        with torch.no_grad(), adapter:
            hidden = adapted.base_model.model.model(torch.tensor([prompt])).last_hidden_state
        expected = torch.nn.functional.normalize(hidden[0, -1], dim=-1)
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), expected, atol=1e-4, rtol=0
        )
