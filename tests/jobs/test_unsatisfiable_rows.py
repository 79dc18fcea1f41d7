"""Jobs whose rows carry a constraint no text can meet: that row alone gets an error row
(a status-400 line in run-batch), every other row its completion, and --resume finds the
job done."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_llm.cli import main
from tests.jobs.files import (
    CHAT_URL,
    batch_line,
    check_batch_line,
    engine_args,
    read_rows,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# "a" may start, then nothing can follow: the grammar's mask leaves no token.
DEAD_END_REGEX = r"a[^\s\S]"


def test_generate_writes_every_row_and_an_error_row_for_the_unsatisfiable_one(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"id": "a", "prompt": "Once upon a time"},
        {"id": "b", "prompt": "Pick:", "structured_outputs": {"choice": ["red", "blue"]}},
        {"id": "dead", "prompt": "Spell:", "structured_outputs": {"regex": DEAD_END_REGEX}},
        {"id": "c", "prompt": "The weather"},
        {"id": "d", "prompt": "Count:"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), *engine_args(model)]
    assert main([*argv, "--max-tokens", "6", "--temperature", "0"]) == 0

    by_id = {row["id"]: row for row in read_rows(output)}
    assert sorted(by_id) == sorted(row["id"] for row in rows)
    error = by_id["dead"]["error"]
    assert error.startswith("line 3: no token satisfies the constraint")
    assert "structured_outputs" in error
    assert by_id["b"]["outputs"][0]["text"] in ("red", "blue")
    for row_id in ("a", "c", "d"):
        assert by_id[row_id]["outputs"][0]["completion_tokens"] >= 1
    assert "5 rows written" in capsys.readouterr().out

    assert main([*argv, "--max-tokens", "6", "--temperature", "0", "--resume"]) == 0
    assert "Nothing to do: all 5 rows" in capsys.readouterr().out
    assert len(read_rows(output)) == len(rows)


def test_run_batch_answers_an_unsatisfiable_schema_with_a_400_line(
    model: str, tmp_path: Path
) -> None:
    hello = [{"role": "user", "content": "Hello!"}]
    # A bare string: no free whitespace for the model to spend its tokens on first.
    schema = {"type": "string", "pattern": "^" + DEAD_END_REGEX + "$"}
    lines = [
        batch_line("first", CHAT_URL, messages=hello, max_tokens=4),
        batch_line(
            "dead",
            CHAT_URL,
            messages=hello,
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        ),
        batch_line("last", CHAT_URL, messages=hello, max_tokens=4),
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]) == 0
    written = {line["custom_id"]: line for line in read_rows(output)}
    for line in written.values():
        check_batch_line(line)
    assert [written[key]["response"]["status_code"] for key in ("first", "dead", "last")] == [
        200,
        400,
        200,
    ]
    error = written["dead"]["response"]["body"]["error"]
    assert error["message"].startswith("line 2: no token satisfies the constraint")
    assert error["param"] == "structured_outputs"
