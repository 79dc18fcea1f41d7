"""The rows of a ``paged-llm generate`` job: ``{"id": ..., "prompt": "..."}``,
``{"id": ..., "messages": [...]}`` or ``{"id": ..., "prompt_token_ids": [...]}`` JSON
objects, one per line (or Parquet records with the same columns), each optionally
constrained by ``"structured_outputs"`` (the fields of `StructuredOutputsParams`) or
OpenAI's ``"response_format"``, and optionally run under the LoRA adapter its ``"lora"``
names (one the job registers, `paged_llm.jobs.lora_modules`).

The rows of a pooling job (``paged-llm embed``, ``classify``) are the same less
``"messages"`` and the constraints, plus an optional ``"dimensions"`` (embed: keep the
first this many dimensions, `PoolingParams.dimensions`).

A malformed row (not JSON, JSON nested deeper than `MAX_JSON_DEPTH`, no id, a duplicate id,
not exactly one of the prompt fields, malformed messages or token ids, a ``"lora"`` that is
not a string, a field its job kind does not take) is a bad line: a job lists every bad line
and runs nothing. A row that is well formed but cannot run keeps its place and gets an error
row instead: text that is not valid Unicode (JSON can spell a lone UTF-16 surrogate,
``"\\ud83d"``, an emoji cut in half, which no tokenizer or UTF-8 file can hold), a
``"lora"`` the job has not registered, a ``"dimensions"`` out of range, or a prompt the
model refuses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from paged_llm.exceptions import ConversationError
from paged_llm.frontend.chat import check_conversation
from paged_llm.inputs import TokensPrompt
from paged_llm.structured_outputs import StructuredOutputsParams

# At most this many bad lines are listed before the rest are only counted.
_MAX_LISTED_ERRORS = 20
# A row nested deeper is a bad line: deeper values would overflow the recursion of the code
# that reads and writes them (json, repr, chat templates), which stays far below this depth.
MAX_JSON_DEPTH = 256


class JobError(Exception):
    """A problem with a job's input or files, reported as one message (the command's exit
    code 2)."""


@dataclass(slots=True)
class InputRow:
    """One request of the input; ``line`` is 1-based, None where the input was read through
    Ray Data (which keeps no line numbers; the row's id then tells which it is)."""

    line: int | None
    id: str | int
    # The row's "prompt" text, its chat "messages" or its "prompt_token_ids" (a row gives
    # exactly one of them).
    prompt: str | list[dict[str, Any]] | TokensPrompt
    # Why the row cannot run (written as its error row instead of generating), or None.
    error: str | None = None
    # The row's "structured_outputs" or "response_format", or None.
    structured_outputs: StructuredOutputsParams | None = None
    # The name of the LoRA adapter the row runs under (its "lora"), or None: the base model.
    lora: str | None = None
    # A pooling row's "dimensions" as given (checked by PoolingParams), or None.
    dimensions: object = None

    def located(self, message: str) -> str:
        """``message`` after the row's line number, where that is known."""
        return message if self.line is None else f"line {self.line}: {message}"


def read_input(path: Path, *, pooling: bool = False) -> list[InputRow]:
    """Parse and validate the input JSONL (a pooling job's rows under ``pooling``); raise
    JobError listing every bad line."""
    rows: list[InputRow] = []
    errors: list[str] = []
    first_line_of: dict[str | int, int] = {}
    with open(path, "rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                row = parse_line(line_number, decode_line(raw), first_line_of, pooling=pooling)
            except ValueError as error:
                errors.append(f"{path}:{line_number}: {error}")
                continue
            first_line_of[row.id] = line_number
            rows.append(row)
    if errors:
        raise JobError(listed_errors(errors))
    return rows


def listed_errors(errors: list[str]) -> str:
    """The message that refuses an input with these bad lines."""
    listed = errors[:_MAX_LISTED_ERRORS]
    if len(errors) > len(listed):
        listed.append(f"... and {len(errors) - len(listed)} more bad lines")
    return f"{len(errors)} bad line(s) in the input; nothing was generated:\n" + "\n".join(listed)


def decode_line(raw: bytes) -> str:
    """An input line's text; ValueError for one that is not UTF-8, naming the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"not valid UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})"
        ) from None


def parse_json(text: str) -> object:
    """A line's JSON value; ValueError naming the column where it is not JSON, or saying that
    it nests deeper than `MAX_JSON_DEPTH`."""
    too_deep = (
        f"JSON nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects inside each "
        "other); flatten that value"
    )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:  # the parser gives up near Python's recursion limit
        raise ValueError(too_deep) from None
    if max(depth for depth, _ in _nested_values(value)) > MAX_JSON_DEPTH:
        raise ValueError(too_deep)
    return value


def _nested_values(value: object) -> Iterator[tuple[int, object]]:
    """Every value inside a JSON value (itself, dict keys and values, list items) with its
    depth, containers counting from 1, in document order."""
    # NOTE: a loop, not recursion: a value nested a thousand deep must not overflow the stack.
    pending: list[tuple[int, object]] = [(0, value)]
    while pending:
        depth, item = pending.pop()
        items: list[object] = []
        if isinstance(item, dict):
            items = [entry for pair in item.items() for entry in pair]
        elif isinstance(item, list):
            items = item
        else:
            yield depth, item
            continue
        yield depth + 1, item
        pending.extend((depth + 1, inner) for inner in reversed(items))


def _lone_surrogate(value: object) -> str | None:
    """The first lone UTF-16 surrogate in a JSON value's strings (keys included), or None."""
    for _, item in _nested_values(value):
        if isinstance(item, str) and (match := re.search("[\ud800-\udfff]", item)):
            return f"\\u{ord(match.group()):04x}"
    return None


def parse_line(
    line_number: int | None,
    text: str,
    first_line_of: dict[str | int, int],
    *,
    pooling: bool = False,
) -> InputRow:
    """One input line as a row; ValueError says why it is a bad line. ``first_line_of`` maps
    the ids seen so far to their lines, to refuse a duplicate."""
    return parse_record(line_number, parse_json(text), first_line_of, pooling=pooling)


# The fields that give a row's prompt; a row gives exactly one.
_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# The fields a pooling row does not take (the job kind that does, for the message).
_GENERATE_ONLY_FIELDS = ("messages", "structured_outputs", "response_format")


def parse_record(
    line_number: int | None,
    record: object,
    first_line_of: dict[str | int, int],
    *,
    pooling: bool = False,
) -> InputRow:
    """One input record (a line's JSON value, or a Parquet row) as a row of a generating
    job, or of a pooling one under ``pooling``; ValueError says why it is a bad line."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "id" not in record:
        raise ValueError("missing 'id'")
    row_id = record["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"'id' must be a string or an integer, got {row_id!r}")
    if row_id in first_line_of:
        raise ValueError(f"duplicate id {row_id!r} (first seen on line {first_line_of[row_id]})")
    if pooling:
        given = [name for name in _GENERATE_ONLY_FIELDS if record.get(name) is not None]
        if given:
            raise ValueError(
                f"row {row_id!r} has '{given[0]}', which a pooling job does not take (only "
                "`paged-llm generate` does); give 'prompt' or 'prompt_token_ids'"
            )
    elif record.get("dimensions") is not None:
        raise ValueError(
            f"row {row_id!r} has 'dimensions', which only a pooling job (`paged-llm embed`) takes"
        )
    given = [name for name in _PROMPT_FIELDS if record.get(name) is not None]
    if len(given) != 1:
        accepted = [name for name in _PROMPT_FIELDS if not (pooling and name == "messages")]
        raise ValueError(
            f"row {row_id!r} has {' and '.join(map(repr, given)) or 'no prompt'}; give exactly "
            f"one of {', '.join(map(repr, accepted))}"
        )
    prompt_field, value = given[0], record[given[0]]
    text_or_messages: str | list[dict[str, Any]] | TokensPrompt
    if prompt_field == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
        text_or_messages = value
    elif prompt_field == "prompt_token_ids":
        if not (
            isinstance(value, list)
            and value
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        ):
            raise ValueError("'prompt_token_ids' must be a non-empty list of token ids (ints >= 0)")
        text_or_messages = TokensPrompt(prompt_token_ids=value)
    else:
        try:
            text_or_messages = check_conversation(value)
        except ConversationError as error:
            raise ValueError(messages_problem(error)) from None
    lora = record.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise ValueError(f"'lora' must be a string (an adapter's name), got {lora!r}")
    row = InputRow(
        line_number,
        row_id,
        text_or_messages,
        structured_outputs=_structured_outputs(record),
        lora=lora,
        dimensions=record.get("dimensions"),
    )
    # NOTE: a lone surrogate fails the row, not the job: the tokenizer cannot take it, but the
    # row is well formed, and its error row tells the user which one to fix.
    for field, value in (("id", row_id), (prompt_field, row.prompt)):
        if (surrogate := _lone_surrogate(value)) is not None:
            row.error = row.located(
                f"the {field} is not valid Unicode: it has a lone surrogate {surrogate} (half "
                "of a UTF-16 pair, e.g. an emoji cut in two)"
            )
            break
    return row


def messages_problem(error: ConversationError) -> str:
    """A row's malformed ``messages``, worded as its fields are named."""
    if error.message is None:
        return f"'messages' {error.reason}"
    return f"messages[{error.message}]: {error.reason}"


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
