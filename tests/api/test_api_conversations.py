"""OpenAI's Conversations API (api.conversations) against a live stack, driven by the official
`openai` client: a response run on a conversation reads its items as the chat before its input
(the oracle: the same chat sent to /v1/chat/completions, token for token) and adds its turn;
items are listed in pages, read and deleted; the conversation is updated and deleted."""

from __future__ import annotations

import openai
import pytest

GREEDY = {"temperature": 0.0, "max_output_tokens": 6, "extra_body": {"ignore_eos": True}}


def as_chat(oai: openai.OpenAI, model: str, messages: list[dict]) -> tuple[str, int]:
    reply = oai.chat.completions.create(model=model, messages=messages, temperature=0.0, max_tokens=6,
                                        extra_body={"ignore_eos": True})
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def test_responses_run_on_a_conversation_and_add_their_turns(oai: openai.OpenAI, served_model: str) -> None:
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                    metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    first = oai.responses.create(model=served_model, conversation=conv.id, input="What is my name?", **GREEDY)
    assert first.conversation.id == conv.id
    chat = [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "What is my name?"}]
    assert (first.output_text, first.usage.input_tokens) == as_chat(oai, served_model, chat)

    items = oai.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[1].content[0].text == "What is my name?" and items[2].id == first.output[0].id
    assert items[2].content[0].text == first.output_text

    second = oai.responses.create(model=served_model, conversation={"id": conv.id}, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And again?"}]}], **GREEDY)
    chat += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And again?"}]
    assert (second.output_text, second.usage.input_tokens) == as_chat(oai, served_model, chat)
    assert len(oai.conversations.items.list(conv.id).data) == 5


def test_items_are_paged_read_and_deleted(oai: openai.OpenAI) -> None:
    conv = oai.conversations.create(items=[{"role": "user", "content": f"item {i}"} for i in range(3)])
    added = oai.conversations.items.create(conv.id, items=[{"type": "message", "role": "assistant", "content": "ok"}])
    assert [i.content[0].type for i in added.data] == ["output_text"]
    newest = oai.conversations.items.list(conv.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["ok", "item 2"] and newest.has_more
    rest = oai.conversations.items.list(conv.id, limit=2, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["item 1", "item 0"] and not rest.has_more
    one = oai.conversations.items.retrieve(rest.data[0].id, conversation_id=conv.id)
    assert one.content[0].text == "item 1"
    assert oai.conversations.items.delete(one.id, conversation_id=conv.id).id == conv.id
    assert [i.content[0].text for i in oai.conversations.items.list(conv.id, order="asc").data] == \
        ["item 0", "item 2", "ok"]
    with pytest.raises(openai.NotFoundError):
        oai.conversations.items.retrieve(one.id, conversation_id=conv.id)


def test_a_conversation_is_updated_and_deleted(oai: openai.OpenAI, served_model: str) -> None:
    conv = oai.conversations.create()
    assert oai.conversations.update(conv.id, metadata={"k": "v"}).metadata == {"k": "v"}
    assert oai.conversations.retrieve(conv.id).metadata == {"k": "v"}
    assert oai.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.create(model=served_model, conversation=conv.id, input="Hi", **GREEDY)
    assert info.value.body["param"] == "conversation"


def test_what_a_conversation_cannot_hold_is_refused_by_name(oai: openai.OpenAI, served_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.conversations.create(items=[{"type": "web_search_call", "id": "ws_1"}])
    assert info.value.body["param"] == "items[0].type"
    with pytest.raises(openai.BadRequestError) as info:
        oai.conversations.create(items=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    assert info.value.body["param"] == "items[0].content"
    conv = oai.conversations.create()
    stored = oai.responses.create(model=served_model, input="Hi", **GREEDY)
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=served_model, conversation=conv.id, previous_response_id=stored.id,
                             input="Hi", **GREEDY)
    assert info.value.body["param"] == "conversation"
