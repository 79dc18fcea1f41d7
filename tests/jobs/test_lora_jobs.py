"""LoRA adapters in file jobs: ``paged-llm generate --lora NAME=PATH`` runs each row under the
adapter its ``"lora"`` names, ``run-batch --lora-modules NAME=PATH`` each request under the
adapter its body's ``"model"`` names; in one job mixing adapters and the base model, every
completion is transformers + peft's greedy one, and a name not registered is that row's
error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from paged_llm.cli import main
from tests.conftest import peft_greedy, write_peft_adapter
from tests.jobs.files import (
    COMPLETIONS_URL,
    batch_line,
    check_batch_line,
    engine_args,
    peft_greedy_by_adapter,
    read_rows,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 6
GREEDY_FLAGS = ["--temperature", "0", "--ignore-eos", "--max-tokens", str(MAX_TOKENS)]
GREEDY_BODY = {"temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS}
# The adapter of each row (None: the base model), mixed in one job.
NAMES: list[str | None] = ["qv", None, "mlp", "qv", None, "mlp"]


def _lora_flags(flag: str, adapters: dict[str, Path]) -> list[str]:
    return [part for name, path in adapters.items() for part in (flag, f"{name}={path}")]


def _wide_adapter(model_dir: Path, folder: Path) -> Path:
    """An adapter of rank 16, above the --max-lora-rank 8 of the tests."""
    return write_peft_adapter(
        model_dir, folder / "wide", rank=16, target_modules=["q_proj"], seed=2
    )


def _expected(
    model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None]
) -> list[list[int]]:
    """peft's greedy tokens of each prompt under its adapter, which changes them (else the
    comparison would not tell an adapter from the base model)."""
    expected = peft_greedy_by_adapter(model_dir, adapters, prompts, names, MAX_TOKENS)
    base = peft_greedy(model_dir, None, prompts, MAX_TOKENS)
    assert all((tokens != base[i]) == (names[i] is not None) for i, tokens in enumerate(expected))
    return expected


def _texts(tokenizer: PreTrainedTokenizerBase, completions: list[list[int]]) -> list[str]:
    return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in completions]


def test_generate_runs_each_row_under_the_adapter_it_names_and_resumes(
    model: str,
    llama_dir: Path,
    lora_adapters: dict[str, Path],
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    # A third adapter above --max-lora-rank, and --max-loras 1 (the adapters take turns):
    # both engine flags reach the LLM beside --lora.
    adapters = {**lora_adapters, "wide": _wide_adapter(llama_dir, tmp_path)}
    prompts = [f"Row {i} of the dataset asks about {'more words ' * (i % 3)}" for i in range(6)]
    rows: list[dict] = [
        {"id": i, "prompt": prompt, **({} if name is None else {"lora": name})}
        for i, (prompt, name) in enumerate(zip(prompts, NAMES, strict=True))
    ]
    rows += [
        {"id": "typo", "prompt": "hi", "lora": "qvv"},
        {"id": "wide", "prompt": "hi", "lora": "wide"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), *engine_args(model), *GREEDY_FLAGS]
    argv += [*_lora_flags("--lora", adapters), "--max-loras", "1", "--max-lora-rank", "8"]
    assert main(argv) == 0

    written = read_rows(output)
    by_id = {row["id"]: row for row in written}
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    expected = _expected(llama_dir, lora_adapters, prompt_ids, NAMES)
    assert [by_id[i]["outputs"][0]["text"] for i in range(6)] == _texts(tokenizer, expected)
    assert by_id["typo"]["error"] == (
        "line 7: 'lora' names 'qvv', which is not a registered LoRA adapter (registered: 'qv', "
        "'mlp', 'wide'); register it with --lora NAME=PATH"
    )
    assert "max_lora_rank" in by_id["wide"]["error"] and by_id["wide"]["error"].startswith(
        "line 8:"
    )

    # Cut after three rows, as a crash would leave it: the resumed job writes the same rows.
    output.write_text("".join(json.dumps(row) + "\n" for row in written[:3]))
    assert main([*argv, "--resume"]) == 0
    assert sorted(read_rows(output), key=str) == sorted(written, key=str)


def test_a_lora_that_is_not_a_string_is_a_bad_line(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi", "lora": 3}])
    argv = ["generate", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", model]
    assert main(argv) == 2
    assert (
        "in.jsonl:1: 'lora' must be a string (an adapter's name), got 3" in capsys.readouterr().err
    )


def test_run_batch_runs_each_request_under_the_adapter_its_model_names(
    model: str,
    llama_dir: Path,
    lora_adapters: dict[str, Path],
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (5, 17, 9, 23)
    ]
    # An adapter's name, the served model's name, and no "model": the base model.
    models: list[str | None] = ["qv", model, "mlp", None]
    lines = [
        batch_line(
            f"req-{i}",
            COMPLETIONS_URL,
            prompt=prompt,
            **GREEDY_BODY,
            **({} if m is None else {"model": m}),
        )
        for i, (prompt, m) in enumerate(zip(prompts, models, strict=True))
    ]
    lines += [
        batch_line("gpt", COMPLETIONS_URL, prompt="hi", model="gpt-4o-mini"),
        batch_line("number", COMPLETIONS_URL, prompt="hi", model=3),
        batch_line("wide", COMPLETIONS_URL, prompt="hi", model="wide"),
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    argv = ["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]
    # vllm serve's flag, and our generate's spelling as its alias.
    qv, mlp = (f"{name}={path}" for name, path in lora_adapters.items())
    wide = _wide_adapter(llama_dir, tmp_path)
    argv += ["--lora-modules", qv, f"wide={wide}", "--lora", mlp, "--max-lora-rank", "8"]
    assert main(argv) == 0

    written = read_rows(output)
    for line in written:
        check_batch_line(line)
    by_id = {line["custom_id"]: line["response"]["body"] for line in written}
    names = [None if m in (model, None) else m for m in models]
    expected = _expected(llama_dir, lora_adapters, prompts, names)
    texts = [by_id[f"req-{i}"]["choices"][0]["text"] for i in range(len(prompts))]
    assert texts == _texts(tokenizer, expected)
    # The response names what ran it: the adapter, else the served model.
    assert [by_id[f"req-{i}"]["model"] for i in range(len(prompts))] == ["qv", model, "mlp", model]
    error = by_id["gpt"]["error"]
    assert (error["param"], error["type"]) == ("model", "invalid_request_error")
    assert error["message"] == (
        f"line 5: 'model' names 'gpt-4o-mini', which is neither the served model ('{model}') nor "
        "a registered LoRA adapter (registered: 'qv', 'wide', 'mlp'); register it with "
        "--lora-modules NAME=PATH"
    )
    assert by_id["number"]["error"]["message"] == (
        "line 6: 'model' must be a string (the name of a LoRA adapter), got 3"
    )
    # An adapter the engine refuses is the error of the lines that name it, at "model".
    error = by_id["wide"]["error"]
    assert error["param"] == "model" and "max_lora_rank" in error["message"], error


def test_run_batch_refuses_an_adapter_named_as_the_served_model(
    model: str, lora_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(
        tmp_path / "requests.jsonl", [batch_line("a", COMPLETIONS_URL, prompt="hi")]
    )
    output = tmp_path / "results.jsonl"
    argv = ["run-batch", "-i", str(source), "-o", str(output), "-m", model]
    argv += ["--served-model-name", "base", "--lora-modules", f"base={lora_adapters['qv']}"]
    assert main(argv) == 2
    assert "LoRA adapter name(s) 'base' of --lora-modules NAME=PATH are also the served model" in (
        capsys.readouterr().err
    )
    assert not output.exists()
