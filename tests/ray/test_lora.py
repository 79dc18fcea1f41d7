"""LoRA adapters on Ray Data: a `ProcessorConfig` registers adapters by name -> path, and each
row runs under the adapter its ``lora`` column names (the base model without one), with
transformers + peft's greedy tokens; ``paged-llm generate --ray-address`` with ``--lora``
writes the single-machine command's rows. The adapters reach the actors by path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray.data
import torch

from paged_llm.cli import main
from paged_llm.ray import ProcessorConfig, build_processor
from tests.jobs.files import peft_greedy_by_adapter, write_jsonl, write_lora_adapters

MAX_TOKENS = 4
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# The adapter of each row (None: the base model), mixed in one batch.
NAMES: list[str | None] = ["qv", None, "mlp", "qv", None, "mlp"]


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_lora_adapters(llama_dir, tmp_path_factory.mktemp("lora-adapters"))


def preprocess(row: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_token_ids": row["ids"], "sampling_params": GREEDY, "lora": row["adapter"]}


@pytest.mark.slow
def test_each_row_runs_under_the_adapter_its_lora_column_names(
    ray_address: str, llama_dir: Path, adapters: dict[str, Path], one_thread: None
) -> None:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (5, 9) * 3]
    items = [
        {"id": i, "ids": prompt, "adapter": name}
        for i, (prompt, name) in enumerate(zip(prompts, NAMES, strict=True))
    ]
    items.append({"id": len(items), "ids": prompts[0], "adapter": "nope"})
    config = ProcessorConfig(
        str(llama_dir),
        {"max_model_len": 64, "max_loras": 1},
        batch_size=len(items),
        lora_modules={name: str(path) for name, path in adapters.items()},
    )
    processor = build_processor(config, preprocess=preprocess)
    rows = sorted(processor(ray.data.from_items(items)).take_all(), key=lambda row: row["id"])

    expected = peft_greedy_by_adapter(llama_dir, adapters, prompts, NAMES, MAX_TOKENS)
    assert [list(row["generated_token_ids"]) for row in rows[:-1]] == expected
    assert [row["error"] for row in rows[:-1]] == [None] * len(NAMES)
    assert rows[-1]["error"] == (
        "'lora' names 'nope', which is not a registered LoRA adapter (registered: 'qv', 'mlp'); "
        "register it with ProcessorConfig.lora_modules"
    )


@pytest.mark.slow
def test_the_cli_on_a_cluster_writes_the_single_machine_lora_rows(
    ray_address: str,
    model: str,
    adapters: dict[str, Path],
    tmp_path: Path,
    one_thread: None,
) -> None:
    rows = [
        {"id": i, "prompt": f"Row {i} asks", **({} if name is None else {"lora": name})}
        for i, name in enumerate(NAMES)
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", model, "--max-model-len", "64", "--max-tokens", "4", "--no-progress"]
    flags += [part for name, path in adapters.items() for part in ("--lora", f"{name}={path}")]
    single = tmp_path / "single.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(single), *flags]) == 0
    output = tmp_path / "out"
    cluster = ["--ray-address", ray_address, "--batch-size", "3"]
    assert main(["generate", "-i", str(source), "-o", str(output), *flags, *cluster]) == 0
    written = [json.loads(line) for file in output.glob("*.jsonl") for line in file.open()]
    expected = [json.loads(line) for line in single.open()]
    assert sorted(written, key=lambda row: row["id"]) == sorted(expected, key=lambda row: row["id"])


def test_the_config_refuses_malformed_adapters_and_lora_turned_off() -> None:
    with pytest.raises(ValueError, match=r"ProcessorConfig\.lora_modules: the path of adapter 'a'"):
        ProcessorConfig("m", lora_modules={"a": ""})
    with pytest.raises(ValueError, match="an adapter name must be a non-empty string, got ''"):
        ProcessorConfig("m", lora_modules={"": "/adapters/a"})
    with pytest.raises(ValueError, match="enable_lora=False, but adapters are registered with"):
        ProcessorConfig("m", {"enable_lora": False}, lora_modules={"a": "/adapters/a"})
    config = ProcessorConfig("m", {"max_lora_rank": 8}, lora_modules={"a": "/adapters/a"})
    assert config.llm_kwargs() == {"max_lora_rank": 8, "enable_lora": True}
