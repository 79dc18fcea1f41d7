"""Pooling jobs: ``paged-llm embed`` and ``classify`` rows (the same vectors as `LLM.embed`,
errors naming the line and the field), resuming a torn output to every id once, the
``.npy`` output, and ``/v1/embeddings`` lines in ``run-batch``."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from paged_llm import LLM
from paged_llm.cli import main
from paged_llm.pooling_params import PoolingParams
from tests.jobs.files import (
    COMPLETIONS_URL,
    batch_line,
    engine_args,
    read_rows,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
EMBEDDINGS_URL = "/v1/embeddings"
ROWS = [
    {"id": "a", "prompt": "The capital of France is"},
    {"id": 2, "prompt_token_ids": [5, 6, 7, 8]},
    {"id": "short", "prompt": "Hi", "dimensions": 8},
    {"id": "zero", "prompt": "Hi", "dimensions": 0},
    {"id": "long", "prompt": "word " * 200},
    {"id": "c", "prompt": "A quick brown fox"},
]


@pytest.fixture(scope="module")
def embedder(model: str) -> Callable[[object, int | None], list[float]]:
    """`LLM.embed` of one prompt (with its dimensions) in this process: the reference."""
    llm = LLM(model, runner="pooling", max_model_len=128)

    def embed(prompt: object, dimensions: int | None = None) -> list[float]:
        (output,) = llm.embed([prompt], PoolingParams(dimensions=dimensions), use_tqdm=False)
        return output.outputs.embedding

    yield embed
    llm.shutdown()


def embed_argv(source: Path, output: Path, model: str, *extra: str) -> list[str]:
    return ["embed", "-i", str(source), "-o", str(output), *engine_args(model), *extra]


def test_embed_writes_each_rows_vector_once_and_errors_naming_line_and_field(
    model: str, tmp_path: Path, embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    output = tmp_path / "vectors.jsonl"
    assert main(embed_argv(source, output, model)) == 0

    by_id = {row["id"]: row for row in read_rows(output)}
    assert len(by_id) == len(read_rows(output)) == len(ROWS)
    for row in (ROWS[0], ROWS[1], ROWS[2], ROWS[5]):
        prompt = row.get("prompt") or {"prompt_token_ids": row["prompt_token_ids"]}
        expected = embedder(prompt, row.get("dimensions"))
        assert set(by_id[row["id"]]) == {"id", "embedding", "prompt_tokens"}
        np.testing.assert_allclose(by_id[row["id"]]["embedding"], expected, atol=TOLERANCE)
    assert len(by_id["short"]["embedding"]) == 8
    assert by_id[2]["prompt_tokens"] == 4
    assert by_id["zero"]["error"].startswith("line 4: PoolingParams.dimensions must be")
    assert by_id["long"]["error"].startswith("line 5: the prompt has")
    summary = capsys.readouterr().out
    assert "6 rows written" in summary and "(2 errors)" in summary and "prompt tok/s" in summary


def test_pooling_rows_refuse_generation_fields_as_bad_lines(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": 1, "messages": [{"role": "user", "content": "hi"}]},
            {"id": 2, "prompt": "x", "response_format": {"type": "json_object"}},
            {"id": 3, "prompt": "x", "prompt_token_ids": [1]},
            {"id": 4, "prompt_token_ids": []},
        ],
    )
    assert main(embed_argv(source, tmp_path / "out.jsonl", model)) == 2
    err = capsys.readouterr().err
    assert "4 bad line(s)" in err
    assert "in.jsonl:1: row 1 has 'messages', which a pooling job does not take" in err
    assert "in.jsonl:2: row 2 has 'response_format'" in err
    assert "in.jsonl:3: row 3 has 'prompt' and 'prompt_token_ids'; give exactly one of" in err
    assert "in.jsonl:4: 'prompt_token_ids' must be a non-empty list" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_after_a_torn_write_holds_every_id_once_with_the_same_vectors(
    model: str, tmp_path: Path
) -> None:
    rows = [{"id": i, "prompt": f"Row {i}: {'more ' * (i % 5)}"} for i in range(12)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    whole = tmp_path / "whole.jsonl"
    assert main(embed_argv(source, whole, model)) == 0
    # A run killed after five rows, its sixth cut short mid-write.
    lines = whole.read_bytes().splitlines(keepends=True)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_bytes(b"".join(lines[:5]) + lines[5][:30])
    assert main(embed_argv(source, resumed, model)) == 2  # no --resume: refused
    assert main(embed_argv(source, resumed, model, "--resume")) == 0

    def by_id(path: Path) -> dict[int, list[float]]:
        return {row["id"]: row["embedding"] for row in read_rows(path)}

    assert len(read_rows(resumed)) == len(rows)
    assert by_id(resumed).keys() == by_id(whole).keys()
    for row_id, vector in by_id(whole).items():
        np.testing.assert_allclose(by_id(resumed)[row_id], vector, atol=TOLERANCE)


def test_npy_output_has_a_row_per_input_row_in_order_and_an_ids_file(
    model: str, tmp_path: Path, embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [row for row in ROWS if "dimensions" not in row]  # a, 2, long, c
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "vectors.npy"
    argv = embed_argv(source, output, model, "--output-format", "npy")
    assert main(argv) == 0
    matrix = np.load(output)
    assert matrix.dtype == np.float32 and matrix.shape[0] == len(rows)
    ids = [json.loads(line) for line in (tmp_path / "vectors.npy.ids.jsonl").read_text().split()]
    assert ids == ["a", 2, "long", "c"]
    np.testing.assert_allclose(matrix[0], embedder(ROWS[0]["prompt"]), atol=TOLERANCE)
    np.testing.assert_allclose(matrix[3], embedder(ROWS[5]["prompt"]), atol=TOLERANCE)
    assert np.isnan(matrix[2]).all() and not np.isnan(matrix[[0, 1, 3]]).any()
    by_id = {row["id"]: row for row in read_rows(tmp_path / "vectors.npy.rows.jsonl")}
    assert "max_model_len" in by_id["long"]["error"]

    assert main(argv) == 2  # the output exists
    assert "Pass --resume" in capsys.readouterr().err
    output.unlink()
    assert main([*argv, "--resume"]) == 0  # every row is done: the .npy is written again
    np.testing.assert_array_equal(np.load(output), matrix)


def test_npy_refuses_rows_of_different_widths_and_keeps_them(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    output = tmp_path / "vectors.npy"
    assert main(embed_argv(source, output, model, "--output-format", "npy")) == 2
    assert "have embeddings of 2 lengths ([8, 64])" in capsys.readouterr().err
    assert not output.exists() and len(read_rows(tmp_path / "vectors.npy.rows.jsonl")) == 3


def test_classify_writes_each_rows_class_probabilities(
    tiny_classifier_dir: Callable[[str, int], Path], tmp_path: Path
) -> None:
    classifier = str(tiny_classifier_dir("llama", 3))
    source = write_jsonl(tmp_path / "in.jsonl", [ROWS[0], ROWS[1], ROWS[2]])
    output = tmp_path / "probs.jsonl"
    argv = ["classify", "-i", str(source), "-o", str(output), *engine_args(classifier)]
    assert main(argv) == 0
    by_id = {row["id"]: row for row in read_rows(output)}
    for row_id in ("a", 2):
        assert len(by_id[row_id]["probs"]) == 3
        assert sum(by_id[row_id]["probs"]) == pytest.approx(1.0, abs=1e-5)
    assert by_id["short"]["error"].startswith(
        "line 3: PoolingParams.dimensions=8 does not apply to the 'classify' task"
    )


def test_embed_refuses_a_generating_runner(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    argv = embed_argv(source, tmp_path / "out.jsonl", model, "--runner", "generate")
    assert main(argv) == 2
    assert "--runner generate contradicts `paged-llm embed`" in capsys.readouterr().err


def test_run_batch_embeddings_lines_answer_as_openai_and_other_kinds_name_the_runner(
    model: str, tmp_path: Path, embedder
) -> None:
    lines = [
        batch_line("one", EMBEDDINGS_URL, model="tiny", input="The capital of France is"),
        batch_line("two", EMBEDDINGS_URL, input=["Hi", "A quick brown fox"], dimensions=8),
        batch_line("b64", EMBEDDINGS_URL, input=[5, 6, 7, 8], encoding_format="base64"),
        batch_line("ids", EMBEDDINGS_URL, input=[[5, 6], [7]]),
        batch_line("empty", EMBEDDINGS_URL, input=["fine", ""]),
        batch_line("format", EMBEDDINGS_URL, input="x", encoding_format="bits"),
        batch_line("none", EMBEDDINGS_URL, input=[]),
        batch_line("text", COMPLETIONS_URL, prompt="Hi", max_tokens=2),
    ]
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    output = tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]
    assert main([*argv, "--runner", "pooling", "--served-model-name", "tiny"]) == 0
    by_id = {line["custom_id"]: line for line in read_rows(output)}
    assert len(by_id) == len(lines)

    one = by_id["one"]["response"]
    assert one["status_code"] == 200 and by_id["one"]["error"] is None
    body = one["body"]
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [set(entry) for entry in body["data"]] == [{"object", "index", "embedding"}]
    np.testing.assert_allclose(
        body["data"][0]["embedding"], embedder("The capital of France is"), atol=TOLERANCE
    )
    usage = body["usage"]
    assert usage == {
        "prompt_tokens": usage["prompt_tokens"],
        "total_tokens": usage["prompt_tokens"],
    }

    two = by_id["two"]["response"]["body"]
    assert [entry["index"] for entry in two["data"]] == [0, 1]
    np.testing.assert_allclose(two["data"][1]["embedding"], embedder("A quick brown fox", 8))
    assert two["model"] == "tiny"  # no "model" in the body: the served name

    raw = base64.b64decode(by_id["b64"]["response"]["body"]["data"][0]["embedding"])
    decoded = np.frombuffer(raw, dtype="<f4")
    np.testing.assert_allclose(decoded, embedder({"prompt_token_ids": [5, 6, 7, 8]}), atol=1e-5)
    assert len(by_id["ids"]["response"]["body"]["data"]) == 2
    assert by_id["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 3

    def error(custom_id: str) -> dict:
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 400
        return response["body"]["error"]

    assert error("empty")["message"].startswith("line 5: input[1]: the prompt is empty")
    assert error("empty")["param"] == "input"
    assert error("format")["param"] == "encoding_format"
    assert error("none")["param"] == "input"
    assert error("text")["param"] == "url"
    assert (
        "run the generation lines in a run-batch without --runner pooling"
        in (error("text")["message"])
    )

    generating = tmp_path / "generating.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(generating), *engine_args(model)]) == 0
    by_id = {line["custom_id"]: line for line in read_rows(generating)}
    assert by_id["text"]["response"]["status_code"] == 200
    message = by_id["one"]["response"]["body"]["error"]["message"]
    assert "needs a pooling model" in message and "--runner pooling" in message
