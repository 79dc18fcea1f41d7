"""``paged-llm generate --ray-address`` on a local two-node cluster writes the rows that the
single-machine command writes, from JSONL or Parquet, and refuses bad input the same way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from paged_llm.cli import main
from tests.test_cli import cli_env

pytestmark = pytest.mark.slow

FLAGS = ["--max-model-len", "64", "--max-tokens", "6", "--no-progress"]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def on_cluster(address: str, *args: str) -> subprocess.Popen[str]:
    """``paged-llm generate ...`` started as its own Ray driver, in a subprocess."""
    return subprocess.Popen(
        [sys.executable, "-m", "paged_llm", "generate", "--ray-address", address, *args],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cluster_rows(folder: Path) -> list[dict[str, Any]]:
    files = sorted(folder.glob("*.jsonl"))
    assert files, f"no output files in {folder}"
    return [json.loads(line) for file in files for line in file.read_text().splitlines()]


def by_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda row: row["id"])


# NOTE: the three runs share the cluster at once, one engine actor each (a node each), so
# that the Ray tests stay under 4 minutes on 2 cores; concurrency 2 is the processor's test.
def test_the_cluster_writes_the_single_machine_rows_from_jsonl_and_parquet_and_refuses_bad_input(
    ray_address: str, model: str, tmp_path: Path, one_thread: None
) -> None:
    rows = input_rows()
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    parquet = tmp_path / "in.parquet"
    columns = ("id", "prompt", "messages")
    pq.write_table(pa.table({name: [row.get(name) for row in rows] for name in columns}), parquet)
    bad_rows = [*rows[:3], "not json\n", {"id": "row-1", "prompt": "again"}, {"prompt": "x"}]
    bad_source = write_jsonl(tmp_path / "bad.jsonl", bad_rows)
    runs = {
        given: on_cluster(
            ray_address,
            *("-i", str(given), "-o", str(tmp_path / f"out-{given.stem}-{given.suffix[1:]}")),
            *("--model", model, *FLAGS, "--batch-size", "4"),
        )
        for given in (source, parquet, bad_source)
    }

    try:
        single = tmp_path / "single.jsonl"
        # The model's default sampling (temperature 1), each row with the seed of its id.
        assert (
            main(["generate", "-i", str(source), "-o", str(single), "--model", model, *FLAGS]) == 0
        )
        expected = by_id([json.loads(line) for line in single.read_text().splitlines()])
        assert [row["id"] for row in expected if "error" in row] == ["too-long"]
        for row in expected:
            if "error" in row:
                # Ray Data keeps no line numbers: on the cluster, the id alone names the row.
                row["error"] = re.sub(r"^line \d+: ", "", row["error"])

        for given, run in runs.items():
            stdout, stderr = run.communicate(timeout=300)
            output = tmp_path / f"out-{given.stem}-{given.suffix[1:]}"
            if given == bad_source:
                assert run.returncode == 2, stderr
                assert "3 bad line(s) in the input; nothing was generated" in stderr
                for problem in ("not valid JSON", "duplicate id 'row-1'", "missing 'id'"):
                    assert problem in stderr
                assert not any(output.glob("*.jsonl"))
                continue
            assert run.returncode == 0, stderr
            assert f"Done: {len(rows)} rows written to {output} (1 errors)" in stdout
            assert by_id(cluster_rows(output)) == expected
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate()
