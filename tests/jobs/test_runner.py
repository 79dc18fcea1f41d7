"""Running a file job (`run_job`): what its summary reports, loading the model apart from
generating."""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any

import pytest

from paged_llm.jobs import runner
from paged_llm.jobs.output import RowWriter
from paged_llm.jobs.runner import JobSpec, run_job
from tests.jobs.files import read_rows

LOAD_SECONDS = 2.0


class SlowLoadingLLM:
    """Stands for `LLM` in the runner: it only takes long to load, and generates."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        time.sleep(LOAD_SECONDS)
        self.config = SimpleNamespace(pooler=None)

    def __enter__(self) -> SlowLoadingLLM:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


def test_loading_is_reported_on_its_own_line_and_tokens_per_second_count_generation_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "LLM", SlowLoadingLLM)

    def body(llm: Any, pending: list[int], writer: RowWriter) -> None:
        for index in pending:
            writer.write({"id": index, "outputs": []}, error=False, completion_tokens=500)

    spec = JobSpec(input=tmp_path / "in.jsonl", output=tmp_path / "out.jsonl", model="slow")
    assert run_job(spec, [0, 1], body) == 0
    assert [row["id"] for row in read_rows(spec.output)] == [0, 1]
    loaded, done = capsys.readouterr().out.splitlines()
    loaded_match = re.fullmatch(r"Loaded slow in ([\d.]+) s\.", loaded)
    assert loaded_match is not None and float(loaded_match[1]) >= LOAD_SECONDS
    done_match = re.search(r"1000 completion tokens in ([\d.]+) s \(([\d.]+) output tok/s\)", done)
    assert done_match is not None, done
    # Two rows written take far less than the load: a time that counted it would be longer,
    # and its rate below 1000 tokens / 2 s.
    assert float(done_match[1]) < LOAD_SECONDS / 2
    assert float(done_match[2]) > 1000 / (LOAD_SECONDS / 2)
