"""`EngineArgs.add_cli_args` / `from_cli_args` and `FlexibleArgumentParser` as vLLM's: every
field is a flag in vLLM's spelling, no flags give `EngineArgs()`, and vLLM's example scripts
that build their parser from them (tests/vllm_scripts/generate.py, chat.py) run unchanged."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from paged_llm import LLM, EngineArgs, SamplingParams
from paged_llm.utils import FlexibleArgumentParser
from paged_llm.utils.argparse_utils import FlexibleArgumentParser as ArgparseUtilsParser
from tests.vllm_scripts.runner import run_script


def _parser() -> FlexibleArgumentParser:
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def test_both_of_vllms_paths_give_the_flexible_parser() -> None:
    assert ArgparseUtilsParser is FlexibleArgumentParser
    assert issubclass(FlexibleArgumentParser, argparse.ArgumentParser)


def test_every_field_is_a_flag_spelled_as_vllm_spells_it() -> None:
    parser = _parser()
    flags = {option: action.dest for action in parser._actions for option in action.option_strings}
    for setting in fields(EngineArgs):
        assert flags["--" + setting.name.replace("_", "-")] == setting.name
    for alias, name in [
        ("-tp", "tensor_parallel_size"),
        ("-dp", "data_parallel_size"),
        ("-pp", "pipeline_parallel_size"),
        ("-q", "quantization"),
        ("-O", "compilation_config"),
        ("-m", "model"),
        ("--prefix-caching", "enable_prefix_caching"),
        ("--no-enable-prefix-caching", "enable_prefix_caching"),
        ("--kv-cache-memory", "kv_cache_memory_bytes"),
    ]:
        assert flags[alias] == name


def test_no_flags_give_the_fields_own_defaults() -> None:
    given = vars(_parser().parse_args([]))
    assert given == EngineArgs().to_kwargs()
    assert EngineArgs(**given) == EngineArgs.from_cli_args(argparse.Namespace(**given))
    assert EngineArgs.from_cli_args(argparse.Namespace(**given)) == EngineArgs()


@pytest.mark.parametrize(
    ("argv", "changed"),
    [
        ("-tp 2", {"tensor_parallel_size": 2}),
        ("-dp=2", {"data_parallel_size": 2}),
        ("--no-enable-prefix-caching", {"enable_prefix_caching": False}),
        ("--no_prefix_caching", {"enable_prefix_caching": False}),
        ("--max_model_len=64", {"max_model_len": 64}),
        ("--max_model_len 64 --max-num-seqs=3", {"max_model_len": 64, "max_num_seqs": 3}),
        ("--enable-chunked-prefill", {"enable_chunked_prefill": True}),
        ('--hf-overrides {"a":1}', {"hf_overrides": {"a": 1}}),
        ("--served-model-name a b", {"served_model_name": ["a", "b"]}),
        ("--kv-cache-memory 1GiB", {"kv_cache_memory_bytes": 2**30}),
        ("--kv-cache-memory-bytes 512M", {"kv_cache_memory_bytes": 512 * 2**20}),
        ("-q int8 --kv-cache-dtype fp8", {"quantization": "int8", "kv_cache_dtype": "fp8"}),
        ("--seed None", {"seed": None}),
        ("--seed 7 --dtype float32", {"seed": 7, "dtype": "float32"}),
        ("--swap-space 8 --cuda-graph-sizes 1 2", {"swap_space": 8.0, "cuda_graph_sizes": [1, 2]}),
        ("-O3", {"compilation_config": 3}),
        ("--hf-token", {"hf_token": True}),
        ("--hf-token abc", {"hf_token": "abc"}),
        ("--trust-remote-code -m tiny", {"trust_remote_code": True, "model": "tiny"}),
    ],
)
def test_vllms_spellings_parse_to_the_settings(argv: str, changed: dict[str, Any]) -> None:
    args = _parser().parse_args(argv.split())
    assert EngineArgs.from_cli_args(args).to_kwargs(changed_only=True) == changed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--kv-cache-dtype fp4", "argument --kv-cache-dtype: invalid choice: 'fp4'"),
        ("--tokenizer-mode mistral", "argument --tokenizer-mode: invalid choice: 'mistral'"),
        ("--hf-overrides {a}", "argument --hf-overrides: expected JSON"),
        ("--kv-cache-memory lots", "argument --kv-cache-memory-bytes/--kv-cache-memory: expected"),
        ("--max-model-len=long", "argument --max-model-len: invalid int value: 'long'"),
    ],
)
def test_a_value_the_flag_cannot_read_is_a_usage_error_naming_it(
    argv: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv.split())
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_refused_flag_parses_and_the_settings_refuse_it() -> None:
    args = _parser().parse_args(["-pp", "2"])
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported by paged_llm"):
        EngineArgs.from_cli_args(args)


def test_changed_only_keeps_the_settings_that_differ_from_their_defaults() -> None:
    assert EngineArgs().to_kwargs(changed_only=True) == {}
    # NOTE: 0 is no bool: a bool default differs from any int.
    args = EngineArgs(seed=None, enable_prefix_caching=False, swap_space=4.0)
    assert args.to_kwargs(changed_only=True) == {"seed": None, "enable_prefix_caching": False}


def test_on_an_argument_group_every_flag_goes_in_the_group() -> None:
    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    assert EngineArgs.add_cli_args(group) is group
    assert {action.dest for action in group._group_actions} == {f.name for f in fields(EngineArgs)}


# ----- vLLM's example scripts ---------------------------------------------------------------

ENGINE_FLAGS = ("--max-model-len", "128", "--max_num_seqs=4")


def test_vllms_generate_example_gives_what_llm_gives(model: str, one_thread: None) -> None:
    outputs = run_script(
        "generate.py", "--model", model, *ENGINE_FLAGS, "--max-tokens", "8", "--temperature", "0"
    )["outputs"]
    with LLM(model, max_model_len=128, max_num_seqs=4) as llm:
        params = llm.get_default_sampling_params()
        params.max_tokens, params.temperature = 8, 0.0
        expected = llm.generate([output.prompt for output in outputs], params)
    assert [o.outputs[0].token_ids for o in outputs] == [e.outputs[0].token_ids for e in expected]
    assert all(len(output.outputs[0].token_ids) == 8 for output in outputs)


def test_vllms_chat_example_gives_what_llm_gives(
    model: str, one_thread: None, tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>")
    run = run_script(
        "chat.py",
        *("-m", model, *ENGINE_FLAGS, "--max-tokens", "8", "--temperature", "0"),
        *("--chat-template-path", str(template)),
    )
    params = SamplingParams(max_tokens=8, temperature=0.0)
    conversation = run["conversation"]
    with LLM(model, max_model_len=128, max_num_seqs=4) as llm:
        (expected,) = llm.chat(conversation, params)
        (templated,) = llm.chat(conversation, params, chat_template=template.read_text())
    (one,) = run["one"]
    assert one.outputs[0].token_ids == expected.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in run["batch"]] == [expected.outputs[0].token_ids] * 3
    (script_templated,) = run["templated"]
    assert script_templated.prompt == templated.prompt != expected.prompt
    assert script_templated.outputs[0].token_ids == templated.outputs[0].token_ids
