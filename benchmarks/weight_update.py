"""Weights inside a training loop: `LLM.update_weights` against a plain ``state_dict``
copy of the same tensors (in-process, and over gloo from a trainer process), and the loop's
rollouts: paged_llm's sampled ``generate`` against transformers' ``generate`` doing the
same rollouts, in one run.

The trainer's model is transformers' model of the same weights; every timing is the median
of ``--repeats`` rounds. The plain copy is ``load_state_dict`` into a second transformers
model: the least an update can cost, with no engine formats (packed projections, oneDNN's
weight layout) to fill.

Run from the repository root:
    python -m benchmarks.weight_update
    python -m benchmarks.weight_update --random-weights-config qwen3-0.6b --num-prompts 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    benchmark_model_dir,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, machine_line, write_json
from benchmarks.workloads import RANDOM_TOKEN_ID_LIMIT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="rollouts per prompt (n)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    resolve_device_arguments(args)
    if args.device != "cpu":
        parser.error("the weight-update benchmark runs on the CPU only")
    return args


def median_seconds(action: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _trainer(model_dir: str, port: int, repeats: int, infos: Any) -> None:
    """The trainer's process: sends the model's weights ``repeats`` times over gloo."""
    from paged_llm.distributed.weight_transfer import (
        TrainerWeightSender,
        WeightTransferUpdateInfo,
    )

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = list(model.named_parameters())
    sender = TrainerWeightSender({"master_port": port})
    for _ in range(repeats):
        infos.put(WeightTransferUpdateInfo.describing(pairs))
        sender.send_weights(pairs)


def _time_in_process(llm: Any, model_dir: Path, repeats: int) -> tuple[float, float, float]:
    """Seconds of a plain copy and of an in-process update, and the weights' MiB."""
    trainer_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    )
    target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = trainer_model.state_dict()
    copy_seconds = median_seconds(lambda: target.load_state_dict(state), repeats)
    update_seconds = median_seconds(
        lambda: llm.update_weights(trainer_model.named_parameters()), repeats
    )
    mib = sum(p.numel() * p.element_size() for p in trainer_model.parameters()) / 2**20
    return copy_seconds, update_seconds, mib


def time_updates(llm: Any, model_dir: Path, repeats: int) -> dict[str, float]:
    """Seconds of a plain copy, an in-process update and a gloo round, and the weights' MiB."""
    from paged_llm.distributed.ports import get_open_port

    copy_seconds, update_seconds, mib = _time_in_process(llm, model_dir, repeats)

    context = multiprocessing.get_context("spawn")
    infos = context.Queue()
    port = get_open_port()
    trainer = context.Process(target=_trainer, args=(str(model_dir), port, repeats, infos))
    trainer.start()
    llm.init_weight_transfer_engine({"master_port": port})

    def gloo_round() -> None:
        info = infos.get(timeout=300)
        llm.start_weight_update()
        llm.update_weights(info)
        llm.finish_weight_update()

    gloo_round()  # the first round includes the trainer's start-up: untimed
    gloo_seconds = median_seconds(gloo_round, repeats - 1)
    trainer.join(timeout=60)
    return {
        "weight_mib": mib,
        "state_dict_copy_s": copy_seconds,
        "update_weights_s": update_seconds,
        "gloo_round_s": gloo_seconds,
    }


def time_rollouts(llm: Any, model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Output tokens per second of the same sampled rollouts, paged_llm and transformers."""
    from paged_llm import SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        RANDOM_TOKEN_ID_LIMIT, (args.num_prompts, args.prompt_len), generator=generator
    )
    params = SamplingParams(
        n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0
    )
    inputs = [{"prompt_token_ids": p.tolist()} for p in prompts]
    llm.generate(inputs[:2], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    paged_seconds = time.perf_counter() - started

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            num_return_sequences=args.samples,
            max_new_tokens=args.max_tokens,
            min_new_tokens=args.max_tokens,
            pad_token_id=0,
        )
    hf_seconds = time.perf_counter() - started
    tokens = args.num_prompts * args.samples * args.max_tokens
    return {
        "rollout_tokens": tokens,
        "paged_llm_tok_s": tokens / paged_seconds,
        "transformers_tok_s": tokens / hf_seconds,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from paged_llm import LLM

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device, args.threads)
    with (
        benchmark_model_dir(args) as model_dir,
        LLM(model_dir, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens) as llm,
    ):
        updates = time_updates(llm, model_dir, args.repeats)
        rollouts = time_rollouts(llm, model_dir, args)
    print(machine_line(machine, args.device, args.dtype))
    print(f"Weights: {updates['weight_mib']:,.0f} MiB (float32); median of {args.repeats}\n")
    copy = updates["state_dict_copy_s"]
    update_rows = [
        ["state_dict copy (transformers)", copy],
        ["LLM.update_weights, in process", updates["update_weights_s"]],
        ["gloo round from a trainer process", updates["gloo_round_s"]],
    ]
    print(
        format_table(
            ["weights", "seconds", "x state_dict copy"],
            [[name, seconds, seconds / copy] for name, seconds in update_rows],
        )
    )
    print(
        f"\nRollouts: {args.num_prompts} prompts of {args.prompt_len} tokens, n={args.samples}, "
        f"{args.max_tokens} tokens each, sampled\n"
    )
    hf_tok_s = rollouts["transformers_tok_s"]
    rollout_rows = [
        ["paged_llm generate", rollouts["paged_llm_tok_s"]],
        ["transformers generate", hf_tok_s],
    ]
    print(
        format_table(
            ["rollouts", "output tok/s", "x transformers"],
            [[name, tok_s, tok_s / hf_tok_s] for name, tok_s in rollout_rows],
        )
    )
    result = {
        "benchmark": "weight_update",
        "machine": machine,
        "args": vars(args),
        **updates,
        **rollouts,
    }
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
