"""llama.cpp's side of `benchmarks.llama_cpp`: its Python bindings (llama-cpp-python) on
the same GGUF file and the same token ids, greedy, EOS ignored.

Runs under the python of the venv that ``setup_llama_cpp.sh`` makes, which has llama.cpp
but not paged_llm's environment, so it imports only the standard library and llama_cpp:

    VENV_PYTHON benchmarks/peers/llama_cpp_worker.py JOB RESULT

JOB: {"gguf": path, "threads": n, "n_ctx": tokens, "requests": [[prompt ids, max_tokens]],
"warmup": [[prompt ids, max_tokens]]}. RESULT gets {"seconds", "output_tokens",
"token_ids", "version"}. The bindings decode one sequence at a time (their ``generate`` has
no batch of sequences), so requests run one after another, as paged_llm does with
``max_num_seqs=1``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def greedy(llm: object, prompt: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens after ``prompt``, whatever they are (EOS included)."""
    tokens: list[int] = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # type: ignore[attr-defined]
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens


def main(job_path: str, result_path: str) -> None:
    import llama_cpp

    job = json.loads(Path(job_path).read_text())
    llm = llama_cpp.Llama(
        model_path=job["gguf"],
        n_ctx=job["n_ctx"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_batch=512,
        verbose=False,
    )
    for prompt, max_tokens in job["warmup"]:
        greedy(llm, prompt, max_tokens)
    start = time.perf_counter()
    token_ids = [greedy(llm, prompt, max_tokens) for prompt, max_tokens in job["requests"]]
    seconds = time.perf_counter() - start
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
        "version": llama_cpp.__version__,
    }
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
