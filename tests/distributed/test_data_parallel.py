"""Data parallelism: greedy parity with transformers at two replicas under every kind of
batching, sampled outputs that do not depend on the number of replicas, replicas that die
mid-generation, and no process left behind (the assignment of requests to replicas is
tested in tests/frontend/test_replica_assignment.py)."""

from __future__ import annotations

import functools
import gc
import io
import itertools
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tqdm import tqdm

from paged_llm import LLM, BeamSearchParams, RequestOutput, SamplingParams
from paged_llm.engine.core import EngineCore
from paged_llm.engine.request import EngineRequest
from paged_llm.frontend.data_parallel import DataParallelEngine
from paged_llm.frontend.replica_assignment import resolve_seed
from paged_llm.metrics import Counter
from tests.conftest import TINY_MODELS
from tests.distributed.processes import child_pids
from tests.models.test_parity import (
    MAX_TOKENS,
    SCENARIO_GROUPS,
    check_scenario,
    generate_greedy,
    group_settings,
)

# NOTE: this process's own engines and transformers' runs need one thread on a busy 2-core
# machine (see tests/test_cli.py); replicas take their own share.

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_MODEL_LEN = 256
# Far above the few seconds a generation of the parity prompts takes, far below a hang.
DEADLINE_S = 120


@pytest.fixture(scope="module")
def dp_llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, data_parallel_size=2) as llm:
        pids = set(llm.engine.replica_pids)
        yield llm
    assert not pids & child_pids()


def greedy_params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


# ----- seeds -----------------------------------------------------------------------------


def test_front_seeds_give_each_sequence_the_seed_a_single_engine_draws(
    llama_dir: Path,
) -> None:
    with LLM(llama_dir, max_model_len=64) as llm:
        engine = llm.engine
        assert isinstance(engine, EngineCore)
        params = SamplingParams(n=3, temperature=0.8)
        for attempt in range(3):
            # An unseeded arrival at a single engine ...
            serial = engine.get_metrics().num_requests
            alone = engine.add_request(EngineRequest(f"alone-{attempt}", None, [5, 6], params))
            # ... and the same arrival as the front resolves it for a replica, whose own
            # arrival count differs.
            resolved = resolve_seed(params, llm.config.seed, serial)
            replica = engine.add_request(
                EngineRequest(f"replica-{attempt}", None, [5, 6], resolved)
            )
            assert [s.seed for s in replica.seqs] == [s.seed for s in alone.seqs]
        engine.abort_all()
        seeded = SamplingParams(seed=42)
        assert resolve_seed(seeded, llm.config.seed, 7) is seeded


def test_sampled_tokens_do_not_depend_on_the_number_of_replicas(
    llama_dir: Path,
) -> None:
    prompts = [f"Story {i}: once upon a time, {'far away ' * i}" for i in range(9)] + [""]

    def sample(llm: LLM) -> list[list[list[list[int]]]]:
        """Two rounds (the arrival count carries over), unseeded and seeded, with n=2 and a
        rejected request (which draws no arrival number)."""
        rounds = []
        for seeds in ([None] * len(prompts), range(len(prompts)), [None] * len(prompts)):
            params = [
                SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=12, seed=seed)
                for seed in seeds
            ]
            outputs = llm.generate(prompts, params, use_tqdm=False, on_error="skip")
            assert outputs[-1].error is not None
            rounds.append([[c.token_ids for c in o.outputs] for o in outputs])
        return rounds

    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN) as single:
        expected = sample(single)
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, data_parallel_size=2) as llm:
        assert sample(llm) == expected
    # The rounds differ from each other: the seeds were really drawn.
    assert expected[0] != expected[1] != expected[2]


# ----- parity ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "group"),
    # Llama in the default run; every other architecture (8 s each: two replica processes)
    # in the slow one.
    [
        pytest.param(arch, group, marks=() if arch == "llama" else pytest.mark.slow)
        for arch in TINY_MODELS
        for group in list(SCENARIO_GROUPS)[:2]
    ]
    + [("llama", "prefix-hits")],
)
def test_greedy_matches_transformers_with_two_replicas(
    arch: str,
    group: str,
    tiny_model_dir: Callable[[str], Path],
    references: Callable[[str, bool], tuple[list[list[int]], list[list[int]]]],
) -> None:
    settings, shared_prefix = group_settings(tiny_model_dir(arch), group)
    prompts, expected = references(arch, shared_prefix)
    with LLM(tiny_model_dir(arch), data_parallel_size=2, **settings) as llm:
        outputs, metrics = generate_greedy(llm, prompts)
    for scenario in SCENARIO_GROUPS[group]:
        check_scenario(scenario, outputs, metrics, expected)


# ----- the front -------------------------------------------------------------------------


def test_stream_progress_metrics_and_a_second_generation(dp_llm: LLM) -> None:
    lengths = [9, 1, 5, 3, 7, 2]
    prompts = [{"prompt_token_ids": [300 + i, 301, 302]} for i in range(len(lengths))]
    captured = io.StringIO()

    def progress_bar(**kwargs: object) -> tqdm:
        return tqdm(**kwargs, file=captured, mininterval=0)

    before = dp_llm.get_engine_metrics()
    stream = dp_llm.generate_stream(prompts, greedy_params(lengths), use_tqdm=progress_bar)
    iterator = iter(stream)
    streamed = [next(iterator)]
    with pytest.raises(RuntimeError, match="Another generation is still running"):
        next(iter(dp_llm.generate_stream(["x"])))
    streamed += list(iterator)
    assert sorted(index for index, _ in streamed) == list(range(len(prompts)))
    for index, output in streamed:
        assert len(output.outputs[0].token_ids) == lengths[index]
    assert f"{len(prompts)}/{len(prompts)}" in captured.getvalue()
    run = dp_llm.get_engine_metrics().since(before)
    assert run.num_requests == len(prompts)
    assert run.num_generated_tokens == sum(lengths)
    assert run.num_prompt_tokens == 3 * len(prompts)


def test_get_metrics_gives_one_series_per_replica(dp_llm: LLM) -> None:
    """vLLM's metrics of each replica, labelled with its rank, add up to the run's tokens."""

    def totals(name: str, reason: str | None = None) -> dict[str, int]:
        return {
            metric.labels["engine"]: metric.value
            for metric in dp_llm.get_metrics()
            if isinstance(metric, Counter)
            and metric.name == name
            and metric.labels.get("finished_reason") == reason
        }

    before = [totals("vllm:prompt_tokens"), totals("vllm:request_success", "length")]
    prompts = [{"prompt_token_ids": [700 + 10 * i + j for j in range(5)]} for i in range(6)]
    dp_llm.generate(prompts, greedy_params([3] * len(prompts)), use_tqdm=False)
    after = [totals("vllm:prompt_tokens"), totals("vllm:request_success", "length")]
    assert [sorted(counts) for counts in after] == [["0", "1"], ["0", "1"]]
    assert sum(after[0].values()) - sum(before[0].values()) == 5 * len(prompts)
    assert sum(after[1].values()) - sum(before[1].values()) == len(prompts)
    metrics = dp_llm.get_metrics()
    names = [metric.name for metric in metrics]
    # Grouped by name, the replicas in rank order within each name.
    assert [metric.labels["engine"] for metric in metrics] == ["0", "1"] * (len(metrics) // 2)
    assert len([name for name, _ in itertools.groupby(names)]) == len(set(names))
    model_name = dp_llm.llm_engine.model_config.served_model_name
    assert {metric.labels["model_name"] for metric in metrics} == {model_name}


def test_beam_search_matches_one_replica(dp_llm: LLM, llama_dir: Path) -> None:
    prompts = [{"prompt_token_ids": [500 + i, 501, 502]} for i in range(4)]
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN) as single:
        expected = single.beam_search(prompts, params)
    outputs = dp_llm.beam_search(prompts, params)
    for output, reference in zip(outputs, expected, strict=True):
        assert [(s.tokens, s.text, s.finish_reason) for s in output.sequences] == [
            (s.tokens, s.text, s.finish_reason) for s in reference.sequences
        ]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(
            [s.cum_logprob for s in reference.sequences], abs=1e-4
        )


def test_leaving_a_stream_early_cancels_the_rest(dp_llm: LLM) -> None:
    prompts = [{"prompt_token_ids": [400 + i] * 20} for i in range(6)]
    stream = dp_llm.generate_stream(prompts, greedy_params([30] * 6))
    for _ in stream:
        break
    stream.close()
    assert not dp_llm.engine.has_unfinished()
    (output,) = dp_llm.generate("still works", greedy_params([4]), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_a_replica_that_cannot_start_raises_its_error(
    llama_dir: Path,
) -> None:
    # 512 bytes per token of the tiny llama: room for 40 tokens, less than max_model_len.
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        LLM(
            llama_dir,
            max_model_len=128,
            kv_cache_memory_bytes=512 * 40,
            data_parallel_size=2,
        )


def test_garbage_collection_ends_the_replicas(llama_dir: Path) -> None:
    llm = LLM(llama_dir, max_model_len=64, data_parallel_size=2)
    pids = set(llm.engine.replica_pids)
    assert pids <= child_pids()
    del llm
    gc.collect()
    assert not pids & child_pids()


# ----- replicas that die -----------------------------------------------------------------


def test_a_killed_replica_s_requests_finish_on_the_others_until_none_is_left(
    llama_dir: Path,
    references: Callable[[str, bool], tuple[list[list[int]], list[list[int]]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts, expected = references("llama", False)
    requests = [{"prompt_token_ids": p} for p in prompts]

    def generate_killing(llm: LLM, victim: int, on_error: str) -> dict[int, RequestOutput]:
        """Stream a generation, SIGKILLing replica ``victim`` once the first result is in."""
        started = time.monotonic()
        results: dict[int, RequestOutput] = {}
        for index, output in llm.generate_stream(
            requests, greedy_params(MAX_TOKENS), on_error=on_error
        ):
            if not results:
                os.kill(llm.engine.replica_pids[victim], signal.SIGKILL)
            assert index not in results
            results[index] = output
        assert time.monotonic() - started < DEADLINE_S
        assert sorted(results) == list(range(len(prompts)))
        return results

    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN, data_parallel_size=2) as llm:
        results = generate_killing(llm, victim=0, on_error="raise")
        assert [results[i].outputs[0].token_ids for i in range(len(prompts))] == expected
        assert re.search(
            r"replica 0 ended \(killed by signal SIGKILL\); [1-9]\d* unfinished", caplog.text
        )
        assert llm.engine.num_live_replicas == 1

        # The last replica dies: under on_error="skip" what it had not finished comes back
        # as errors naming every replica lost; a new generation raises.
        results = generate_killing(llm, victim=1, on_error="skip")
        errors = [o.error for o in results.values() if o.error is not None]
        assert errors
        for error in errors:
            assert "replica 0 (killed by signal SIGKILL)" in error
            assert "replica 1 (killed by signal SIGKILL)" in error
        for index, output in results.items():
            if output.error is None:
                assert output.outputs[0].token_ids == expected[index]
        with pytest.raises(RuntimeError, match=r"no data-parallel replica is left.*SIGKILL"):
            llm.generate("anyone?", use_tqdm=False)


def _engine_that_fails_once(model_dir: Path, claim: Path) -> EngineCore:
    """A replica engine whose step, once it has finished something, raises in the first
    process to claim the file ``claim``."""
    engine = LLM(model_dir, max_model_len=MAX_MODEL_LEN).engine
    assert isinstance(engine, EngineCore)
    step = engine.step

    def failing_step() -> list[RequestOutput]:
        finished = step()
        if finished:
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return finished
            raise RuntimeError("injected failure")
        return finished

    engine.step = failing_step  # type: ignore[method-assign]
    return engine


def test_a_replica_that_raises_is_named_and_its_requests_rerun(
    llama_dir: Path,
    references: Callable[[str, bool], tuple[list[list[int]], list[list[int]]]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompts, expected = references("llama", False)
    engine = DataParallelEngine(
        functools.partial(_engine_that_fails_once, llama_dir, tmp_path / "claim"),
        num_replicas=2,
        seed=0,
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
    )
    try:
        for index, (prompt, params) in enumerate(
            zip(prompts, greedy_params(MAX_TOKENS), strict=True)
        ):
            engine.add_request(EngineRequest(str(index), None, prompt, params))
        results: dict[int, RequestOutput] = {}
        with caplog.at_level(logging.WARNING):
            while engine.has_unfinished():
                for output in engine.step():
                    assert int(output.request_id) not in results
                    results[int(output.request_id)] = output
        assert engine.num_live_replicas == 1
    finally:
        engine.shutdown()
    assert [results[i].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert re.search(
        r"replica \d ended \(exit code 1 after RuntimeError: injected failure\); [1-9]\d* "
        r"unfinished",
        caplog.text,
    )


@pytest.mark.slow
def test_structured_outputs_compile_in_the_replicas_and_match_one_process(
    dp_llm: LLM, llama_dir: Path
) -> None:
    from tests.test_structured_outputs import CONSTRAINTS

    chosen = CONSTRAINTS[::4]
    prompts = [f"Record {i}:" for i in range(len(chosen))]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=32, structured_outputs=c)
        for i, (c, _) in enumerate(chosen)
    ]
    with LLM(llama_dir, max_model_len=MAX_MODEL_LEN) as single:
        expected = single.generate(prompts, params, use_tqdm=False)
    outputs = dp_llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    for output, (_, check) in zip(outputs, chosen, strict=True):
        assert all(check(c.text) for c in output.outputs if c.finish_reason == "stop")


def test_the_llm_engine_loop_aborts_and_resets_the_prefix_cache_in_every_replica(
    dp_llm: LLM,
) -> None:
    engine = dp_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {name: f"Tell me all about {name}, please. " * 4 for name in ("kept", "dropped")}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    engine.abort_request("dropped")
    reported = []
    while engine.has_unfinished_requests():
        reported += engine.step()
    # The default output kind (CUMULATIVE) reports every token from the replica's steps.
    assert [output.request_id for output in reported] == ["kept"] * 4
    assert [len(output.outputs[0].token_ids) for output in reported] == [1, 2, 3, 4]
    assert [output.finished for output in reported] == [False, False, False, True]
    # Both replicas run the prompt now, so each caches it.
    repeats = dp_llm.generate([prompts["kept"]] * 4, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in repeats] == [reported[-1].outputs[0].token_ids] * 4
    assert dp_llm.generate(prompts["kept"], params, use_tqdm=False)[0].num_cached_tokens > 0
    assert dp_llm.reset_prefix_cache() is True
    again = dp_llm.generate(prompts["kept"], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
