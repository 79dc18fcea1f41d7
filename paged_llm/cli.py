"""The `paged-llm` command line: argparse and `main`; the jobs themselves are `paged_llm.jobs`.

    paged-llm generate --input prompts.jsonl --output completions.jsonl [--resume]
    paged-llm embed --input texts.jsonl --output vectors.jsonl [--output-format npy] [--resume]
    paged-llm classify --input texts.jsonl --output probs.jsonl [--resume]
    paged-llm run-batch -i requests.jsonl -o results.jsonl [--runner pooling] [--resume]
    paged-llm eval --model PATH --tasks ... (lm-evaluation-harness, the [eval] extra)

``generate`` completes a JSONL file of ``{"id", "prompt" | "messages" | "prompt_token_ids"}``
rows (`paged_llm.jobs.rows`); ``embed`` and ``classify`` write each row's embedding or class
probabilities with a pooling model (``--runner pooling`` implied; `paged_llm.jobs.pooling`);
``run-batch`` runs an OpenAI Batch API file (`paged_llm.jobs.openai_batch`; ``/v1/embeddings``
lines under ``--runner pooling``). All append each result as it finishes and flush it to
disk, hold ``<output>.lock`` while they run, and with ``--resume`` repair a torn last line
and run only the ids not yet written (`paged_llm.jobs.output`); a symlinked ``--output`` is
followed to its file (`paged_llm.jobs.runner.run_job`). Every `EngineArgs` field is a flag
of both (`EngineArgs.add_cli_args`), and the parser reads vLLM's spellings
(`FlexibleArgumentParser`). LoRA adapters are registered by name, ``--lora NAME=PATH``
(``--lora-modules``, vLLM's spelling, in ``run-batch``): a row's ``"lora"`` or a batch body's
``"model"`` selects one (`paged_llm.jobs.lora_modules`). Exit codes: 0 done, 1 an error of the
model or its settings, 2 a problem with the input or output files or a usage error, 130
interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paged_llm.engine_args import EngineArgs
from paged_llm.jobs.lora_modules import LoRAModules
from paged_llm.jobs.requests import GENERATE, POOLING_JOB_TASKS
from paged_llm.jobs.rows import JobError
from paged_llm.jobs.runner import (
    DEFAULT_MAX_TOKENS,
    JobSpec,
    run_batch_job,
    run_generate_job,
    run_pooling_job,
)
from paged_llm.settings import FlexibleArgumentParser

# The cluster flags of `paged-llm generate`, by their ProcessorConfig field.
_CLUSTER_FLAGS = ("concurrency", "batch_size", "num_cpus_per_actor", "num_gpus_per_actor")

# Each EngineArgs field is a flag: a usage line listing them all would hide the job's own.
_USAGE = "%(prog)s --input FILE --output FILE [--resume] [flags below]"

# The help of --seed (EngineArgs.seed) in a job, where it is also the base of the rows' seeds.
_SEED_HELP = (
    "The LLM's seed, and the base of every row's: a row (a batch request) without a seed of "
    "its own samples with one derived from this and its id, so reruns and resumed runs write "
    "the same rows. A job needs an integer."
)


def build_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(
        prog="paged-llm", description="Offline batch inference with paged_llm."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="complete every row of a JSONL file",
        usage=_USAGE,
        description=(
            "Complete every row of a JSONL file of {id, prompt} or {id, messages} objects. "
            "Rows are appended to the output as they finish; after a crash, rerun with "
            "--resume to finish the job."
        ),
    )
    _add_file_options(gen, "input JSONL", "output JSONL")
    sampling = gen.add_argument_group(
        "sampling (see SamplingParams; unset flags keep the model's generation_config values)"
    )
    sampling.add_argument("--n", type=int, help="completions per row")
    sampling.add_argument("--temperature", type=float, help="0 means greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float)
    sampling.add_argument("--presence-penalty", type=float)
    sampling.add_argument("--frequency-penalty", type=float)
    sampling.add_argument(
        "--max-tokens",
        type=int,
        help=f"most tokens per completion (default: the model's, else {DEFAULT_MAX_TOKENS})",
    )
    sampling.add_argument("--min-tokens", type=int)
    sampling.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop string (repeatable)"
    )
    sampling.add_argument(
        "--ignore-eos", action="store_true", default=None, help="generate past EOS"
    )
    _add_lora_options(
        gen,
        ("--lora", "--lora-modules"),
        'register a LoRA adapter (a PEFT folder) under NAME, for the rows whose "lora" names '
        "it (rows without one run on the base model)",
    )
    _add_cluster_options(gen)
    _add_output_options(gen)
    _add_engine_options(gen)

    for task, what in (("embed", "embedding"), ("classify", "class probabilities")):
        pool = commands.add_parser(
            task,
            help=f"write the {what} of every row of a JSONL file (a pooling model)",
            usage=_USAGE,
            description=(
                f"Write the {what} of every row of a JSONL file of {{id, prompt}} or {{id, "
                "prompt_token_ids}} objects (optionally 'dimensions' and 'lora'), with the "
                "model as a pooling model (--runner pooling is implied; --convert and "
                f'--pooler-config apply). Output rows are {{id, "{POOLING_JOB_TASKS[task]}": '
                "[...], prompt_tokens}, appended as they finish; after a crash, rerun with "
                "--resume to finish the job."
            ),
        )
        _add_file_options(pool, "input JSONL", "output JSONL (or .npy: --output-format)")
        pool.add_argument_group("output").add_argument(
            "--output-format",
            choices=("jsonl", "npy"),
            default="jsonl",
            help="jsonl: a row per line as it finishes; npy: OUTPUT is a float32 .npy, one row "
            "per input row in input order (NaN for a row that failed), with the ids in "
            "OUTPUT.ids.jsonl, written when every row is done; the rows go to "
            "OUTPUT.rows.jsonl meanwhile, which --resume continues",
        )
        _add_lora_options(
            pool,
            ("--lora", "--lora-modules"),
            'register a LoRA adapter (a PEFT folder) under NAME, for the rows whose "lora" '
            "names it (rows without one run on the base model)",
        )
        _add_output_options(pool)
        _add_engine_options(pool)

    batch = commands.add_parser(
        "run-batch",
        help="run an OpenAI Batch API file (as vllm run-batch)",
        usage=_USAGE,
        description=(
            "Run every request of an OpenAI Batch API input file ({custom_id, method, url, "
            "body} lines for /v1/chat/completions or /v1/completions, or with --runner "
            "pooling for /v1/embeddings) and write OpenAI's batch output lines. Each body "
            "sets its own sampling; lines that cannot run (a url the model does not serve "
            "among them) get a status 400 line. Results are appended as they finish; after a "
            "crash, rerun with --resume to finish the job."
        ),
    )
    _add_file_options(batch, "batch input JSONL", "batch output JSONL")
    _add_lora_options(
        batch,
        ("--lora-modules", "--lora"),
        'serve a LoRA adapter (a PEFT folder) as the model NAME: a body whose "model" is NAME '
        "runs under it, one whose model is the served model's name (or that has none) on the "
        "base model, as vllm serve --lora-modules",
    )
    _add_output_options(batch)
    _add_engine_options(batch)

    # NOTE: main hands `eval` to lm-eval's own parser before this one runs; it is listed
    # here for --help.
    commands.add_parser(
        "eval",
        help="run lm-evaluation-harness tasks on a model (needs the [eval] extra)",
        description="paged-llm eval --model PATH --tasks ... [lm-eval's flags]",
        add_help=False,
    )
    return parser


def _add_file_options(parser: argparse.ArgumentParser, input_help: str, output_help: str) -> None:
    files = parser.add_argument_group("files")
    # --input-file / --output-file: vllm run-batch's spelling.
    files.add_argument("--input", "--input-file", "-i", type=Path, required=True, help=input_help)
    files.add_argument(
        "--output", "--output-file", "-o", type=Path, required=True, help=output_help
    )
    files.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing output: skip what it holds, repair a torn last line",
    )


def _add_lora_options(
    parser: argparse.ArgumentParser, flags: tuple[str, str], help_text: str
) -> None:
    # NOTE: one or more values per flag (vllm serve's --lora-modules A=X B=Y) and the flag
    # repeatable (--lora A=X --lora B=Y) alike; errors about the adapters name flags[0].
    parser.set_defaults(lora_flag=flags[0])
    parser.add_argument_group("LoRA adapters").add_argument(
        *flags,
        dest="lora_modules",
        nargs="+",
        action=_LoRAModulesAction,
        type=_lora_module,
        metavar="NAME=PATH",
        help=f"{help_text}. Repeatable; turns on --enable-lora; ids 1, 2, ... in the order "
        "given (--max-loras adapters run at a time, each of rank <= --max-lora-rank).",
    )


def _lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path), the form of --lora and --lora-modules."""
    name, equals, path = value.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH (the adapter's name, '=', its PEFT folder), got {value!r}"
        )
    return name, path


class _LoRAModulesAction(argparse.Action):
    """Collects ``NAME=PATH`` values into one name -> path dict, in the order given, and
    refuses a name given twice."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list)  # nargs="+": the (name, path) of each NAME=PATH
        modules: dict[str, str] = dict(getattr(namespace, self.dest) or {})
        for name, path in values:
            if name in modules:
                raise argparse.ArgumentError(
                    self,
                    f"adapter name {name!r} is given twice ({modules[name]!r} and {path!r}); "
                    "give each adapter its own name",
                )
            modules[name] = path
        setattr(namespace, self.dest, modules)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    # NOTE: last, so that the job's own groups come first in --help.
    EngineArgs.add_cli_args(parser, help_texts={"seed": _SEED_HELP})


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    # NOTE: unset flags stay None, so that ProcessorConfig keeps its own defaults.
    cluster = parser.add_argument_group(
        "cluster (Ray Data, needs the [ray] extra; see ProcessorConfig in docs/scaling.md)"
    )
    cluster.add_argument(
        "--ray-address",
        help="run on this Ray cluster ('auto': the one `ray start` began on this node); "
        "--input is then JSONL or Parquet (.parquet), --output a folder of JSONL files, one "
        "per Ray Data write task",
    )
    cluster.add_argument("--concurrency", type=int, help="engine actors (default: 1)")
    cluster.add_argument("--batch-size", type=int, help="rows per actor call (default: 64)")
    cluster.add_argument("--num-cpus-per-actor", type=float, help="default: 1")
    cluster.add_argument("--num-gpus-per-actor", type=float, help="default: 0")


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--verbose", "-v", action="store_true", help="log engine details")


_SAMPLING_FLAGS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "ignore_eos",
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:
        return _eval(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.input.resolve() == args.output.resolve():
            raise JobError("--input and --output are the same file.")
        if not args.input.is_file():
            raise JobError(f"input file {args.input} does not exist.")
        spec = _job_spec(args)
        if args.command == "run-batch":
            return run_batch_job(spec)
        if args.command in POOLING_JOB_TASKS:
            return run_pooling_job(spec)
        if args.ray_address is not None:
            # NOTE: imported only here: Ray is an optional extra.
            from paged_llm.ray.generate_job import run_on_cluster

            cluster = {
                name: value for name in _CLUSTER_FLAGS if (value := getattr(args, name)) is not None
            }
            return run_on_cluster(spec, args.ray_address, cluster, log_to_driver=args.verbose)
        return run_generate_job(spec)
    except JobError as error:
        print(f"paged-llm: error: {error}", file=sys.stderr)
        return 2
    except (OSError, ImportError, ValueError) as error:
        print(f"paged-llm: error: {error}", file=sys.stderr)
        return 1


def _job_spec(args: argparse.Namespace) -> JobSpec:
    """The job the flags describe; unset sampling flags keep the model's defaults. Its
    engine arguments are those that differ from `LLM`'s defaults."""
    sampling: dict[str, Any] = {}
    if args.command == "generate":
        sampling = {
            name: value for name in _SAMPLING_FLAGS if (value := getattr(args, name)) is not None
        }
    engine = EngineArgs.from_cli_args(args)
    if engine.seed is None:
        raise ValueError(f"--seed None is not for a job: {_SEED_HELP}")
    engine_kwargs = engine.to_kwargs(changed_only=True)
    engine_kwargs.pop("model", None)
    engine_kwargs.pop("seed", None)
    return JobSpec(
        input=args.input,
        output=args.output,
        model=str(engine.model),
        engine_kwargs=engine_kwargs,
        seed=engine.seed,
        resume=args.resume,
        progress=not args.no_progress,
        sampling=sampling,
        lora_modules=LoRAModules(args.lora_modules or {}, f"{args.lora_flag} NAME=PATH"),
        task=args.command if args.command in POOLING_JOB_TASKS else GENERATE,
        output_format=getattr(args, "output_format", "jsonl"),
    )


def _eval(argv: list[str]) -> int:
    """``paged-llm eval``: lm-eval's command line with our model registered; lm-eval is an
    optional extra, imported only here."""
    try:
        from paged_llm.integrations import lm_eval
    except ImportError as error:
        print(f"paged-llm: error: {error}", file=sys.stderr)
        return 1
    return lm_eval.main(argv)
