"""Grammars, compilation, matchers and bitmasks, against xgrammar's own matcher."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from paged_llm.structured_outputs import StructuredOutputsParams
from paged_llm.structured_outputs.xgrammar_backend import (
    GrammarCompiler,
    SequenceGrammar,
    build_grammar,
    grammar_bitmask,
    import_xgrammar,
    unpack_token_bitmask,
)

# A vocabulary small enough to try every token at every step; token 0 is the stop token.
TINY_VOCAB = ["</s>", "{", "}", '"', "a", "b", "ab", ":", ",", " ", "1", "2", "12", "-", '{"']
TINY_VOCAB += ['"a"', '":', "x", "yes", "no", "y", "e", "s", "n", "o", "\\", "ba", "0", "9"]
STOP = 0


def _compiled(params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
    info = xgr.TokenizerInfo(TINY_VOCAB, xgr.VocabType.RAW, stop_token_ids=[STOP])
    future: Future[xgr.CompiledGrammar] = Future()
    future.set_result(xgr.GrammarCompiler(info).compile_grammar(build_grammar(params)))
    return future


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 12}},
                "required": ["a"],
            },
            disable_any_whitespace=True,
        ),
        StructuredOutputsParams(regex=r"(ab|a)+b?-[0-9]{1,2}"),
        StructuredOutputsParams(choice=["yes", "no", "ab"]),
        StructuredOutputsParams(grammar='root ::= "x" inner "x"\ninner ::= "a" inner | "b"'),
    ],
    ids=["json", "regex", "choice", "grammar"],
)
@pytest.mark.parametrize("seed", range(4))
def test_the_bitmask_allows_exactly_the_tokens_the_matcher_accepts(
    params: StructuredOutputsParams, seed: int
) -> None:
    """Brute force: at every step of a random walk, the tokens our bitmask allows are the
    tokens a copy of the matcher accepts one by one."""
    compiled = _compiled(params)
    grammar = SequenceGrammar(compiled)
    reference = xgr.GrammarMatcher(compiled.result())
    rng = random.Random(seed)
    for _ in range(30):
        bitmask = grammar_bitmask([None, grammar])
        assert bitmask is not None
        allowed = unpack_token_bitmask(bitmask, len(TINY_VOCAB))
        assert allowed[0].all(), "a row without a grammar allows every token"
        accepted = set()
        for token in range(len(TINY_VOCAB)):
            trial = reference.fork()
            if trial.accept_token(token):
                accepted.add(token)
        assert set(allowed[1].nonzero().flatten().tolist()) == accepted
        assert accepted, "the walk never reaches a dead end"
        token = rng.choice(sorted(accepted))
        grammar.accept(token)
        assert reference.accept_token(token)
        if token == STOP:
            assert grammar.is_terminated
            break
        assert not grammar.is_terminated


def test_unpacking_masks_the_logits_as_xgrammar_does() -> None:
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    logits = torch.randn(3, 150)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=150)
    ours = logits.masked_fill(~unpack_token_bitmask(bitmask, 150), float("-inf"))
    assert torch.equal(ours, expected)


def test_a_choice_with_quotes_and_backslashes_matches_itself_only() -> None:
    choices = ['say "hi"', "back\\slash", "new\nline"]
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(xgr.TokenizerInfo(TINY_VOCAB)).compile_grammar(
            build_grammar(StructuredOutputsParams(choice=choices))
        )
    )
    for choice in choices:
        trial = matcher.fork()
        assert trial.accept_string(choice) and trial.is_completed()
    assert not matcher.fork().accept_string("say hi")


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('{"a": 1}', True),
        ('{"a":1,"b":["x y"]}', True),
        ('{ "a" : 1 , "b" : [ "x" ] }', True),
        ('{"a":  1}', False),
        ('{\n"a": 1}', False),
        ('{"a": 1}\t', False),
    ],
)
def test_a_whitespace_pattern_is_the_only_whitespace_between_json_tokens(
    text: str, accepted: bool
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["a"],
    }
    grammar = build_grammar(StructuredOutputsParams(json=schema, whitespace_pattern="[ ]?"))
    info = xgr.TokenizerInfo([chr(code) for code in range(32, 127)] + ["\n", "\t"])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    assert (matcher.accept_string(text) and matcher.is_completed()) is accepted


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"json_object": True, "whitespace_pattern": "( "},
            r"whitespace_pattern is not a valid regex for xgrammar: Regex parsing error",
        ),
        ({"json": {"type": "integr"}}, r"json is not valid for xgrammar: Unsupported type"),
        ({"regex": "a(b"}, r"regex is not valid for xgrammar: Regex parsing error at position 4"),
        ({"grammar": "root ::= foo"}, r'grammar is not valid for xgrammar: .*Rule "foo" is not'),
    ],
)
def test_invalid_constraints_fail_with_xgrammars_reason(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        build_grammar(StructuredOutputsParams(**fields))
    assert ".cc:" not in str(caught.value), "the native source location is dropped"


def test_each_constraint_compiles_once(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}))
    try:
        first = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
        again = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
        other = compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
        assert first is again and other is not first
        matcher = xgr.GrammarMatcher(first.result())
        assert matcher.accept_string("42") and matcher.accept_token(2) and matcher.is_terminated()
        other.result()
        assert compiler.num_compiled == 2 and compiler.compile_seconds > 0
    finally:
        compiler.shutdown()


def test_a_missing_xgrammar_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=re.escape('pip install "paged_llm[structured]"')):
        import_xgrammar()


def test_paged_llm_imports_and_validates_plain_requests_without_xgrammar() -> None:
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "from paged_llm import SamplingParams, StructuredOutputsParams\n"
        "SamplingParams(structured_outputs=StructuredOutputsParams(regex='a+'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
