"""The `paged-llm` command line: batch generation from a JSONL file, safe to kill and resume.

    paged-llm generate --input prompts.jsonl --output completions.jsonl [--resume]
    paged-llm run-batch -i requests.jsonl -o results.jsonl [--resume]

``run-batch`` reads and writes OpenAI Batch API files (see `paged_llm.batch_api`); both
commands share everything below but the row format: the output lock, appending and flushing
each result, ``--resume`` (its output rows are keyed by their ``id`` too) and crash safety.

Each input line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}``
(rendered with the model's chat template). A row may constrain its completions with
``"structured_outputs": {...}`` (the fields of `StructuredOutputsParams`) or OpenAI's
``"response_format": {"type": "json_schema", "json_schema": {"schema": {...}}}`` (or
``{"type": "json_object"}``). Each finished request is appended to the output
as one JSON line and flushed to disk at once, so a crash loses only the requests still
running; ``--resume`` repairs a torn last line, removes duplicate ids (keeping each id's
first row) and runs only the ids not yet written.

One writer per output: the command holds ``<output>.lock`` (created with O_CREAT|O_EXCL,
holding ``pid host``) for the whole run and removes it at exit. A second command on the same
output is refused (exit code 2) while the holder lives; a lock whose pid is dead on this host
is stale and taken over, with a note on stderr.

Text that is not valid Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud83d"``, an emoji
cut in half by JavaScript), which no tokenizer or UTF-8 file can hold. A row with one in its
prompt, messages or id is not generated; it gets an error row saying so, and the job goes on.
Output rows are UTF-8; a record that cannot be (an id with a lone surrogate) is written with
ASCII escapes, so the file stays valid and ``--resume`` reads the same id back. An input line
that is not valid UTF-8 at all is a bad line, reported with its line number like bad JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from paged_llm import batch_api
from paged_llm.engine_args import add_cli_arguments, cli_settings
from paged_llm.inputs import PromptType, TokensPrompt
from paged_llm.llm import LLM, check_conversation
from paged_llm.model_files import DEFAULT_MODEL
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_outputs import StructuredOutputsParams

# At most this many input errors are listed before the rest are only counted.
_MAX_LISTED_ERRORS = 20
# Used when neither --max-tokens nor the model's generation_config sets a length: vLLM's
# SamplingParams default of 16 tokens is too short for a dataset job.
_DEFAULT_MAX_TOKENS = 256


class CliError(Exception):
    """A problem with the command's input or files, reported as one message, exit code 2."""


@dataclass(slots=True)
class InputRow:
    """One request of the input; ``line`` is 1-based, None where the input was read through
    Ray Data (which keeps no line numbers; the row's id then tells which it is)."""

    line: int | None
    id: str | int
    # The row's "prompt" text, or its chat "messages" (a row gives exactly one of them).
    prompt: str | list[dict[str, Any]]
    # Why the row cannot run (written as its error row instead of generating), or None.
    error: str | None = None
    # The row's "structured_outputs" or "response_format", or None.
    structured_outputs: StructuredOutputsParams | None = None

    def located(self, message: str) -> str:
        """``message`` after the row's line number, where that is known."""
        return message if self.line is None else f"line {self.line}: {message}"


def read_input(path: Path) -> list[InputRow]:
    """Parse and validate the input JSONL; raise CliError listing every bad line."""
    rows: list[InputRow] = []
    errors: list[str] = []
    first_line_of: dict[str | int, int] = {}
    with open(path, "rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                row = parse_line(line_number, _decode_line(raw), first_line_of)
            except ValueError as error:
                errors.append(f"{path}:{line_number}: {error}")
                continue
            first_line_of[row.id] = line_number
            rows.append(row)
    if errors:
        raise CliError(listed_errors(errors))
    return rows


def listed_errors(errors: list[str]) -> str:
    """The message that refuses an input with these bad lines."""
    listed = errors[:_MAX_LISTED_ERRORS]
    if len(errors) > len(listed):
        listed.append(f"... and {len(errors) - len(listed)} more bad lines")
    return f"{len(errors)} bad line(s) in the input; nothing was generated:\n" + "\n".join(listed)


def _decode_line(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"not valid UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})"
        ) from None


def _lone_surrogate(value: object) -> str | None:
    """The first lone UTF-16 surrogate in a JSON value's strings (keys included), or None."""
    if isinstance(value, str):
        match = re.search("[\ud800-\udfff]", value)
        return None if match is None else f"\\u{ord(match.group()):04x}"
    items: list[object] = []
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    for item in items:
        if (found := _lone_surrogate(item)) is not None:
            return found
    return None


def parse_line(line_number: int | None, text: str, first_line_of: dict[str | int, int]) -> InputRow:
    """One input line as a row; ValueError says why it is a bad line. ``first_line_of`` maps
    the ids seen so far to their lines, to refuse a duplicate."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    return parse_record(line_number, record, first_line_of)


def parse_record(
    line_number: int | None, record: object, first_line_of: dict[str | int, int]
) -> InputRow:
    """One input record (a line's JSON value, or a Parquet row) as a row; ValueError says why
    it is a bad line."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "id" not in record:
        raise ValueError("missing 'id'")
    row_id = record["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"'id' must be a string or an integer, got {row_id!r}")
    if row_id in first_line_of:
        raise ValueError(f"duplicate id {row_id!r} (first seen on line {first_line_of[row_id]})")
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        which = "both 'prompt' and" if prompt is not None else "neither 'prompt' nor"
        raise ValueError(f"row {row_id!r} has {which} 'messages'; give exactly one")
    text_or_messages: str | list[dict[str, Any]]
    if messages is None:
        if not isinstance(prompt, str):
            raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
        text_or_messages = prompt
    elif not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        raise ValueError(
            '\'messages\' must be a non-empty list of {"role": ..., "content": ...} objects'
        )
    else:
        text_or_messages = messages
    row = InputRow(
        line_number, row_id, text_or_messages, structured_outputs=_structured_outputs(record)
    )
    # NOTE: a lone surrogate fails the row, not the job: the tokenizer cannot take it, but the
    # row is well formed, and its error row tells the user which one to fix.
    for field, value in (
        ("id", row_id),
        ("prompt" if messages is None else "messages", row.prompt),
    ):
        if (surrogate := _lone_surrogate(value)) is not None:
            row.error = row.located(
                f"the {field} is not valid Unicode: it has a lone surrogate {surrogate} (half "
                "of a UTF-16 pair, e.g. an emoji cut in two)"
            )
            break
    return row


def _structured_outputs(record: dict[str, Any]) -> StructuredOutputsParams | None:
    """A row's constraint, from "structured_outputs" or OpenAI's "response_format"."""
    given, response_format = record.get("structured_outputs"), record.get("response_format")
    if given is not None and response_format is not None:
        raise ValueError("give 'structured_outputs' or 'response_format', not both")
    if response_format is not None:
        return StructuredOutputsParams.from_response_format(response_format)
    if given is None:
        return None
    if not isinstance(given, dict):
        raise ValueError(f"'structured_outputs' must be an object, got {type(given).__name__}")
    known = {field.name for field in fields(StructuredOutputsParams)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"'structured_outputs' has unknown fields {unknown}; known: {sorted(known)}"
        )
    return StructuredOutputsParams(**given)


def recover_output(path: Path) -> set[str | int]:
    """The ids already in an output file, after cutting it back to its last complete row and
    removing rows whose id an earlier row already has.

    A crash can leave the last line half written (no newline, or not valid JSON); it is
    truncated away, and its request runs again. Duplicates (from writers that raced before
    the output lock existed) keep the first row of each id; the file is then rewritten
    through a temporary file and os.replace, so a crash leaves either the old or the new one.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    lines = data[:keep].splitlines(keepends=True)
    ids: set[str | int] = set()
    unique: list[bytes] = []
    num_duplicates = 0
    for number, line in enumerate(lines, start=1):
        try:
            row_id = json.loads(line)["id"]
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise CliError(
                    f"{path}:{number}: not a valid output row, and not the last line, so not a "
                    "torn write; fix or remove that line, then rerun with --resume."
                ) from None
            keep -= len(line)
            break
        if row_id in ids:
            num_duplicates += 1
            continue
        ids.add(row_id)
        unique.append(line)
    if num_duplicates:
        # The rewrite also leaves out a torn last line.
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as sink:
            sink.writelines(unique)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temporary, path)
        print(
            f"Removed {num_duplicates} duplicate row(s) from {path}, keeping the first row of "
            "each id.",
            file=sys.stderr,
        )
    elif keep < len(data):
        with open(path, "r+b") as sink:
            sink.truncate(keep)
    if keep < len(data):
        print(
            f"Repaired {path}: dropped a torn last line ({len(data) - keep} bytes).",
            file=sys.stderr,
        )
    return ids


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold ``<output>.lock`` while the body runs, so that one command at a time writes output.

    The lock file is created atomically (O_CREAT|O_EXCL) and holds ``pid host``. A lock whose
    holder is alive, or on another host where it cannot be checked, raises CliError naming the
    file and the pid; one whose pid is dead on this host (its holder was killed before it could
    remove it) is taken over, with a note on stderr. The lock is removed when the body ends,
    by an error or Ctrl-C too.
    """
    lock = output.with_name(output.name + ".lock")
    host = socket.gethostname()
    mine = f"{os.getpid()} {host}\n"
    while True:
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            pass
        try:
            held = lock.read_text()
        except FileNotFoundError:  # its holder just removed it
            continue
        pid, _, holder_host = held.strip().partition(" ")
        if not _lock_is_stale(pid, holder_host, host):
            raise CliError(
                f"{output} is being written by another paged-llm: {lock} is held by pid "
                f"{pid or '?'} on {holder_host or '?'}. Wait for it to finish or stop it; if it "
                f"is not running, delete {lock}."
            )
        # NOTE: read again just before unlinking, so that a lock another process has taken
        # over since is left alone; if it has, the next O_EXCL fails and names that process.
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == held:
                lock.unlink()
                print(
                    f"Took over the stale lock {lock}: its pid {pid} is not running on {host}.",
                    file=sys.stderr,
                )
    try:
        os.write(descriptor, mine.encode())
    finally:
        os.close(descriptor)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == mine:
                lock.unlink()


def _lock_is_stale(pid: str, holder_host: str, host: str) -> bool:
    if holder_host != host or not pid.isdigit() or int(pid) == 0:
        return False
    # NOTE: our own pid in a lock we have not taken yet is a previous run's, e.g. a container
    # restarted with the same pid and host name.
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def row_seed(seed: int, row_id: str | int) -> int:
    """A 63-bit seed from --seed and the row's id, the same in every run and on every machine,
    so a resumed run samples each row exactly as an uninterrupted run would."""
    digest = hashlib.blake2b(json.dumps([seed, row_id]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged-llm", description="Offline batch inference with paged_llm."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="complete every row of a JSONL file",
        description=(
            "Complete every row of a JSONL file of {id, prompt} or {id, messages} objects. "
            "Rows are appended to the output as they finish; after a crash, rerun with "
            "--resume to finish the job."
        ),
    )
    _add_file_options(gen, "input JSONL", "output JSONL")
    _add_engine_options(gen)
    sampling = gen.add_argument_group(
        "sampling (see SamplingParams; unset flags keep the model's generation_config values)"
    )
    sampling.add_argument("--n", type=int, help="completions per row")
    sampling.add_argument("--temperature", type=float, help="0 means greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float)
    sampling.add_argument("--presence-penalty", type=float)
    sampling.add_argument("--frequency-penalty", type=float)
    sampling.add_argument(
        "--max-tokens",
        type=int,
        help=f"most tokens per completion (default: the model's, else {_DEFAULT_MAX_TOKENS})",
    )
    sampling.add_argument("--min-tokens", type=int)
    sampling.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop string (repeatable)"
    )
    sampling.add_argument(
        "--ignore-eos", action="store_true", default=None, help="generate past EOS"
    )
    _add_seed_option(sampling)
    _add_cluster_options(gen)
    _add_output_options(gen)

    batch = commands.add_parser(
        "run-batch",
        help="run an OpenAI Batch API file (as vllm run-batch)",
        description=(
            "Run every request of an OpenAI Batch API input file ({custom_id, method, url, "
            "body} lines for /v1/chat/completions or /v1/completions) and write OpenAI's "
            "batch output lines. Each body sets its own sampling; lines that cannot run get "
            "a status 400 line. Results are appended as they finish; after a crash, rerun "
            "with --resume to finish the job."
        ),
    )
    _add_file_options(batch, "batch input JSONL", "batch output JSONL")
    _add_engine_options(batch)
    _add_seed_option(batch.add_argument_group("sampling (each request's body sets the rest)"))
    _add_output_options(batch)

    # NOTE: main hands `eval` to lm-eval's own parser before this one runs; it is listed
    # here for --help.
    commands.add_parser(
        "eval",
        help="run lm-evaluation-harness tasks on a model (needs the [eval] extra)",
        description="paged-llm eval --model PATH --tasks ... [lm-eval's flags]",
        add_help=False,
    )
    return parser


def _add_file_options(parser: argparse.ArgumentParser, input_help: str, output_help: str) -> None:
    files = parser.add_argument_group("files")
    # --input-file / --output-file: vllm run-batch's spelling.
    files.add_argument("--input", "--input-file", "-i", type=Path, required=True, help=input_help)
    files.add_argument(
        "--output", "--output-file", "-o", type=Path, required=True, help=output_help
    )
    files.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing output: skip what it holds, repair a torn last line",
    )


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine (see LLM in docs/usage.md)")
    engine.add_argument("--model", "-m", default=DEFAULT_MODEL, help="default: %(default)s")
    add_cli_arguments(engine)


def _add_seed_option(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        help="each row samples with a seed derived from this and its id (unless it sets "
        "its own), so reruns and resumed runs reproduce it (default: %(default)s)",
    )


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    # NOTE: unset flags stay None, so that ProcessorConfig keeps its own defaults.
    cluster = parser.add_argument_group(
        "cluster (Ray Data, needs the [ray] extra; see ProcessorConfig in docs/scaling.md)"
    )
    cluster.add_argument(
        "--ray-address",
        help="run on this Ray cluster ('auto': the one `ray start` began on this node); "
        "--input is then JSONL or Parquet (.parquet), --output a folder of JSONL files, one "
        "per Ray Data write task",
    )
    cluster.add_argument("--concurrency", type=int, help="engine actors (default: 1)")
    cluster.add_argument("--batch-size", type=int, help="rows per actor call (default: 64)")
    cluster.add_argument("--num-cpus-per-actor", type=float, help="default: 1")
    cluster.add_argument("--num-gpus-per-actor", type=float, help="default: 0")


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--verbose", "-v", action="store_true", help="log engine details")


_SAMPLING_FLAGS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "ignore_eos",
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:
        return _eval(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.input.resolve() == args.output.resolve():
            raise CliError("--input and --output are the same file.")
        if not args.input.is_file():
            raise CliError(f"input file {args.input} does not exist.")
        if args.command == "run-batch":
            requests = batch_api.read_requests(args.input)
            return _run_job(
                args, [request.key for request in requests], partial(_run_batch, requests)
            )
        if args.ray_address is not None:
            # NOTE: imported only here: Ray is an optional extra.
            from paged_llm.ray.generate_job import run_on_cluster

            return run_on_cluster(args)
        rows = read_input(args.input)
        return _run_job(args, [row.id for row in rows], partial(generate_rows, rows))
    except CliError as error:
        print(f"paged-llm: error: {error}", file=sys.stderr)
        return 2
    except (OSError, ImportError, ValueError) as error:
        print(f"paged-llm: error: {error}", file=sys.stderr)
        return 1


def _eval(argv: list[str]) -> int:
    """``paged-llm eval``: lm-eval's command line with our model registered; lm-eval is an
    optional extra, imported only here."""
    try:
        from paged_llm.integrations import lm_eval
    except ImportError as error:
        print(f"paged-llm: error: {error}", file=sys.stderr)
        return 1
    return lm_eval.main(argv)


def json_line(record: dict[str, Any]) -> bytes:
    """One output row as a UTF-8 JSON line."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:  # an id with a lone surrogate: escapes keep it exact
        return (json.dumps(record) + "\n").encode()


class RowWriter(Protocol):
    """Where a job body puts its output rows: a file here, a Ray Data block on a cluster."""

    def write(
        self,
        record: dict[str, Any],
        *,
        error: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None: ...


@dataclass
class RowCounts:
    """What a job wrote, for its summary line."""

    num_written: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, *, error: bool, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.num_written += 1
        self.num_errors += error
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def merge(self, other: RowCounts) -> None:
        """Add the counts of another part of the job."""
        for count in fields(self):
            setattr(self, count.name, getattr(self, count.name) + getattr(other, count.name))

    def summary(self, output: Path, num_skipped: int, seconds: float) -> str:
        return (
            f"Done: {self.num_written} rows written to {output} ({self.num_errors} errors), "
            f"{num_skipped} skipped as already done; {self.prompt_tokens} prompt + "
            f"{self.completion_tokens} completion tokens in {seconds:.1f} s "
            f"({self.completion_tokens / seconds:.1f} output tok/s)."
        )


class OutputWriter:
    """Appends output rows, each flushed and fsynced at once so a crash loses none already
    written, and counts what it wrote for the summary."""

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self.counts = RowCounts()

    def write(
        self,
        record: dict[str, Any],
        *,
        error: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        self._sink.write(json_line(record))
        self._sink.flush()
        os.fsync(self._sink.fileno())
        self.counts.add(
            error=error, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )


# Writes the output rows of the pending input rows (those at the given input positions).
JobBody = Callable[[argparse.Namespace, LLM, list[int], RowWriter], None]


def _run_job(args: argparse.Namespace, keys: list[str | int], body: JobBody) -> int:
    """Run the input rows whose key is not yet in the output, under the output lock.

    ``keys[i]`` is the ``id`` the output row of input row ``i`` is written under.
    """
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(args.output):
        # NOTE: checked under the lock, so that two commands started together cannot both
        # find the output empty.
        if not args.resume and args.output.exists() and args.output.stat().st_size > 0:
            raise CliError(
                f"{args.output} already exists and is not empty. Pass --resume to continue it "
                "(rows already there are skipped), or choose another --output."
            )
        done = recover_output(args.output) if args.resume else set()
        pending = [index for index, key in enumerate(keys) if key not in done]
        stray = len(done - set(keys))
        if stray:
            print(f"Note: {stray} id(s) in {args.output} are not in the input.", file=sys.stderr)
        if not pending:
            args.output.touch()
            print(f"Nothing to do: all {len(keys)} rows are already in {args.output}.")
            return 0
        started = time.perf_counter()
        with _llm_from_args(args) as llm, open(args.output, "ab") as sink:
            writer = OutputWriter(sink)
            try:
                body(args, llm, pending, writer)
            except KeyboardInterrupt:
                print(
                    f"\nInterrupted after {writer.counts.num_written} rows; rerun with --resume to "
                    "finish.",
                    file=sys.stderr,
                )
                return 130
    seconds = time.perf_counter() - started
    print(writer.counts.summary(args.output, len(keys) - len(pending), seconds))
    return 0


def _llm_from_args(args: argparse.Namespace) -> LLM:
    return LLM(args.model, **llm_kwargs(args))


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` keyword arguments of a command's flags."""
    return {"seed": args.seed, **cli_settings(args)}


def render_messages(llm: LLM, messages: list[dict[str, Any]]) -> TokensPrompt | str:
    """A chat row's prompt, or why its messages cannot be rendered."""
    try:
        check_conversation(0, messages)
        return llm.render_chat(messages)
    except Exception as exc:  # a template error names the bad message
        return f"cannot render messages: {exc}"


def _stream(
    args: argparse.Namespace,
    llm: LLM,
    prompts: list[PromptType],
    params: list[SamplingParams],
) -> Iterator[tuple[int, RequestOutput, str | None]]:
    """``(prompt index, output, error)`` as each prompt finishes; ``error`` is the reason a
    prompt was refused, without LLM's ``Request N:`` prefix (N is not the input line)."""
    stream = llm.generate_stream(prompts, params, use_tqdm=not args.no_progress, on_error="skip")
    with contextlib.closing(stream):
        for index, output in stream:
            yield index, output, refusal(output)


def refusal(output: RequestOutput) -> str | None:
    """Why a request was refused, without LLM's ``Request N:`` prefix (N is its index in one
    generate call, which the caller's rows do not know), or None."""
    return None if output.error is None else re.sub(r"^Request \d+: ", "", output.error)


def generate_rows(
    rows: list[InputRow],
    args: argparse.Namespace,
    llm: LLM,
    pending: list[int],
    writer: RowWriter,
) -> None:
    """``paged-llm generate``'s body: the output row of each pending input row, its sampling
    from the flags and its seed from ``--seed`` and its id, so it is the same row on every
    machine (the Ray path runs it in each engine actor)."""
    base = llm.get_default_sampling_params()
    if llm.generation_config.get("max_new_tokens") is None:
        base.max_tokens = _DEFAULT_MAX_TOKENS
    # The flags given override the model's defaults; replace() validates them here, once,
    # before any row runs.
    base = replace(
        base,
        **{name: value for name in _SAMPLING_FLAGS if (value := getattr(args, name)) is not None},
    )
    runnable: list[InputRow] = []
    prompts: list[PromptType] = []
    for row in (rows[index] for index in pending):
        prompt: PromptType | None = row.prompt if isinstance(row.prompt, str) else None
        error = row.error
        if error is None and not isinstance(row.prompt, str):
            rendered = render_messages(llm, row.prompt)
            if isinstance(rendered, dict):
                prompt = rendered
            else:
                error = row.located(rendered)
        if error is not None or prompt is None:
            writer.write({"id": row.id, "error": error}, error=True)
            continue
        prompts.append(prompt)
        runnable.append(row)
    params = [
        replace(base, seed=row_seed(args.seed, row.id), structured_outputs=row.structured_outputs)
        for row in runnable
    ]
    for index, output, error in _stream(args, llm, prompts, params):
        row = runnable[index]
        if error is not None:
            writer.write({"id": row.id, "error": row.located(error)}, error=True)
        else:
            record = _output_record(row.id, output)
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


def _run_batch(
    requests: list[batch_api.BatchRequest],
    args: argparse.Namespace,
    llm: LLM,
    pending: list[int],
    writer: RowWriter,
) -> None:
    defaults = llm.get_default_sampling_params()
    model_max_tokens = llm.generation_config.get("max_new_tokens")
    runnable: list[batch_api.BatchRequest] = []
    prompts: list[PromptType] = []
    params: list[SamplingParams] = []
    for request in (requests[index] for index in pending):
        try:
            if request.error is not None:
                raise request.error
            request_params = batch_api.sampling_params(request, defaults, model_max_tokens)
            prompt: PromptType
            if request.is_chat:
                rendered = render_messages(llm, batch_api.chat_messages(request))
                if isinstance(rendered, str):
                    raise batch_api.BatchLineError(rendered, "messages")
                prompt = rendered
            else:
                prompt = batch_api.completion_prompt(request)
        except batch_api.BatchLineError as error:
            writer.write(batch_api.error_line(request, str(error), error.param), error=True)
            continue
        if request_params.seed is None:
            assert request.custom_id is not None  # a line without one has an error
            request_params.seed = row_seed(args.seed, request.custom_id)
        runnable.append(request)
        prompts.append(prompt)
        params.append(request_params)
    for index, output, refusal in _stream(args, llm, prompts, params):
        request = runnable[index]
        if refusal is not None:
            writer.write(batch_api.error_line(request, refusal), error=True)
            continue
        line = batch_api.success_line(request, output, args.model, int(time.time()))
        usage = line["response"]["body"]["usage"]
        writer.write(
            line,
            error=False,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
        )
