"""vLLM's offline names, each with what paged_llm does with it: the one list behind
docs/vllm_compat.md and behind the refusals of the names paged_llm does not reproduce.

A name is ``"vllm." + path``; paged_llm has it at ``"paged_llm." + path`` (a module, a
module attribute or a class attribute). Its status is one of

- ``Y``: it does what vLLM's does;
- ``differs``: it exists and ``note`` says how it differs;
- ``refused``: using it raises an error whose message is ``note`` (see `refusal`), never
  a silent no-op.

The keyword arguments of ``LLM`` / ``EngineArgs`` and the fields of ``SamplingParams`` have
tables of their own in docs/usage.md.
"""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("Y", "differs", "refused")

_SLEEP = (
    "levels 1 and 2 (level 0, a server's pause of scheduling, has nothing to pause offline); "
    "on CPU level 1 frees the KV cache and keeps the weights; after level 2, wake_up reads "
    "the weights again from the model's files."
)
_WAKE_UP = "tags 'weights' and 'kv_cache' (no 'scheduling': there is no level 0)."
_COLLECTIVE_RPC = (
    "calls the model runner of every rank (vLLM: the worker); timeout is refused: a call "
    "runs to its end."
)


@dataclass(frozen=True)
class VllmName:
    """One vLLM name: ``path`` after ``vllm.``, its status and how it differs or why not."""

    path: str
    status: str
    note: str = ""

    @property
    def paged_llm_path(self) -> str:
        return f"paged_llm.{self.path}"


VLLM_NAMES: tuple[VllmName, ...] = (
    # ----- the package --------------------------------------------------------------------
    VllmName("LLM", "Y"),
    VllmName("LLMEngine", "Y"),
    VllmName("EngineArgs", "Y"),
    VllmName("SamplingParams", "Y"),
    VllmName("BeamSearchParams", "Y"),
    VllmName("TextPrompt", "Y"),
    VllmName("TokensPrompt", "Y"),
    VllmName("RequestOutput", "Y"),
    VllmName("CompletionOutput", "Y"),
    VllmName("PoolingParams", "Y"),
    VllmName("PoolingRequestOutput", "Y"),
    VllmName("EmbeddingRequestOutput", "Y"),
    VllmName("ClassificationRequestOutput", "Y"),
    VllmName("ScoringRequestOutput", "Y"),
    VllmName("config.PoolerConfig", "Y"),
    VllmName(
        "AsyncLLMEngine",
        "refused",
        "paged_llm is an offline engine: use LLM, LLM.generate_stream or LLMEngine's step loop.",
    ),
    VllmName(
        "AsyncEngineArgs",
        "refused",
        "paged_llm is an offline engine: use EngineArgs with LLM or LLMEngine.",
    ),
    VllmName(
        "ModelRegistry",
        "refused",
        "paged_llm runs its own Llama, Mistral, Qwen2 and Qwen3 code; other architectures "
        "cannot be registered.",
    ),
    # ----- LLM ----------------------------------------------------------------------------
    VllmName("LLM.generate", "Y"),
    VllmName("LLM.chat", "Y"),
    VllmName("LLM.beam_search", "Y"),
    VllmName("LLM.get_tokenizer", "Y"),
    VllmName("LLM.get_default_sampling_params", "Y"),
    VllmName("LLM.get_metrics", "Y"),
    VllmName("LLM.reset_prefix_cache", "Y"),
    VllmName("LLM.llm_engine", "Y"),
    VllmName(
        "LLM.encode",
        "differs",
        "pooling_task defaults to 'encode' (every token's output, raw) where vLLM requires "
        "it; also takes on_error.",
    ),
    VllmName("LLM.embed", "Y"),
    VllmName("LLM.classify", "Y"),
    VllmName("LLM.score", "Y"),
    VllmName("LLM.reward", "Y"),
    VllmName("LLM.sleep", "differs", _SLEEP),
    VllmName("LLM.wake_up", "differs", _WAKE_UP),
    VllmName("LLM.collective_rpc", "differs", _COLLECTIVE_RPC),
    VllmName("LLM.apply_model", "Y"),
    VllmName(
        "LLM.start_profile",
        "refused",
        "LLM.start_profile: paged_llm has no built-in profiler hooks; profile generate() with "
        "torch.profiler or py-spy.",
    ),
    VllmName(
        "LLM.stop_profile",
        "refused",
        "LLM.stop_profile: paged_llm has no built-in profiler hooks; profile generate() with "
        "torch.profiler or py-spy.",
    ),
    # ----- LLMEngine ----------------------------------------------------------------------
    VllmName("LLMEngine.from_engine_args", "Y"),
    VllmName("LLMEngine.add_request", "Y"),
    VllmName("LLMEngine.step", "Y"),
    VllmName("LLMEngine.has_unfinished_requests", "Y"),
    VllmName("LLMEngine.get_num_unfinished_requests", "Y"),
    VllmName("LLMEngine.abort_request", "Y"),
    VllmName("LLMEngine.reset_prefix_cache", "Y"),
    VllmName("LLMEngine.get_metrics", "Y"),
    VllmName("LLMEngine.get_tokenizer", "Y"),
    VllmName("LLMEngine.get_model_config", "Y"),
    VllmName("LLMEngine.sleep", "differs", _SLEEP),
    VllmName("LLMEngine.wake_up", "differs", _WAKE_UP),
    VllmName("LLMEngine.is_sleeping", "Y"),
    VllmName("LLMEngine.collective_rpc", "differs", _COLLECTIVE_RPC),
    VllmName("LLMEngine.apply_model", "Y"),
    # ----- modules ------------------------------------------------------------------------
    VllmName("engine.arg_utils.EngineArgs", "Y"),
    VllmName("outputs.RequestOutput", "Y"),
    VllmName("outputs.CompletionOutput", "Y"),
    VllmName("sampling_params.SamplingParams", "Y"),
    VllmName("sampling_params.BeamSearchParams", "Y"),
    VllmName("sampling_params.RequestOutputKind", "Y"),
    VllmName("inputs.TextPrompt", "Y"),
    VllmName("inputs.TokensPrompt", "Y"),
    VllmName("lora.request.LoRARequest", "Y"),
    VllmName("platforms.current_platform", "Y"),
    VllmName(
        "distributed.cleanup_dist_env_and_memory",
        "differs",
        "Collects the engines no longer referenced (ending their worker processes) and empties "
        "CUDA's cache; it leaves torch.distributed's default process group alone, since "
        "paged_llm's tensor-parallel groups end with their engine and a default group is the "
        "caller's.",
    ),
    VllmName("utils.FlexibleArgumentParser", "Y"),
    VllmName("utils.argparse_utils.FlexibleArgumentParser", "Y"),
    VllmName("utils.get_open_port", "Y"),
    VllmName("v1.metrics.reader.Metric", "Y"),
    VllmName("v1.metrics.reader.Counter", "Y"),
    VllmName("v1.metrics.reader.Gauge", "Y"),
    VllmName("v1.metrics.reader.Histogram", "Y"),
    VllmName("v1.metrics.reader.Vector", "Y"),
    VllmName("v1.sample.logits_processor.LogitsProcessor", "Y"),
    VllmName("v1.sample.logits_processor.BatchUpdate", "Y"),
    VllmName("v1.sample.logits_processor.MoveDirectionality", "Y"),
    VllmName("v1.sample.logits_processor.process_dict_updates", "Y"),
    VllmName("v1.sample.logits_processor.AdapterLogitsProcessor", "Y"),
    VllmName("v1.sample.logits_processor.builtin.process_dict_updates", "Y"),
    VllmName("v1.sample.logits_processor.interface.LogitsProcessor", "Y"),
    VllmName("v1.sample.logits_processor.interface.BatchUpdate", "Y"),
    VllmName("v1.sample.logits_processor.interface.MoveDirectionality", "Y"),
    VllmName("config.VllmConfig", "Y"),
)


def refusal(owner: str, name: str) -> AttributeError | ImportError:
    """The error for attribute ``name`` of ``owner`` (a module, ``"paged_llm"``, or a
    class, ``"LLM"``) where it is missing: for a refused vLLM name, an error whose message is
    the refusal's note (from a module an ImportError, so that ``from paged_llm import X``
    shows it), else Python's AttributeError."""
    is_module = owner == "paged_llm" or owner.startswith("paged_llm.")
    path = f"{owner}.{name}".removeprefix("paged_llm").lstrip(".")
    for vllm_name in VLLM_NAMES:
        if vllm_name.path == path and vllm_name.status == "refused":
            if is_module:
                return ImportError(vllm_name.note, name=owner)
            return AttributeError(vllm_name.note)
    kind = "module" if is_module else "object"
    return AttributeError(f"{kind} {owner!r} has no attribute {name!r}")


def markdown_table() -> str:
    """docs/vllm_compat.md's table: one row per name, in `VLLM_NAMES` order."""
    rows = [
        "| vLLM | paged_llm | status | how it differs, or why not |",
        "| --- | --- | --- | --- |",
    ]
    for vllm_name in VLLM_NAMES:
        here = "" if vllm_name.status == "refused" else f"`{vllm_name.paged_llm_path}`"
        note = vllm_name.note.replace("|", "\\|")
        rows.append(f"| `vllm.{vllm_name.path}` | {here} | {vllm_name.status} | {note} |")
    return "\n".join(rows)
