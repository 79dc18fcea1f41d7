"""Custom logits processors, with vLLM v1's interface (`vllm.v1.sample.logits_processor`).

A `LogitsProcessor` subclass, named in ``LLM(logits_processors=[...])``, is built once per
engine, on the rank that samples, with ``(vllm_config, device, is_pin_memory)``. It sees the
rows of the sequences that draw a token in a step as a persistent batch, vLLM's: every such
sequence keeps its row from step to step while it samples, and before each step's `apply`
the processor's `update_state` hears how the rows changed (a `BatchUpdate`, or None when
none did). `apply` then gets the step's ``[rows, vocab]`` float32 logits in that row order.
Where `apply` runs among the sampler's own steps, and what it costs, is in docs/usage.md
("Custom logits processors").

`SamplingParams.logits_processors` takes vLLM 0's per-request form instead: callables
``fn(output_token_ids, logits_row)`` or ``fn(prompt_token_ids, output_token_ids,
logits_row)`` returning the row; `AdapterLogitsProcessor` wraps such callables into a
processor chosen per request from its params.

User code imports from here or from `paged_llm.v1.sample.logits_processor` (vLLM's path).
"""

from __future__ import annotations

import enum
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar

import torch

from paged_llm.sampling_params import SamplingParams

T = TypeVar("T")

# vLLM 0's per-request form: (output_token_ids, logits_row) -> logits_row, or
# (prompt_token_ids, output_token_ids, logits_row) -> logits_row.
RequestLogitsProcessor = Callable[..., torch.Tensor]


class MoveDirectionality(enum.Enum):
    """How a `BatchUpdate.moved` entry ``(a, b, direction)`` moves rows."""

    # The request at row a moves to row b; row a is left empty.
    UNIDIRECTIONAL = enum.auto()
    # The requests at rows a and b trade places.
    SWAP = enum.auto()


# A row whose request left the batch.
RemovedRequest = int
# (row, params, prompt token ids, output token ids): a request that joined the batch. The
# output list is the request's live list: it grows as the request generates tokens, so a
# processor that keeps it always sees the tokens generated so far.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
# (row a, row b, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the previous step; ``batch_size`` rows now.

    Apply the changes in the order removed, added, moved. A row that a request left and
    another one filled in the same step appears only in ``added`` (or as a move's
    destination): an added or moved request replaces whatever its row held. ``removed``
    lists, from the highest row down, the rows left empty; after the moves the rows are
    exactly ``0 .. batch_size - 1``.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM v1's interface)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Check a request's params (its ``extra_args`` most often) when it is submitted;
        an exception refuses that request alone, with the exception's message. The default
        accepts every request."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """``vllm_config``: the engine's `paged_llm.config.VllmConfig`; ``device``: where the
        logits live; ``is_pin_memory``: whether pinned host memory is available for copies
        to the device."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's ``[batch_size, vocab]`` float32 logits, rows in persistent-batch order,
        processed. May modify ``logits`` in place; returns the result either way."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if `apply` never changes a row's argmax (then it is skipped for greedy rows
        and applied on the random-sampling path only); asked once, when the engine starts."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once per step, before `apply`: ``batch_update`` is None when the batch is
        made of the same requests in the same rows as in the previous step."""


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Keep ``req_entries`` (row -> per-request state, for the rows a processor applies to)
    in step with ``batch_update``: an added request gets ``new_state(params,
    prompt_token_ids, output_token_ids)``, or no entry where that is None; removed rows lose
    theirs; moves carry entries along. Returns whether any entry changed."""
    if batch_update is None:
        return False
    changed = False
    # NOTE: adds before removals, as vLLM's helper: an update never lists a row in both.
    for row, params, prompt_token_ids, output_token_ids in batch_update.added:
        state = new_state(params, prompt_token_ids, output_token_ids)
        if state is not None:
            req_entries[row] = state
            changed = True
        elif req_entries.pop(row, None) is not None:
            changed = True
    if not req_entries:
        return changed
    for row in batch_update.removed:
        if req_entries.pop(row, None) is not None:
            changed = True
    for source, destination, direction in batch_update.moved:
        moving = req_entries.pop(source, None)
        replaced = req_entries.pop(destination, None)
        if moving is not None:
            req_entries[destination] = moving
            changed = True
        if replaced is not None:
            changed = True
            if direction is MoveDirectionality.SWAP:
                req_entries[source] = replaced
    return changed


def bind_request_logits_processor(
    processor: RequestLogitsProcessor,
    prompt_token_ids: list[int] | None,
    output_token_ids: list[int],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``processor`` as a function of the logits row alone: with the output token ids, and
    the prompt's first where it takes three arguments (vLLM 0's two forms)."""
    if len(inspect.signature(processor).parameters) == 3:
        return lambda row: processor(prompt_token_ids, output_token_ids, row)
    return lambda row: processor(output_token_ids, row)


def apply_to_rows(
    logits: torch.Tensor, rows: Sequence[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]
) -> torch.Tensor:
    """Apply each (row, function) to its row of ``logits``, in place."""
    for row, process in rows:
        row_logits = logits[row]
        processed = process(row_logits)
        if processed is not row_logits:
            logits[row] = processed
    return logits


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor made of per-request ones (vLLM's adapter): a subclass
    implements `is_argmax_invariant` and `new_req_logits_processor`, which returns the
    request's `RequestLogitsProcessor`, or None where the request does not use it. A
    subclass that overrides ``__init__`` calls ``super().__init__``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # row -> the request's processor, bound to its token lists (the output list live).
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The processor of a request with ``params``, or None to leave its row alone."""

    def _new_state(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int] | None,
        output_token_ids: list[int],
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        processor = self.new_req_logits_processor(params)
        if processor is None:
            return None
        return bind_request_logits_processor(processor, prompt_token_ids, output_token_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_to_rows(logits, list(self.req_info.items()))


# What `LLM(logits_processors=...)` takes.
LOGITS_PROCESSORS_ALLOWED = (
    "a list of LogitsProcessor subclasses or their fully qualified names "
    "('package.module.ClassName' or 'package.module:ClassName'); per-request callables go "
    "in SamplingParams.logits_processors"
)


def is_logits_processor_entry(entry: object) -> bool:
    """A `LogitsProcessor` subclass that can be built, or a name to import."""
    return (isinstance(entry, str) and bool(entry)) or _is_processor_class(entry)


def _is_processor_class(value: object) -> TypeGuard[type[LogitsProcessor]]:
    return (
        isinstance(value, type)
        and issubclass(value, LogitsProcessor)
        and not inspect.isabstract(value)
    )


def load_logits_processors(
    entries: Sequence[type[LogitsProcessor] | str] | None,
) -> tuple[type[LogitsProcessor], ...]:
    """The classes of ``LLM(logits_processors=...)``, names imported; a ValueError names an
    entry that cannot be imported or is not a `LogitsProcessor` subclass."""
    classes = []
    for entry in entries or ():
        loaded = _import_class(entry) if isinstance(entry, str) else entry
        if not _is_processor_class(loaded):
            what = "an abstract class" if inspect.isabstract(loaded) else repr(loaded)
            raise ValueError(
                f"LLM argument logits_processors: {entry!r} is {what}, not a LogitsProcessor "
                f"subclass that can be built; give {LOGITS_PROCESSORS_ALLOWED}."
            )
        classes.append(loaded)
    return tuple(classes)


def _import_class(name: str) -> object:
    """``package.module:Class`` (vLLM's form) or ``package.module.Class``; a nested class
    takes the colon form (``package.module:Outer.Inner``)."""
    if ":" in name:
        module_name, _, qualname = name.partition(":")
    else:
        module_name, _, qualname = name.rpartition(".")
    if not module_name or not qualname:
        raise ValueError(
            f"LLM argument logits_processors: {name!r} is not a fully qualified class name; "
            "write 'package.module.ClassName' or 'package.module:ClassName'."
        )
    try:
        found: object = importlib.import_module(module_name)
        for attribute in qualname.split("."):
            found = getattr(found, attribute)
    except Exception as error:  # whatever the import raises is the reason
        raise ValueError(
            f"LLM argument logits_processors: cannot import {name!r} "
            f"({type(error).__name__}: {error})."
        ) from error
    return found
