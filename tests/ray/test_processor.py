"""`paged_llm.ray.build_processor` on a local two-node cluster: every row once, the same greedy
text as one `LLM`, bad rows answered with an error, though an actor dies mid-job."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.data
import torch

from paged_llm import LLM, SamplingParams
from paged_llm.ray import ProcessorConfig, build_processor

pytestmark = pytest.mark.slow

MAX_TOKENS = 4
ENGINE_KWARGS = {"max_model_len": 64}
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# Rows that cannot run, by id, and a word their error names (41, odd, is a chat row).
TOO_LONG, BAD_MESSAGES, BAD_PARAMS = 40, 41, 42
BAD_ROWS = {TOO_LONG: "max_model_len", BAD_PARAMS: "max_tokens", BAD_MESSAGES: "content"}


def question_rows(count: int) -> list[dict[str, Any]]:
    """Rows of a dataset job: even ids ask as a prompt, odd ones as a chat."""
    return [
        {"id": i, "topic": f"topic-{i % 3}", "question": f"What is {i} plus {i}?", "chat": i % 2}
        for i in range(count)
    ]


def preprocess(row: dict[str, Any]) -> dict[str, Any]:
    sampling = {**GREEDY, "max_tokens": -1 if row["id"] == BAD_PARAMS else MAX_TOKENS}
    question = "word " * 100 if row["id"] == TOO_LONG else row["question"]
    if row["chat"]:
        content = None if row["id"] == BAD_MESSAGES else question
        return {"messages": [{"role": "user", "content": content}], "sampling_params": sampling}
    return {"prompt": question, "sampling_params": sampling}


def postprocess(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("id", "topic", "generated_text", "generated_token_ids", "finish_reason", "error")
    return {
        **{name: row[name] for name in keep},
        "num_tokens": (row["num_prompt_tokens"], row["num_generated_tokens"]),
        "node": ray.get_runtime_context().get_node_id(),
    }


@pytest.fixture(scope="module")
def reference(model: str) -> Iterator[Callable[[list[dict[str, Any]]], dict[int, Any]]]:
    """One `LLM` in this process: the (text, token ids) that each good row should get."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(model, **ENGINE_KWARGS)

    def expected(rows: list[dict[str, Any]]) -> dict[int, Any]:
        params = SamplingParams(**GREEDY)
        prompts = [row for row in rows if not row["chat"]]
        chats = [row for row in rows if row["chat"]]
        outputs = llm.generate([row["question"] for row in prompts], params, use_tqdm=False)
        outputs += llm.chat(
            [[{"role": "user", "content": row["question"]}] for row in chats],
            params,
            use_tqdm=False,
        )
        return {
            row["id"]: (output.outputs[0].text, output.outputs[0].token_ids)
            for row, output in zip(prompts + chats, outputs, strict=True)
        }

    yield expected
    llm.shutdown()
    torch.set_num_threads(threads)


def exit_once(marker: Path, row_id: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """`preprocess`, but the actor that first meets ``row_id`` dies at once (os._exit)."""

    def run(row: dict[str, Any]) -> dict[str, Any]:
        if row["id"] == row_id and not marker.exists():
            marker.touch()
            os._exit(1)
        return preprocess(row)

    return run


# NOTE: one job checks both the rows and an actor's death: a second job would start its
# actors again, and all the Ray tests together must stay under 4 minutes on 2 cores.
def test_every_row_comes_back_once_with_one_llms_greedy_text_though_an_actor_dies(
    ray_address: str,
    model: str,
    reference: Callable[[list[dict[str, Any]]], dict[int, Any]],
    tmp_path: Path,
) -> None:
    rows = question_rows(43)
    marker = tmp_path / "died"
    config = ProcessorConfig(model, ENGINE_KWARGS, concurrency=2, batch_size=6)
    processor = build_processor(config, preprocess=exit_once(marker, 13), postprocess=postprocess)
    results = processor(ray.data.from_items(rows)).take_all()

    assert marker.exists()  # an actor did die, in the batch of row 13
    assert sorted(result["id"] for result in results) == list(range(43))
    expected = reference([row for row in rows if row["id"] not in BAD_ROWS])
    by_id = {result["id"]: result for result in results}
    for row in rows:
        result = by_id[row["id"]]
        assert result["topic"] == row["topic"]
        if row["id"] in BAD_ROWS:
            assert BAD_ROWS[row["id"]] in result["error"], result["error"]
            assert result["generated_text"] == "" and list(result["generated_token_ids"]) == []
            assert result["finish_reason"] is None
            continue
        text, token_ids = expected[row["id"]]
        assert result["error"] is None
        assert (result["generated_text"], list(result["generated_token_ids"])) == (text, token_ids)
        assert result["finish_reason"] == "length"
        assert result["num_tokens"][1] == MAX_TOKENS and result["num_tokens"][0] > 0
    # Both nodes' actors took part.
    assert len({result["node"] for result in results}) == 2


def test_a_bad_config_fails_on_the_driver_before_any_actor_starts(model: str) -> None:
    with pytest.raises(ValueError, match="max_model_lenn"):
        ProcessorConfig(model, {"max_model_lenn": 64})
    with pytest.raises(ValueError, match="concurrency"):
        ProcessorConfig(model, concurrency=0)
    with pytest.raises(ValueError, match="num_gpus_per_actor"):
        ProcessorConfig(model, {"tensor_parallel_size": 2}, num_gpus_per_actor=1)
