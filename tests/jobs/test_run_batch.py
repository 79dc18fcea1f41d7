"""``paged-llm run-batch`` jobs: OpenAI batch output lines equal to the LLM's own results,
bad lines (one nested too deeply among them) answered with status 400 while the rest run,
constrained replies, and resuming after a SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.cli import main
from tests.jobs.files import (
    CHAT_URL,
    COMPLETIONS_URL,
    batch_line,
    check_batch_line,
    cli_env,
    engine_args,
    read_rows,
    without_created,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_thread")


NUM_BATCH_LINES = 12


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
    # A body's "model" is one of the served model's names (vllm serve's rule).
    assert main([*argv, "--served-model-name", model, "mine"]) == 0
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
        '{"custom_id": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(output), *engine_args(model)]) == 0
    summary = capsys.readouterr().out
    assert "10 rows written" in summary and "(8 errors)" in summary
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
        "line 3:embed": "url '/v1/embeddings' needs a pooling model",
        "line 4:cold": "SamplingParams.temperature must be >= 0",
        "line 5:typo": "unknown body field(s) 'max_tokenz'",
        "line 6:good": "duplicate custom_id 'good' (first seen on line 1)",
        "line 7:schema": "'response_format' must be",
        "line 8:long": "max_model_len=128",
        "line 10:None": "JSON nested more than 256 levels deep",
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
