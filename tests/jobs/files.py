"""Helpers of the job tests: input and output files, and the shape of an OpenAI batch line."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from tests.conftest import peft_greedy, write_peft_adapter

REPO_ROOT = Path(__file__).resolve().parents[2]

# LoRA adapters of the tiny Llama for the jobs' tests, by name: (rank, targets, seed).
LORA_ADAPTERS = {
    "qv": (8, ["q_proj", "v_proj"], 0),
    "mlp": (4, ["o_proj", "gate_proj", "up_proj", "down_proj"], 1),
}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def cli_env() -> dict[str, str]:
    """The environment of a `python -m paged_llm` subprocess: this checkout, one thread."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def engine_args(model: str) -> list[str]:
    return ["--model", model, "--max-model-len", "128", "--no-progress"]


def lock_for(output: Path, pid: int) -> Path:
    lock = output.with_name(output.name + ".lock")
    lock.write_text(f"{pid} {socket.gethostname()}\n")
    return lock


CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def batch_line(custom_id: str, url: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def check_batch_line(line: dict) -> None:
    """The shape of one output line of OpenAI's Batch API, success or error."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    assert isinstance(response["request_id"], str)
    body = response["body"]
    if response["status_code"] != 200:
        assert response["status_code"] == 400
        assert set(body) == {"error"} and isinstance(body["error"]["message"], str)
        assert body["error"]["type"] == "invalid_request_error"
        assert line["error"] == {"code": "invalid_request", "message": body["error"]["message"]}
        return
    assert line["error"] is None and isinstance(line["custom_id"], str)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] in ("chat.completion", "text_completion")
    assert isinstance(body["created"], int) and isinstance(body["model"], str)
    chat = body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert [choice["index"] for choice in body["choices"]] == list(range(len(body["choices"])))
    for choice in body["choices"]:
        content = {"message"} if chat else {"text"}
        assert set(choice) == {"index", "logprobs", "finish_reason", "stop_reason", *content}
        assert choice["finish_reason"] in ("stop", "length")
        if chat:
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
        else:
            assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def without_created(line: dict) -> dict:
    """An output line less the time its request finished, the one field a rerun changes."""
    body = line["response"]["body"]
    return {**line, "response": {**line["response"], "body": {**body, "created": None}}}


def write_lora_adapters(model_dir: Path, folder: Path) -> dict[str, Path]:
    """The `LORA_ADAPTERS` of the model in ``model_dir``, written by peft into ``folder``."""
    return {
        name: write_peft_adapter(
            model_dir, folder / name, rank=rank, target_modules=targets, seed=seed
        )
        for name, (rank, targets, seed) in LORA_ADAPTERS.items()
    }


def peft_greedy_by_adapter(
    model_dir: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    names: list[str | None],
    max_new_tokens: int,
) -> list[list[int]]:
    """transformers + peft greedy tokens of each prompt under the adapter its name picks
    (None: the base model), one model per adapter."""
    expected: list[list[int]] = [[] for _ in prompts]
    for name in set(names):
        positions = [i for i, other in enumerate(names) if other == name]
        adapter = None if name is None else adapters[name]
        tokens = peft_greedy(model_dir, adapter, [prompts[i] for i in positions], max_new_tokens)
        for position, completion in zip(positions, tokens, strict=True):
            expected[position] = completion
    return expected
