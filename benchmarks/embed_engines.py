"""The engines the embedding benchmark compares, and the worker that runs one of them.

Each engine runs in a fresh subprocess (``python -m benchmarks.embed_engines JOB RESULT``)
so that its peak RSS is its own. Every engine embeds token-id prompts with the decoder
model's hidden states after the final norm, LAST-token pooled and L2-normalized (what
vLLM's and paged_llm's pooling runner do for a ``*ForCausalLM``), and writes the vectors,
in prompt order, to ``RESULT.npy``.

Engines (names as on the command line):
    paged_llm      ``LLM(runner="pooling").embed``.
    hf_sorted<N>   transformers' ``AutoModel`` over batches of N prompts sorted by length,
                   longest first, right padded with an attention mask: what
                   sentence-transformers' ``encode`` does (its default N is 32).
    vllm           vLLM's ``LLM(runner="pooling").embed`` (its CPU build), run by
                   ``benchmarks/peers/vllm_embed_worker.py`` in the venv that
                   ``benchmarks/peers/setup_vllm_cpu.sh`` makes.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

VLLM_ENGINE = "vllm"
_HF_SORTED_RE = re.compile(r"hf_sorted(\d+)")


@dataclass(frozen=True)
class EmbedOptions:
    """Settings every engine gets, so that they run the same model the same way."""

    model_dir: str
    dtype: str
    threads: int
    # Longest prompt of the workload.
    max_model_len: int
    # paged_llm's batching limits, resolved here so the vLLM worker can take them too.
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class EmbedRun:
    """What one engine did with the whole workload (its vectors are in RESULT.npy)."""

    engine: str
    wall_seconds: float
    load_seconds: float
    # CPU seconds of the engine's processes in the timed run.
    cpu_seconds: float
    peak_rss_mib: float
    settings: dict[str, Any] = field(default_factory=dict)


class EmbedEngine(ABC):
    """A loaded model that embeds token-id prompts."""

    @abstractmethod
    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """A ``[len(prompts), hidden]`` float32 array of normalized LAST-token embeddings,
        in prompt order."""

    def settings(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:  # noqa: B027 - engines without resources to free skip it
        """Free what the engine holds."""


class PagedLLMEmbedEngine(EmbedEngine):
    def __init__(self, options: EmbedOptions) -> None:
        from paged_llm import LLM

        self.llm = LLM(
            options.model_dir,
            runner="pooling",
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
        )

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        outputs = self.llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)

    def settings(self) -> dict[str, Any]:
        scheduler = self.llm.config.scheduler
        return {
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        }

    def close(self) -> None:
        self.llm.shutdown()


class HFSortedEmbedEngine(EmbedEngine):
    """sentence-transformers' batching over transformers' base model."""

    def __init__(self, options: EmbedOptions, batch_size: int) -> None:
        from transformers import AutoModel

        self.batch_size = batch_size
        self.model = AutoModel.from_pretrained(
            options.model_dir, dtype=getattr(torch, options.dtype), attn_implementation="sdpa"
        ).eval()
        pad = self.model.config.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        embeddings = np.empty((len(prompts), self.model.config.hidden_size), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            lengths = torch.tensor([len(prompts[i]) for i in batch])
            input_ids = torch.full((len(batch), int(lengths.max())), self.pad_token_id)
            attention_mask = torch.zeros_like(input_ids)
            for row, index in enumerate(batch):
                input_ids[row, : lengths[row]] = torch.tensor(prompts[index])
                attention_mask[row, : lengths[row]] = 1
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]
            last = hidden[torch.arange(len(batch)), lengths - 1].float()
            embeddings[batch] = torch.nn.functional.normalize(last, dim=-1).numpy()
        return embeddings

    def settings(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size}


def validate_engine_name(name: str) -> str:
    if name in ("paged_llm", VLLM_ENGINE) or _HF_SORTED_RE.fullmatch(name):
        return name
    raise ValueError(
        f"unknown engine {name!r}; expected paged_llm, vllm or hf_sorted<batch size> "
        "(e.g. hf_sorted32, sentence-transformers' default)."
    )


def make_engine(name: str, options: EmbedOptions) -> EmbedEngine:
    """An engine of this environment (vllm runs in its own venv)."""
    if name == "paged_llm":
        return PagedLLMEmbedEngine(options)
    match = _HF_SORTED_RE.fullmatch(validate_engine_name(name))
    if match is None:
        raise ValueError(f"engine {name!r} does not run in this environment.")
    return HFSortedEmbedEngine(options, int(match.group(1)))


def run_engine(
    name: str, options: EmbedOptions, prompts: list[list[int]], warmup: list[list[int]]
) -> tuple[EmbedRun, np.ndarray]:
    """Load ``name``, warm it up, then time it on every prompt (in this process)."""
    torch.set_num_threads(options.threads)
    load_started = time.perf_counter()
    engine = make_engine(name, options)
    load_seconds = time.perf_counter() - load_started
    try:
        engine.embed(warmup)
        started, cpu_started = time.perf_counter(), time.process_time()
        embeddings = engine.embed(prompts)
        wall_seconds = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu_started
        settings = engine.settings()
    finally:
        engine.close()
    run = EmbedRun(
        engine=name,
        wall_seconds=wall_seconds,
        load_seconds=load_seconds,
        cpu_seconds=cpu_seconds,
        # ru_maxrss is in KiB on Linux.
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        settings=settings,
    )
    return run, embeddings


def write_job(
    path: Path,
    name: str,
    options: EmbedOptions,
    prompts: list[list[int]],
    warmup: list[list[int]],
) -> None:
    """The JSON a worker (this module's or the vLLM one) reads."""
    job = {"engine": name, "options": asdict(options), "prompts": prompts, "warmup": warmup}
    path.write_text(json.dumps(job))


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    job = json.loads(Path(job_path).read_text())
    run, embeddings = run_engine(
        job["engine"], EmbedOptions(**job["options"]), job["prompts"], job["warmup"]
    )
    Path(result_path).write_text(json.dumps(asdict(run)))
    np.save(f"{result_path}.npy", embeddings)


if __name__ == "__main__":
    main(sys.argv[1:])
