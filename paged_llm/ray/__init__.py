"""Batch inference on Ray Data, past one machine, shaped like ``ray.data.llm``.

    import ray
    from paged_llm.ray import ProcessorConfig, build_processor

    config = ProcessorConfig(model_source="path/to/model", concurrency=4, batch_size=64)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(prompt=row["question"], sampling_params=dict(max_tokens=64)),
        postprocess=lambda row: dict(question=row["question"], answer=row["generated_text"]),
    )
    processor(ray.data.read_json("questions.jsonl")).write_json("answers/")

Ray is an optional extra (``pip install "paged_llm[ray]"``) and only this package imports it;
``import paged_llm`` never does. See docs/scaling.md ("Past one machine: Ray Data").
"""

try:
    import ray.data  # noqa: F401
except ImportError as error:
    raise ImportError(
        'paged_llm.ray needs Ray Data, an optional extra: pip install "paged_llm[ray]"'
    ) from error

from paged_llm.ray.processor import Processor, ProcessorConfig, build_processor

__all__ = ["Processor", "ProcessorConfig", "build_processor"]
