"""An lm-evaluation-harness model backed by `LLM`: ``--model paged_llm``.

Importing this module registers the model as ``"paged_llm"``:

    import lm_eval
    import paged_llm.integrations.lm_eval  # noqa: F401  (registers "paged_llm")

    lm_eval.simple_evaluate(model="paged_llm", model_args="pretrained=path/to/model", tasks=[...])

or from the command line, ``paged-llm eval --model path/to/model --tasks ...`` (`main`).
Model args are ``pretrained=`` plus any `LLM` keyword (``dtype``, ``max_model_len``,
``tensor_parallel_size``, ``data_parallel_size``, ...), and those of lm-eval's vLLM wrapper
that have a meaning here (``max_length``, ``max_gen_toks``, ``add_bos_token``,
``prefix_token_id``, ``seed``, ``lora_local_path``).

Each request list becomes one `LLM.generate` call, so continuous batching sizes the
batches; scoring requests score only their continuation, so the prefix cache serves shared
contexts (see `PagedLM._loglikelihood_tokens`).
Scores come from ``prompt_logprobs``: the logprob of each continuation token given everything
before it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, maybe_truncate, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'paged_llm.integrations.lm_eval needs lm-evaluation-harness: pip install "paged_llm[eval]"'
    ) from error

from paged_llm.inputs import TokensPrompt
from paged_llm.jobs.lora_modules import LoRAModules
from paged_llm.llm import LLM
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MODEL_NAME = "paged_llm"
# The name lm-eval's vLLM wrapper gives the adapter of ``lora_local_path``.
_LORA_NAME = "finetuned"
# lm-eval's default for generate_until requests that do not set max_gen_toks.
_DEFAULT_MAX_GEN_TOKS = 256

# (cache key (context, continuation) or None, context token ids, continuation token ids)
_TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model(MODEL_NAME)
class PagedLM(TemplateLM):
    """lm-eval's model interface over one `LLM`.

    Args:
        pretrained: The model, as `LLM`'s ``model``.
        batch_size: Accepted as lm-eval passes it (``--batch_size``) and not used: each
            request list runs as one `LLM.generate` call whose batches continuous batching
            sizes, so a fixed batch size would only add idle steps.
        max_batch_size: The most sequences per step (`LLM`'s ``max_num_seqs``), as in
            lm-eval's vLLM wrapper, unless ``max_num_seqs`` is given.
        device: "cpu", "cuda" or "auto" (`LLM`'s ``device``); None (lm-eval's default) is
            "auto". A device index (``cuda:1``) is refused: choose devices with
            ``CUDA_VISIBLE_DEVICES``.
        max_length: The context length used for scoring and generation (`LLM`'s
            ``max_model_len``; ``max_model_len`` is the same setting).
        max_gen_toks: Tokens a generate_until request may generate when it does not say.
        add_bos_token: Whether strings are tokenized with the tokenizer's special tokens;
            None keeps the tokenizer's own choice.
        prefix_token_id: The token scored continuations of an empty context follow
            (default: BOS, else EOS).
        seed: `LLM`'s seed (1234, as lm-eval's vLLM wrapper).
        lora_local_path: A LoRA adapter (a PEFT folder) every request runs under, as in
            lm-eval's vLLM wrapper: ``LoRARequest("finetuned", 1, lora_local_path)``, with
            ``enable_lora`` turned on (``max_lora_rank``, default 16, as there).
        **llm_kwargs: Any other `LLM` keyword.
    """

    def __init__(
        self,
        pretrained: str,
        batch_size: int | str = "auto",
        max_batch_size: int | None = None,
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = _DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        seed: int = 1234,
        lora_local_path: str | None = None,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__()
        if max_length is not None and llm_kwargs.get("max_model_len") not in (None, max_length):
            raise ValueError(
                f"max_length={max_length} and max_model_len={llm_kwargs['max_model_len']} name "
                "one setting, the context length; give one of them."
            )
        if device is not None and device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"device={device!r}: paged_llm takes 'auto', 'cpu' or 'cuda'; choose which GPUs "
                "with CUDA_VISIBLE_DEVICES (and tensor_parallel_size / data_parallel_size)."
            )
        if max_length is not None:
            llm_kwargs["max_model_len"] = max_length
        if max_batch_size is not None:
            llm_kwargs.setdefault("max_num_seqs", int(max_batch_size))
        if not str(batch_size).startswith("auto"):
            logger.info(
                "batch_size=%s is not used: continuous batching sizes the batches (set "
                "max_batch_size to cap the sequences per step).",
                batch_size,
            )
        adapters = LoRAModules(
            {} if lora_local_path is None else {_LORA_NAME: str(lora_local_path)},
            "lora_local_path",
        )
        # The adapter of every request, or None: the base model.
        self.lora_request = adapters.requests().get(_LORA_NAME)
        self.llm = LLM(
            pretrained, device=device or "auto", seed=seed, **adapters.llm_kwargs(llm_kwargs)
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = max_gen_toks

    # ----- what lm-eval asks of a model --------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos: int = self.tokenizer.eos_token_id
        return eos

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos: int | None = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.llm.config.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        name: str = self.tokenizer.name_or_path
        return name.replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered with the model's chat template; lm-eval calls this for
        ``--apply_chat_template``. Without a generation prompt the last message is
        continued, as in lm-eval's vLLM and hf models."""
        text = self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
        assert isinstance(text, str)  # tokenize=False
        return text

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of ``string``. With ``add_special_tokens`` None, the tokenizer's own
        choice (or ``add_bos_token``) applies, except that a string that already starts with
        the prefix token (a rendered chat template) gets no second one, as in lm-eval's
        hf model."""
        options: dict[str, bool] = {}
        if add_special_tokens is not None:
            options["add_special_tokens"] = add_special_tokens
        elif string.startswith(str(self.tokenizer.decode(self.prefix_token_id))):
            options["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            options["add_special_tokens"] = self.add_bos_token
        ids: list[int] = self.tokenizer.encode(string, **options)
        return ids

    def _loglikelihood_tokens(
        self, requests: list[_TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether greedy decoding would produce it) of
        each request, from one `LLM.generate` call with ``prompt_logprobs``.

        Only the continuation's positions are scored (``prompt_logprobs_start``), so the
        prefix cache serves a context that an earlier request computed: the choices of a
        multiple-choice question share their context's blocks. An empty continuation scores
        (0.0, True) without running, as lm-eval's vLLM model scores it (an empty sum, no
        token that greedy decoding would miss).
        """
        # NOTE: the whole sequence is the prompt, and the engine needs room for one generated
        # token; a longer one keeps its last tokens, as lm-eval's models truncate.
        max_prompt_len = self.max_length - 1
        scored = [index for index, (_, _, continuation) in enumerate(requests) if continuation]
        prompts: list[TokensPrompt] = []
        num_context = []
        params = []
        for _, context, continuation in (requests[index] for index in scored):
            whole = (context + continuation)[-max_prompt_len:]
            prompts.append(TokensPrompt(prompt_token_ids=whole))
            num_context.append(max(len(whole) - len(continuation), 1))
            params.append(
                SamplingParams(
                    temperature=0.0,
                    max_tokens=1,
                    prompt_logprobs=1,
                    prompt_logprobs_start=num_context[-1],
                    detokenize=False,
                )
            )
        outputs = self.llm.generate(
            prompts,
            params,
            use_tqdm=not disable_tqdm and self.rank == 0,
            lora_request=self.lora_request,
        )
        results = [(0.0, True)] * len(requests)
        for index, output, context_len in zip(scored, outputs, num_context, strict=True):
            results[index] = _continuation_score(output, context_len)
        for (cache_key, _, _), result in zip(requests, results, strict=True):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The loglikelihood of each whole text, scored in disjoint windows of the context
        length (each window conditioned on the tokens before it), all windows of all texts
        in one generate call."""
        windows: list[_TokenRequest] = []
        num_windows: list[int] = []
        for (text,) in (request.args for request in requests):
            pairs = [
                make_disjoint_window(pair)
                for pair in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    # The prompt is context + continuation, plus room for one generated token.
                    max_seq_len=self.max_length - 2,
                    context_len=1,
                )
            ]
            windows.extend((None, context, continuation) for context, continuation in pairs)
            num_windows.append(len(pairs))
        scores = iter(self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm))
        totals = []
        for request, count in zip(requests, num_windows, strict=True):
            total = sum(next(scores)[0] for _ in range(count))
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's completion up to its first ``until`` string (EOS included), in one
        generate call; greedy unless its gen_kwargs sample."""
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts: list[TokensPrompt] = []
        params, stops = [], []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("do_sample", None)
            context_ids, max_gen_toks = maybe_truncate(
                self.tok_encode(context),
                max_gen_toks=max_gen_toks,
                max_model_len=self.max_length,
            )
            prompts.append(TokensPrompt(prompt_token_ids=context_ids))
            stops.append(until)
            params.append(_sampling_params(kwargs, max_gen_toks, until))
        outputs = self.llm.generate(
            prompts,
            params,
            use_tqdm=not disable_tqdm and self.rank == 0,
            lora_request=self.lora_request,
        )
        texts = []
        for request, output, until in zip(requests, outputs, stops, strict=True):
            text = output.outputs[0].text
            # A stop string the tokenizer decodes differently mid-text can slip through the
            # engine's check; cut at the first one, as lm-eval's models do.
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts


def _continuation_score(output: RequestOutput, num_context: int) -> tuple[float, bool]:
    """Sum the logprobs of the prompt's tokens from ``num_context`` on; greedy means each was
    the most likely token at its position."""
    assert output.prompt_logprobs is not None
    token_ids = output.prompt_token_ids
    total, greedy = 0.0, True
    for position in range(num_context, len(token_ids)):
        scored = output.prompt_logprobs[position]
        assert scored is not None
        logprob = scored[token_ids[position]]
        total += logprob.logprob
        greedy = greedy and logprob.rank == 1
    return total, greedy


# gen_kwargs lm-eval tasks set -> SamplingParams fields (transformers' names on the left).
_GEN_KWARGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "min_tokens": "min_tokens",
    "min_new_tokens": "min_tokens",
}


def _sampling_params(
    gen_kwargs: dict[str, Any], max_tokens: int, until: list[str]
) -> SamplingParams:
    unknown = sorted(set(gen_kwargs) - set(_GEN_KWARGS))
    if unknown:
        raise ValueError(
            f"gen_kwargs {', '.join(map(repr, unknown))} have no meaning for paged_llm; the "
            f"ones it takes are {', '.join(sorted(_GEN_KWARGS))} (plus until, max_gen_toks "
            "and do_sample)."
        )
    fields = {_GEN_KWARGS[name]: value for name, value in gen_kwargs.items()}
    # NOTE: special tokens are left out of the text, as lm-eval's hf model decodes it; EOS
    # (whose text is among the until strings) ends generation as a token anyway.
    return SamplingParams(max_tokens=max_tokens, stop=[stop for stop in until if stop], **fields)


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    """lm-eval's command line reads sys.argv; give it ours for the call."""
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def main(argv: Sequence[str]) -> int:
    """``paged-llm eval --model PATH --tasks ... [lm-eval's flags]``: lm-eval's ``run``
    command with ``--model paged_llm --model_args pretrained=PATH`` (further
    ``--model_args`` are merged in)."""
    from lm_eval.__main__ import cli_evaluate

    parser = argparse.ArgumentParser(
        prog="paged-llm eval",
        description="Run lm-evaluation-harness on a paged_llm model; every flag but --model "
        "is lm-eval's (lm-eval run --help lists them).",
    )
    parser.add_argument("--model", "-m", required=True, help="model directory or .gguf file")
    known, lm_eval_args = parser.parse_known_args(argv)
    command = ["run", "--model", MODEL_NAME, "--model_args", f"pretrained={known.model}"]
    with _argv(["lm-eval", *command, *lm_eval_args]):
        cli_evaluate()
    return 0
