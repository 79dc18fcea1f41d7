"""Chat conversations: their checks, their content parts and their rendering with a chat
template, written once for `LLM.chat`, the JSONL job, OpenAI batch files and Ray Data.

A conversation is a list of ``{"role": str, "content": ...}`` messages whose content is a
str or a list of OpenAI-style text parts (``{"type": "text", "text": ...}``; a bare str
part is read as its text). A problem is a `ConversationError` naming the message at fault;
each entry point words where the conversation came from.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from paged_llm.exceptions import ConversationError
from paged_llm.inputs import TokensPrompt

CONTENT_FORMATS = ("auto", "string", "openai")


def check_conversation(conversation: object) -> list[dict[str, Any]]:
    """``conversation`` once checked: a non-empty list of messages, each a dict with a str
    ``role`` and a str (or text parts) ``content``. Raises `ConversationError`."""
    if not isinstance(conversation, list) or not conversation:
        raise ConversationError(
            f"must be a non-empty list of messages, got {_described(conversation)}."
        )
    for position, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ConversationError(
                f"must be a dict with 'role' and 'content', got {type(message).__name__}.",
                message=position,
            )
        if not isinstance(message.get("role"), str):
            raise ConversationError(
                f"'role' must be a str, got {message.get('role')!r}.", message=position
            )
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise ConversationError(
                f"'content' must be a str (or a list of content parts), got {content!r}; use "
                "'' for an empty message.",
                message=position,
            )
        if isinstance(content, list):
            _content_texts(position, content)
    return conversation


def _described(value: object) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _content_texts(position: int, parts: list[Any]) -> list[str]:
    """The texts of a message's content parts; other kinds of part are refused."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ConversationError(
                f"content part {part!r} is not supported: only text parts "
                f"({{'type': 'text', 'text': ...}}) are, the models here being text-only "
                f"(got type {kind!r}).",
                message=position,
            )
    return texts


def _with_content_format(
    conversation: list[dict[str, Any]], content_format: str
) -> list[dict[str, Any]]:
    """Messages with their content as the template expects it: one string ("string", text
    parts joined by newlines, as vLLM does) or a list of text parts ("openai")."""
    messages = []
    for position, message in enumerate(conversation):
        content = message["content"]
        texts = [content] if isinstance(content, str) else _content_texts(position, content)
        if content_format == "string":
            content = "\n".join(texts)
        else:
            content = [{"type": "text", "text": text} for text in texts]
        messages.append({**message, "content": content})
    return messages


@functools.lru_cache(maxsize=16)
def _loops_over_content(template: str) -> bool:
    """Whether a chat template iterates over a message's content (``for part in
    message['content']``), i.e. expects a list of parts."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        source = loop.iter
        if isinstance(source, jinja2.nodes.Getattr) and source.attr == "content":
            return True
        if (
            isinstance(source, jinja2.nodes.Getitem)
            and isinstance(source.arg, jinja2.nodes.Const)
            and source.arg.value == "content"
        ):
            return True
    return False


def read_chat_template(chat_template: str | Path | None) -> str | None:
    """The `LLM` argument ``chat_template``: a path is read from its file; any other string
    is the template itself."""
    if chat_template is None:
        return None
    path = Path(chat_template)
    # NOTE: a template's text can be too long to be a file name, which is no error.
    try:
        is_file = path.is_file()
    except OSError:
        is_file = False
    if is_file:
        return path.read_text()
    # As vLLM: a string with none of Jinja's characters was meant as a path.
    if isinstance(chat_template, Path) or not any(c in chat_template for c in "{}\n"):
        raise ValueError(
            f"LLM argument chat_template={str(chat_template)!r} looks like a file path, but "
            "there is no such file; pass the template's text or an existing file."
        )
    return chat_template


def check_content_format(content_format: str) -> None:
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            "chat_template_content_format must be 'auto', 'string' or 'openai', got "
            f"{content_format!r}."
        )


class ChatRenderer:
    """Renders conversations into prompts with a tokenizer's chat template, or the one
    given to the `LLM` (``default_template``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, default_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.default_template = default_template

    def render(
        self,
        conversation: object,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        *,
        tools: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> TokensPrompt:
        """One conversation as a prompt dict: the rendered text and its token ids.

        The template is ``chat_template``, else the default one, else the tokenizer's.
        Content given as a list of text parts reaches the template as one string (the
        parts joined by newlines) under ``chat_template_content_format`` "string", as the
        list of parts under "openai"; "auto" picks "openai" for a template that loops over
        a message's content, as vLLM does. The template writes the special tokens itself,
        so the text is tokenized without adding any. A malformed conversation, or one the
        template refuses, raises `ConversationError`.
        """
        check_content_format(chat_template_content_format)
        messages = check_conversation(conversation)
        template = chat_template or self.default_template
        content_format = chat_template_content_format
        if content_format == "auto":
            loops = _loops_over_content(template or self.tokenizer.chat_template or "")
            content_format = "openai" if loops else "string"
        try:
            text: str = self.tokenizer.apply_chat_template(  # type: ignore[assignment]
                _with_content_format(messages, content_format),
                chat_template=template,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except (jinja2.TemplateError, ValueError) as error:
            raise ConversationError(
                f"the chat template could not render it: {type(error).__name__}: {error}. "
                "Check its messages against what the template expects, or pass another "
                "chat_template."
            ) from error
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return TokensPrompt(prompt=text, prompt_token_ids=token_ids)
