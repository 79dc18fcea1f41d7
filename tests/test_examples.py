"""Smoke tests: every example runs to the end in its small size.

The quickstart runs on the real embedded model; the others point `--model` at the tiny
random model, where only the plumbing is being checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples"


def run_example(script: str, *args: str) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        # NOTE: one thread: on a busy 2-core machine, OpenMP threads that wait on each other
        # make every step many times slower, and these runs are too small to gain from two.
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_quickstart_on_the_embedded_model() -> None:
    out = run_example("quickstart.py", "--num-prompts", "3", "--max-tokens", "8")
    # NOTE: the first answer is a near tie of the float model (0.08 logits between "The"
    # and "L"), which the W8A8 matmuls of the default load, as llama.cpp's, answer "L'".
    assert "Q: Explain photosynthesis in one sentence.\nA: Photosynthesis is" in out
    assert re.search(r"for 3 prompts .* [\d.]+ output tokens/s\.", out)


def test_chat_reuses_the_history_from_the_prefix_cache(model: str) -> None:
    out = run_example("chat.py", "--model", model, "--max-model-len", "256", "--max-tokens", "8")
    assert out.count("assistant> ") == 3
    cached = [int(n) for n in re.findall(r"(\d+) of them from the prefix cache", out)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]


@pytest.mark.slow
def test_dataset_generation_kills_and_resumes(model: str, tmp_path: Path) -> None:
    out = run_example(
        "dataset_generation.py",
        *("--model", model, "--num-rows", "12", "--max-tokens", "16"),
        *("--max-model-len", "256", "--workdir", str(tmp_path)),
    )
    assert "holds all 12 ids, each exactly once" in out
    assert (tmp_path / "completions.jsonl").read_text().count("\n") == 12


def test_loglikelihood(model: str) -> None:
    out = run_example("loglikelihood.py", "--model", model, "--num-questions", "3")
    assert out.count(" -> ") == 3
    assert re.search(r"Accuracy: \d/3", out)


def test_prefix_caching(model: str) -> None:
    out = run_example(
        "prefix_caching.py",
        *("--model", model, "--num-questions", "4", "--max-tokens", "2"),
        *("--system-paragraphs", "2", "--max-model-len", "512", "--max-num-batched-tokens", "128"),
    )
    hit_rates = re.findall(r"enable_prefix_caching=(\w+)\s*:.* hit rate (\d+)%", out)
    assert [enabled for enabled, _ in hit_rates] == ["True", "False"]
    assert int(hit_rates[0][1]) > 50 and hit_rates[1][1] == "0"


def test_structured_dataset_writes_schema_valid_records(model: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from structured_dataset import SCHEMA
    finally:
        sys.path.remove(str(EXAMPLES))
    output = tmp_path / "records.jsonl"
    out = run_example(
        "structured_dataset.py",
        *("--model", model, "--num-records", "4", "--max-tokens", "96"),
        *("--max-model-len", "512", "--output", str(output)),
    )
    written = int(re.search(r"Wrote (\d+) schema-valid records", out).group(1))
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == written >= 1
    for record in records:
        jsonschema.validate({k: v for k, v in record.items() if k != "id"}, SCHEMA)


def test_lora_eval_scores_each_adapter_and_the_base_model(llama_dir: Path, tmp_path: Path) -> None:
    from tests.conftest import write_peft_adapter

    adapters = [
        f"{name}={write_peft_adapter(llama_dir, tmp_path / name, rank=8, target_modules=targets, seed=seed)}"
        for seed, (name, targets) in enumerate(
            [("qv", ["q_proj", "v_proj"]), ("mlp", ["down_proj"])]
        )
    ]
    out = run_example(
        "lora_eval.py",
        *("--model", str(llama_dir), "--max-tokens", "4", "--max-model-len", "128"),
        *(arg for adapter in adapters for arg in ("--adapter", adapter)),
    )
    scores = re.findall(r"^(.+): (\d)/8 answered$", out, re.MULTILINE)
    assert [name for name, _ in scores] == ["qv", "mlp", "base model"]
    assert "24 requests under 2 adapters and the base model" in out


def test_dedup_by_embedding_drops_repeated_rows_with_the_tiny_model_as_an_embedder(
    model: str, tmp_path: Path
) -> None:
    texts = ["A cat sat on the mat.", "The river runs to the sea.", "A cat sat on the mat."]
    texts += ["Trains leave at noon.", "The river runs to the sea.", "Something else entirely."]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    output = tmp_path / "kept.jsonl"
    out = run_example(
        "dedup_by_embedding.py",
        *("--model", model, "--input", str(source), "--output", str(output)),
        *("--threshold", "0.9999", "--max-model-len", "64"),
    )
    assert "Embedded 6 rows (64 dimensions); kept 4, dropped 2" in out
    kept = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["id"] for row in kept] == [0, 1, 3, 5]


def test_rl_rollouts_serve_the_trained_weights_after_every_step(model: str) -> None:
    out = run_example(
        "rl_rollouts.py",
        *("--model", model, "--iterations", "3", "--max-tokens", "6", "--check"),
        *("--learning-rate", "0.05"),
    )
    assert out.count("engine equals transformers: True") == 3, out
