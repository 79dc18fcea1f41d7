"""From finished sequences to `RequestOutput`s: text, stop strings, logprob dicts."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from paged_llm.engine.beam_search import FinishedBeam
from paged_llm.engine.detokenizer import IncrementalDetokenizer, decode, find_stop_string
from paged_llm.engine.sequence import FinishReason, RawLogprobs, Request, Sequence
from paged_llm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
)
from paged_llm.sampling_params import RequestOutputKind


class OutputProcessor:
    """Without a tokenizer (skip_tokenizer_init) texts are empty and logprobs carry no
    decoded tokens, as in vLLM; `LLM` refuses stop strings then."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        # seq_id -> text cut at a stop string.
        self._stopped_texts: dict[int, str] = {}
        # seq_id -> (tokens, characters) of its output that a DELTA request has reported.
        self._reported: dict[int, tuple[int, int]] = {}
        self._token_texts: dict[int, str] = {}

    def reset(self) -> None:
        """Forget the per-sequence state of aborted sequences."""
        self._detokenizers.clear()
        self._stopped_texts.clear()
        self._reported.clear()

    def forget(self, seqs: list[Sequence]) -> None:
        """Forget the per-sequence state of these aborted sequences."""
        for seq in seqs:
            self._detokenizers.pop(seq.seq_id, None)
            self._stopped_texts.pop(seq.seq_id, None)
            self._reported.pop(seq.seq_id, None)

    def find_stop_string(self, seq: Sequence, num_new_tokens: int) -> tuple[str, int] | None:
        """Detokenize the sequence's ``num_new_tokens`` newest tokens one at a time, but a
        last one that stopped it (EOS, a stop token, the grammar's end: not part of the
        text); at the first that completes a stop string, return it and how many tokens
        follow that one (to be dropped).

        Only sequences with stop strings are detokenized as they grow; the others are
        decoded once, when they finish.
        """
        params = seq.sampling_params
        assert self.tokenizer is not None, "LLM refuses stop strings without a tokenizer"
        detokenizer = self._detokenizers.get(seq.seq_id)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
            self._detokenizers[seq.seq_id] = detokenizer
        end = seq.num_tokens - (seq.finish_reason is FinishReason.STOP)
        for position in range(seq.num_tokens - num_new_tokens, end):
            delta = detokenizer.update(seq.token_ids[position])
            found = find_stop_string(
                detokenizer.text, len(delta), params.stop, params.include_stop_str_in_output
            )
            if found is not None:
                stop_str, text_end = found
                self._stopped_texts[seq.seq_id] = detokenizer.text[:text_end]
                return stop_str, seq.num_tokens - 1 - position
        return None

    def _text(self, seq: Sequence) -> str:
        """The finished sequence's text; its per-sequence state is dropped."""
        text = self._text_so_far(seq)
        self._detokenizers.pop(seq.seq_id, None)
        self._stopped_texts.pop(seq.seq_id, None)
        return text

    def _text_so_far(self, seq: Sequence) -> str:
        params = seq.sampling_params
        stopped = self._stopped_texts.get(seq.seq_id)
        if stopped is not None:
            return stopped
        if not params.detokenize or self.tokenizer is None:
            return ""
        token_ids = seq.output_token_ids
        # EOS and stop tokens end the sequence without being part of its text, as in vLLM.
        stopped_by_token = seq.finish_reason is FinishReason.STOP and not isinstance(
            seq.stop_reason, str
        )
        if stopped_by_token and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        return decode(
            self.tokenizer,
            token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = decode(self.tokenizer, [token_id])
        return text

    def _logprob_dict(self, raw: RawLogprobs) -> dict[int, Logprob]:
        """The scored (sampled or prompt) token first, then the top ones by rank, as vLLM
        orders them; a top token that is the scored one keeps its first place."""
        token_ids, logprobs, rank = raw
        entries = {token_ids[0]: Logprob(logprobs[0], rank, self._token_text(token_ids[0]))}
        for top_rank, (token_id, logprob) in enumerate(
            zip(token_ids[1:], logprobs[1:], strict=True), start=1
        ):
            entries.setdefault(token_id, Logprob(logprob, top_rank, self._token_text(token_id)))
        return entries

    def make_beam_search_output(self, request: Request, beams: list[FinishedBeam]) -> RequestOutput:
        """The output of a finished beam search: one completion per beam of its result,
        best first (``index`` is the rank), with ``text`` left empty: `LLM.beam_search`
        decodes each beam, prompt included."""
        num_prompt_tokens = len(request.prompt_token_ids)
        completions = [
            CompletionOutput(
                index=rank,
                text="",
                token_ids=beam.token_ids[num_prompt_tokens:],
                cumulative_logprob=beam.cum_logprob,
                logprobs=[self._logprob_dict(raw) for raw in beam.logprobs],
                finish_reason=beam.finish_reason.value,
                stop_reason=beam.stop_reason,
                lora_request=request.lora_request,
            )
            for rank, beam in enumerate(beams)
        ]
        request.metrics.num_generation_tokens = max(len(c.token_ids) for c in completions)
        return _request_output(request, completions)

    def make_output(self, request: Request) -> RequestOutput:
        """The output of a request whose sequences have all finished (for a ``DELTA``
        request, what was not reported yet)."""
        output = self._output(request, finished=True)
        request.metrics.num_generation_tokens = max(seq.num_output_tokens for seq in request.seqs)
        for seq in request.seqs:
            self._reported.pop(seq.seq_id, None)
        return output

    def make_progress_output(self, request: Request) -> RequestOutput:
        """The output so far of an unfinished ``CUMULATIVE`` or ``DELTA`` request (for
        ``DELTA``, what was added since the last report). Its text is decoded anew each
        time: streaming costs a decode per step, which `LLM`'s final-only calls never pay."""
        return self._output(request, finished=False)

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        params = request.sampling_params
        delta = request.output_kind is RequestOutputKind.DELTA
        first_report = not any(seq.seq_id in self._reported for seq in request.seqs)
        completions = []
        for seq in request.seqs:
            text = self._text(seq) if finished else self._text_so_far(seq)
            # NOTE: an unfinished sequence's list keeps growing: report a copy.
            token_ids = seq.output_token_ids if finished else list(seq.output_token_ids)
            num_tokens = num_chars = 0
            if delta:
                num_tokens, num_chars = self._reported.get(seq.seq_id, (0, 0))
                self._reported[seq.seq_id] = (len(token_ids), len(text))
                token_ids, text = token_ids[num_tokens:], text[num_chars:]
            logprobs = None
            cumulative = None
            if params.logprobs is not None:
                logprobs = [self._logprob_dict(raw) for raw in seq.logprobs[num_tokens:]]
                cumulative = sum(raw[1][0] for raw in seq.logprobs)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=cumulative,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                    lora_request=request.lora_request,
                )
            )
        prompt_logprobs = None
        if params.prompt_logprobs is not None and (first_report or not delta):
            prompt_logprobs = [None] + [
                None if raw is None else self._logprob_dict(raw) for raw in request.prompt_logprobs
            ]
        return _request_output(request, completions, prompt_logprobs, finished)

    def make_pooling_output(
        self, request: Request, data: torch.Tensor
    ) -> PoolingRequestOutput[PoolingOutput]:
        """The output of a finished pooling request: the pooler's ``data``."""
        return PoolingRequestOutput(
            request_id=request.request_id,
            outputs=PoolingOutput(data),
            prompt_token_ids=request.prompt_token_ids,
            prompt=request.prompt,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            metrics=request.metrics,
            lora_request=request.lora_request,
        )

    def make_error_output(self, request: Request, reason: str, parameter: str) -> RequestOutput:
        """The output of a request the engine stopped: no completions, ``error`` the
        reason (without the request's index, which only the front end knows) and
        ``error_parameter`` the parameter at fault."""
        self.forget(request.seqs)
        output = _request_output(request, [])
        output.error, output.error_parameter = reason, parameter
        return output


def _request_output(
    request: Request,
    completions: list[CompletionOutput],
    prompt_logprobs: PromptLogprobs | None = None,
    finished: bool = True,
) -> RequestOutput:
    """The `RequestOutput` of a request with these completions."""
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=request.seqs[0].num_cached_tokens,
        metrics=request.metrics,
        prompt_logprobs=prompt_logprobs,
        lora_request=request.lora_request,
    )
