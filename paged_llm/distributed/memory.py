"""Freeing what a finished engine held, so a script can build the next one in this process."""

from __future__ import annotations

import gc
import sys

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's ``cleanup_dist_env_and_memory``: after ``del llm`` (or `LLM.shutdown`), free
    what the engine held: a collection runs the finalizers that end its worker and replica
    processes and drop its weights and KV cache, and CUDA's cached memory goes back to the
    device. ``shutdown_ray=True`` also ends this process's Ray session, where Ray is loaded.

    paged_llm's tensor-parallel groups belong to their engine and end with it, so unlike
    vLLM this leaves torch.distributed's default process group alone: it is the caller's.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    ray = sys.modules.get("ray")
    if shutdown_ray and ray is not None:
        ray.shutdown()
