"""`StructuredOutputsParams`: which grammar a completion must follow, with vLLM's fields.

A plain dataclass without the grammar library, so that `SamplingParams` carrying it pickles
to data-parallel replicas and ``import paged_llm`` works without the ``structured`` extra.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint fields, of which exactly one is set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrains a completion to a JSON schema, a regex, a list of choices or a grammar.

    Every field keeps the name and meaning of ``vllm.sampling_params.StructuredOutputsParams``.
    Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` and ``json_object`` is set.

    Args:
        json: A JSON schema (a dict, or its JSON text) the output must validate against.
        regex: A regular expression the whole output must match.
        choice: The output is exactly one of these strings.
        grammar: An EBNF grammar in xgrammar's syntax (GBNF-like, a ``root`` rule).
        json_object: True: any JSON object.
        disable_any_whitespace: JSON without free whitespace: items separated by ", " and
            keys by ": ", nothing else (a model cannot fill the output with blanks).
        disable_additional_properties: JSON objects may not have properties the schema does
            not list. With xgrammar (as in vLLM) this is always so: its strict mode treats
            every object without ``additionalProperties`` as closed, so the flag is accepted
            for compatibility and changes nothing.
        whitespace_pattern: JSON only: a regex for the whitespace allowed between JSON
            tokens (where free whitespace would be), e.g. ``"[ ]?"``; not together with
            ``disable_any_whitespace``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    @classmethod
    def from_response_format(cls, response_format: object) -> StructuredOutputsParams | None:
        """The constraint of an OpenAI ``response_format``: ``{"type": "json_schema",
        "json_schema": {"schema": {...}}}`` or ``{"type": "json_object"}``; None for
        ``{"type": "text"}`` (or None). Raises ValueError for anything else."""
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if response_format is None or kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            assert isinstance(response_format, dict)
            spec = response_format.get("json_schema")
            if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
                return cls(json=spec["schema"])
        raise ValueError(
            '\'response_format\' must be {"type": "json_schema", "json_schema": {"schema": '
            f'{{...}}}}}}, {{"type": "json_object"}} or {{"type": "text"}}, got {response_format!r}'
        )

    @property
    def kind(self) -> str:
        """The name of the constraint field that is set."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def verify(self) -> None:
        """Raise ValueError naming the field whose value is not allowed."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}, got "
                f"{'none' if not given else ' and '.join(given)}; "
                "pass one constraint per request."
            )
        _check(
            self.json is None or isinstance(self.json, (str, dict)),
            "json",
            self.json,
            "a JSON schema as a dict or a str",
        )
        if isinstance(self.json, str):
            _json_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value != ""),
                name,
                value,
                "a non-empty str",
            )
        _check(
            self.choice is None
            or (
                isinstance(self.choice, list)
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice)
            ),
            "choice",
            self.choice,
            "a non-empty list of non-empty strs",
        )
        _check(self.json_object in (None, True), "json_object", self.json_object, "True or None")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "a bool")
        if self.whitespace_pattern is not None:
            _check(
                isinstance(self.whitespace_pattern, str) and self.whitespace_pattern != "",
                "whitespace_pattern",
                self.whitespace_pattern,
                "a non-empty regex str or None",
            )
            _check(
                given[0] in ("json", "json_object") and not self.disable_any_whitespace,
                "whitespace_pattern",
                self.whitespace_pattern,
                "None unless json or json_object is set and disable_any_whitespace is False "
                "(it is the whitespace allowed between JSON tokens)",
            )

    def cache_key(self) -> str:
        """The same text for the same constraint: the key of its compiled grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, str) and self.kind == "json":
            # A schema given as text and the same schema as a dict share one grammar.
            value = _json_schema(value)
        return json.dumps(
            [self.kind, value, self.disable_any_whitespace, self.whitespace_pattern],
            sort_keys=True,
            ensure_ascii=False,
        )


def _json_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"StructuredOutputsParams.json is not valid JSON: {error}; pass the schema as a "
            "dict or as its JSON text."
        ) from None


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"StructuredOutputsParams.{name} must be {allowed}, got {value!r}.")
