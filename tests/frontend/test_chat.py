"""Chat conversations: one check for every entry point, content parts, and rendering with a
chat template into a prompt whose errors name the message at fault."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from paged_llm.exceptions import ConversationError
from paged_llm.frontend.chat import ChatRenderer, check_conversation, read_chat_template

TAG_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
PARTS_TEMPLATE = (
    "{% for m in messages %}{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}"
    "{% endfor %}"
)


@pytest.mark.parametrize(
    ("conversation", "message", "reason"),
    [
        ("hello", None, "must be a non-empty list of messages, got str"),
        ([], None, "must be a non-empty list of messages, got an empty list"),
        ([{"role": "user", "content": "hi"}, "hi"], 1, "must be a dict with 'role'"),
        ([{"role": 3, "content": "hi"}], 0, "'role' must be a str, got 3"),
        ([{"role": "user", "content": None}], 0, "'content' must be a str"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            0,
            "content part",
        ),
    ],
)
def test_a_malformed_conversation_names_the_message_at_fault(
    conversation: object, message: int | None, reason: str
) -> None:
    with pytest.raises(ConversationError) as caught:
        check_conversation(conversation)
    assert caught.value.message == message
    assert reason in caught.value.reason
    where = "" if message is None else f"message {message}: "
    assert str(caught.value) == where + caught.value.reason


def test_text_parts_are_joined_for_a_string_template_and_kept_for_one_that_loops(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    conversation = [{"role": "user", "content": ["one", {"type": "text", "text": "two"}]}]
    renderer = ChatRenderer(tokenizer, TAG_TEMPLATE)
    joined = renderer.render(conversation, add_generation_prompt=False)
    assert joined["prompt"] == "<<user:one\ntwo>>"
    assert (
        joined["prompt_token_ids"]
        == tokenizer(joined["prompt"], add_special_tokens=False)["input_ids"]
    )
    parts = renderer.render(conversation, PARTS_TEMPLATE, add_generation_prompt=False)
    assert parts["prompt"] == "[one][two]"
    forced = renderer.render(
        conversation, PARTS_TEMPLATE, False, chat_template_content_format="string"
    )
    # A string has no text parts: the template's loop finds none.
    assert forced["prompt"] == "[]" * len("one\ntwo")


def test_a_template_that_refuses_a_conversation_raises_a_conversation_error(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    renderer = ChatRenderer(tokenizer, "{{ raise_exception('no system messages') }}")
    with pytest.raises(ConversationError, match=r"could not render it: .*no system messages"):
        renderer.render([{"role": "system", "content": "hi"}])
    with pytest.raises(ValueError, match="chat_template_content_format must be"):
        renderer.render([{"role": "user", "content": "hi"}], chat_template_content_format="x")


def test_a_template_argument_is_its_text_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TAG_TEMPLATE)
    assert read_chat_template(str(path)) == TAG_TEMPLATE
    assert read_chat_template(TAG_TEMPLATE) == TAG_TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        read_chat_template(str(tmp_path / "missing.jinja"))
