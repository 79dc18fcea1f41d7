"""The public entry point: `LLM`, shaped like vLLM's offline `LLM` class.

A facade: it builds one `LLMEngine` (the model's files, the resolved settings, the intake
and the engine client) and delegates every call to the front end: the intake
(`InputProcessor`), chat rendering (`ChatRenderer`) and the result stream
(`GenerationStream`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from paged_llm.config import EngineConfig
from paged_llm.engine.core import EngineMetrics
from paged_llm.engine.detokenizer import decode
from paged_llm.engine_args import EngineArgs
from paged_llm.exceptions import ConversationError
from paged_llm.frontend.chat import ChatRenderer
from paged_llm.frontend.engine_client import EngineClient
from paged_llm.frontend.input_processor import (
    InputProcessor,
    RejectedRequest,
    params_per_prompt,
    prompt_list,
)
from paged_llm.frontend.llm_engine import LLMEngine
from paged_llm.frontend.lora_requests import lora_per_prompt
from paged_llm.frontend.model_info import ModelInfo
from paged_llm.frontend.pooling import (
    PoolingCall,
    cosine_scores,
    cross_encoder_prompts,
    score_pairs,
)
from paged_llm.frontend.stream import GenerationLock, GenerationStream
from paged_llm.frontend.training_loop import TrainingLoopMethods
from paged_llm.inputs import LoRARequest, PromptType, TokensPrompt
from paged_llm.metrics import Metric
from paged_llm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
from paged_llm.vllm_names import refusal


class LLM(TrainingLoopMethods):
    """An offline batch-inference engine for one model.

    Args:
        model: A local Hugging Face model directory (config.json, safetensors weights,
            tokenizer files), a ``.gguf`` file, or a hub id found in the local cache.
        **kwargs: The settings, by the names of vLLM's ``LLM`` and ``EngineArgs``: every
            field of `EngineArgs`, where each is documented (``dtype``, ``max_model_len``,
            ``tensor_parallel_size``, ...). vLLM arguments with no effect here are
            accepted; those asking for a missing feature, and unknown names, raise
            ValueError naming the argument.

    ``llm.llm_engine`` is the `LLMEngine` it drives (vLLM's ``llm.llm_engine``, with its
    ``model_config``, ``get_tokenizer()`` and step-by-step loop). One LLM runs one
    generation at a time: a call from a second thread while another generates raises
    RuntimeError (give each thread its own LLM).
    """

    # The engine this LLM drives.
    llm_engine: LLMEngine

    def __init__(self, model: str | Path, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs({"model": model, **kwargs}))
        self.args: EngineArgs = self.llm_engine.args
        self.model_info: ModelInfo = self.llm_engine.model_info
        self.config: EngineConfig = self.llm_engine.config
        self.processor: InputProcessor = self.llm_engine.processor
        self._generation_lock = GenerationLock()

    def __getattr__(self, name: str) -> Any:
        """vLLM's `LLM` methods that paged_llm does not reproduce fail with a message
        saying why (docs/vllm_compat.md)."""
        raise refusal("LLM", name)

    @property
    def engine(self) -> EngineClient | None:
        """The engine client that runs the requests; None after `shutdown`."""
        return self.llm_engine.engine_core

    # ----- the model --------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer prompts are encoded with; None under skip_tokenizer_init=True."""
        return self.model_info.tokenizer

    @property
    def generation_config(self) -> dict[str, Any]:
        """The model's generation_config.json values that `get_default_sampling_params`
        reads (with override_generation_config over them)."""
        return self.model_info.generation_config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.model_info.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer prompts are encoded with (vLLM's ``LLM.get_tokenizer``)."""
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values from generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM
        does; used when `generate` gets no sampling_params."""
        return self.model_info.default_sampling_params()

    # ----- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Free the KV cache and the weights (with data parallelism: end the replica
        processes). The LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def _live_engine(self) -> EngineClient:
        return self.llm_engine.live_engine()

    def _idle_engine(self) -> EngineClient:
        """The engine, for a generation: awake, and holding no request of ``llm_engine``'s
        own."""
        engine = self.llm_engine.awake_engine()
        if self.llm_engine.get_num_unfinished_requests():
            raise RuntimeError(
                "This LLM's llm_engine has requests queued with add_request that have not "
                "finished: step them to the end or abort_request them before generating."
            )
        return engine

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (with data parallelism: in every replica), so later
        prompts compute their KV cache anew. Returns False, forgetting nothing, while
        requests are running."""
        return self.llm_engine.reset_prefix_cache()

    # ----- generation ---------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        on_error: str = "raise",
        *,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
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
                a `RequestError` (a ValueError) naming its index before any work starts.
                "skip": a bad request gets a RequestOutput whose ``error`` says why, and
                the others run. With data parallelism, requests that no live replica is
                left to run raise a RuntimeError naming the replicas lost and why, or
                under "skip" come back with ``error`` set. A request that fails while
                running (its constraints leave no token) raises its `RequestError` at
                once under "raise", cancelling the rest; under "skip" it gets an output
                with ``error`` and ``error_parameter`` set and the others run.
            lora_request: The LoRA adapter of every prompt, or a list with one (None: the
                base model) per prompt; needs ``enable_lora=True``. A bad adapter is that
                request's `RequestError`.
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
        return stream.collect()

    def generate_stream(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        on_error: str = "raise",
        *,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> GenerationStream[RequestOutput]:
        """Like `generate`, but yields ``(input_index, RequestOutput)`` as each request
        finishes, so results can be written while the batch runs.

        Validation happens here, before the first result is asked for. Leaving the loop
        early (break, an exception) cancels the requests still running. The stream's
        `GenerationStream.results` yields a refused request's `RequestError` (its index,
        the parameter at fault and the reason) instead of an output.
        """
        engine = self._idle_engine()
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        prompts_given = prompt_list(prompts)
        params = params_per_prompt(
            sampling_params, len(prompts_given), self.get_default_sampling_params()
        )
        requests = self.processor.process(
            prompts_given,
            params,
            priority=priority,
            tokenization_kwargs=tokenization_kwargs,
            lora_requests=lora_per_prompt(lora_request, len(prompts_given)),
        )
        if on_error == "raise":
            _raise_first_error(requests)
        return GenerationStream(
            engine,
            requests,
            self._generation_lock,
            use_tqdm,
            skip_errors=on_error == "skip",
            log_stats=not self.args.disable_log_stats,
        )

    def beam_search(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
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
            lora_request: The LoRA adapter of every prompt, or a list with one per prompt
                (as `generate` takes it).
            use_tqdm: Show a progress bar (of sequences returned); a callable replaces
                ``tqdm.auto.tqdm``.
            concurrency_limit: Search at most this many prompts at a time (None: all at
                once, within ``max_num_seqs`` and the KV cache).

        Every request is validated before any work starts; a bad one raises a
        `RequestError` naming its index.
        """
        engine = self._idle_engine()
        params = self.processor.check_beam_search(params)
        if concurrency_limit is not None and not (
            isinstance(concurrency_limit, int) and concurrency_limit >= 1
        ):
            raise ValueError(
                f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}."
            )
        prompts_given = prompt_list(prompts)
        requests = self.processor.process_beam_search(
            prompts_given, params, lora_per_prompt(lora_request, len(prompts_given))
        )
        _raise_first_error(requests)
        group = concurrency_limit or max(len(requests), 1)
        outputs = []
        for start in range(0, len(requests), group):
            stream = GenerationStream(
                engine,
                requests[start : start + group],
                self._generation_lock,
                use_tqdm,
                log_stats=not self.args.disable_log_stats,
            )
            outputs += stream.collect(first_index=start)
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

    # ----- pooling ------------------------------------------------------------------
    #
    # Every pooling call takes prompts as `generate` does, one PoolingParams for all or one
    # per prompt (None: the model's defaults), `use_tqdm`, `on_error` ("skip": a refused
    # request comes back with ``error`` set and ``outputs`` None), `lora_request`,
    # `tokenization_kwargs` and `truncate_prompt_tokens` (keep each prompt's last k tokens;
    # -1: max_model_len). They need ``runner="pooling"``; see docs/usage.md, "Pooling".

    def embed(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        on_error: str = "raise",
        *,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), in input order: the hidden
        states after the final norm, pooled (LAST token by default), cut to
        ``PoolingParams.dimensions`` and L2-normalized unless ``normalize=False``."""
        outputs = self._pooling_call().run(
            prompts, pooling_params, "embed", use_tqdm, on_error, lora_request,
            tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        on_error: str = "raise",
        *,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """One class distribution per prompt (``outputs.probs``) from a classifier
        (``*ForSequenceClassification``): the head's logits of the last token through
        softmax (sigmoid for one label; raw logits under ``use_activation=False``)."""
        outputs = self._pooling_call().run(
            prompts, pooling_params, "classify", use_tqdm, on_error, lora_request,
            tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def reward(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        on_error: str = "raise",
        *,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """One output per prompt token (``outputs.data``, ``[num_tokens, ...]``): the
        hidden states, or a classifier's head logits, of every token, raw."""
        return self._pooling_call().run(
            prompts, pooling_params, "reward", use_tqdm, on_error, lora_request,
            tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip

    def encode(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        on_error: str = "raise",
        *,
        pooling_task: str | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooler's output of ``pooling_task`` for every prompt (``outputs.data``, a
        tensor): "embed", "classify", "score", "token_embed", "token_classify", or
        "encode" (the default) and "reward" (every token's output, raw)."""
        return self._pooling_call().run(
            prompts, pooling_params, pooling_task or "encode", use_tqdm, on_error,
            lora_request, tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip

    def score(
        self,
        data_1: PromptType | SequenceABC[PromptType],
        data_2: PromptType | SequenceABC[PromptType],
        /,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        on_error: str = "raise",
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """The score (``outputs.score``) of each pair, in order: one ``data_1`` prompt
        against every ``data_2`` prompt, or the i-th against the i-th. A cross-encoder (a
        classifier with one label) scores the pair joined as its tokenizer joins a text
        pair, through a sigmoid; an embedding model gives the cosine of the two
        embeddings."""
        pooler = self.config.pooler
        pairs = score_pairs(data_1, data_2)
        if pooler is not None and "score" in pooler.tasks:
            if pooler.num_labels != 1:
                raise ValueError(
                    "LLM.score on a classifier needs one label (a cross-encoder); this one has "
                    f"{pooler.num_labels}: use LLM.classify for its class probabilities."
                )
            prompts: list[Any] = cross_encoder_prompts(pairs, self.tokenizer, tokenization_kwargs)
            outputs = self._pooling_call().run(
                prompts, pooling_params, "score", use_tqdm, on_error, lora_request, None,
                truncate_prompt_tokens,
            )  # fmt: skip
            return [ScoringRequestOutput.from_base(output) for output in outputs]
        first, second = prompt_list(data_1), prompt_list(data_2)
        embeddings = self._pooling_call().run(
            first + second, pooling_params, "embed", use_tqdm, on_error, lora_request,
            tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip
        return cosine_scores(
            [(0 if len(first) == 1 else i, len(first) + i) for i in range(len(second))],
            embeddings,
        )

    def encode_stream(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        on_error: str = "raise",
        *,
        pooling_task: str = "encode",
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> GenerationStream[PoolingRequestOutput[PoolingOutput]]:
        """Like `encode`, but yields ``(input_index, output)`` as each request finishes,
        as `generate_stream` does (``results()`` gives a refused request's `RequestError`)."""
        return self._pooling_call().stream(
            prompts, pooling_params, pooling_task, use_tqdm, on_error, lora_request,
            tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip

    def _pooling_call(self) -> PoolingCall:
        return PoolingCall(
            self.processor,
            self._idle_engine(),
            self._generation_lock,
            log_stats=not self.args.disable_log_stats,
        )

    # ----- chat ---------------------------------------------------------------------

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
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
        ``{"enable_thinking": False}``) go to the template. A conversation that is
        malformed or that the template refuses raises ValueError naming it.
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
            except ConversationError as error:
                raise ValueError(f"Conversation {index}{_where(error)}: {error.reason}") from error
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

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
        """One conversation as a prompt dict: the rendered text and its token ids (see
        `ChatRenderer.render`). The template is ``chat_template``, else the LLM's
        ``chat_template`` argument, else the tokenizer's. Raises `ConversationError` (a
        ValueError) naming the message at fault."""
        return self.chat_renderer.render(
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            chat_template_content_format=chat_template_content_format,
        )

    @functools.cached_property
    def chat_renderer(self) -> ChatRenderer:
        """The renderer of chat conversations (needs the tokenizer)."""
        return ChatRenderer(self.get_tokenizer(), self.model_info.chat_template)

    # ----- introspection ----------------------------------------------------------------

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics now (``vllm.v1.metrics.reader`` values): see
        `LLMEngine.get_metrics`."""
        return self.llm_engine.get_metrics()

    def get_engine_metrics(self) -> EngineMetrics:
        """paged_llm's engine counters: requests, tokens, preemptions, prefix-cache hits,
        steps, KV cache capacity (summed over data-parallel replicas); `EngineMetrics.since`
        gives the counts of one run."""
        return self._live_engine().get_metrics()


def _where(error: ConversationError) -> str:
    return "" if error.message is None else f", message {error.message}"


def _raise_first_error(requests: list[Any]) -> None:
    """on_error="raise": the first refused request's error, before any work starts."""
    for request in requests:
        if isinstance(request, RejectedRequest):
            raise request.error
