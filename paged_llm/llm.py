"""The public entry point: `LLM`, shaped like vLLM's offline `LLM` class."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from paged_llm.config import EngineConfig, ModelConfig
from paged_llm.distributed.data_parallel import DataParallelEngine, ReplicasLostError
from paged_llm.engine.detokenizer import decode
from paged_llm.engine.llm_engine import EngineMetrics, LLMEngine
from paged_llm.engine_args import EngineArgs
from paged_llm.exceptions import VLLMValidationError
from paged_llm.inputs import PromptType, TokensPrompt
from paged_llm.model_files import resolve_model
from paged_llm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
from paged_llm.structured_outputs.params import StructuredOutputsParams
from paged_llm.structured_outputs.xgrammar_backend import build_grammar

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A prompt after tokenization and validation; ``error`` says why it cannot run."""

    index: int
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    bad_words_token_ids: list[list[int]] | None = None
    error: str | None = None


@dataclass
class LLMEngineInfo:
    """``llm.llm_engine`` for scripts written for vLLM: its ``model_config`` and
    ``get_tokenizer()``. The engine that runs requests is `LLM.engine`."""

    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise ValueError(
                "This LLM has no tokenizer: it was built with skip_tokenizer_init=True."
            )
        return self.tokenizer


class _GenerationLock:
    """One generation at a time per LLM: the engine's batch belongs to one caller.

    Held from a stream's first step to its end (finished, closed, broken out of or
    garbage), never blocking: a second caller gets a RuntimeError that says who holds it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                holder = (
                    "an unfinished generate_stream of this LLM holds it; finish iterating it "
                    "or close() it first"
                )
            else:
                holder = (
                    "another thread is generating with it; an LLM runs one generation at a "
                    "time, so wait for that call to return or give each thread its own LLM"
                )
            raise RuntimeError(f"Another generation is still running on this LLM: {holder}.")
        self._owner = threading.get_ident()

    def release(self) -> None:
        self._owner = None
        self._lock.release()


class GenerationStream:
    """Iterates ``(input_index, RequestOutput)`` in completion order while the engine
    runs; see `LLM.generate_stream`."""

    def __init__(
        self,
        engine: LLMEngine | DataParallelEngine,
        requests: list[PreparedRequest],
        use_tqdm: bool | Callable[..., tqdm],
        skip_errors: bool = False,
        lock: _GenerationLock | None = None,
        log_stats: bool = True,
    ) -> None:
        self.num_requests = len(requests)
        self._engine = engine
        self._requests = requests
        self._use_tqdm = use_tqdm
        self._skip_errors = skip_errors
        self._lock = lock or _GenerationLock()
        self._log_stats = log_stats
        self._closed = False
        # NOTE: only a weak reference: the generator must not be kept alive by the stream
        # (nor the stream by the generator), so that leaving a loop early frees it at once
        # and its cleanup runs then, not whenever the cyclic GC gets to it.
        self._iterator: weakref.ref[Generator[tuple[int, RequestOutput], None, None]] | None = None

    def __iter__(self) -> Iterator[tuple[int, RequestOutput]]:
        if self._closed:
            return iter(())
        if self._iterator is not None:
            return self._iterator() or iter(())
        iterator = _run_stream(
            self._engine,
            self._requests,
            self._use_tqdm,
            self._skip_errors,
            self._lock,
            self._log_stats,
        )
        self._iterator = weakref.ref(iterator)
        return iterator

    def close(self) -> None:
        """Stop early: cancel this stream's requests still running. A stream closed before
        its first iteration runs nothing."""
        self._closed = True
        iterator = self._iterator() if self._iterator is not None else None
        if iterator is not None:
            iterator.close()


def _run_stream(
    engine: LLMEngine | DataParallelEngine,
    requests: list[PreparedRequest],
    use_tqdm: bool | Callable[..., tqdm],
    skip_errors: bool,
    lock: _GenerationLock,
    log_stats: bool,
) -> Generator[tuple[int, RequestOutput], None, None]:
    lock.acquire()
    # NOTE: from here to the release, the engine's requests are this stream's only, so the
    # cleanup's abort_all cancels nothing of another call's.
    try:
        progress = _progress_bar(
            use_tqdm, total=sum(1 if r.error else r.params.n for r in requests)
        )
        metrics_before = engine.get_metrics()
        started = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        order: dict[str, int] = {}
        try:
            for request in requests:
                if request.error is not None:
                    progress.update(1)
                    yield request.index, _error_output(request)
                    continue
                order[request.request_id] = request.index
                engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.token_ids,
                    request.params,
                    request.bad_words_token_ids,
                )
            while engine.has_unfinished():
                try:
                    outputs = engine.step()
                except ReplicasLostError as error:
                    if not skip_errors:
                        raise
                    for request_id in error.request_ids:
                        request = requests[order[request_id]]
                        progress.update(request.params.n)
                        yield request.index, _error_output(replace(request, error=str(error)))
                    continue
                for output in outputs:
                    num_prompt_tokens += len(output.prompt_token_ids)
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    progress.set_postfix_str(
                        f"est. speed input: {num_prompt_tokens / elapsed:.2f} toks/s, "
                        f"output: {num_output_tokens / elapsed:.2f} toks/s",
                        refresh=False,
                    )
                    progress.update(len(output.outputs))
                    yield order[output.request_id], output
        finally:
            if engine.has_unfinished():
                engine.abort_all()
            progress.close()
            if log_stats:
                _log_summary(metrics_before, engine.get_metrics(), time.perf_counter() - started)
    finally:
        lock.release()


def _prompt_list(prompts: PromptType | SequenceABC[PromptType]) -> list[Any]:
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise ValueError(
            "prompts must be a str, a {'prompt': ...} or {'prompt_token_ids': [...]} dict, "
            f"or a list of them, got {type(prompts).__name__}" + _BYTES_HINT.get(type(prompts), ".")
        )
    return list(prompts)


def _collect(stream: GenerationStream, first_index: int = 0) -> list[RequestOutput]:
    """Every output of a stream, in input order (its requests' indices start at
    ``first_index``)."""
    results: list[RequestOutput | None] = [None] * stream.num_requests
    try:
        for index, output in stream:
            results[index - first_index] = output
    finally:
        stream.close()
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> tqdm:
    factory = use_tqdm if callable(use_tqdm) else tqdm
    return factory(
        total=total, desc="Processed prompts", disable=use_tqdm is False, dynamic_ncols=True
    )


def _error_output(request: PreparedRequest) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.token_ids,
        outputs=[],
        finished=True,
        error=request.error,
    )


def _log_summary(before: EngineMetrics, after: EngineMetrics, seconds: float) -> None:
    run = after.since(before)
    if run.num_requests == 0:
        return
    logger.info(
        "Finished %d requests in %.2f s: %d prompt tokens (%.1f tok/s), %d generated tokens "
        "(%.1f tok/s); prefix-cache hit rate %.1f%%; %d preemptions.",
        run.num_requests,
        seconds,
        run.num_prompt_tokens,
        run.num_prompt_tokens / seconds,
        run.num_generated_tokens,
        run.num_generated_tokens / seconds,
        100.0 * run.prefix_cache_hit_rate,
        run.num_preemptions,
    )


class LLM:
    """An offline batch-inference engine for one model.

    Args:
        model: A local Hugging Face model directory (config.json, safetensors weights,
            tokenizer files), a ``.gguf`` file, or a hub id found in the local cache.
        **kwargs: The settings, by the names of vLLM's ``LLM`` and ``EngineArgs``: every
            field of `EngineArgs`, where each is documented (``dtype``, ``max_model_len``,
            ``tensor_parallel_size``, ...). vLLM arguments with no effect here are
            accepted; those asking for a missing feature, and unknown names, raise
            ValueError naming the argument.

    ``llm.llm_engine.model_config`` and ``llm.get_tokenizer()`` answer what scripts
    written for vLLM ask of its LLM. One LLM runs one generation at a time: a call from a
    second thread while another generates raises RuntimeError (give each thread its own
    LLM).
    """

    def __init__(self, model: str | Path, **kwargs: Any) -> None:
        self.args = args = EngineArgs.from_kwargs(kwargs)
        model_dir = resolve_model(model, revision=args.revision).path
        hf_config = _hf_config(model_dir, args)
        self.tokenizer: PreTrainedTokenizerBase | None = None
        if not args.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(
                args.tokenizer or model_dir,
                trust_remote_code=args.trust_remote_code,
                revision=args.tokenizer_revision,
                use_fast=args.tokenizer_mode != "slow",
            )
        self.chat_template = _read_chat_template(args.chat_template)
        self.config = EngineConfig.create(model_dir, hf_config, args)
        generation_file = _read_generation_config(
            model_dir if args.generation_config in ("auto", "vllm") else args.generation_config
        )
        # As vLLM: "vllm" drops the file's sampling defaults, not its EOS tokens.
        self.generation_config: dict[str, Any] = {
            **({} if args.generation_config == "vllm" else generation_file),
            **(args.override_generation_config or {}),
        }
        self.eos_token_ids = _eos_token_ids(generation_file, hf_config, self.tokenizer)
        self.vocab_size: int = hf_config.vocab_size
        self.llm_engine = LLMEngineInfo(
            _model_config(model, model_dir, args, self.config), self.tokenizer
        )
        self.engine: LLMEngine | DataParallelEngine | None
        if args.data_parallel_size > 1:
            # NOTE: a replica loads the resolved directory, which has no revisions, and takes
            # the seed drawn here for seed=None.
            replica_args = replace(args, data_parallel_size=1, revision=None, seed=self.config.seed)
            self.engine = DataParallelEngine(
                functools.partial(_replica_engine, model_dir, replica_args),
                num_replicas=args.data_parallel_size,
                seed=self.config.seed,
                block_size=self.config.block_size,
                max_model_len=self.config.max_model_len,
                tensor_parallel_size=args.tensor_parallel_size,
                devices=self.config.platform.replica_devices(),
            )
        else:
            self.engine = LLMEngine(self.config, self.tokenizer, self.eos_token_ids)
        self._request_counter = itertools.count()
        self._generation_lock = _GenerationLock()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer prompts are encoded with (vLLM's ``LLM.get_tokenizer``)."""
        return self.llm_engine.get_tokenizer()

    # ----- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Free the KV cache and the weights (with data parallelism: end the replica
        processes). The LLM cannot generate afterwards."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _live_engine(self) -> LLMEngine | DataParallelEngine:
        if self.engine is None:
            raise RuntimeError("This LLM was shut down; create a new one to generate.")
        return self.engine

    # ----- generation ---------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        on_error: str = "raise",
        *,
        lora_request: None = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; results come back in input order.

        Args:
            prompts: A string, a `TextPrompt` (``{"prompt": "..."}``), a `TokensPrompt`
                (``{"prompt_token_ids": [...]}``), or a list of them.
            sampling_params: One for all prompts, or a list with one per prompt; None
                uses `get_default_sampling_params`.
            use_tqdm: Show a "Processed prompts" progress bar; a callable replaces
                ``tqdm.auto.tqdm`` (it gets the same arguments).
            on_error: "raise": every request is validated first, and a bad one raises
                ValueError naming its index before any work starts. "skip": a bad
                request gets a RequestOutput whose ``error`` says why, and the others run.
                With data parallelism, requests that no live replica is left to run raise
                a RuntimeError naming the replicas lost and why, or under "skip" come back
                with ``error`` set.
            lora_request: vLLM's LoRA adapter; only None (no LoRA here).
            priority: vLLM's per-request priorities; requests run first come, first
                served here, so every priority must be 0.
            tokenization_kwargs: Keyword arguments for the tokenizer call on text prompts
                (e.g. ``{"add_special_tokens": False}``, or truncation settings).
        """
        stream = self.generate_stream(
            prompts,
            sampling_params,
            use_tqdm,
            on_error,
            lora_request=lora_request,
            priority=priority,
            tokenization_kwargs=tokenization_kwargs,
        )
        return _collect(stream)

    def generate_stream(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        on_error: str = "raise",
        *,
        lora_request: None = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> GenerationStream:
        """Like `generate`, but yields ``(input_index, RequestOutput)`` as each request
        finishes, so results can be written while the batch runs.

        Validation happens here, before the first result is asked for. Leaving the loop
        early (break, an exception) cancels the requests still running.
        """
        engine = self._live_engine()
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        _check_no_lora(lora_request)
        if tokenization_kwargs is not None and not isinstance(tokenization_kwargs, dict):
            raise ValueError(
                "tokenization_kwargs must be a dict of tokenizer arguments or None, got "
                f"{type(tokenization_kwargs).__name__}."
            )
        skip = on_error == "skip"
        prompt_list = _prompt_list(prompts)
        prepared = self._prepare(
            prompt_list,
            self._params_per_prompt(sampling_params, len(prompt_list)),
            self._validate_request,
            skip,
            priority,
            tokenization_kwargs or {},
        )
        return GenerationStream(
            engine,
            prepared,
            use_tqdm,
            skip_errors=skip,
            lock=self._generation_lock,
            log_stats=not self.args.disable_log_stats,
        )

    def beam_search(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam-search every prompt (vLLM's ``LLM.beam_search``); one `BeamSearchOutput`
        per prompt, in input order, with the ``beam_width`` best sequences, best first.

        The search runs inside the engine: the beams of a prompt share its KV blocks and
        their common prefix, one forward pass scores every beam of every prompt, and pruned
        beams free their blocks at once. It follows vLLM's rules (see docs/usage.md, "Beam
        search").

        Args:
            prompts: Prompts as `generate` takes them.
            params: The search's parameters, for every prompt.
            lora_request: vLLM's LoRA adapter; only None (no LoRA here).
            use_tqdm: Show a progress bar (of sequences returned); a callable replaces
                ``tqdm.auto.tqdm``.
            concurrency_limit: Search at most this many prompts at a time (None: all at
                once, within ``max_num_seqs`` and the KV cache).

        Every request is validated before any work starts; a bad one raises ValueError
        naming its index.
        """
        engine = self._live_engine()
        _check_no_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise VLLMValidationError(
                f"params must be a BeamSearchParams, got {type(params).__name__}; build it "
                "with BeamSearchParams(beam_width=..., max_tokens=...).",
                parameter="params",
            )
        params.verify()
        if self.tokenizer is None:
            raise VLLMValidationError(
                "Beam search decodes the text of its sequences, and this LLM was built with "
                "skip_tokenizer_init=True; build it with a tokenizer.",
                parameter="skip_tokenizer_init",
            )
        if params.beam_width > self.config.max_num_seqs:
            raise VLLMValidationError(
                f"BeamSearchParams.beam_width={params.beam_width} exceeds max_num_seqs="
                f"{self.config.max_num_seqs}; the beams of a prompt run together. Lower "
                "beam_width or raise max_num_seqs.",
                parameter="beam_width",
                value=params.beam_width,
            )
        if 2 * params.beam_width > self.vocab_size:
            raise VLLMValidationError(
                f"BeamSearchParams.beam_width={params.beam_width} needs 2 * beam_width "
                f"candidate tokens per beam, more than the vocabulary's {self.vocab_size}.",
                parameter="beam_width",
                value=params.beam_width,
            )
        if params.structured_outputs is not None:
            self._check_structured_outputs(params.structured_outputs)
        if concurrency_limit is not None and not (
            isinstance(concurrency_limit, int) and concurrency_limit >= 1
        ):
            raise ValueError(
                f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}."
            )
        prompt_list = _prompt_list(prompts)
        prepared = self._prepare(
            prompt_list,
            [params] * len(prompt_list),
            lambda index, token_ids, _: self._check_prompt(index, token_ids),
            False,
            None,
            {},
        )
        group = concurrency_limit or max(len(prepared), 1)
        outputs = []
        for start in range(0, len(prepared), group):
            stream = GenerationStream(
                engine,
                prepared[start : start + group],
                use_tqdm,
                lock=self._generation_lock,
                log_stats=not self.args.disable_log_stats,
            )
            outputs += _collect(stream, first_index=start)
        return [self._beam_search_output(output, params) for output in outputs]

    def _beam_search_output(
        self, output: RequestOutput, params: BeamSearchParams
    ) -> BeamSearchOutput:
        """vLLM's form of an engine's beam search result: whole sequences, decoded."""
        sequences = []
        for beam in output.outputs:
            tokens = output.prompt_token_ids + beam.token_ids
            ended_by_eos = beam.finish_reason == "stop"
            text_tokens = (
                tokens[:-1] if ended_by_eos and not params.include_stop_str_in_output else tokens
            )
            assert beam.cumulative_logprob is not None and beam.logprobs is not None
            sequences.append(
                BeamSearchSequence(
                    tokens=tokens,
                    logprobs=beam.logprobs,
                    cum_logprob=beam.cumulative_logprob,
                    text=decode(self.get_tokenizer(), text_tokens),
                    finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason,
                )
            )
        return BeamSearchOutput(sequences=sequences)

    def _prepare(
        self,
        prompt_list: list[Any],
        params_list: SequenceABC[SamplingParams | BeamSearchParams],
        validate: Callable[[int, list[int], Any], None],
        skip_invalid: bool,
        priority: list[int] | None,
        tokenization_kwargs: dict[str, Any],
    ) -> list[PreparedRequest]:
        """Tokenize and validate each prompt with its params; ``validate(index, token_ids,
        params)`` raises ValueError for a request that cannot run."""
        priorities = _priorities(priority, len(prompt_list))
        texts = {
            index: text
            for index, prompt in enumerate(prompt_list)
            if (text := _prompt_text(prompt)) is not None
        }
        # A text that is not valid Unicode (a lone surrogate) fails the batched tokenizer
        # for every prompt; it is this request's error alone. So does a missing tokenizer.
        text_errors = {
            index: _text_error(index, text)
            if self.tokenizer is not None
            else (
                f"Request {index}: a text prompt needs a tokenizer, and this LLM was built "
                "with skip_tokenizer_init=True; pass {'prompt_token_ids': [...]} instead."
            )
            for index, text in texts.items()
        }
        encodable = [index for index, error in text_errors.items() if error is None]
        encoded: dict[int, list[int]] = {}
        if encodable:
            batch = self.get_tokenizer()([texts[i] for i in encodable], **tokenization_kwargs)
            encoded = dict(zip(encodable, batch["input_ids"], strict=True))
        prepared = []
        for index, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            request = PreparedRequest(
                index, str(next(self._request_counter)), texts.get(index), [], params
            )
            try:
                if index in texts:
                    text_error = text_errors[index]
                    if text_error is not None:
                        raise VLLMValidationError(text_error, parameter="prompt")
                    token_ids = list(encoded[index])
                else:
                    request.prompt, token_ids = self._prompt_tokens(index, prompt)
                request.token_ids = token_ids
                if priorities[index] != 0:
                    raise VLLMValidationError(
                        f"Request {index}: priority={priorities[index]}, but requests run first "
                        "come, first served here (scheduling_policy 'fcfs' only); pass "
                        "priority 0 or None.",
                        parameter="priority",
                        value=priorities[index],
                    )
                validate(index, token_ids, params)
                if isinstance(params, SamplingParams):
                    request.bad_words_token_ids = self._bad_words_token_ids(index, params)
            except ValueError as error:
                if not skip_invalid:
                    raise
                request.error = str(error)
            prepared.append(request)
        return prepared

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's ``LLM.chat``).

        Each conversation (a list of ``{"role": ..., "content": ...}`` messages; a content
        is a str or a list of OpenAI-style ``{"type": "text", "text": ...}`` parts) is
        rendered with `render_chat`, then generated like a prompt.
        ``continue_final_message`` continues the last (assistant) message instead of
        starting a new one; ``tools`` and ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}``) go to the template.
        """
        _check_no_lora(lora_request)
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be True: a "
                "reply either starts a new message or continues the last one."
            )
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations.")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = []
        for index, conversation in enumerate(conversations):
            _check_conversation(index, conversation)
            try:
                prompts.append(
                    self.render_chat(
                        conversation,
                        chat_template,
                        add_generation_prompt,
                        continue_final_message,
                        tools=tools,
                        chat_template_kwargs=chat_template_kwargs,
                        chat_template_content_format=chat_template_content_format,
                    )
                )
            except (jinja2.TemplateError, ValueError) as error:
                raise ValueError(
                    f"Conversation {index}: the chat template could not render it: "
                    f"{type(error).__name__}: {error}. Check its messages against what the "
                    "template expects, or pass another chat_template."
                ) from error
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        *,
        tools: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> TokensPrompt:
        """One conversation as a prompt dict: the rendered text and its token ids.

        The template is ``chat_template``, else the LLM's ``chat_template`` argument, else
        the tokenizer's. Content given as a list of text parts reaches the template as
        one string (the parts joined by newlines) under ``chat_template_content_format``
        "string", as the list of parts under "openai"; "auto" picks "openai" for a
        template that loops over a message's content, as vLLM does. The template writes
        the special tokens itself, so the text is tokenized without adding any.
        """
        tokenizer = self.get_tokenizer()
        template = chat_template or self.chat_template
        if chat_template_content_format == "auto":
            chat_template_content_format = (
                "openai"
                if _loops_over_content(template or tokenizer.chat_template or "")
                else "string"
            )
        if chat_template_content_format not in ("string", "openai"):
            raise ValueError(
                "chat_template_content_format must be 'auto', 'string' or 'openai', got "
                f"{chat_template_content_format!r}."
            )
        text: str = tokenizer.apply_chat_template(  # type: ignore[assignment]  # tokenize=False
            _with_content_format(conversation, chat_template_content_format),
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return TokensPrompt(prompt=text, prompt_token_ids=token_ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values from generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM
        does; used when `generate` gets no sampling_params."""
        generation = self.generation_config
        fields = {
            name: generation[name]
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if generation.get(name) is not None
        }
        if generation.get("max_new_tokens") is not None:
            fields["max_tokens"] = generation["max_new_tokens"]
        return SamplingParams(**fields)

    def _params_per_prompt(
        self,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        num_prompts: int,
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(
                "sampling_params must be a SamplingParams, a list with one per prompt, or "
                f"None, got {type(sampling_params).__name__}; build it with "
                "SamplingParams(**fields)."
            )
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"Got {len(params)} SamplingParams for {num_prompts} prompts; pass one "
                "SamplingParams for all prompts or a list with exactly one per prompt."
            )
        return params

    @staticmethod
    def _prompt_tokens(index: int, prompt: Any) -> tuple[str | None, list[int]]:
        """The text and token ids of a prompt given as a dict."""
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise VLLMValidationError(
                f"Request {index}: a prompt must be a str, a {{'prompt': str}} dict or a dict "
                f"with 'prompt_token_ids', got {type(prompt).__name__}"
                + (f" with keys {sorted(prompt)}." if isinstance(prompt, dict) else "."),
                parameter="prompt",
            )
        token_ids = prompt["prompt_token_ids"]
        if isinstance(token_ids, (str, bytes, bytearray, dict)) or not isinstance(
            token_ids, Iterable
        ):
            raise ValueError(
                f"Request {index}: prompt_token_ids must be a list of ints, got "
                f"{type(token_ids).__name__}."
            )
        ids = list(token_ids)
        # Any integer type (numpy's included) is a token id; a bool is not.
        bad = next(
            (t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None
        )
        if bad is not None:
            raise ValueError(
                f"Request {index}: prompt_token_ids must be a list of ints, got an element "
                f"{bad!r} of type {type(bad).__name__}."
            )
        return prompt.get("prompt"), [int(t) for t in ids]

    def _check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None:
        """Parse the constraint now, so that a bad schema or regex fails its own request up
        front; the engine compiles it for the tokenizer beside the running batch."""
        if self.tokenizer is None:
            raise VLLMValidationError(
                "structured outputs compile their grammar for the tokenizer, and this LLM was "
                "built with skip_tokenizer_init=True; build it with a tokenizer.",
                parameter="structured_outputs",
            )
        try:
            build_grammar(structured_outputs)
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter="structured_outputs") from None

    def _validate_request(self, index: int, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise VLLMValidationError(
                f"Request {index}: sampling_params must be a SamplingParams, got "
                f"{type(params).__name__}.",
                parameter="sampling_params",
            )
        self._check_prompt(index, token_ids)
        try:
            params.verify()
            if params.prompt_logprobs_start >= len(token_ids):
                raise VLLMValidationError(
                    f"prompt_logprobs_start={params.prompt_logprobs_start} is past the "
                    f"prompt's last position, {len(token_ids) - 1}; score from a position "
                    "inside the prompt.",
                    parameter="prompt_logprobs_start",
                    value=params.prompt_logprobs_start,
                )
            if params.structured_outputs is not None:
                self._check_structured_outputs(params.structured_outputs)
        except VLLMValidationError as error:
            raise VLLMValidationError(
                f"Request {index}: {error}", parameter=error.parameter, value=error.value
            ) from None
        except ValueError as error:  # StructuredOutputsParams' own checks
            raise VLLMValidationError(
                f"Request {index}: {error}", parameter="structured_outputs"
            ) from None
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise VLLMValidationError(
                f"Request {index}: stop strings and bad_words need a tokenizer, and this LLM "
                "was built with skip_tokenizer_init=True; use stop_token_ids instead.",
                parameter="stop" if params.stop else "bad_words",
            )
        if params.n > self.config.max_num_seqs:
            raise VLLMValidationError(
                f"Request {index}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}; "
                "the n sequences of a request run together. Lower n or raise max_num_seqs.",
                parameter="n",
                value=params.n,
            )
        bad = next((t for t in params.token_ids_in_use() if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise VLLMValidationError(
                f"Request {index}: SamplingParams names token id {bad}, outside the vocabulary "
                f"[0, {self.vocab_size}).",
                parameter="token_ids",
                value=bad,
            )
        self._check_logprobs(index, params)

    def _check_prompt(self, index: int, token_ids: list[int]) -> None:
        """A prompt runs when it has at least one token, leaves room for one generated token
        within max_model_len, and names only ids of the vocabulary."""
        max_model_len = self.config.max_model_len
        if not token_ids:
            raise VLLMValidationError(
                f"Request {index}: the prompt is empty (0 tokens); every request needs at "
                "least one prompt token.",
                parameter="prompt",
            )
        if len(token_ids) + 1 > max_model_len:
            raise VLLMValidationError(
                f"Request {index}: the prompt has {len(token_ids)} tokens, but "
                f"max_model_len={max_model_len} leaves room for at most {max_model_len - 1} "
                "prompt tokens plus 1 generated token. Shorten the prompt, or raise "
                "max_model_len (up to the model's max_position_embeddings="
                f"{self.config.hf_config.max_position_embeddings}).",
                parameter="prompt",
                value=len(token_ids),
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise VLLMValidationError(
                f"Request {index}: prompt token id {bad} is outside the vocabulary "
                f"[0, {self.vocab_size}).",
                parameter="prompt_token_ids",
                value=bad,
            )

    def _check_logprobs(self, index: int, params: SamplingParams) -> None:
        """vLLM's cap: -1 asks for the whole vocabulary, allowed only with max_logprobs=-1;
        never more than the vocabulary."""
        max_logprobs = self.config.max_logprobs
        limit = self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            requested = getattr(params, name)
            if requested is None:
                continue
            if requested == -1:
                requested = self.vocab_size
            if requested > limit:
                raise VLLMValidationError(
                    f"Request {index}: Requested {kind} logprobs of {requested}, which is "
                    f"greater than max allowed: {limit} (the vocabulary has {self.vocab_size} "
                    f"tokens, LLM(max_logprobs={max_logprobs})). Lower {name}, or raise "
                    "max_logprobs (-1 allows the whole vocabulary).",
                    parameter=name,
                    value=requested,
                )

    def _bad_words_token_ids(self, index: int, params: SamplingParams) -> list[list[int]]:
        """Token sequences of each bad word, at the start of a text and after a space."""
        sequences: list[list[int]] = []
        if not params.bad_words:
            return sequences
        tokenizer = self.get_tokenizer()
        for word in params.bad_words:
            error = _text_error(index, word, "bad word")
            if error is not None:
                raise ValueError(error)
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(
                    f"Request {index}: bad word {word!r} is no tokens once leading spaces are "
                    "dropped; remove it from bad_words."
                )
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            # The spaced form counts only when it is another word of the same length, as
            # vLLM decides.
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return sequences

    # ----- introspection ----------------------------------------------------------------

    def get_metrics(self) -> EngineMetrics:
        """Engine counters: requests, tokens, preemptions, prefix-cache hits (summed over
        data-parallel replicas)."""
        return self._live_engine().get_metrics()


# Why bytes are refused: iterating them gives ints, not prompts.
_BYTES_HINT = {
    bytes: "; decode bytes to a str first (e.g. data.decode('utf-8')).",
    bytearray: "; decode bytes to a str first (e.g. data.decode('utf-8')).",
}


def _text_error(index: int, text: str, what: str = "prompt") -> str | None:
    """Why ``text`` cannot be tokenized (it is not valid Unicode), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"Request {index}: the {what} is not valid Unicode text: "
            f"{text[error.start : error.end]!r} at position {error.start} is a lone "
            "surrogate; decode the source with errors='replace' or drop that character."
        )
    return None


def _check_conversation(index: int, conversation: Any) -> None:
    """A conversation is a list of messages, each a dict with a str role and a str (or
    list of parts) content."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(
            f"Conversation {index}: must be a non-empty list of messages, got "
            f"{type(conversation).__name__}."
        )
    for position, message in enumerate(conversation):
        where = f"Conversation {index}, message {position}"
        if not isinstance(message, dict):
            raise ValueError(
                f"{where}: must be a dict with 'role' and 'content', got {type(message).__name__}."
            )
        if not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: 'role' must be a str, got {message.get('role')!r}.")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise ValueError(
                f"{where}: 'content' must be a str (or a list of content parts), got "
                f"{content!r}; use '' for an empty message."
            )
        if isinstance(content, list):
            _content_texts(where, content)


def _content_texts(where: str, parts: list[Any]) -> list[str]:
    """The texts of OpenAI-style content parts; other kinds of part are refused."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"{where}: content part {part!r} is not supported: only text parts "
                f"({{'type': 'text', 'text': ...}}) are, the models here being text-only "
                f"(got type {kind!r})."
            )
    return texts


def _with_content_format(
    conversation: list[dict[str, Any]], content_format: str
) -> list[dict[str, Any]]:
    """Messages with their content as the template expects it: one string ("string", text
    parts joined by newlines, as vLLM does) or a list of text parts ("openai")."""
    messages = []
    for position, message in enumerate(conversation):
        content = message.get("content")
        if content_format == "string" and isinstance(content, list):
            content = "\n".join(_content_texts(f"Message {position}", content))
        elif content_format == "openai":
            texts = (
                [content]
                if isinstance(content, str)
                else _content_texts(f"Message {position}", content)
                if isinstance(content, list)
                else None
            )
            if texts is not None:
                content = [{"type": "text", "text": text} for text in texts]
        messages.append({**message, "content": content})
    return messages


@functools.lru_cache(maxsize=16)
def _loops_over_content(template: str) -> bool:
    """Whether a chat template iterates over a message's content (``for part in
    message['content']``), i.e. expects a list of parts."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        source = loop.iter
        if isinstance(source, jinja2.nodes.Getattr) and source.attr == "content":
            return True
        if (
            isinstance(source, jinja2.nodes.Getitem)
            and isinstance(source.arg, jinja2.nodes.Const)
            and source.arg.value == "content"
        ):
            return True
    return False


def _prompt_text(prompt: Any) -> str | None:
    """The text of a prompt given as text: a str, or a `TextPrompt` without token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


def _priorities(priority: list[int] | None, num_prompts: int) -> list[int]:
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
        raise ValueError(
            f"priority must be None or a list with one int per prompt ({num_prompts}), got "
            f"{priority!r}."
        )
    return list(priority)


def _check_no_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise ValueError(
            "lora_request is not supported: paged_llm has no LoRA adapters (see enable_lora); "
            "merge the adapter into the weights and load that model, or pass None."
        )


def _replica_engine(model_dir: Path, args: EngineArgs) -> LLMEngine:
    """The engine of one data-parallel replica, built in its own process as a single-replica
    `LLM` with the front's settings would build it."""
    engine = LLM(model_dir, **args.to_kwargs()).engine
    assert isinstance(engine, LLMEngine)
    return engine


def _hf_config(model_dir: Path, args: EngineArgs) -> Any:
    """The model's Hugging Face config with ``hf_overrides`` applied."""
    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    overrides = args.hf_overrides
    if callable(overrides):
        return overrides(hf_config)
    for name, value in (overrides or {}).items():
        setattr(hf_config, name, value)
    return hf_config


def _read_chat_template(chat_template: str | Path | None) -> str | None:
    """A template given as a path is read from that file; any other string is the template."""
    if chat_template is None:
        return None
    path = Path(chat_template)
    # NOTE: a template's text can be too long to be a file name, which is no error.
    try:
        is_file = path.is_file()
    except OSError:
        is_file = False
    if is_file:
        return path.read_text()
    # As vLLM: a string with none of Jinja's characters was meant as a path.
    if isinstance(chat_template, Path) or not any(c in chat_template for c in "{}\n"):
        raise ValueError(
            f"LLM argument chat_template={str(chat_template)!r} looks like a file path, but "
            "there is no such file; pass the template's text or an existing file."
        )
    return chat_template


def _read_generation_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "generation_config.json"
    if path.exists():
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    if not Path(folder).is_dir():
        raise ValueError(
            f"LLM argument generation_config={str(folder)!r} must be 'auto', 'vllm' or a "
            "folder holding generation_config.json; no such folder."
        )
    return {}


def _eos_token_ids(
    generation_config: dict[str, Any],
    hf_config: Any,
    tokenizer: PreTrainedTokenizerBase | None,
) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer, or the
    model config where there is no tokenizer."""
    eos: set[int] = set()
    for ids in (
        generation_config.get("eos_token_id"),
        getattr(hf_config, "eos_token_id", None) if tokenizer is None else None,
        tokenizer.eos_token_id if tokenizer is not None else None,
    ):
        eos.update(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return frozenset(eos)


def _model_config(
    model: str | Path, model_dir: Path, args: EngineArgs, config: EngineConfig
) -> ModelConfig:
    names = args.served_model_name
    served = names[0] if isinstance(names, list) else names
    return ModelConfig(
        model=str(model),
        tokenizer=str(args.tokenizer or model_dir),
        tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code,
        dtype=config.dtype,
        seed=config.seed,
        revision=args.revision,
        tokenizer_revision=args.tokenizer_revision,
        max_model_len=config.max_model_len,
        max_logprobs=config.max_logprobs,
        hf_config=config.hf_config,
        served_model_name=served if served is not None else str(model),
        generation_config=str(args.generation_config),
        skip_tokenizer_init=args.skip_tokenizer_init,
    )
