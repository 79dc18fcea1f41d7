"""Model files: turn the user's `model` argument into a local Hugging Face-format directory.

`resolve_model` accepts a model directory, a .gguf file (converted once into the cache) or a hub
id found in the local Hugging Face cache, and works fully offline.
"""

from paged_llm.model_files.gguf import SUPPORTED_GGUF_ARCHITECTURES, convert_gguf
from paged_llm.model_files.resolve import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    ResolvedModel,
    cache_dir,
    embedded_gguf,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "ModelNotFoundError",
    "ResolvedModel",
    "cache_dir",
    "convert_gguf",
    "embedded_gguf",
    "resolve_model",
]
