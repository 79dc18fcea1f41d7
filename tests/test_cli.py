"""The `paged-llm generate` command: output rows, input errors, overwrite guard, the output
lock, rows that are not valid Unicode, and resuming after a SIGKILL to the same outputs as an
uninterrupted run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from paged_llm import LLM, SamplingParams
from paged_llm.cli import main, row_seed
from paged_llm.engine_args import parse_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_ROWS = 40
NUM_BATCH_LINES = 12


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # NOTE: the tiny model gains nothing from a second thread, and on a busy 2-core machine
    # OpenMP threads that wait on each other make every step many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> str:
    return str(tiny_model_dir("llama"))


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
        "in.jsonl:5: row 'b' has neither 'prompt' nor 'messages'",
        "in.jsonl:6: not valid JSON",
        "in.jsonl:7: 'messages' must be a non-empty list",
        "in.jsonl:8: row 'd' has both 'prompt' and 'messages'",
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


def test_refuses_to_write_over_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    same = tmp_path / "sub" / ".." / "in.jsonl"
    assert main(["generate", "-i", str(source), "-o", str(same), "--resume"]) == 2
    assert "--input and --output are the same file" in capsys.readouterr().err
    assert read_rows(source) == [{"id": 1, "prompt": "hi"}]


def test_max_tokens_defaults_to_256_when_the_model_sets_none(model: str, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    argv = ["generate", "-i", str(source), "-o", str(output), "--model", model, "--no-progress"]
    assert main([*argv, "--max-model-len", "512", "--ignore-eos"]) == 0
    (record,) = read_rows(output)
    assert record["completion_tokens"] == 256
    assert record["outputs"][0]["finish_reason"] == "length"


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


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == parse_bytes("2g") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 2**20
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size like 4GiB"):
        parse_bytes("lots")


def test_row_seed_is_stable_and_depends_on_seed_and_id() -> None:
    assert row_seed(0, "a") == row_seed(0, "a")
    assert len({row_seed(0, "a"), row_seed(1, "a"), row_seed(0, "b"), row_seed(0, 1)}) == 4
    assert row_seed(0, 1) != row_seed(0, "1")
    assert 0 <= row_seed(2**40, "x" * 1000) < 2**63


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


def lock_for(output: Path, pid: int) -> Path:
    lock = output.with_name(output.name + ".lock")
    lock.write_text(f"{pid} {socket.gethostname()}\n")
    return lock


def test_a_second_writer_is_refused_while_the_lock_holder_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = lock_for(output, holder.pid)
        argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
        assert main([*argv, "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"{lock} is held by pid {holder.pid}" in err
        assert lock.read_text() == f"{holder.pid} {socket.gethostname()}\n"
        assert not output.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_and_every_lock_is_removed_at_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = write_jsonl(tmp_path / "out.jsonl", [{"id": 1, "outputs": []}])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = lock_for(output, dead.pid)
    argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
    assert main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"Took over the stale lock {lock}: its pid {dead.pid} is not running" in captured.err
    assert "Nothing to do" in captured.out
    assert not lock.exists()
    # An error after the lock is taken (here the model is missing) removes it too.
    write_jsonl(source, [{"id": 1, "prompt": "hi"}, {"id": 2, "prompt": "more"}])
    assert main([*argv, "--resume"]) == 1
    assert not lock.exists()


def test_resume_removes_duplicate_ids_keeping_the_first_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "hi"} for i in (1, 2)])
    first_of_1 = {"id": 1, "outputs": [{"text": "first"}]}
    first_of_2 = {"id": 2, "outputs": []}
    later = [{"id": 1, "outputs": [{"text": "again"}]}, {"id": 2, "error": "line 2: x"}]
    rows = [first_of_1, later[0], first_of_2, later[1], '{"id": 1, "ou']
    output = write_jsonl(tmp_path / "out.jsonl", rows)
    argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
    assert main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"Removed 2 duplicate row(s) from {output}" in captured.err
    assert "dropped a torn last line" in captured.err
    assert "Nothing to do" in captured.out
    assert read_rows(output) == [first_of_1, first_of_2]
    assert sorted(tmp_path.iterdir()) == [source, output]  # no temporary file left behind


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


# ----- run-batch: OpenAI Batch API files --------------------------------------------------

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


def test_run_batch_writes_openai_lines_equal_to_llm_chat_and_generate(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conversations = [
        [{"role": "user", "content": "Hello!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
        ],
    ]
    greedy = {"temperature": 0, "max_tokens": 6}
    lines = [
        batch_line("chat-0", CHAT_URL, messages=conversations[0], **greedy),
        batch_line("chat-1", CHAT_URL, messages=conversations[1], model="mine", **greedy),
        batch_line(
            "chat-lp", CHAT_URL, messages=conversations[0], logprobs=True, top_logprobs=2, **greedy
        ),
        batch_line("text", COMPLETIONS_URL, prompt="Once upon a time", temperature=0),
        batch_line("ids", COMPLETIONS_URL, prompt=[[5, 6, 7, 8]], logprobs=1, **greedy),
        batch_line("n2", COMPLETIONS_URL, prompt="Two ways", n=2, ignore_eos=True, max_tokens=4),
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    argv = ["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]
    assert main(argv) == 0
    assert "6 rows written" in capsys.readouterr().out

    written = read_rows(output)
    for line in written:
        check_batch_line(line)
    by_id = {line["custom_id"]: line["response"]["body"] for line in written}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines)

    with LLM(model, max_model_len=128) as llm:
        # Text content parts are read as their text joined.
        conversations[1][1]["content"] = "What is 2 + 2?"
        replies = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=6))
        text, ids = llm.generate(
            ["Once upon a time", {"prompt_token_ids": [5, 6, 7, 8]}],
            [SamplingParams(temperature=0), SamplingParams(temperature=0, max_tokens=6)],
        )
    for custom_id, reply in zip(("chat-0", "chat-1"), replies, strict=True):
        (choice,) = by_id[custom_id]["choices"]
        assert choice["message"]["content"] == reply.outputs[0].text
        assert choice["finish_reason"] == reply.outputs[0].finish_reason
        assert by_id[custom_id]["usage"]["prompt_tokens"] == len(reply.prompt_token_ids)
        assert by_id[custom_id]["usage"]["completion_tokens"] == len(reply.outputs[0].token_ids)
    assert by_id["chat-1"]["model"] == "mine" and by_id["chat-0"]["model"] == model
    assert by_id["chat-lp"]["choices"][0]["message"] == by_id["chat-0"]["choices"][0]["message"]
    for entry in by_id["chat-lp"]["choices"][0]["logprobs"]["content"]:
        # Greedy: the generated token is the most likely one, so it heads its top 2.
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
    assert by_id["text"]["choices"][0]["text"] == text.outputs[0].text
    assert by_id["text"]["usage"]["completion_tokens"] == 16  # OpenAI's default length
    (choice,) = by_id["ids"]["choices"]
    assert choice["text"] == ids.outputs[0].text
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert choice["logprobs"]["text_offset"][0] == 0
    assert len(choice["logprobs"]["token_logprobs"]) == 6
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])
    assert [len(c["text"]) > 0 for c in by_id["n2"]["choices"]] == [True, True]
    assert by_id["n2"]["usage"]["completion_tokens"] == 8


def test_run_batch_answers_bad_lines_with_400_and_runs_the_rest(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hello = [{"role": "user", "content": "Hello!"}]
    lines = [
        batch_line("good", CHAT_URL, messages=hello, max_tokens=3),
        "{not json\n",
        batch_line("embed", "/v1/embeddings", input="hi"),
        batch_line("cold", CHAT_URL, messages=hello, temperature=-1),
        batch_line("typo", CHAT_URL, messages=hello, max_tokenz=3),
        batch_line("good", CHAT_URL, messages=hello),
        batch_line(
            "schema",
            CHAT_URL,
            messages=hello,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        ),
        batch_line("long", COMPLETIONS_URL, prompt="word " * 200),
        batch_line("last", COMPLETIONS_URL, prompt="fine", max_tokens=2),
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]) == 0
    summary = capsys.readouterr().out
    assert "9 rows written" in summary and "(7 errors)" in summary
    written = read_rows(output)
    for line in written:
        check_batch_line(line)
    assert len(written) == len(lines) and len({line["id"] for line in written}) == len(lines)
    # "line N:custom_id" -> the error message.
    errors = {
        f"{line['error']['message'].partition(':')[0]}:{line['custom_id']}": line["error"][
            "message"
        ]
        for line in written
        if line["error"] is not None
    }
    expected = {
        "line 2:None": "not valid JSON",
        "line 3:embed": "unsupported url '/v1/embeddings'",
        "line 4:cold": "SamplingParams.temperature must be >= 0",
        "line 5:typo": "unknown body field(s) 'max_tokenz'",
        "line 6:good": "duplicate custom_id 'good' (first seen on line 1)",
        "line 7:schema": "'response_format' must be",
        "line 8:long": "max_model_len=128",
    }
    assert sorted(errors) == sorted(expected)
    for key, fragment in expected.items():
        assert fragment in errors[key]
    statuses = sorted((str(line["custom_id"]), line["response"]["status_code"]) for line in written)
    assert [status for custom_id, status in statuses if custom_id in ("good", "last")] == [
        200,
        400,
        200,
    ]


def without_created(line: dict) -> dict:
    """An output line less the time its request finished, the one field a rerun changes."""
    body = line["response"]["body"]
    return {**line, "response": {**line["response"], "body": {**body, "created": None}}}


@pytest.mark.slow
def test_run_batch_resumes_after_kill_9_with_each_custom_id_once_and_refuses_a_second_writer(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sampling = [{"temperature": 0}, {"temperature": 0.9}, {"temperature": 0.9, "seed": 3}]
    lines = [
        batch_line(
            f"r{i}",
            CHAT_URL,
            messages=[{"role": "user", "content": f"Question {i}?"}],
            **sampling[i % 3],
        )
        if i % 2
        else batch_line(
            f"r{i}", COMPLETIONS_URL, prompt=f"Row {i}: {'words ' * i}", **sampling[i % 3]
        )
        for i in range(NUM_BATCH_LINES)
    ]
    for line in lines:
        line["body"]["max_tokens"] = 24
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    # Two sequences at a time and 24 tokens each, so lines finish a few at a time.
    options = [*engine_args(model), "--max-num-seqs", "2"]

    clean = tmp_path / "clean.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(clean), *options]) == 0

    crashed = tmp_path / "crashed.jsonl"
    command = [
        sys.executable,
        "-m",
        "paged_llm",
        "run-batch",
        "-i",
        str(source),
        "-o",
        str(crashed),
    ]
    job = subprocess.Popen(
        [*command, *options], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while job.poll() is None and time.monotonic() < deadline:
        if crashed.exists() and crashed.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.005)
    assert job.poll() is None, f"the job ended before it was killed: {job.stderr.read()}"
    capsys.readouterr()
    # A second writer on the same output, while the first runs, is refused.
    assert main(["run-batch", "-i", str(source), "-o", str(crashed), *options, "--resume"]) == 2
    assert f"is held by pid {job.pid}" in capsys.readouterr().err
    job.send_signal(signal.SIGKILL)
    job.wait()
    job.stderr.close()
    num_written = crashed.read_bytes().count(b"\n")
    assert 2 <= num_written < NUM_BATCH_LINES
    with open(crashed, "ab") as sink:
        sink.write(b'{"id": "batch_req_0", "custom_id": "r1", "resp')

    assert main(["run-batch", "-i", str(source), "-o", str(crashed), *options, "--resume"]) == 0
    captured = capsys.readouterr()
    assert "dropped a torn last line" in captured.err
    assert f"{num_written} skipped as already done" in captured.out
    resumed = read_rows(crashed)
    assert sorted(line["custom_id"] for line in resumed) == sorted(
        f"r{i}" for i in range(NUM_BATCH_LINES)
    )
    by_id = {line["custom_id"]: without_created(line) for line in resumed}
    assert by_id == {line["custom_id"]: without_created(line) for line in read_rows(clean)}


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


def test_run_batch_response_format_constrains_the_reply(model: str, tmp_path: Path) -> None:
    hello = [{"role": "user", "content": "Pick a colour."}]
    schema = {"enum": ["red", "blue"]}
    lines = [
        batch_line(
            "colour",
            CHAT_URL,
            messages=hello,
            max_tokens=20,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]) == 0
    (line,) = read_rows(output)
    check_batch_line(line)
    (choice,) = line["response"]["body"]["choices"]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"]) in ("red", "blue")
