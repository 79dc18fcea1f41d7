"""The LoRA adapters a job registers by name, and the one each of its requests selects.

Every entry point registers adapters the same way, by name -> path: ``paged-llm generate
--lora NAME=PATH``, ``paged-llm run-batch --lora-modules NAME=PATH`` (``vllm serve``'s
flag), a Ray `ProcessorConfig`'s ``lora_modules``. A request then names one: a row's
``"lora"``, a batch body's ``"model"``. Ids are 1, 2, ... in the order of registration, so
that every actor of a cluster and every run of a resumed job gives an adapter the same id
(the engine keys an adapter's slot and its prefix cache by id).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from paged_llm.exceptions import RequestError
from paged_llm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModules:
    """A job's adapters: ``paths`` maps each name to its adapter folder (PEFT's format), in
    the order the ids follow; ``registered_with`` says how a user registers one (the flag or
    field), for the errors that name it."""

    paths: dict[str, str] = field(default_factory=dict)
    registered_with: str = "--lora NAME=PATH"

    def __post_init__(self) -> None:
        if not isinstance(self.paths, Mapping):
            raise ValueError(
                f"{self.registered_with} must map adapter names to paths, got "
                f"{type(self.paths).__name__}."
            )
        for name, path in self.paths.items():
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"{self.registered_with}: an adapter name must be a non-empty string, got "
                    f"{name!r}."
                )
            if not isinstance(path, str) or not path:
                raise ValueError(
                    f"{self.registered_with}: the path of adapter {name!r} must be a non-empty "
                    f"string (its PEFT folder), got {path!r}."
                )

    def requests(self) -> dict[str, LoRARequest]:
        """Each adapter's `LoRARequest`, by name; ids 1, 2, ... in registration order."""
        return {
            name: LoRARequest(name, lora_id, path)
            for lora_id, (name, path) in enumerate(self.paths.items(), start=1)
        }

    def select(
        self, name: object, field_name: str, base_names: Collection[str] = ()
    ) -> LoRARequest | None:
        """The adapter a request names in its field ``field_name`` (None: the base model, as
        is a name in ``base_names``). A `RequestError` names the field, the value, the names
        registered and how to register one."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise RequestError(
                f"'{field_name}' must be a string (the name of a LoRA adapter), got {name!r}",
                parameter=field_name,
                value=name,
            )
        if name in base_names:
            return None
        request = self.requests().get(name)
        if request is None:
            registered = ", ".join(map(repr, self.paths)) or "none"
            what = "not a registered LoRA adapter"
            if base_names:
                served = ", ".join(map(repr, base_names))
                what = f"neither the served model ({served}) nor a registered LoRA adapter"
            raise RequestError(
                f"'{field_name}' names {name!r}, which is {what} (registered: {registered}); "
                f"register it with {self.registered_with}",
                parameter=field_name,
                value=name,
            )
        return request

    def llm_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """`LLM` keyword arguments ``kwargs``, with ``enable_lora`` on where adapters are
        registered."""
        if not self.paths:
            return dict(kwargs)
        if kwargs.get("enable_lora") is False:
            raise ValueError(
                f"enable_lora=False, but adapters are registered with {self.registered_with} "
                f"({', '.join(map(repr, self.paths))}); leave enable_lora out (the adapters turn "
                "it on) or register none."
            )
        return {**kwargs, "enable_lora": True}
