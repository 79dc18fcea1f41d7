"""Perplexity of a model over a fixed text, from prompt logprobs: the quality yardstick for
lossy paths (quantized weights, an fp8 KV cache), compared against float32 on the same text.

    python -m benchmarks.perplexity                      # SmolLM2, float32
    python -m benchmarks.perplexity --dtype bfloat16
    python -m benchmarks.perplexity --kv-cache-dtype fp8
    python -m benchmarks.perplexity --text-file docs/architecture.md --max-chars 12000

The text is `benchmarks.prompts.SHARED_SYSTEM_PROMPT` (562 tokens of plain English), or the
first ``--max-chars`` characters of ``--text-file`` (a longer text steadies a comparison of
roundings: one code flipped can move a short text's score by half a percent); every token
after the first is scored given all tokens before it, in windows of ``window`` tokens.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.prompts import SHARED_SYSTEM_PROMPT
from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL

# Tokens per scored window: every benchmark that reports perplexity uses this one.
PERPLEXITY_WINDOW = 256


def perplexity(llm: LLM, token_ids: list[int], window: int = PERPLEXITY_WINDOW) -> float:
    """exp of the mean negative log-likelihood of ``token_ids[1:]``, scored in disjoint
    windows of ``window`` tokens (each window's first token is context only), all windows in
    one ``generate`` call."""
    windows = [token_ids[start : start + window] for start in range(0, len(token_ids), window)]
    windows = [ids for ids in windows if len(ids) > 1]
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in windows],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
        use_tqdm=False,
    )
    total_logprob = 0.0
    num_scored = 0
    for ids, output in zip(windows, outputs, strict=True):
        assert output.prompt_logprobs is not None
        for token_id, position in zip(ids[1:], output.prompt_logprobs[1:], strict=True):
            assert position is not None
            total_logprob += position[token_id].logprob
            num_scored += 1
    return math.exp(-total_logprob / num_scored)


def text_token_ids(llm: LLM, text: str = SHARED_SYSTEM_PROMPT) -> list[int]:
    return list(llm.get_tokenizer().encode(text, add_special_tokens=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--window", type=int, default=PERPLEXITY_WINDOW)
    parser.add_argument(
        "--quantization",
        default="dequantize",
        help="LLM(quantization=...); the default is float, the GGUF dequantized exactly "
        "(none: what LLM loads by default, the GGUF kept quantized)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--text-file", type=Path, help="score this file's text instead")
    parser.add_argument("--max-chars", type=int, help="of --text-file, the first this many")
    args = parser.parse_args()
    text = SHARED_SYSTEM_PROMPT
    if args.text_file is not None:
        text = args.text_file.read_text()[: args.max_chars]
    with LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=1024,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    ) as llm:
        token_ids = text_token_ids(llm, text)
        print(
            f"perplexity: {perplexity(llm, token_ids, args.window):.4f} ({len(token_ids)} tokens)"
        )


if __name__ == "__main__":
    main()
