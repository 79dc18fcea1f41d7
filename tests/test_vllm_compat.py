"""Scripts written for vLLM's offline API run with only the import changed: the call patterns
of vLLM's examples and of lm-evaluation-harness's vLLM wrapper, one test per behaviour."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

import paged_llm
import paged_llm.frontend.model_info as model_info_module
from paged_llm import LLM, SamplingParams
from paged_llm.cli import build_parser
from paged_llm.engine.core import EngineCore
from paged_llm.engine_args import EngineArgs
from paged_llm.exceptions import VLLMValidationError
from paged_llm.inputs import TextPrompt, TokensPrompt
from paged_llm.settings import rewrite_generated_tables, settings_of_kind
from paged_llm.settings_docs import DOCS_COMMAND, main

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# The model's generation_config.json recommends these; "vllm" must ignore them.
RECOMMENDED = {"temperature": 0.3, "top_k": 7, "max_new_tokens": 9}
TAG_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
PARTS_TEMPLATE = (
    "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
)
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a generation_config.json that recommends sampling values."""
    source = llama_dir
    folder = tmp_path_factory.mktemp("llama-recommended")
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    generation = json.loads((source / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, **RECOMMENDED}))
    return folder


@pytest.fixture(scope="module")
def tuned(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """One LLM with the vLLM arguments that change behaviour, as a vLLM script passes them."""
    template = tmp_path_factory.mktemp("template") / "tags.jinja"
    template.write_text(TAG_TEMPLATE)
    with LLM(
        model=str(model_dir),
        chat_template=str(template),
        generation_config="vllm",
        served_model_name=["tiny-llama", "alias"],
        disable_log_stats=True,
        enable_chunked_prefill=False,
        hf_overrides={"max_position_embeddings": 96},
        distributed_executor_backend="mp",
    ) as instance:
        yield instance


def _greedy_ids(llm: LLM, prompt: Any) -> list[int]:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


# ----- LLM arguments ----------------------------------------------------------------------


def test_lm_evals_model_args_build_an_llm_that_generates_as_the_plain_one(
    model_dir: Path, llm: LLM
) -> None:
    # What lm-eval's vLLM wrapper passes, plus the no-ops vLLM scripts commonly set.
    model_args: dict[str, Any] = {
        "model": str(model_dir),
        "revision": None,
        "dtype": "auto",
        "tokenizer": None,
        "tokenizer_mode": "auto",
        "tokenizer_revision": None,
        "trust_remote_code": False,
        "tensor_parallel_size": 1,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": None,
        "quantization": None,
        "seed": 1234,
        "enable_lora": False,
        "max_lora_rank": 16,
    }
    no_ops = {setting.name: setting.default for setting in settings_of_kind(EngineArgs, "no-op")}
    no_ops.update(swap_space=0, download_dir="/nowhere", compilation_config={"level": 3})
    settings = {**no_ops, **model_args, "load_format": "auto", "cpu_offload_gb": 0.0}
    with LLM(**settings) as vllm_style:
        assert _greedy_ids(vllm_style, "The capital of France") == _greedy_ids(
            llm, "The capital of France"
        )


def test_seed_none_the_uni_backend_and_a_revision_with_a_local_path_run(
    model_dir: Path, llm: LLM
) -> None:
    """What vLLM scripts pass: seed=None (a fresh seed per LLM), the single-process "uni"
    executor, and revision="main" with a local path (no revisions there: ignored)."""
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(
            model_dir,
            max_model_len=MAX_MODEL_LEN,
            seed=None,
            distributed_executor_backend="uni",
            revision="main",
        ) as other:
            assert _greedy_ids(other, "The capital") == _greedy_ids(llm, "The capital")
            runs.append((other.config.seed, other.generate("The capital", unseeded)[0]))
    (seed_a, output_a), (seed_b, output_b) = runs
    assert seed_a != seed_b
    assert output_a.outputs[0].token_ids != output_b.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"distributed_executor_backend='uni' runs the model in"):
        LLM(model_dir, distributed_executor_backend="uni", tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ({"cpu_offload_gb": 4}, r"cpu_offload_gb=4 is not supported.*never offloaded"),
        (
            {"quantization": "bitsandbytes"},
            r"quantization='bitsandbytes' is not supported.*Leave it at None or 'dequantize' or 'int8'",
        ),
        (
            {"quantization": "awq"},
            r"quantization='awq' loads a pre-quantized checkpoint.*no quantization_config",
        ),
        (
            {"logits_processors": [lambda ids, logits: logits]},
            r"logits_processors must be a list of LogitsProcessor subclasses.*per-request",
        ),
        ({"distributed_executor_backend": "ray"}, r"distributed_executor_backend='ray'.*ray"),
        ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size=2 .*tensor_parallel_size"),
        ({"pipeline_parallel_size": True}, r"pipeline_parallel_size=True is not supported"),
        ({"tokenizer_mode": "mistral"}, r"tokenizer_mode='mistral' is not supported"),
        ({"kv_cache_dtype": "fp8_inc"}, r"kv_cache_dtype='fp8_inc' is not supported"),
        ({"max_model_lenn": 64}, r"unknown argument\(s\) 'max_model_lenn' \(did you mean"),
        ({"trust_remote_code": "yes"}, r"trust_remote_code must be a bool"),
    ],
)
def test_vllm_arguments_paged_llm_cannot_honour_raise_a_value_error_naming_them(
    model_dir: Path, argument: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, **argument)


def test_usage_md_settings_tables_are_generated_from_engine_args() -> None:
    usage = (REPO_ROOT / "docs" / "usage.md").read_text()
    # NOTE: it raises where a field is in no generated table of the page.
    generated = rewrite_generated_tables(usage, EngineArgs, DOCS_COMMAND)
    assert generated == usage, f"docs/usage.md's settings tables are stale: run {DOCS_COMMAND}"
    missing = [s.name for s in fields(EngineArgs) if f"\n| `{s.name}` | " not in usage]
    assert missing == []


def test_the_docs_command_rewrites_a_stale_table_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    usage = (REPO_ROOT / "docs" / "usage.md").read_text()
    page = tmp_path / "usage.md"
    page.write_text(usage.replace("| `block_size` | `16` |", "| `block_size` | `8` |"))
    main([str(page)])
    assert page.read_text() == usage
    assert capsys.readouterr().out == f"{page}: rewritten\n"


def test_the_clis_engine_flags_are_generated_from_engine_args() -> None:
    parser = build_parser()
    flags = "--kv-cache-memory 2GiB --no-prefix-caching --trust-remote-code --max-model-len 64"
    flags += " --no-enable-chunked-prefill --gpu-memory-utilization 0.5"
    args = parser.parse_args(["generate", "-i", "in.jsonl", "-o", "out.jsonl", *flags.split()])
    assert EngineArgs.from_cli_args(args).to_kwargs(changed_only=True) == {
        "kv_cache_memory_bytes": 2 * 2**30,
        "enable_prefix_caching": False,
        "trust_remote_code": True,
        "max_model_len": 64,
        "enable_chunked_prefill": False,
        "gpu_memory_utilization": 0.5,
    }
    # Unset flags keep the fields' defaults.
    unset = parser.parse_args(["generate", "-i", "a", "-o", "b"])
    assert EngineArgs.from_cli_args(unset) == EngineArgs()


def test_trust_remote_code_and_tokenizer_mode_reach_transformers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: dict[str, dict[str, Any]] = {}
    for name in ("AutoConfig", "AutoTokenizer"):
        loader = getattr(model_info_module, name)
        original = loader.from_pretrained

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls[_name] = kwargs
            return _original(*args, **kwargs)

        monkeypatch.setattr(loader, "from_pretrained", spy)
    with LLM(model_dir, max_model_len=64, trust_remote_code=True, tokenizer_mode="slow") as llm:
        assert llm.llm_engine.model_config.trust_remote_code is True
    assert calls["AutoConfig"]["trust_remote_code"] is True
    assert calls["AutoTokenizer"]["trust_remote_code"] is True
    assert calls["AutoTokenizer"]["use_fast"] is False


def test_chat_template_argument_is_chats_default_template(tuned: LLM, llm: LLM) -> None:
    conversation = [{"role": "user", "content": "hi"}]
    assert tuned.render_chat(conversation)["prompt"] == "<<user:hi>>"
    assert llm.render_chat(conversation)["prompt"] != "<<user:hi>>"
    # A call's own template still wins.
    assert tuned.render_chat(conversation, chat_template="{{ 'own' }}")["prompt"] == "own"
    (output,) = tuned.chat(conversation, GREEDY, use_tqdm=False)
    assert output.prompt == "<<user:hi>>"


def test_generation_config_vllm_ignores_the_models_recommended_sampling(
    tuned: LLM, llm: LLM
) -> None:
    recommended = llm.get_default_sampling_params()
    assert (recommended.temperature, recommended.top_k, recommended.max_tokens) == (0.3, 7, 9)
    defaults = tuned.get_default_sampling_params()
    plain = SamplingParams()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (
        plain.temperature,
        plain.top_k,
        plain.max_tokens,
    )
    # EOS tokens still come from the file.
    assert tuned.eos_token_ids == llm.eos_token_ids


def test_generation_config_folder_and_overrides(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"generation_config='/no/such' must be 'auto', 'vllm'"):
        LLM(model_dir, generation_config="/no/such")
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    with LLM(
        model_dir,
        max_model_len=64,
        generation_config=folder,
        override_generation_config={"top_p": 0.5},
    ) as llm:
        defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.5, 0)


def test_hf_overrides_change_the_config_the_engine_reads(tuned: LLM) -> None:
    model_config = tuned.llm_engine.model_config
    assert model_config.hf_config.max_position_embeddings == 96
    assert model_config.max_model_len == 96


def test_served_model_name_is_reported_by_the_model_config(
    tuned: LLM, llm: LLM, model_dir: Path
) -> None:
    assert tuned.llm_engine.model_config.served_model_name == "tiny-llama"
    assert llm.llm_engine.model_config.served_model_name == str(model_dir)


def test_enable_chunked_prefill_false_schedules_prompts_whole(
    tuned: LLM, llm: LLM, model_dir: Path
) -> None:
    assert isinstance(tuned.engine, EngineCore)
    assert tuned.engine.scheduler.config.chunked_prefill is False
    assert tuned.config.scheduler.max_num_batched_tokens >= tuned.config.max_model_len
    assert _greedy_ids(tuned, "Hello there") == _greedy_ids(llm, "Hello there")
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens=32 is smaller than max_model_len=64"
    ):
        LLM(model_dir, max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_disable_log_stats_drops_the_summary_line(
    tuned: LLM, llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    def summaries(instance: LLM) -> int:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="paged_llm"):
            instance.generate("Hi", GREEDY, use_tqdm=False)
        return sum(r.getMessage().startswith("Finished") for r in caplog.records)

    assert summaries(llm) == 1
    assert summaries(tuned) == 0


def test_skip_tokenizer_init_runs_token_ids_without_text(model_dir: Path, llm: LLM) -> None:
    prompt = TokensPrompt(prompt_token_ids=llm.get_tokenizer().encode("The weather today"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM(model_dir, max_model_len=64, skip_tokenizer_init=True) as bare:
        (output,) = bare.generate(prompt, params, use_tqdm=False)
        assert output.outputs[0].token_ids == _greedy_ids(llm, prompt)
        assert output.outputs[0].text == ""
        assert all(
            entry.decoded_token is None
            for position in output.outputs[0].logprobs or []
            for entry in position.values()
        )
        with pytest.raises(ValueError, match=r"Request 0: a text prompt needs a tokenizer"):
            bare.generate("text", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"Request 0: stop strings and bad_words need"):
            bare.generate(prompt, SamplingParams(stop=["."]), use_tqdm=False)
        with pytest.raises(ValueError, match=r"skip_tokenizer_init=True"):
            bare.get_tokenizer()


# ----- what harnesses read, and the extra call arguments -------------------------------------


def test_get_tokenizer_and_the_model_config_lm_eval_reads(llm: LLM, model_dir: Path) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer and tokenizer is llm.llm_engine.get_tokenizer()
    model_config = llm.llm_engine.model_config
    assert model_config.max_model_len == MAX_MODEL_LEN
    assert model_config.dtype == torch.float32
    assert model_config.model == str(model_dir)
    assert model_config.tokenizer == str(model_dir)
    assert model_config.hf_config.vocab_size == model_config.get_vocab_size() == 49152
    assert model_config.hf_text_config is model_config.hf_config
    assert model_config.max_logprobs == 20


def test_generate_takes_lora_request_priority_and_tokenization_kwargs(llm: LLM) -> None:
    text = "One two three four five six"
    (output,) = llm.generate(
        [text],
        GREEDY,
        use_tqdm=False,
        lora_request=None,
        priority=[0],
        tokenization_kwargs={"truncation": True, "max_length": 3},
    )
    assert output.prompt_token_ids == llm.get_tokenizer().encode(text)[:3]
    with pytest.raises(ValueError, match=r"Request 0: priority=1, but requests run first come"):
        llm.generate([text], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match=r"lora_request must be a LoRARequest"):
        llm.generate([text], GREEDY, use_tqdm=False, lora_request=object())  # type: ignore[arg-type]


def test_chat_takes_template_kwargs_tools_and_lora_request(llm: LLM) -> None:
    template = (
        "{% if tools %}tools={{ tools | map(attribute='name') | join(',') }};{% endif %}"
        "{% if shout %}!{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    conversation = [{"role": "user", "content": "hi"}]
    (output,) = llm.chat(
        conversation,
        GREEDY,
        use_tqdm=False,
        lora_request=None,
        chat_template=template,
        chat_template_kwargs={"shout": True},
        tools=[{"name": "search"}, {"name": "calc"}],
        chat_template_content_format="string",
    )
    assert output.prompt == "tools=search,calc;!hi"
    with pytest.raises(ValueError, match=r"chat_template_content_format must be 'auto'"):
        llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_content_format="xml")


def test_openai_style_content_parts_render_as_the_template_expects(llm: LLM) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    as_parts = llm.render_chat([{"role": "user", "content": parts}])
    as_text = llm.render_chat([{"role": "user", "content": "Hello\nworld"}])
    # The tokenizer's template concatenates content: parts reach it as one string.
    assert as_parts == as_text
    # A template that loops over the content gets the parts, a plain string as one part.
    looped = llm.render_chat(
        [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}],
        chat_template=PARTS_TEMPLATE,
    )
    assert looped["prompt"] == "[Hello][world][ok]"
    image = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    with pytest.raises(ValueError, match=r"Conversation 0, message 0: content part .*text-only"):
        llm.chat([{"role": "user", "content": image}], GREEDY, use_tqdm=False)


# ----- prompt forms and SamplingParams ------------------------------------------------------


def test_text_and_tokens_prompts_are_dicts_generate_takes(llm: LLM) -> None:
    # lm-eval imports them from the top of the package, vLLM's examples from .inputs.
    assert (paged_llm.TokensPrompt, paged_llm.TextPrompt) == (TokensPrompt, TextPrompt)
    text = "The capital of France"
    expected = _greedy_ids(llm, text)
    assert _greedy_ids(llm, {"prompt": text}) == expected
    assert _greedy_ids(llm, TextPrompt(prompt=text)) == expected
    token_ids = llm.get_tokenizer().encode(text)
    (output,) = llm.generate(
        [TokensPrompt(prompt_token_ids=token_ids, prompt=text)], GREEDY, use_tqdm=False
    )
    assert output.outputs[0].token_ids == expected and output.prompt == text


def test_sampling_params_clone_and_extra_args() -> None:
    params = SamplingParams(stop=["\n"], temperature=0.5, extra_args={"tag": [1]})
    copy = params.clone()
    copy.stop.append("END")
    assert copy.extra_args is not None
    copy.extra_args["tag"].append(2)
    assert params.stop == ["\n"] and params.extra_args == {"tag": [1]}
    assert copy == SamplingParams(stop=["\n", "END"], temperature=0.5, extra_args={"tag": [1, 2]})


def test_n_above_one_with_greedy_sampling_is_vllms_error() -> None:
    with pytest.raises(VLLMValidationError, match=r"n must be 1 when using greedy sampling, got 3"):
        SamplingParams(n=3, temperature=0)


def test_top_k_minus_one_round_trips_and_samples_as_top_k_zero(llm: LLM) -> None:
    params = SamplingParams(top_k=-1, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    assert params.top_k == -1
    disabled = SamplingParams(top_k=0, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(["Once upon", "Once upon"], [params, disabled], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


# ----- silent differences -------------------------------------------------------------------


def test_logprob_dicts_list_the_sampled_and_prompt_tokens_first(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    (output,) = llm.generate("A quiet morning in the", params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.logprobs is not None and output.prompt_logprobs is not None
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert next(iter(position)) == token_id
        # Then the top tokens by rank (the sampled one keeps its first place).
        ranks = [entry.rank for tid, entry in position.items() if tid != token_id]
        assert ranks == sorted(ranks) and len(position) in (3, 4)
    # Seeded sampling at temperature 1 draws tokens that are not the most likely.
    assert any(
        position[t].rank != 1
        for t, position in zip(completion.token_ids, completion.logprobs, strict=True)
    )
    for token_id, position in zip(
        output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True
    ):
        assert position is not None and next(iter(position)) == token_id


def test_num_cached_tokens_and_metrics_have_vllms_names(llm: LLM) -> None:
    prompt = {"prompt_token_ids": list(range(300, 340))}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert output.num_cached_tokens == 32  # two full blocks of 16
    metrics = output.metrics
    assert metrics is not None
    assert metrics.num_generation_tokens == 4
    assert metrics.first_token_latency == metrics.time_to_first_token
    assert metrics.queued_ts == metrics.arrival_time
    assert metrics.scheduled_ts is not None and metrics.first_token_ts is not None
    assert metrics.last_token_ts is not None
    assert (
        metrics.queued_ts <= metrics.scheduled_ts <= metrics.first_token_ts <= metrics.last_token_ts
    )


def test_vllms_fields_for_absent_features_read_as_empty(llm: LLM) -> None:
    """The LoRA, encoder-decoder, multimodal and KV-transfer fields scripts print or log."""
    (output,) = llm.generate("Hi", GREEDY, use_tqdm=False)
    assert (output.lora_request, output.encoder_prompt, output.encoder_prompt_token_ids) == (
        None,
        None,
        None,
    )
    assert (output.multi_modal_placeholders, output.kv_transfer_params) == ({}, None)
    assert output.outputs[0].lora_request is None


def test_validation_errors_are_value_errors_with_vllms_exception_name(llm: LLM) -> None:
    with pytest.raises(VLLMValidationError) as sampling:
        SamplingParams(top_p=2.0)
    assert (sampling.value.parameter, sampling.value.value) == ("top_p", 2.0)
    with pytest.raises(VLLMValidationError) as request:
        llm.generate("Hi", SamplingParams(logprobs=50), use_tqdm=False)
    assert isinstance(request.value, ValueError)
    assert request.value.parameter == "logprobs"
    assert str(request.value).startswith("Request 0: Requested sample logprobs of 50")
    # What most scripts catch: every request check raises the same type.
    changed_after_construction = SamplingParams()
    changed_after_construction.max_tokens = 0
    for prompt, params, parameter in (
        ("Hi", changed_after_construction, "max_tokens"),
        ({"prompt_token_ids": [1] * MAX_MODEL_LEN}, GREEDY, "prompt"),
        ({"prompt_token_ids": [10**6]}, GREEDY, "prompt_token_ids"),
    ):
        with pytest.raises(ValueError) as caught:
            llm.generate(prompt, params, use_tqdm=False)
        assert isinstance(caught.value, VLLMValidationError)
        assert caught.value.parameter == parameter
