"""``paged-llm generate --ray-address`` on a local two-node cluster writes the rows that the
single-machine command writes, from JSONL or Parquet, and refuses bad input the same way.

The command runs in this process (as tests/test_cli.py runs the single-machine one), which
is connected to the cluster already: a subprocess would import torch and Ray again, for
minutes on a busy 2-core machine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paged_llm.cli import main

pytestmark = pytest.mark.slow

FLAGS = ["--max-model-len", "64", "--max-tokens", "6", "--no-progress"]


def input_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {"id": f"row-{i}", "prompt": f"Row {i} of the dataset: {'more words ' * (i % 4)}"}
        for i in range(10)
    ]
    rows += [
        {"id": f"chat-{i}", "messages": [{"role": "user", "content": f"Hello number {i}!"}]}
        for i in range(2)
    ]
    rows.append({"id": "too-long", "prompt": "word " * 100})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text(
        "".join(row if isinstance(row, str) else json.dumps(row) + "\n" for row in rows)
    )
    return path


def by_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda row: row["id"])


def test_the_cluster_writes_the_single_machine_rows_from_jsonl_and_parquet(
    ray_address: str,
    model: str,
    tmp_path: Path,
    one_thread: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = input_rows()
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    single = tmp_path / "single.jsonl"
    # The model's default sampling (temperature 1), each row with the seed of its id.
    assert main(["generate", "-i", str(source), "-o", str(single), "--model", model, *FLAGS]) == 0
    expected = by_id([json.loads(line) for line in single.read_text().splitlines()])
    assert [row["id"] for row in expected if "error" in row] == ["too-long"]
    for row in expected:
        if "error" in row:
            # Ray Data keeps no line numbers: on the cluster, the id alone names the row.
            row["error"] = re.sub(r"^line \d+: ", "", row["error"])

    parquet = tmp_path / "in.parquet"
    columns = ("id", "prompt", "messages")
    pq.write_table(pa.table({name: [row.get(name) for row in rows] for name in columns}), parquet)
    for given, concurrency in ((source, "2"), (parquet, "1")):
        output = tmp_path / f"out-{given.suffix[1:]}"
        argv = ["generate", "-i", str(given), "-o", str(output), "--model", model, *FLAGS]
        cluster = ["--ray-address", ray_address, "--concurrency", concurrency, "--batch-size", "4"]
        capsys.readouterr()
        assert main([*argv, *cluster]) == 0
        summary = capsys.readouterr().out
        assert f"Done: {len(rows)} rows written to {output} (1 errors)" in summary
        # The actors load their models while others generate: the time says it includes that.
        assert "the actors' model loading included" in summary
        files = sorted(output.glob("*.jsonl"))
        assert files
        written = [json.loads(line) for file in files for line in file.read_text().splitlines()]
        assert by_id(written) == expected


def test_bad_input_rows_are_all_listed_and_nothing_is_generated_nor_overwritten(
    ray_address: str, model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [*input_rows()[:3], "not json\n", {"id": "row-1", "prompt": "again"}, {"prompt": "x"}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out"
    argv = ["generate", "-i", str(source), "-o", str(output), "--model", model, *FLAGS]
    assert main([*argv, "--ray-address", ray_address]) == 2
    stderr = capsys.readouterr().err
    assert "3 bad line(s) in the input; nothing was generated" in stderr
    for problem in ("not valid JSON", "duplicate id 'row-1'", "missing 'id'"):
        assert problem in stderr
    assert not output.exists()

    # No --resume on a cluster, and no writing into a folder that holds files already.
    good = write_jsonl(tmp_path / "good.jsonl", input_rows())
    argv = ["generate", "-i", str(good), "-o", str(output), "--model", model, *FLAGS]
    assert main([*argv, "--ray-address", ray_address, "--resume"]) == 2
    assert "--resume does not apply with --ray-address" in capsys.readouterr().err
    output.mkdir()
    (output / "earlier.jsonl").write_text("{}\n")
    assert main([*argv, "--ray-address", ray_address]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
