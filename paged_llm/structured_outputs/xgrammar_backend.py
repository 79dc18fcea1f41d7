"""Grammars with xgrammar: validation, compilation (cached, on a worker thread), one matcher
per sequence, and each step's token bitmask for the batch.

xgrammar is imported here only, and only when a request asks for structured outputs, so
the rest of paged_llm runs without the ``structured`` extra.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from paged_llm.structured_outputs.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Distinct constraints whose compiled grammars an engine keeps (a few hundred KB each).
_CACHE_SIZE = 256

# Free whitespace in xgrammar's JSON grammars (any_whitespace=True), between every two tokens.
_FREE_WHITESPACE = "[ \\n\\r\\t]*"
# An EBNF string literal, a character class, or a name.
_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\w+')

# xgrammar's errors start with "[time] /path/file.cc:line: ", which tells a user nothing.
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


def import_xgrammar() -> ModuleType:
    """The xgrammar module, or an ImportError that says how to install it."""
    try:
        import xgrammar
    except ImportError as error:
        raise ImportError(
            "Structured outputs need xgrammar, which is not installed: "
            'pip install "paged_llm[structured]"'
        ) from error
    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    # json.dumps escapes quotes, backslashes and control characters as EBNF strings need.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar grammar; ValueError naming the field when xgrammar
    cannot read it (an invalid schema, regex or grammar)."""
    xgrammar = import_xgrammar()
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    grammar: xgr.Grammar
    try:
        if kind in ("json", "json_object"):
            schema = '{"type": "object"}' if params.json is None else params.json
            grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
            if params.whitespace_pattern is not None:
                grammar = _with_whitespace_pattern(xgrammar, grammar, params.whitespace_pattern)
        elif kind == "regex":
            assert params.regex is not None
            grammar = xgrammar.Grammar.from_regex(params.regex)
        elif kind == "choice":
            assert params.choice is not None
            grammar = xgrammar.Grammar.from_ebnf(choice_ebnf(params.choice))
        else:
            assert params.grammar is not None
            grammar = xgrammar.Grammar.from_ebnf(params.grammar)
    except RuntimeError as error:
        reason = _NATIVE_PREFIX.sub("", str(error).strip())
        raise ValueError(
            f"StructuredOutputsParams.{kind} is not valid for xgrammar: {reason}"
        ) from None
    return grammar


def _with_whitespace_pattern(
    xgrammar: ModuleType, grammar: xgr.Grammar, pattern: str
) -> xgr.Grammar:
    """A JSON grammar whose free whitespace is replaced by the regex ``pattern``.

    xgrammar has no whitespace option of its own (vLLM's whitespace_pattern goes to outlines
    only), so the regex's grammar joins the JSON grammar's, its rules renamed apart.
    """
    try:
        whitespace = str(xgrammar.Grammar.from_regex(pattern))
    except RuntimeError as error:
        raise ValueError(
            "StructuredOutputsParams.whitespace_pattern is not a valid regex for xgrammar: "
            + _NATIVE_PREFIX.sub("", str(error).strip())
        ) from None
    names = set(re.findall(r"^(\w+) ::=", whitespace, flags=re.MULTILINE))
    whitespace = _EBNF_TOKEN.sub(
        lambda m: f"json_whitespace_{m.group()}" if m.group() in names else m.group(), whitespace
    )
    json_ebnf = str(grammar)
    assert _FREE_WHITESPACE in json_ebnf, "xgrammar changed how it writes JSON whitespace"
    merged: xgr.Grammar = xgrammar.Grammar.from_ebnf(
        json_ebnf.replace(_FREE_WHITESPACE, "json_whitespace_root") + "\n" + whitespace
    )
    return merged


class GrammarCompiler:
    """Compiles each distinct constraint once for one tokenizer, on a worker thread.

    `compile` returns at once with a future: the engine goes on prefilling the prompt (and
    running other requests) while the grammar compiles, and a sequence waits for it only
    at its first sampled token. Compiling takes about 1 ms for a small JSON schema and
    5 ms for a regex with SmolLM2's 49k-token vocabulary on this CPU; the tokenizer's
    vocabulary table, built once before the first grammar, takes about 0.25 s.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: frozenset[int]
    ) -> None:
        self._tokenizer = tokenizer
        # NOTE: the model's vocabulary (the logits' width) may be padded past the
        # tokenizer's, or the tokenizer may have added tokens the model never produces;
        # the bitmask covers both.
        self._vocab_size = max(vocab_size, len(tokenizer))
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        key = params.cache_key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="paged_llm-grammar")
        future = self._cache[key] = self._pool.submit(self._compile, params)
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        xgr = import_xgrammar()
        started = time.perf_counter()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = self._compiler.compile_grammar(build_grammar(params))
        seconds = time.perf_counter() - started
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += seconds
        logger.info("Compiled a %s grammar in %.1f ms.", params.kind, 1000 * seconds)
        return compiled

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class SequenceGrammar:
    """One sequence's matcher. It has accepted exactly the sequence's output tokens, in
    order: the scheduler advances it with every token it appends.

    NOTE: preemption by recompute keeps a sequence's tokens and recomputes only their KV
    cache, so the matcher is neither rebuilt nor rolled back; its state stays the tokens'.
    """

    __slots__ = ("_compiled", "_matcher")

    def __init__(self, compiled: Future[xgr.CompiledGrammar]) -> None:
        self._compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            # Waits only when the grammar is still compiling.
            self._matcher = import_xgrammar().GrammarMatcher(self._compiled.result())
        return self._matcher

    @property
    def vocab_size(self) -> int:
        """The width, in tokens, of the bitmasks this grammar fills."""
        return int(self._compiled.result().tokenizer_info.vocab_size)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token."""
        return self._matcher is not None and self._matcher.is_terminated()

    def fork(self) -> SequenceGrammar:
        """A matcher in this one's state that advances on its own (a forked beam's)."""
        child = SequenceGrammar(self._compiled)
        child._matcher = None if self._matcher is None else self._matcher.fork()
        return child

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(
                f"The grammar refused token {token_id} although the token bitmask allowed "
                "it; this is a bug in paged_llm."
            )

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allows_no_token(self, vocab_size: int) -> bool:
        """Nothing of the first ``vocab_size`` tokens may come next, its stop token
        included: the output so far leads nowhere the grammar accepts (an unsatisfiable
        constraint). For explaining a failure, not for every step."""
        bitmask = import_xgrammar().allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return not bool(unpack_token_bitmask(bitmask, vocab_size).any())


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, vocab_size]`` bool from a ``[B, W]`` int32 bitmask (bit ``t % 32`` of word
    ``t // 32`` stands for token ``t``); a bitmask wider than the vocabulary is cut."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def only_stop_tokens_allowed(
    bitmask_row: torch.Tensor, stop_token_ids: frozenset[int], vocab_size: int
) -> bool:
    """The row's grammar is complete and allows nothing but its stop tokens next."""
    allowed = unpack_token_bitmask(bitmask_row[None], vocab_size)[0]
    allowed[list(stop_token_ids)] = False
    return not bool(allowed.any())


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` that their grammar does not allow.

    xgrammar's kernel: on CPU about 4x faster than unpacking the bits with torch.
    """
    import_xgrammar().apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows
    )


def grammar_bitmask(grammars: list[SequenceGrammar | None]) -> torch.Tensor | None:
    """``[len(grammars), ceil(V / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` is set
    where the row's grammar allows token ``t`` next; rows without a grammar allow all.
    None when no row has a grammar."""
    rows = [(row, grammar) for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return None
    bitmask: torch.Tensor = import_xgrammar().allocate_token_bitmask(
        len(grammars), rows[0][1].vocab_size
    )
    for row, grammar in rows:
        grammar.fill_bitmask(bitmask, row)
    return bitmask
