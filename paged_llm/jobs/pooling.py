"""The rows of a pooling job (``paged-llm embed``, ``paged-llm classify``): each input row's
vector, and the ``.npy`` form of a finished job's output.

An output row is ``{"id", "embedding": [...], "prompt_tokens"}`` (``"probs"`` for classify),
or ``{"id", "error"}`` for a row that cannot run; rows are appended as they finish, like a
``generate`` job's (`paged_llm.jobs.output`). With ``--output-format npy`` those rows go to
``<output>.rows.jsonl`` (the job's crash-safe progress, continued by ``--resume``), and when
every row is in it, `write_npy` writes ``<output>`` (float32, one row per input row in input
order, NaN for a row that failed) and ``<output>.ids.jsonl`` (each row's id as JSON, one per
line, in the same order).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from paged_llm.exceptions import RequestError, VLLMValidationError
from paged_llm.jobs.lora_modules import LoRAModules
from paged_llm.jobs.output import RowWriter
from paged_llm.jobs.requests import POOLING_JOB_TASKS, JobRequest, run_requests
from paged_llm.jobs.rows import InputRow, JobError, decode_line, parse_json
from paged_llm.llm import LLM
from paged_llm.outputs import PoolingRequestOutput
from paged_llm.pooling_params import PoolingParams


def rows_path(output: Path) -> Path:
    """Where an npy job keeps its rows while it runs: ``<output>.rows.jsonl``."""
    return output.with_name(output.name + ".rows.jsonl")


def ids_path(output: Path) -> Path:
    """The ids file beside an npy output: ``<output>.ids.jsonl``."""
    return output.with_name(output.name + ".ids.jsonl")


def pooling_params(row: InputRow) -> PoolingParams:
    """A row's `PoolingParams`; a `RequestError` names the field out of range."""
    try:
        return PoolingParams(dimensions=row.dimensions)  # type: ignore[arg-type]
    except VLLMValidationError as error:
        raise RequestError.of(error) from None


def pool_rows(
    task: str,
    adapters: LoRAModules,
    llm: LLM,
    rows: list[InputRow],
    writer: RowWriter,
    *,
    progress: bool,
) -> None:
    """The output row of each input row: its ``task`` vector (`POOLING_JOB_TASKS`) under
    the adapter its ``lora`` names, or its error naming the line and the field."""
    requests: list[JobRequest | RequestError] = []
    for row in rows:
        if row.error is not None:
            requests.append(RequestError(row.error))
            continue
        try:
            lora = adapters.select(row.lora, "lora")
            params = pooling_params(row)
        except RequestError as error:
            requests.append(error)
            continue
        assert not isinstance(row.prompt, list)  # a pooling row has no messages
        requests.append(JobRequest(row.prompt, params, lora))
    for position, result in run_requests(llm, requests, progress=progress, task=task):
        row = rows[position]
        if isinstance(result, RequestError):
            # NOTE: a row's own error already names its line.
            reason = result.reason if row.error is not None else row.located(result.reason)
            writer.write({"id": row.id, "error": reason}, error=True)
            continue
        assert isinstance(result, PoolingRequestOutput)
        prompt_tokens = len(result.prompt_token_ids)
        record = {
            "id": row.id,
            POOLING_JOB_TASKS[task]: result.outputs.data.tolist(),
            "prompt_tokens": prompt_tokens,
        }
        writer.write(record, error=False, prompt_tokens=prompt_tokens)


def write_npy(rows_file: Path, ids: list[str | int], task: str, output: Path) -> None:
    """``output`` (the vectors of ``rows_file``'s rows in the order of ``ids``, float32,
    NaN rows for errors) and its ids file, each replaced atomically. JobError if the
    vectors differ in length (rows that asked for other ``dimensions``)."""
    key = POOLING_JOB_TASKS[task]
    vectors: dict[str | int, list[float] | None] = {}
    with open(rows_file, "rb") as lines:
        for raw in lines:
            record: Any = parse_json(decode_line(raw))
            vectors[record["id"]] = record.get(key)
    widths = sorted({len(vector) for vector in vectors.values() if vector is not None})
    if len(widths) > 1:
        raise JobError(
            f"the rows of {rows_file} have {key}s of {len(widths)} lengths ({widths}); an .npy "
            "holds one: give every row the same 'dimensions', or use --output-format jsonl. "
            f"The rows stay in {rows_file}."
        )
    matrix = np.full((len(ids), widths[0] if widths else 0), np.nan, dtype=np.float32)
    for index, row_id in enumerate(ids):
        vector = vectors[row_id]
        if vector is not None:
            matrix[index] = vector
    _replace(output, lambda sink: np.save(sink, matrix))
    _replace(
        ids_path(output),
        lambda sink: sink.writelines((json.dumps(row_id) + "\n").encode() for row_id in ids),
    )


def _replace(path: Path, write: Any) -> None:
    """Write ``path`` through a temporary file and os.replace, so that a crash leaves the
    old file or the new one, never half of one."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as sink:
        write(sink)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(temporary, path)
