"""The engine core: requests in, one scheduled step at a time, finished sequences out."""

from __future__ import annotations

import itertools
import time
from dataclasses import astuple, dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from paged_llm.config import EngineConfig
from paged_llm.engine.beam_search import BeamSearcher
from paged_llm.engine.block_manager import BlockManager
from paged_llm.engine.executor import create_executor
from paged_llm.engine.model_runner import ModelRunner, StepOutput
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.request import EngineRequest
from paged_llm.engine.scheduler import ScheduledBatch, Scheduler
from paged_llm.engine.sequence import FinishReason, Request, Sequence
from paged_llm.engine.speculation import SequenceDrafter, Speculator
from paged_llm.engine.stats import EngineStats
from paged_llm.engine.weight_updates import NamedTensors, apply_weight_update
from paged_llm.engine.worker import RunnerMethod
from paged_llm.metrics import Metric
from paged_llm.outputs import EngineOutput, RequestOutput
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import BeamSearchParams, RequestOutputKind
from paged_llm.seeds import derive_seed, request_seed
from paged_llm.structured_outputs.xgrammar_backend import GrammarCompiler, SequenceGrammar


@dataclass(frozen=True)
class EngineMetrics:
    """Counters over the engine's lifetime."""

    num_requests: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_steps: int = 0
    # Seconds rank 0 spent in tensor-parallel collectives (0 on one rank).
    collective_seconds: float = 0.0
    # Tokens the KV cache holds (summed over data-parallel replicas): a size, not a count,
    # so `since` keeps it.
    kv_cache_capacity_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were found in the prefix cache."""
        if self.prefix_cache_queried_tokens == 0:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens

    def since(self, earlier: EngineMetrics) -> EngineMetrics:
        """The counts between ``earlier`` and these."""
        counts = EngineMetrics(
            *(now - then for now, then in zip(astuple(self), astuple(earlier), strict=True))
        )
        return replace(counts, kv_cache_capacity_tokens=self.kv_cache_capacity_tokens)


class EngineCore:
    """The engine loop in this process: the scheduler, the block manager and the executor
    (rank 0 of the tensor-parallel ranks); validated requests in, finished outputs out."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.config = config
        # One rank in this process, or N tensor-parallel ranks (rank 0 here).
        self.executor = create_executor(config, eos_token_ids)
        self.block_manager = BlockManager(
            self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            eos_token_ids,
            None if config.speculative is None else Speculator(config.speculative),
        )
        self.output_processor = OutputProcessor(tokenizer)
        # On rank 0 only, with the sequences: other ranks never sample. An LLM without a
        # tokenizer refuses structured outputs up front, so it needs no compiler.
        self.grammar_compiler = (
            None
            if tokenizer is None
            else GrammarCompiler(tokenizer, config.hf_config.vocab_size, eos_token_ids)
        )
        self._seq_ids = itertools.count()
        self.beam_searcher = BeamSearcher(self.scheduler, eos_token_ids, self._seq_ids)
        # request_id -> the state of each request not yet reported finished.
        self._unfinished: dict[str, Request] = {}
        self._num_requests = 0
        self._num_prompt_tokens = 0
        self._num_steps = 0
        self.stats = EngineStats(self.scheduler, config.max_model_len)

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's runner."""
        return self.executor.runner

    def add_request(self, request: EngineRequest) -> Request:
        """Queue a validated request: a generation, a beam search (its output lists the
        beams best first, see `OutputProcessor.make_beam_search_output`), or a pooling
        request (one sequence that computes its prompt and samples nothing).

        Sequence i of the request draws from seed (base, i), where base is the request's
        own seed or else `request_seed` of the engine seed and the request's arrival
        number, so that a rerun of the same submission reproduces every draw.
        """
        serial = self._num_requests
        self._num_requests += 1
        self._num_prompt_tokens += len(request.prompt_token_ids)
        params = request.params
        arrival_seed = request_seed(self.config.seed, serial)
        if isinstance(params, PoolingParams):
            pooled = Request(
                request.request_id,
                request.prompt,
                request.prompt_token_ids,
                params,
                time.time(),
                lora_request=request.lora_request,
            )
            pooled.seqs = [Sequence(next(self._seq_ids), pooled, arrival_seed)]
            self.scheduler.add(pooled.seqs[0])
            self._unfinished[request.request_id] = pooled
            return pooled
        grammar = None
        if params.structured_outputs is not None:
            assert self.grammar_compiler is not None, "LLM checks for a tokenizer"
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        if isinstance(params, BeamSearchParams):
            searched = self.beam_searcher.add_request(
                request, arrival_seed, None if grammar is None else SequenceGrammar(grammar)
            )
            self._unfinished[request.request_id] = searched
            return searched
        base_seed = params.seed if params.seed is not None else arrival_seed
        state = Request(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            params,
            time.time(),
            request.bad_words_token_ids,
            output_kind=request.output_kind,
            lora_request=request.lora_request,
        )
        # NOTE: a grammar decides each next token's mask from the tokens before it, which a
        # draft's rows would need one matcher state each for: such a request does not
        # speculate.
        speculative = self.config.speculative if grammar is None else None
        state.seqs = [
            Sequence(
                next(self._seq_ids),
                state,
                derive_seed(base_seed, index),
                index,
                None if grammar is None else SequenceGrammar(grammar),
                None if speculative is None else SequenceDrafter(speculative),
            )
            for index in range(params.n)
        ]
        parent = state.seqs[0]
        parent.pending_forks = state.seqs[1:]
        self.scheduler.add(parent)
        self._unfinished[request.request_id] = state
        return state

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """Schedule, run and account one step; return the outputs of the requests it
        finished, then those of the unfinished ``CUMULATIVE`` or ``DELTA`` requests it
        added tokens to (``finished=False``)."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError(
                "The scheduler found nothing to run although requests are pending; "
                "this is a bug in paged_llm."
            )
        output = self.executor.execute(batch)
        self._num_steps += 1
        for seq in batch.seqs:
            seq.request.prompt_logprobs.extend(output.prompt_logprobs.get(seq.seq_id, ()))
        failed = self._fail_requests_without_token(batch, output) if output.no_token_rows else []
        sampling_seqs = batch.sampling_seqs
        num_prompt_tokens = self.stats.record_step(sampling_seqs, time.time())
        emitted = output.sampled_token_ids
        finished = self.scheduler.update(batch, emitted)
        if output.logprobs is not None:
            for seq, tokens, rows in zip(sampling_seqs, emitted, output.logprobs, strict=True):
                if rows is not None:
                    seq.logprobs.extend(rows[: len(tokens)])
        searched = self.beam_searcher.step(sampling_seqs)
        for seq, tokens in zip(sampling_seqs, emitted, strict=True):
            if seq.sampling_params.stop and self._stop_at_string(seq, len(tokens)):
                finished.append(seq)
        num_emitted = sum(map(len, emitted))
        self.stats.record_emitted(num_prompt_tokens, num_emitted)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.step_done(time.perf_counter() - started)
        outputs: list[EngineOutput] = [
            self.output_processor.make_output(request)
            if request.pooling_params is None
            else self.output_processor.make_pooling_output(
                request, output.pooled[request.seqs[0].seq_id]
            )
            for request in _unique_requests(finished)
            if request.is_finished
        ]
        outputs += [
            self.output_processor.make_beam_search_output(request, beams)
            for request, beams in searched
        ]
        outputs += failed
        for request_output in outputs:
            request = self._unfinished.pop(request_output.request_id)
            self.stats.record_finished(request, request_output)
        progress: list[EngineOutput] = [
            self.output_processor.make_progress_output(request)
            for request in _unique_requests(sampling_seqs)
            if request.output_kind is not RequestOutputKind.FINAL_ONLY
            and request.request_id in self._unfinished
        ]
        return outputs + progress

    def _stop_at_string(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a stop string ends the sequence in its newest tokens and it is to be
        reported finished now (a token that ended it already does not count: a stop string
        it completed earlier in the same step ends it there instead, and the tokens after
        it are dropped, as one token a step would have stopped)."""
        found = self.output_processor.find_stop_string(seq, num_new_tokens)
        if found is None:
            return False
        stop_str, num_dropped = found
        if num_dropped:
            del seq.token_ids[-num_dropped:]
            del seq.logprobs[len(seq.logprobs) - num_dropped :]
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_str
            return False
        self.scheduler.stop_at_string(seq, stop_str)
        return True

    def _fail_requests_without_token(
        self, batch: ScheduledBatch, output: StepOutput
    ) -> list[RequestOutput]:
        """End the requests of the rows whose masks left no token, as failed: their
        sequences leave the step and free their blocks, and each gets an output whose
        ``error`` says why. The rest of the step goes on without them."""
        vocab_size = self.config.hf_config.vocab_size
        # One sequence explains its request's failure: sibling rows fail alike.
        seqs: dict[str, Sequence] = {}
        for row in output.no_token_rows:
            seqs.setdefault(batch.sampling_seqs[row].request_id, batch.sampling_seqs[row])
        kept_rows = batch.drop_requests(set(seqs))
        output.sampled_token_ids = [output.sampled_token_ids[row] for row in kept_rows]
        if output.logprobs is not None:
            output.logprobs = [output.logprobs[row] for row in kept_rows]
        failed = []
        for seq in seqs.values():
            reason, parameter = _no_token_reason(seq, vocab_size)
            self.scheduler.abort_request(seq.request)
            self.beam_searcher.abort(seq.request_id)
            failed.append(self.output_processor.make_error_output(seq.request, reason, parameter))
        return failed

    def abort_all(self) -> None:
        """Drop every unfinished request and release its blocks."""
        self.scheduler.abort_all()
        self.beam_searcher.abort_all()
        self.output_processor.reset()
        self._unfinished.clear()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop these requests (ids of finished or unknown requests are ignored) and release
        their blocks; they report no output."""
        for request_id in request_ids:
            request = self._unfinished.pop(request_id, None)
            if request is None:
                continue
            self.scheduler.abort_request(request)
            self.beam_searcher.abort(request_id)
            self.output_processor.forget(request.seqs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests hold blocks (see
        `BlockManager.reset_prefix_cache`)."""
        return self.block_manager.reset_prefix_cache()

    # ----- the weights and memory, inside a training loop ----------------------------

    def collective_rpc(
        self, method: RunnerMethod, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` called on every tensor-parallel rank's model runner; results by rank."""
        return self.executor.collective_rpc(method, args, kwargs)

    def update_weights(self, weights: NamedTensors) -> None:
        """Copy new weights into every rank, each checking them whole first (a bad name or
        shape raises before anything changes); the prefix cache is forgotten, since its
        keys and values were computed with the old weights."""
        self._require_idle("update_weights")
        if "weights" in self.sleeping():
            raise RuntimeError(
                "update_weights needs the weights in place, and they are asleep: call "
                "wake_up(tags=['weights']) first."
            )
        self.executor.collective_rpc(apply_weight_update, (weights,))
        self.block_manager.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """Give back the KV cache's memory (level 2: the weights' too); see
        `ModelRunner.sleep`. Cached prefixes are forgotten with the cache."""
        self._require_idle("sleep")
        self.executor.collective_rpc("sleep", (level,))
        self.block_manager.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.executor.collective_rpc("wake_up", (tags,))

    def sleeping(self) -> frozenset[str]:
        """What is asleep: "weights", "kv_cache", both or none."""
        return frozenset(self.model_runner.asleep)

    def _require_idle(self, call: str) -> None:
        if self.has_unfinished():
            raise RuntimeError(
                f"{call} while {len(self._unfinished)} request(s) are unfinished: let them "
                "finish (or abort them) first."
            )

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(
            num_requests=self._num_requests,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self.stats.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=self.block_manager.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.block_manager.prefix_cache_hit_tokens,
            num_steps=self._num_steps,
            collective_seconds=self.model_runner.tp.collective_seconds,
            kv_cache_capacity_tokens=self.model_runner.kv_cache_capacity_tokens,
        )

    def get_stat_metrics(self, model_name: str) -> list[Metric]:
        """vLLM's metrics of this engine (`EngineStats.metrics`), labelled ``engine="0"``."""
        return self.stats.metrics(model_name)

    def shutdown(self) -> None:
        if self.grammar_compiler is not None:
            self.grammar_compiler.shutdown()
        self.executor.shutdown()


def _unique_requests(seqs: list[Sequence]) -> list[Request]:
    return list({id(seq.request): seq.request for seq in seqs}.values())


def _no_token_reason(seq: Sequence, vocab_size: int) -> tuple[str, str]:
    """Why no token satisfies ``seq``'s constraints at its next position, and the
    parameter to change."""
    params = seq.sampling_params
    position = seq.num_output_tokens
    so_far = f"after {position} generated token{'' if position == 1 else 's'}"
    if seq.grammar is not None and seq.grammar.allows_no_token(vocab_size):
        return (
            f"no token satisfies the constraint: {so_far}, structured_outputs allows no "
            "next token and cannot end there either, so no text it accepts continues the "
            "output; check that the constraint can be met (a regex, pattern or grammar "
            "that some string matches all the way).",
            "structured_outputs",
        )
    in_play = [
        name
        for name, applies in (
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("structured_outputs", seq.grammar is not None),
            ("bad_words", bool(seq.request.bad_words_token_ids)),
            ("min_tokens", position < params.min_tokens),
        )
        if applies
    ]
    return (
        f"no token satisfies the constraint: {so_far}, {' and '.join(in_play)} together "
        "leave no token allowed; allow at least one token they all accept "
        "(allowed_token_ids must hold the tokens the constraint needs).",
        in_play[0],
    )
