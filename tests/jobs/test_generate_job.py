"""``paged-llm generate`` jobs: output rows, input errors (rows nested too deeply among them),
the overwrite guard, rows that are not valid Unicode, constrained rows, and resuming after a
SIGKILL to the same outputs as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_llm.cli import main
from paged_llm.jobs.rows import MAX_JSON_DEPTH, parse_record
from tests.jobs.files import (
    cli_env,
    engine_args,
    read_rows,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_thread")


NUM_ROWS = 40


def test_generate_writes_each_row_once_with_texts_counts_and_errors(
    model: str, tmp_path: Path, tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"id": "twin-a", "prompt": "The same prompt"},
        {"id": "twin-b", "prompt": "The same prompt"},
        {"id": 7, "messages": [{"role": "user", "content": "Hello!"}]},
        {"id": "empty", "prompt": ""},
        {"id": "long", "prompt": "word " * 200},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out" / "result.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), *engine_args(model)]
    assert main([*argv, "--n", "2", "--max-tokens", "5", "--ignore-eos"]) == 0

    by_id = {row["id"]: row for row in read_rows(output)}
    assert len(by_id) == len(read_rows(output)) == len(rows)
    assert "line 4: the prompt is empty" in by_id["empty"]["error"]
    assert "line 5: the prompt has" in by_id["long"]["error"]
    assert "max_model_len=128" in by_id["long"]["error"]
    for row_id in ("twin-a", "twin-b", 7):
        record = by_id[row_id]
        assert [c["index"] for c in record["outputs"]] == [0, 1]
        assert all(c["finish_reason"] == "length" for c in record["outputs"])
        assert all(c["completion_tokens"] == 5 for c in record["outputs"])
        assert record["completion_tokens"] == 10
    assert by_id["twin-a"]["prompt_tokens"] == len(tokenizer("The same prompt")["input_ids"])
    # The model's defaults sample (temperature 1), and each row draws from its own seed.
    assert by_id["twin-a"]["outputs"][0]["text"] != by_id["twin-b"]["outputs"][0]["text"]
    summary = capsys.readouterr().out
    assert "5 rows written" in summary and "(2 errors)" in summary
    assert "30 completion tokens" in summary and "output tok/s" in summary
    assert f"Loaded {model} in " in summary


def test_bad_input_lines_are_all_reported_by_line_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"id": "a", "prompt": "fine"},
        {"prompt": "no id"},
        "\n",
        {"id": "a", "prompt": "again"},
        {"id": "b"},
        "{not json\n",
        {"id": "c", "messages": "hello"},
        {"id": "d", "prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"id": 1.5, "prompt": "float id"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    # The model is never loaded: input errors stop the command first.
    code = main(["generate", "-i", str(source), "-o", str(output), "--model", "missing/model"])
    assert code == 2
    err = capsys.readouterr().err
    assert "7 bad line(s) in the input; nothing was generated" in err
    for expected in (
        "in.jsonl:2: missing 'id'",
        "in.jsonl:4: duplicate id 'a' (first seen on line 1)",
        "in.jsonl:5: row 'b' has no prompt; give exactly one of 'prompt', 'messages', "
        "'prompt_token_ids'",
        "in.jsonl:6: not valid JSON",
        "in.jsonl:7: 'messages' must be a non-empty list",
        "in.jsonl:8: row 'd' has 'prompt' and 'messages'; give exactly one of",
        "in.jsonl:9: 'id' must be a string or an integer, got 1.5",
    ):
        assert expected in err
    assert not output.exists()


def test_refuses_to_overwrite_without_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    output.write_text('{"id": 0, "outputs": []}\n')
    assert main(["generate", "-i", str(source), "-o", str(output)]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not empty" in err and "--resume" in err
    assert output.read_text() == '{"id": 0, "outputs": []}\n'


def test_max_tokens_defaults_to_256_when_the_model_sets_none(model: str, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), "--model", model, "--no-progress"]
    assert main([*argv, "--max-model-len", "512", "--ignore-eos"]) == 0
    (record,) = read_rows(output)
    assert record["completion_tokens"] == 256
    assert record["outputs"][0]["finish_reason"] == "length"


SAMPLING = {
    "greedy": ["--temperature", "0"],
    "sampled": ["--temperature", "0.9", "--seed", "5"],
}


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.slow
def test_resume_after_kill_9_matches_a_clean_run(
    model: str, tmp_path: Path, sampling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"id": f"r{i}", "prompt": f"Row {i} of the dataset: {'more words ' * (i % 5)}"}
        if i % 3
        else {"id": f"r{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}
        for i in range(NUM_ROWS)
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    # Two sequences at a time, so rows finish and are written a few at a time.
    options = [*engine_args(model), "--max-tokens", "24", "--max-num-seqs", "2"]
    options += SAMPLING[sampling]

    clean = tmp_path / "clean.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(clean), *options]) == 0

    crashed = tmp_path / "crashed.jsonl"
    command = [sys.executable, "-m", "paged_llm", "generate", "-i", str(source), "-o", str(crashed)]
    job = subprocess.Popen(
        [*command, *options], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while job.poll() is None and time.monotonic() < deadline:
        if crashed.exists() and crashed.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.005)
    assert job.poll() is None, f"the job ended before it was killed: {job.stderr.read()}"
    job.send_signal(signal.SIGKILL)
    job.wait()
    job.stderr.close()
    num_written = crashed.read_bytes().count(b"\n")
    assert 3 <= num_written < NUM_ROWS
    # A write torn by the crash: half a row, no newline.
    with open(crashed, "ab") as sink:
        sink.write(b'{"id": "r39", "outputs": [{"index": 0, "te')

    capsys.readouterr()
    assert main(["generate", "-i", str(source), "-o", str(crashed), *options, "--resume"]) == 0
    captured = capsys.readouterr()
    assert "dropped a torn last line" in captured.err
    assert f"{num_written} skipped as already done" in captured.out

    resumed = read_rows(crashed)
    assert sorted(row["id"] for row in resumed) == sorted(row["id"] for row in rows)
    assert {row["id"]: row for row in resumed} == {row["id"]: row for row in read_rows(clean)}

    # Once complete, resuming again has nothing to do and leaves the file untouched.
    before = crashed.read_bytes()
    assert main(["generate", "-i", str(source), "-o", str(crashed), *options, "--resume"]) == 0
    assert "Nothing to do" in capsys.readouterr().out
    assert crashed.read_bytes() == before


def test_rows_with_lone_surrogates_get_error_rows_and_the_job_finishes(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"id": 1, "prompt": "a cut emoji \ud83d"},
        {"id": "bad\udc00id", "prompt": "hi"},
        {"id": 3, "messages": [{"role": "user", "content": "\ud83d"}]},
        {"id": 4, "prompt": "a fine row \U0001f600"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)  # JSON escapes: "\ud83d"
    output = tmp_path / "out.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), *engine_args(model)]
    assert main([*argv, "--max-tokens", "3"]) == 0
    summary = capsys.readouterr().out
    assert "4 rows written" in summary and "(3 errors)" in summary
    output.read_bytes().decode("utf-8")  # strict: the file is valid UTF-8
    by_id = {row["id"]: row for row in read_rows(output)}
    assert sorted(by_id, key=str) == sorted((row["id"] for row in rows), key=str)
    for row_id, line, field in ((1, 1, "prompt"), ("bad\udc00id", 2, "id"), (3, 3, "messages")):
        error = by_id[row_id]["error"]
        assert error.startswith(f"line {line}: the {field} is not valid Unicode")
        assert "lone surrogate" in error
    assert by_id[4]["completion_tokens"] == 3
    # Every id reads back as written, so resuming finds nothing to do.
    assert main([*argv, "--max-tokens", "3", "--resume"]) == 0
    assert "Nothing to do" in capsys.readouterr().out


def test_a_line_that_is_not_utf8_is_a_bad_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "\xed\xa0\xbd"}\n')
    output = tmp_path / "out.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]) == 2
    assert "in.jsonl:2: not valid UTF-8 (byte 0xed at column 22)" in capsys.readouterr().err
    assert not output.exists()


def nested(depth: int, inner: object = 0) -> list[object]:
    """``inner`` inside ``depth`` lists."""
    value: list[object] = [inner]
    for _ in range(depth - 1):
        value = [value]
    return value


def test_a_row_nested_too_deeply_is_a_bad_line_like_any_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # json.dumps would recurse as deep as the value: the deepest line is written by hand.
    deepest = '{"id": 2, "prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    lines = [
        {"id": 1, "prompt": "fine"},
        deepest,
        {"id": 3, "prompt": "x", "extra": nested(MAX_JSON_DEPTH - 1)},  # the row is one more
        {"id": 4, "prompt": "x", "extra": nested(MAX_JSON_DEPTH)},
        {"prompt": "no id"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]) == 2
    err = capsys.readouterr().err
    assert "3 bad line(s) in the input; nothing was generated" in err
    too_deep = f"JSON nested more than {MAX_JSON_DEPTH} levels deep"
    for expected in (f"in.jsonl:2: {too_deep}", f"in.jsonl:4: {too_deep}", "in.jsonl:5: missing"):
        assert expected in err
    assert not output.exists()


def test_a_lone_surrogate_is_found_however_deep_a_record_nests() -> None:
    """Records that are not JSON lines (Parquet, through Ray) are not depth-checked."""
    message = {"role": "user", "content": "x", "extra": nested(100_000, "\ud83d")}
    row = parse_record(None, {"id": 1, "messages": [message]}, {})
    assert row.error is not None and "lone surrogate \\ud83d" in row.error


def test_rows_constrain_their_completions_with_structured_outputs_or_response_format(
    model: str, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    rows = [
        {"id": "choice", "prompt": "Pick:", "structured_outputs": {"choice": ["red", "blue"]}},
        {
            "id": "schema",
            "messages": [{"role": "user", "content": "A number?"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            },
        },
        {"id": "free", "prompt": "Anything", "response_format": {"type": "text"}},
        {"id": "bad-regex", "prompt": "x", "structured_outputs": {"regex": "[a-"}},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), *engine_args(model)]
    assert main([*argv, "--max-tokens", "40", "--temperature", "0"]) == 0
    by_id = {row["id"]: row for row in read_rows(output)}
    assert by_id["choice"]["outputs"][0]["text"] in ("red", "blue")
    completion = by_id["schema"]["outputs"][0]
    if completion["finish_reason"] == "stop":
        assert 0 <= json.loads(completion["text"])["n"] <= 99
    assert by_id["free"]["outputs"][0]["text"]
    assert (
        "line 4: StructuredOutputsParams.regex is not valid for xgrammar"
        in by_id["bad-regex"]["error"]
    )


def test_bad_structured_output_fields_are_bad_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"id": 1, "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"id": 2, "prompt": "x", "structured_outputs": {"schema": {}}},
        {"id": 3, "prompt": "x", "response_format": {"type": "json_schema"}},
        {"id": 4, "prompt": "x", "response_format": {"type": "text"}, "structured_outputs": {}},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    code = main(["generate", "-i", str(source), "-o", str(tmp_path / "o.jsonl"), "--model", "m"])
    assert code == 2
    err = capsys.readouterr().err
    for expected in (
        "in.jsonl:1: StructuredOutputsParams needs exactly one of",
        "in.jsonl:2: 'structured_outputs' has unknown fields ['schema']",
        "in.jsonl:3: 'response_format' must be",
        "in.jsonl:4: give 'structured_outputs' or 'response_format', not both",
    ):
        assert expected in err
