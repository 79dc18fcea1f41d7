"""Running the scripts of this folder as vLLM's: ``import vllm`` gives paged_llm."""

from __future__ import annotations

import importlib
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from paged_llm.vllm_names import VLLM_NAMES

SCRIPTS = Path(__file__).parent


@contextmanager
def vllm_is_paged_llm() -> Iterator[None]:
    """``import vllm`` and vLLM's module paths (every module of docs/vllm_compat.md) give
    paged_llm's modules, for the duration."""
    aliases = {"vllm": importlib.import_module("paged_llm")}
    for name in VLLM_NAMES:
        parts = name.path.split(".")
        for end in range(1, len(parts)):
            try:
                module = importlib.import_module("paged_llm." + ".".join(parts[:end]))
            except ModuleNotFoundError:
                break
            aliases["vllm." + ".".join(parts[:end])] = module
    saved = {name: sys.modules.get(name) for name in aliases}
    sys.modules.update(aliases)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


def run_script(name: str, *argv: str) -> dict[str, Any]:
    """Run tests/vllm_scripts/``name`` as ``__main__`` with ``argv``; its globals."""
    saved_argv = sys.argv
    sys.argv = [name, *argv]
    try:
        with vllm_is_paged_llm():
            return runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    finally:
        sys.argv = saved_argv
