"""Each API's handlers are functions of a parsed body: called here without
HTTP (no app, no request), on a real engine over a scripted model, they
answer in their API's shape, whole and streamed."""

from __future__ import annotations

import asyncio
import json

import pytest
from kvq_testing.scripted import save_scripted_model
from mlx_lm import load

from mlx_kvq.config import KVConfig
from mlx_kvq.engine import Engine, EngineOptions
from mlx_kvq.plan import plan_kv
from mlx_kvq.server.anthropic import handlers as anthropic
from mlx_kvq.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlx_kvq.server.chat.prompting import PromptWork
from mlx_kvq.server.chat.service import ChatService
from mlx_kvq.server.openai import handlers as openai
from mlx_kvq.server.openai.schemas import ChatCompletionRequest
from mlx_kvq.server.responses import handlers as responses
from mlx_kvq.server.responses.schemas import ResponsesRequest
from mlx_kvq.server.responses.store import AgentCounters
from mlx_kvq.server.settings import ServerSettings

SCRIPT = {"capital": ["Paris is the capital of France."]}
QUESTION = [{"role": "user", "content": "What is the capital?"}]
ANSWER = "Paris is the capital of France."


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    model, tokenizer = load(str(save_scripted_model(tmp_path_factory.mktemp("h") / "m", SCRIPT)))
    kv = KVConfig(bits=4)
    engine = Engine(model, tokenizer, plan_kv(model, kv, batch=True), kv, EngineOptions())
    engine.start()
    assert engine.readiness.ready_event.wait(120)
    yield ChatService(engine, ServerSettings(model_id="m"), PromptWork(tokenizer, None, 1))
    engine.stop()


async def never() -> None:
    """A client that stays."""
    await asyncio.Event().wait()


async def lines(reply) -> list[str]:
    return [line async for line in await reply]


def test_handlers_answer_without_http(service):
    counters = AgentCounters(1 << 20)

    async def main():
        chat = ChatCompletionRequest.model_validate({"messages": QUESTION, "max_tokens": 20})
        body = await openai.chat_completion(service, chat, 0, never)
        assert body["choices"][0]["message"]["content"] == ANSWER

        messages = {"model": "x", "max_tokens": 20, "messages": QUESTION}
        body = await anthropic.messages(service, MessagesRequest(**messages), never)
        assert body["content"] == [{"type": "text", "text": ANSWER}]
        assert body["stop_reason"] == "end_turn"
        counted = CountTokensRequest.model_validate({"model": "x", "messages": QUESTION})
        tokens = (await anthropic.count_tokens(service, counted))["input_tokens"]
        usage = body["usage"]
        assert tokens == usage["input_tokens"] + usage["cache_read_input_tokens"]

        request = ResponsesRequest.model_validate({"model": "x", "input": QUESTION[0]["content"]})
        body = await responses.create(service, counters, request, never)
        assert body["output"][0]["content"][0]["text"] == ANSWER
        return body["id"]

    rid = asyncio.run(main())
    assert responses.retrieve(counters, rid)["id"] == rid


def test_streaming_handlers_yield_their_apis_events(service):
    async def main():
        chat = {"messages": QUESTION, "max_tokens": 20, "stream": True}
        events = await lines(
            openai.chat_completion(service, ChatCompletionRequest(**chat), 0, never)
        )
        messages = {"model": "x", "max_tokens": 20, "messages": QUESTION, "stream": True}
        return events, await lines(anthropic.messages(service, MessagesRequest(**messages), never))

    chat, messages = asyncio.run(main())
    assert chat[-1] == "data: [DONE]\n\n"
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in chat[:-1] if e.startswith("data: ")]
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    kinds = [e.split("\n", 1)[0].removeprefix("event: ") for e in messages]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds
