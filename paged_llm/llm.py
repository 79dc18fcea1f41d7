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
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from paged_llm.config import EngineConfig
from paged_llm.distributed.data_parallel import DataParallelEngine, ReplicasLostError
from paged_llm.engine.llm_engine import EngineMetrics, LLMEngine
from paged_llm.model_files import resolve_model
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_outputs.xgrammar_backend import build_grammar

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


@dataclass
class PreparedRequest:
    """A prompt after tokenization and validation; ``error`` says why it cannot run."""

    index: int
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    bad_words_token_ids: list[list[int]] | None = None
    error: str | None = None


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
    ) -> None:
        self.num_requests = len(requests)
        self._engine = engine
        self._requests = requests
        self._use_tqdm = use_tqdm
        self._skip_errors = skip_errors
        self._lock = lock or _GenerationLock()
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
            self._engine, self._requests, self._use_tqdm, self._skip_errors, self._lock
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
            _log_summary(metrics_before, engine.get_metrics(), time.perf_counter() - started)
    finally:
        lock.release()


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
        tokenizer: Where to load the tokenizer from, when not from ``model``.
        dtype: "auto" (float32 on CPU, the checkpoint's dtype on GPU), "float32",
            "bfloat16" or "float16".
        device: "auto" (CUDA when available), "cpu" or "cuda".
        seed: Seeds the draws of requests without a seed of their own.
        max_model_len: Longest sequence (prompt + output) the engine serves; defaults to
            the model's ``max_position_embeddings``. Lower it to what you need: the KV
            cache is sized to hold at least one sequence this long.
        max_num_seqs: Most sequences in one step (default 64 on CPU, 256 on GPU).
        max_num_batched_tokens: Most tokens in one step; longer prompts are prefilled in
            chunks (default 2048 on CPU, 8192 on GPU).
        block_size: Tokens per KV-cache block.
        enable_prefix_caching: Share the KV cache of identical prompt prefixes.
        kv_cache_memory_bytes: Size of the KV cache; by default a share of free memory.
        gpu_memory_utilization: On GPU, the share of device memory the engine may use.
        enforce_eager: On GPU, never capture CUDA graphs.
        attention_backend: "auto", "torch" or "triton".
        tensor_parallel_size: Split each layer's weights and KV heads over this many
            devices (worker processes on this machine; on CPU each rank is one process).
        data_parallel_size: Run this many engine replicas in their own processes and
            spread the requests over them (each replica may be tensor parallel too). This
            process then tokenizes, validates and orders, and loads no weights. On CPU each
            replica takes its share of the cores; on CUDA replica r takes devices
            ``r * tensor_parallel_size`` onwards of the visible ones (pass device "auto" or
            "cuda"). Outputs are the same as with one replica, seeded or not. A replica that
            dies has its unfinished requests run again on the others. Replicas are spawned
            processes: a script needs the usual ``if __name__ == "__main__":`` guard.
        max_logprobs: Most ``logprobs`` / ``prompt_logprobs`` a request may ask for (20,
            as vLLM); -1 allows up to the whole vocabulary. A request asking for more is
            refused with a ValueError.

    One LLM runs one generation at a time: a call from a second thread while another
    generates raises RuntimeError (give each thread its own LLM).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tokenizer: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        max_logprobs: int = 20,
    ) -> None:
        # Every argument but the model, as given: a data-parallel replica builds its engine
        # from the same settings.
        settings = {
            name: value for name, value in locals().items() if name not in ("self", "model")
        }
        model_dir = resolve_model(model).path
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            tokenizer or model_dir
        )
        self.config = EngineConfig.create(
            model_dir=model_dir,
            hf_config=hf_config,
            dtype=dtype,
            device=device,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            max_logprobs=max_logprobs,
        )
        self.generation_config = _read_generation_config(model_dir)
        self.eos_token_ids = _eos_token_ids(self.generation_config, self.tokenizer)
        self.vocab_size: int = hf_config.vocab_size
        self.engine: LLMEngine | DataParallelEngine | None
        if data_parallel_size > 1:
            self.engine = DataParallelEngine(
                functools.partial(
                    _replica_engine, model_dir, {**settings, "data_parallel_size": 1}
                ),
                num_replicas=data_parallel_size,
                seed=self.config.seed,
                block_size=self.config.block_size,
                max_model_len=self.config.max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                devices=self.config.platform.replica_devices(),
            )
        else:
            self.engine = LLMEngine(self.config, self.tokenizer, self.eos_token_ids)
        self._request_counter = itertools.count()
        self._generation_lock = _GenerationLock()

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
    ) -> list[RequestOutput]:
        """Complete every prompt; results come back in input order.

        Args:
            prompts: A string, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
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
        """
        stream = self.generate_stream(prompts, sampling_params, use_tqdm, on_error)
        results: list[RequestOutput | None] = [None] * stream.num_requests
        try:
            for index, output in stream:
                results[index] = output
        finally:
            stream.close()
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def generate_stream(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        on_error: str = "raise",
    ) -> GenerationStream:
        """Like `generate`, but yields ``(input_index, RequestOutput)`` as each request
        finishes, so results can be written while the batch runs.

        Validation happens here, before the first result is asked for. Leaving the loop
        early (break, an exception) cancels the requests still running.
        """
        engine = self._live_engine()
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        skip = on_error == "skip"
        prepared = self._prepare(prompts, sampling_params, skip_invalid=skip)
        return GenerationStream(
            engine, prepared, use_tqdm, skip_errors=skip, lock=self._generation_lock
        )

    def _prepare(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        skip_invalid: bool,
    ) -> list[PreparedRequest]:
        if isinstance(prompts, (str, dict)):
            prompt_list: list[Any] = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise ValueError(
                "prompts must be a str, a {'prompt_token_ids': [...]} dict, or a list of "
                f"them, got {type(prompts).__name__}" + _BYTES_HINT.get(type(prompts), ".")
            )
        else:
            prompt_list = list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        # A text that is not valid Unicode (a lone surrogate) fails the batched tokenizer
        # for every prompt; it is this request's error alone.
        text_errors = {
            index: _text_error(index, prompt)
            for index, prompt in enumerate(prompt_list)
            if isinstance(prompt, str)
        }
        texts = [prompt_list[i] for i, error in text_errors.items() if error is None]
        encoded = iter(self.tokenizer(texts)["input_ids"] if texts else [])
        prepared = []
        for index, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            text_error = text_errors.get(index)
            token_ids = (
                list(next(encoded)) if isinstance(prompt, str) and text_error is None else None
            )
            request = PreparedRequest(
                index,
                str(next(self._request_counter)),
                prompt if isinstance(prompt, str) else None,
                [],
                params,
            )
            try:
                if text_error is not None:
                    raise ValueError(text_error)
                if token_ids is None:
                    request.prompt, token_ids = self._prompt_tokens(index, prompt)
                request.token_ids = token_ids
                self._validate_request(index, token_ids, params)
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
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them.

        Each conversation (a list of ``{"role": ..., "content": ...}`` messages) is
        rendered with the tokenizer's chat template (or ``chat_template``), then generated
        like a prompt. ``continue_final_message`` continues the last (assistant) message
        instead of starting a new one.
        """
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
                        conversation, chat_template, add_generation_prompt, continue_final_message
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
    ) -> dict[str, Any]:
        """One conversation as a prompt dict: the rendered text and its token ids.

        The template writes the special tokens itself, so the text is tokenized without
        adding any.
        """
        text = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"prompt": text, "prompt_token_ids": token_ids}

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
            raise ValueError(
                f"Request {index}: a prompt must be a str or a dict with 'prompt_token_ids', "
                f"got {type(prompt).__name__}."
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

    def _validate_request(self, index: int, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"Request {index}: sampling_params must be a SamplingParams, got "
                f"{type(params).__name__}."
            )
        max_model_len = self.config.max_model_len
        if not token_ids:
            raise ValueError(
                f"Request {index}: the prompt is empty (0 tokens); every request needs at "
                "least one prompt token."
            )
        if len(token_ids) + 1 > max_model_len:
            raise ValueError(
                f"Request {index}: the prompt has {len(token_ids)} tokens, but "
                f"max_model_len={max_model_len} leaves room for at most {max_model_len - 1} "
                "prompt tokens plus 1 generated token. Shorten the prompt, or raise "
                "max_model_len (up to the model's max_position_embeddings="
                f"{self.config.hf_config.max_position_embeddings})."
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"Request {index}: prompt token id {bad} is outside the vocabulary "
                f"[0, {self.vocab_size})."
            )
        try:
            params.verify()
            if params.structured_outputs is not None:
                # Parsed here, so that a bad schema or regex fails its own request up front;
                # the engine compiles it for the tokenizer beside the running batch.
                build_grammar(params.structured_outputs)
        except ValueError as error:
            raise ValueError(f"Request {index}: {error}") from None
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"Request {index}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}; "
                "the n sequences of a request run together. Lower n or raise max_num_seqs."
            )
        bad = next((t for t in params.token_ids_in_use() if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"Request {index}: SamplingParams names token id {bad}, outside the vocabulary "
                f"[0, {self.vocab_size})."
            )
        self._check_logprobs(index, params)

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
                raise ValueError(
                    f"Request {index}: Requested {kind} logprobs of {requested}, which is "
                    f"greater than max allowed: {limit} (the vocabulary has {self.vocab_size} "
                    f"tokens, LLM(max_logprobs={max_logprobs})). Lower {name}, or raise "
                    "max_logprobs (-1 allows the whole vocabulary)."
                )

    def _bad_words_token_ids(self, index: int, params: SamplingParams) -> list[list[int]]:
        """Token sequences of each bad word, at the start of a text and after a space."""
        sequences: list[list[int]] = []
        for word in params.bad_words:
            error = _text_error(index, word, "bad word")
            if error is not None:
                raise ValueError(error)
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(
                    f"Request {index}: bad word {word!r} is no tokens once leading spaces are "
                    "dropped; remove it from bad_words."
                )
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
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


def _replica_engine(model_dir: Path, settings: dict[str, Any]) -> LLMEngine:
    """The engine of one data-parallel replica, built in its own process as a single-replica
    `LLM` with the front's settings would build it."""
    engine = LLM(model_dir, **settings).engine
    assert isinstance(engine, LLMEngine)
    return engine


def _read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _eos_token_ids(
    generation_config: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer."""
    ids = generation_config.get("eos_token_id")
    eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)
