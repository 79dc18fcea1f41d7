"""Running a file job: the rows not yet in the output, through one `LLM`, under the output
lock, each result appended as it finishes.

Three job kinds share everything here but the row format: ``generate`` (`paged_llm.jobs.rows`),
the pooling jobs ``embed`` and ``classify`` (`paged_llm.jobs.pooling`) and OpenAI batch files
(`paged_llm.jobs.openai_batch`, `paged_llm.jobs.openai_embeddings`). Every generated row
samples with a seed derived from the job's seed and its id, so a rerun, a resumed run and a
run on any machine (Ray Data's actors call `generate_rows`) write the same row. A row runs under the LoRA
adapter it names (a row's ``"lora"``, a batch body's ``"model"``) among those the job
registers (`JobSpec.lora_modules`), else on the base model.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from paged_llm.exceptions import RequestError
from paged_llm.jobs import openai_batch, openai_embeddings
from paged_llm.jobs.lora_modules import LoRAModules
from paged_llm.jobs.output import OutputWriter, RowWriter, output_lock, recover_output
from paged_llm.jobs.pooling import pool_rows, rows_path, write_npy
from paged_llm.jobs.requests import (
    GENERATE,
    POOLING_JOB_TASKS,
    JobRequest,
    chat_prompt,
    run_requests,
    sampling_params_over,
)
from paged_llm.jobs.rows import InputRow, JobError, read_input
from paged_llm.llm import LLM
from paged_llm.outputs import RequestOutput
from paged_llm.seeds import derive_seed

# Used when neither the job nor the model's generation_config sets a length: vLLM's
# SamplingParams default of 16 tokens is too short for a dataset job.
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class JobSpec:
    """One file job: its files, the engine that runs it, and how it samples."""

    input: Path
    output: Path
    model: str
    # `LLM` keyword arguments (`EngineArgs` fields); the job's seed is the LLM's too.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # Each row samples with a seed derived from this and its id, unless it sets its own.
    seed: int = 0
    # Continue an existing output: skip the ids it holds, repair a torn last line.
    resume: bool = False
    # Show the progress bar.
    progress: bool = True
    # generate: SamplingParams fields over the model's defaults for every row (a batch
    # file's lines set their own).
    sampling: dict[str, Any] = field(default_factory=dict)
    # The LoRA adapters rows may name; registering any turns enable_lora on.
    lora_modules: LoRAModules = field(default_factory=LoRAModules)
    # What a JSONL job does with its rows: "generate", or a pooling task ("embed",
    # "classify"), which builds the LLM with runner="pooling".
    task: str = GENERATE
    # A pooling job's output: "jsonl" (a row per line as it finishes) or "npy" (see
    # `paged_llm.jobs.pooling`).
    output_format: str = "jsonl"

    def __post_init__(self) -> None:
        if self.task != GENERATE and self.task not in POOLING_JOB_TASKS:
            raise ValueError(
                f"JobSpec.task must be {GENERATE!r} or one of {', '.join(POOLING_JOB_TASKS)}, "
                f"got {self.task!r}."
            )
        if self.output_format not in ("jsonl", "npy"):
            raise ValueError(
                f"JobSpec.output_format must be 'jsonl' or 'npy', got {self.output_format!r}."
            )
        if self.output_format == "npy" and self.task not in POOLING_JOB_TASKS:
            raise JobError("--output-format npy holds vectors: it is for embed and classify jobs.")

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs = {"seed": self.seed, **self.engine_kwargs}
        if self.task in POOLING_JOB_TASKS:
            if kwargs.get("runner", "pooling") not in ("pooling", "auto"):
                raise JobError(
                    f"--runner {kwargs['runner']} contradicts `paged-llm {self.task}`, which runs "
                    "a pooling model: leave --runner out."
                )
            kwargs["runner"] = "pooling"
        return self.lora_modules.llm_kwargs(kwargs)


# Writes the output rows of the pending input rows (those at the given input positions).
JobBody = Callable[[LLM, list[int], RowWriter], None]
# Called under the output lock once every row is in the output file (given).
JobFinish = Callable[[Path], None]


def run_generate_job(spec: JobSpec) -> int:
    """``paged-llm generate``: every row of a JSONL file of {id, prompt | messages}; the
    exit code."""
    rows = read_input(spec.input)
    return run_job(
        spec,
        [row.id for row in rows],
        lambda llm, pending, writer: generate_rows(spec, llm, [rows[i] for i in pending], writer),
    )


def run_pooling_job(spec: JobSpec) -> int:
    """``paged-llm embed`` and ``paged-llm classify``: the ``spec.task`` vector of every row
    of a JSONL file of {id, prompt | prompt_token_ids}; the exit code."""
    rows = read_input(spec.input, pooling=True)
    ids = [row.id for row in rows]

    def body(llm: LLM, pending: list[int], writer: RowWriter) -> None:
        pending_rows = [rows[i] for i in pending]
        pool_rows(spec.task, spec.lora_modules, llm, pending_rows, writer, progress=spec.progress)

    if spec.output_format == "jsonl":
        return run_job(spec, ids, body)
    # NOTE: the rows go to a JSONL file first, crash-safe and resumable as any job's; the
    # .npy is written from it, under the same lock, once it holds every row.
    output = spec.output.resolve() if spec.output.is_symlink() else spec.output
    if not spec.resume and output.exists():
        raise JobError(
            f"{output} already exists. Pass --resume to continue its job (or to write it again "
            f"from {rows_path(output)}), or choose another --output."
        )
    return run_job(
        replace(spec, output=rows_path(output)),
        ids,
        body,
        finish=lambda rows_file: write_npy(rows_file, ids, spec.task, output),
    )


def run_batch_job(spec: JobSpec) -> int:
    """``paged-llm run-batch``: every request of an OpenAI Batch API file; the exit code."""
    served = openai_batch.served_model_names(
        spec.model, spec.engine_kwargs.get("served_model_name")
    )
    shadowed = [name for name in spec.lora_modules.paths if name in served]
    if shadowed:
        raise JobError(
            f"LoRA adapter name(s) {', '.join(map(repr, shadowed))} of "
            f"{spec.lora_modules.registered_with} are also the served model's name; a body's "
            '"model" could not tell them apart: rename the adapter(s) or set '
            "--served-model-name."
        )
    requests = openai_batch.read_requests(spec.input)
    return run_job(
        spec,
        [request.key for request in requests],
        lambda llm, pending, writer: _batch_requests(
            spec, served, llm, [requests[i] for i in pending], writer
        ),
    )


def run_job(
    spec: JobSpec, keys: list[str | int], body: JobBody, finish: JobFinish | None = None
) -> int:
    """Run the input rows whose key is not yet in the output, under the output lock, then
    ``finish(output)`` (still under the lock) once the output holds every key.

    ``keys[i]`` is the ``id`` the output row of input row ``i`` is written under. An output
    that is a symbolic link is followed to its file: the lock is taken beside that file, so
    that a job on the link and one on the file exclude each other, and a rewrite on
    ``--resume`` replaces the file and leaves the link.
    """
    output = spec.output.resolve() if spec.output.is_symlink() else spec.output
    output.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(output):
        # NOTE: checked under the lock, so that two jobs started together cannot both find
        # the output empty.
        if not spec.resume and output.exists() and output.stat().st_size > 0:
            raise JobError(
                f"{output} already exists and is not empty. Pass --resume to continue it "
                "(rows already there are skipped), or choose another --output."
            )
        done = recover_output(output) if spec.resume else set()
        pending = [index for index, key in enumerate(keys) if key not in done]
        stray = len(done - set(keys))
        if stray:
            print(f"Note: {stray} id(s) in {output} are not in the input.", file=sys.stderr)
        if not pending:
            output.touch()
            print(f"Nothing to do: all {len(keys)} rows are already in {output}.")
            if finish is not None:
                finish(output)
            return 0
        loading = time.perf_counter()
        with LLM(spec.model, **spec.llm_kwargs()) as llm, open(output, "ab") as sink:
            print(f"Loaded {spec.model} in {time.perf_counter() - loading:.1f} s.", flush=True)
            writer = OutputWriter(sink)
            pooled = llm.config.pooler is not None
            # NOTE: the summary's tokens per second are generation's alone, loading excluded.
            started = time.perf_counter()
            try:
                body(llm, pending, writer)
            except KeyboardInterrupt:
                print(
                    f"\nInterrupted after {writer.counts.num_written} rows; rerun with --resume to "
                    "finish.",
                    file=sys.stderr,
                )
                return 130
            seconds = time.perf_counter() - started
        if finish is not None:
            finish(output)
    print(writer.counts.summary(output, len(keys) - len(pending), seconds, pooled=pooled))
    return 0


def generate_rows(spec: JobSpec, llm: LLM, rows: list[InputRow], writer: RowWriter) -> None:
    """The output row of each input row: its sampling from the model's defaults and the
    job's ``sampling``, its seed from the job's seed and its id, so it is the same row on
    every machine; its adapter the one its ``lora`` names."""
    base = llm.get_default_sampling_params()
    if llm.generation_config.get("max_new_tokens") is None:
        base.max_tokens = DEFAULT_MAX_TOKENS
    # NOTE: checked here, once, before any row runs: a bad flag is the job's error.
    base = sampling_params_over(base, spec.sampling)
    requests: list[JobRequest | RequestError] = []
    for row in rows:
        if row.error is not None:
            requests.append(RequestError(row.error))
            continue
        try:
            lora = spec.lora_modules.select(row.lora, "lora")
            prompt = chat_prompt(llm, row.prompt) if isinstance(row.prompt, list) else row.prompt
        except RequestError as error:
            requests.append(error)
            continue
        seed = derive_seed(spec.seed, row.id)
        params = sampling_params_over(
            base, {"seed": seed, "structured_outputs": row.structured_outputs}
        )
        requests.append(JobRequest(prompt, params, lora))
    for position, result in run_requests(llm, requests, progress=spec.progress):
        row = rows[position]
        if isinstance(result, RequestError):
            # NOTE: a row's own error already names its line.
            reason = result.reason if row.error is not None else row.located(result.reason)
            writer.write({"id": row.id, "error": reason}, error=True)
        else:
            assert isinstance(result, RequestOutput)
            record = _output_record(row.id, result)
            writer.write(
                record,
                error=False,
                prompt_tokens=record["prompt_tokens"],
                completion_tokens=record["completion_tokens"],
            )


def _output_record(row_id: str | int, output: RequestOutput) -> dict[str, Any]:
    completions = [
        {
            "index": completion.index,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "completion_tokens": len(completion.token_ids),
        }
        for completion in output.outputs
    ]
    return {
        "id": row_id,
        "outputs": completions,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(c["completion_tokens"] for c in completions),
    }


def _batch_requests(
    spec: JobSpec,
    served: list[str],
    llm: LLM,
    requests: list[openai_batch.BatchRequest],
    writer: RowWriter,
) -> None:
    """The output line of each batch request: embeddings lines on a pooling model
    (`openai_embeddings`), the others on a generating one; a line of the other kind gets an
    error line naming its url and the --runner that serves it."""
    pooling = llm.config.pooler is not None
    runnable: list[openai_batch.BatchRequest] = []
    for request in requests:
        # NOTE: a bad line gets its own error line, whichever the model.
        if request.error is not None or request.is_embeddings == pooling:
            runnable.append(request)
        else:
            error = openai_embeddings.wrong_runner(request, pooling)
            writer.write(openai_batch.error_line(request, error), error=True)
    if pooling:
        openai_embeddings.run_embedding_lines(
            spec.lora_modules, served, llm, runnable, writer, progress=spec.progress
        )
    else:
        _completion_requests(spec, served, llm, runnable, writer)


def _completion_requests(
    spec: JobSpec,
    served: list[str],
    llm: LLM,
    requests: list[openai_batch.BatchRequest],
    writer: RowWriter,
) -> None:
    """The output line of each chat or completion request; a line without a seed samples
    with one derived from the job's seed and its custom_id. A body's ``model`` selects a
    registered LoRA adapter by its name; one of the ``served`` names, or none, the base
    model (as ``vllm serve --lora-modules`` does)."""
    defaults = llm.get_default_sampling_params()
    model_max_tokens = llm.generation_config.get("max_new_tokens")
    prepared: list[JobRequest | RequestError] = []
    for request in requests:
        try:
            if request.error is not None:
                raise request.error
            lora = spec.lora_modules.select(request.body.get("model"), "model", served)
            params = openai_batch.sampling_params(request, defaults, model_max_tokens)
            if params.seed is None:
                assert request.custom_id is not None  # a line without one has an error
                params.seed = derive_seed(spec.seed, request.custom_id)
            prompt = (
                chat_prompt(llm, request.body["messages"])
                if request.is_chat
                else openai_batch.completion_prompt(request)
            )
        except RequestError as error:
            prepared.append(error)
            continue
        prepared.append(JobRequest(prompt, params, lora))
    for position, result in run_requests(llm, prepared, progress=spec.progress):
        request = requests[position]
        if isinstance(result, RequestError):
            if result.parameter == "lora_request":
                # NOTE: the engine names its argument; the body's field that chose it is "model".
                result = RequestError(result.reason, parameter="model", value=result.value)
            writer.write(openai_batch.error_line(request, result), error=True)
            continue
        assert isinstance(result, RequestOutput)
        line = openai_batch.success_line(request, result, served[0], int(time.time()))
        usage = line["response"]["body"]["usage"]
        writer.write(
            line,
            error=False,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
        )
