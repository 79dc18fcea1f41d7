"""``paged-llm generate --ray-address``: the single-machine command's rows, on a Ray cluster.

The input (JSONL, or Parquet with the same columns) is read through Ray Data; every row goes
through the single-machine job's own row -> request mapping (`paged_llm.jobs`), in
`ProcessorConfig.concurrency` engine actors; the output is a folder of JSONL files, one per
write task, whose rows are the single-machine command's rows.

As on one machine, bad input rows (not JSON, no id, a duplicate id, ...) are all listed and
nothing is generated: a first pass over the input checks every row before any actor starts.
There is no ``--resume``: the output folder must be new or empty, and a job killed midway
is run again whole.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import ray.data
from ray.data.block import BlockAccessor
from ray.data.datasource import BlockBasedFileDatasink, WriteResult

from paged_llm.jobs.output import RowCounts, json_line, output_lock
from paged_llm.jobs.rows import InputRow, JobError, listed_errors, parse_line, parse_record
from paged_llm.jobs.runner import JobSpec, generate_rows
from paged_llm.llm import LLM
from paged_llm.ray.processor import ProcessorConfig, Row, map_with_llm


def run_on_cluster(
    spec: JobSpec,
    address: str | None,
    cluster_options: dict[str, Any],
    *,
    log_to_driver: bool = False,
) -> int:
    """Run a ``generate`` job on the cluster at ``address`` (or on the one this process is
    connected to already), ``cluster_options`` being `ProcessorConfig` fields; the exit
    code."""
    if spec.resume:
        raise JobError("--resume does not apply with --ray-address; write to a new --output.")
    config = ProcessorConfig(spec.model, spec.llm_kwargs(), **cluster_options)
    # NOTE: a process already connected to a cluster (a notebook, a test) keeps its
    # connection, and the job runs there.
    connects = not ray.is_initialized()
    if connects:
        ray.init(address=address, log_to_driver=log_to_driver)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = spec.progress
        spec.output.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(spec.output):
            # NOTE: checked under the lock, as on one machine.
            if spec.output.exists() and (spec.output.is_file() or any(spec.output.iterdir())):
                raise JobError(
                    f"{spec.output} already exists and is not an empty folder; with "
                    "--ray-address, --output is a new folder of JSONL files."
                )
            dataset = _read(spec.input)
            _check_rows(spec.input, dataset)
            started = time.perf_counter()
            # NOTE: no progress bars in the actors: Ray Data's bar counts the rows.
            sink = _JsonLinesSink(str(spec.output))
            map_with_llm(
                dataset, config, _GenerateRows(replace(spec, progress=False))
            ).write_datasink(
                sink,
                ray_remote_args={"num_cpus": 0},  # as reading: see _read
            )
            seconds = time.perf_counter() - started
            print(sink.counts.summary(spec.output, 0, seconds, loading_included=True))
    finally:
        if connects:
            ray.shutdown()
    return 0


def _read(path: Path) -> ray.data.Dataset:
    """One row per input line (``{"text": line}``, blank lines left out) for JSONL, one per
    record for Parquet.

    Reading takes no CPU of its own: the engine actors may hold every CPU of a CPU-only
    cluster, and a read waiting for one would wait for ever.
    """
    if _is_parquet(path):
        return ray.data.read_parquet(str(path), num_cpus=0)
    return ray.data.read_text(str(path), num_cpus=0).filter(_not_blank, num_cpus=0)


def _is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet"


def _not_blank(line: Row) -> bool:
    return bool(line["text"].strip())


@dataclass(frozen=True)
class _RowReader:
    """The single-machine job's rows from the rows Ray Data read from one input."""

    parquet: bool

    def row(self, record: Row) -> InputRow:
        """ValueError says why the row is bad; duplicate ids are found by `_check_rows`,
        which sees them all."""
        if not self.parquet:
            return parse_line(None, record["text"], {})
        # NOTE: Arrow gives every record every column, null where a record lacks it.
        return parse_record(
            None, {key: value for key, value in record.items() if value is not None}, {}
        )

    def problems(self, batch: pa.Table) -> pa.Table:
        """Each row's id (as JSON, so that the id 1 and the id "1" stay apart) or why it is
        bad."""
        ids: list[str | None] = []
        problems: list[str | None] = []
        for record in batch.to_pylist():
            try:
                ids.append(json.dumps(self.row(record).id))
                problems.append(None)
            except ValueError as error:
                ids.append(None)
                line = json.dumps(record) if self.parquet else record["text"]
                problems.append(f"{error}: {line[:80]}")
        return pa.table(
            {"id": pa.array(ids, pa.string()), "problem": pa.array(problems, pa.string())}
        )


def _check_rows(path: Path, dataset: ray.data.Dataset) -> None:
    """Raise JobError listing every bad row (and duplicate id) of the input."""
    errors: list[str] = []
    seen: set[str] = set()
    reader = _RowReader(_is_parquet(path))
    # NOTE: no CPU of its own, as reading (see _read): it is fused into the read tasks.
    checked = dataset.map_batches(reader.problems, batch_format="pyarrow", num_cpus=0)
    for checked_row in checked.iter_rows():
        row_id, problem = checked_row["id"], checked_row["problem"]
        if problem is not None:
            errors.append(f"{path}: {problem}")
        elif row_id in seen:
            errors.append(f"{path}: duplicate id {json.loads(row_id)!r}")
        else:
            seen.add(row_id)
    if errors:
        raise JobError(listed_errors(errors))


class _Collector:
    """A job's `RowWriter` over one batch: each row's JSON line and its counts."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def write(
        self,
        record: dict[str, Any],
        *,
        error: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        self.rows.append(
            {
                "line": json_line(record),
                "error": error,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
            }
        )


class _GenerateRows:
    """What an actor does with a batch: the single-machine job's rows, generated."""

    def __init__(self, spec: JobSpec) -> None:
        self._spec = spec
        self._reader = _RowReader(_is_parquet(spec.input))

    def __call__(self, llm: LLM, records: list[Row]) -> list[Row]:
        rows = [self._reader.row(record) for record in records]
        collector = _Collector()
        generate_rows(self._spec, llm, rows, collector)
        return collector.rows


class _JsonLinesSink(BlockBasedFileDatasink):
    """Writes the ``line`` column of each write task's blocks as one JSONL file; the write
    tasks return their `RowCounts`, summed into ``counts`` on the driver."""

    def __init__(self, path: str) -> None:
        super().__init__(path, file_format="jsonl")
        self.counts = RowCounts()

    def write_block_to_file(self, block: BlockAccessor, file: Any) -> None:
        for line in block.to_arrow().column("line").to_pylist():
            file.write(line)

    def write(self, blocks: Any, ctx: Any) -> RowCounts:  # type: ignore[override]
        blocks = list(blocks)
        super().write(blocks, ctx)
        counts = RowCounts()
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            for error, prompt, completion in zip(
                *(
                    table.column(name).to_pylist()
                    for name in ("error", "prompt_tokens", "completion_tokens")
                ),
                strict=True,
            ):
                counts.add(error=error, prompt_tokens=prompt, completion_tokens=completion)
        return counts

    def on_write_complete(self, write_result: WriteResult[Any]) -> None:
        super().on_write_complete(write_result)
        for counts in write_result.write_returns:
            self.counts.merge(counts)
