"""The `paged-llm` command line: its flags reach the jobs and the engine, and its errors are
one line with an exit code, never a traceback. The jobs themselves are tested in
tests/jobs/."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from paged_llm import cli
from paged_llm.cli import main
from paged_llm.jobs.rows import JobError
from paged_llm.jobs.runner import JobSpec
from paged_llm.lora.request import LoRARequest
from paged_llm.settings import parse_bytes
from tests.jobs.files import engine_args, read_rows, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def test_refuses_to_write_over_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    same = tmp_path / "sub" / ".." / "in.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(same), "--resume"]) == 2
    assert "--input and --output are the same file" in capsys.readouterr().err
    assert read_rows(source) == [{"id": 1, "prompt": "hi"}]


def test_a_missing_model_is_reported_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(output), "-m", "nobody/nothing"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("paged-llm: error: model 'nobody/nothing' was not found offline")
    assert "Traceback" not in err


def test_data_parallel_replicas_write_the_same_rows(model: str, tmp_path: Path) -> None:
    rows = [
        {"id": i, "prompt": f"Row {i} of the dataset: {'more words ' * (i % 4)}"} for i in range(8)
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    written = {}
    for size in ("1", "2"):
        output = tmp_path / f"dp{size}.jsonl"
        argv = ["generate", "-i", str(source), "-o", str(output), *engine_args(model)]
        # The model's default sampling (temperature 1), each row with its own seed.
        assert main([*argv, "--max-tokens", "8", "--data-parallel-size", size]) == 0
        written[size] = sorted(read_rows(output), key=lambda row: row["id"])
    assert len(written["1"]) == len(rows)
    assert written["2"] == written["1"]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--data-parallel-size=0", "data_parallel_size must be an integer >= 1, got 0"),
        ("--tensor-parallel-size=3", "tensor_parallel_size=3 does not split this model"),
    ],
)
def test_parallel_sizes_reach_the_llm(
    model: str, tmp_path: Path, flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    argv = ["generate", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), *engine_args(model)]
    assert main([*argv, flag]) == 1
    assert message in capsys.readouterr().err


def test_a_jobs_engine_arguments_are_the_flags_that_change_a_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs: list[JobSpec] = []
    monkeypatch.setattr(cli, "run_generate_job", lambda spec: specs.append(spec) or 0)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    argv = ["generate", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", "tiny"]
    assert main([*argv, "--max_model_len=64", "--seed", "7", "--block-size", "16"]) == 0
    (spec,) = specs
    assert (spec.model, spec.seed, spec.engine_kwargs) == ("tiny", 7, {"max_model_len": 64})
    assert spec.llm_kwargs() == {"seed": 7, "max_model_len": 64}


@pytest.mark.parametrize(
    ("command", "flag", "alias"),
    [("generate", "--lora", "--lora-modules"), ("run-batch", "--lora-modules", "--lora")],
)
def test_lora_flags_register_adapters_by_name_with_ids_in_the_order_given(
    command: str, flag: str, alias: str
) -> None:
    argv = [command, "-i", "in.jsonl", "-o", "out.jsonl", "-m", "tiny", "--max-loras", "2"]
    # One or more NAME=PATH per flag (vllm serve's form), the flag repeated, and its alias;
    # a path may hold "=".
    argv += [flag, "b=/adapters/b", "a=/adapters/a", alias, "c=/adapters/c=1", "--max-lora-rank=8"]
    spec = cli._job_spec(cli.build_parser().parse_args(argv))
    assert spec.lora_modules.requests() == {
        "b": LoRARequest("b", 1, "/adapters/b"),
        "a": LoRARequest("a", 2, "/adapters/a"),
        "c": LoRARequest("c", 3, "/adapters/c=1"),
    }
    assert spec.lora_modules.registered_with == f"{flag} NAME=PATH"
    assert spec.llm_kwargs() == {"seed": 0, "max_loras": 2, "max_lora_rank": 8, "enable_lora": True}
    no_adapters = cli._job_spec(cli.build_parser().parse_args(argv[:9]))
    assert no_adapters.lora_modules.paths == {} and "enable_lora" not in no_adapters.llm_kwargs()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["qv"], "expected NAME=PATH (the adapter's name, '=', its PEFT folder), got 'qv'"),
        (["=/adapters/qv"], "expected NAME=PATH"),
        (["qv="], "expected NAME=PATH"),
        (
            ["qv=/adapters/1", "mlp=/adapters/2", "qv=/adapters/3"],
            "adapter name 'qv' is given twice ('/adapters/1' and '/adapters/3'); give each "
            "adapter its own name",
        ),
    ],
)
def test_a_malformed_or_repeated_lora_is_a_usage_error_naming_the_flag(
    values: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "-i", "in.jsonl", "-o", "out.jsonl", "--lora", *values])
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"argument --lora/--lora-modules: {message}" in err


def test_a_job_refuses_seed_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    assert main(["generate", "-i", str(source), "-o", str(tmp_path / "o"), "--seed", "None"]) == 1
    assert "--seed None is not for a job" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "run-batch"])
def test_help_lists_the_engine_flags_in_their_groups_and_how_rows_are_seeded(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    engine = help_text.index("engine: EngineArgs")
    compatibility = help_text.index("vLLM compatibility: EngineArgs accepted")
    assert engine < help_text.index("--max-model-len") < compatibility
    assert compatibility < help_text.index("--swap-space")
    assert help_text.count("--seed SEED") == 1
    assert "samples with one derived from this and its id" in help_text


@pytest.mark.parametrize("command", ["embed", "classify"])
def test_pooling_commands_take_the_output_format_and_the_pooling_engine_flags(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--output-format {jsonl,npy}" in help_text and "OUTPUT.ids.jsonl" in help_text
    for flag in ("--convert", "--pooler-config", "--lora NAME=PATH", "--max-model-len"):
        assert flag in help_text
    assert "--ray-address" not in help_text and "--temperature" not in help_text


def test_npy_output_is_for_pooling_jobs_only(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="--output-format npy holds vectors"):
        JobSpec(tmp_path / "in.jsonl", tmp_path / "out.npy", "m", output_format="npy")


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == parse_bytes("2g") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 2**20
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size like 4GiB"):
        parse_bytes("lots")


# ----- run-batch: OpenAI Batch API files --------------------------------------------------
