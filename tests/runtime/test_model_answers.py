"""What a run takes as its answer from what a model server sends, through a real server on loopback
and the fake model over real HTTP: reasoning in the content, tool calls that share an id, and a
turn that spends its budget on tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from fake_model import REASONING_ENCRYPTED, REASONING_SIGNATURE, Call, FakeModel, Reply

from persistence.transcript import ToolCall
from runtime.agent import AgentSpec
from runtime.models.client import MAX_REASONING_CHARS
from runtime.models import ModelConfig
from runtime.models.reasoning import ThinkFilter
from runtime.models.wire import ReasoningDetails, distinct_ids, parse_completion
from tests.runtime.agent_support import lookup_tool, sent_messages, stored_messages
from tests.runtime.served import Served, message, serve_keel

# As Ollama, vLLM and llama.cpp's server send a thinking model's answer (qwen3, deepseek-r1) when
# they are run without a reasoning parser: the reasoning opens the content, in a <think> block.
THINKING = "<think>\nThe user asks about the lease. It expired, 25h after its renewal.\n</think>\n\n"
# As Mistral's reasoning models (Magistral) write it when served without a reasoning parser.
MAGISTRAL = "[THINK]The user asks about the lease. It expired, 25h after its renewal.[/THINK]\n\n"
ANSWER = "The lease expired."
VAULT, DNS = '{"service": "vault"}', '{"service": "dns"}'


async def two_turns_across_a_restart(fake_model: FakeModel, tmp_path: Path) -> None:
    """A turn that calls the lookup tool, then, on a server started again on the same state (so
    that what goes to the model is read back from the store), the next turn of the conversation."""
    agent = AgentSpec(tools=[lookup_tool()])
    async with serve_keel(tmp_path / "state", fake_model, agent=agent) as keel:
        task = await keel.send("Why did the lease expire?")
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
    async with serve_keel(tmp_path / "state", fake_model, agent=agent) as keel:
        again = await keel.send("And now?", contextId=task["contextId"])
    assert again["status"]["state"] == "TASK_STATE_COMPLETED", again


async def streamed(keel: Served, text: str, **ids: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The task a streamed send ends with, as GetTask then has it, and the answer artifact's updates."""
    async with keel.stream("SendStreamingMessage", {"message": message(text, **ids)}) as events:
        frames = [frame["result"] for frame in await events.rest()]
    task_id = frames[0]["task"]["id"]
    updates = [frame["artifactUpdate"] for frame in frames if "artifactUpdate" in frame]
    return await keel.result("GetTask", {"id": task_id}), updates


def put_together(updates: list[dict[str, Any]]) -> str:
    """The answer a client builds from its stream's artifact updates (append, or replace)."""
    text = ""
    for update in updates:
        piece = "".join(part["text"] for part in update["artifact"]["parts"])
        text = text + piece if update.get("append") else piece
    return text


def artifact_texts(task: dict[str, Any]) -> list[str]:
    return ["".join(part["text"] for part in artifact["parts"]) for artifact in task.get("artifacts", [])]


@pytest.mark.parametrize("thinking", [THINKING, MAGISTRAL], ids=["think", "magistral"])
@pytest.mark.parametrize("chunk_chars", [1, 3, 4, 1000], ids=["char-by-char", "tags-split", "chunks-of-4", "one-chunk"])
async def test_a_think_block_opening_the_content_is_neither_streamed_nor_the_answer_nor_sent_back(
    keel: Served, chunk_chars: int, thinking: str
) -> None:
    keel.model.script = [Reply(text=thinking + ANSWER, chunk_chars=chunk_chars), Reply(text="Renew it weekly.")]
    task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    assert artifact_texts(task) == [ANSWER]
    assert all("think" not in part["text"].lower() for update in updates for part in update["artifact"]["parts"]), updates
    assert put_together(updates) == ANSWER
    await keel.send("How do I stop it?", contextId=task["contextId"])
    assert [m["content"] for m in sent_messages(keel.model.bodies[1]) if m["role"] == "assistant"] == [ANSWER]


@pytest.mark.parametrize("thinking", [THINKING, MAGISTRAL], ids=["think", "magistral"])
async def test_a_think_block_in_an_answer_sent_in_one_body_is_not_the_answer(keel: Served, thinking: str) -> None:
    # A server (or a proxy) that answers in one JSON body even when asked to stream.
    keel.model.script = [Reply(text=thinking + ANSWER, ignore_stream=True)]
    task = await keel.send("Why did the vault lease expire?")
    assert (task["status"]["state"], artifact_texts(task)) == ("TASK_STATE_COMPLETED", [ANSWER])


@pytest.mark.parametrize(
    "reply",
    [
        Reply(text=ANSWER, reasoning=THINKING, reasoning_field="reasoning_content"),
        Reply(text=ANSWER, reasoning=THINKING, reasoning_field="reasoning"),
        Reply(text=ANSWER, reasoning=THINKING, content_parts=True),
        Reply(text=ANSWER, reasoning=THINKING, reasoning_field="reasoning_content", ignore_stream=True),
        Reply(text=ANSWER, reasoning=THINKING, content_parts=True, ignore_stream=True),
    ],
    ids=["reasoning_content", "reasoning", "thinking-parts", "reasoning_content-one-body", "thinking-parts-one-body"],
)
async def test_reasoning_sent_apart_from_the_answer_is_neither_the_answer_nor_sent_back(keel: Served, reply: Reply) -> None:
    keel.model.script = [reply, Reply(text="Renew it weekly.")]
    task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert (task["status"]["state"], artifact_texts(task), put_together(updates)) == ("TASK_STATE_COMPLETED", [ANSWER], ANSWER)
    await keel.send("How do I stop it?", contextId=task["contextId"])
    sent = sent_messages(keel.model.bodies[1])
    assert [m for m in sent if m["role"] == "assistant"] == [{"role": "assistant", "content": ANSWER}]
    assert "25h after its renewal" not in json.dumps(keel.model.bodies[1]), sent


async def test_an_answer_canceled_after_its_think_block_keeps_only_the_answer_so_far(keel: Served) -> None:
    keel.model.script = [Reply(text=THINKING + "The lease", chunk_chars=1000, hang_after_chunks=2), Reply(text="Sure.")]
    async with keel.stream("SendStreamingMessage", {"message": message("Why did the vault lease expire?")}) as events:
        while "artifactUpdate" not in (frame := await events.next() or {"result": {}})["result"]:
            assert not events.ended
        canceled = await keel.result("CancelTask", {"id": frame["result"]["artifactUpdate"]["taskId"]})
    assert (canceled["status"]["state"], artifact_texts(canceled)) == ("TASK_STATE_CANCELED", ["The lease"])
    await keel.send("Go on.", contextId=canceled["contextId"])  # its turn begins once the canceled run has saved
    stored = await stored_messages(keel.state_dir / "runtime.db", canceled["contextId"])
    assert [(m.text, m.partial) for m in stored if m.role == "assistant"] == [("The lease", True), ("Sure.", False)]


@pytest.mark.parametrize("opening", ["<think>\n", "[THINK]"])
async def test_an_answer_that_ends_inside_its_think_block_fails_and_streams_none_of_it(keel: Served, opening: str) -> None:
    keel.model.script = [Reply(text=opening + "The user asks about the lease. Maybe", chunk_chars=3)]
    task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    reason = task["status"]["message"]["parts"][0]["text"]
    assert "held no text" in reason and "reasoning" in reason, reason
    assert (updates, artifact_texts(task)) == ([], [])


@pytest.mark.parametrize(
    "reply",
    [
        Reply(text=MAGISTRAL + ANSWER, chunk_chars=8, hang_after_chunks=3),
        Reply(text=ANSWER, reasoning=THINKING, hang_after_chunks=3),
    ],
    ids=["magistral-block", "reasoning_content"],
)
async def test_a_model_that_falls_silent_while_reasoning_fails_the_task_saying_it_was_reasoning(
    fake_model: FakeModel, tmp_path: Path, reply: Reply
) -> None:
    fake_model.script = [reply]
    async with serve_keel(tmp_path / "state", fake_model, model_timeout_s=0.3) as keel:
        task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert (task["status"]["state"], updates) == ("TASK_STATE_FAILED", [])
    reason = task["status"]["message"]["parts"][0]["text"]
    said = "nothing arrived within 0.3s while waiting for the model to go on reasoning (it had been reasoning for"
    assert said in reason, reason
    assert "25h" not in reason


async def test_an_answer_that_ends_inside_its_think_block_on_half_an_emoji_fails_and_keeps_none_of_it(keel: Served) -> None:
    # A JavaScript server can cut an emoji between two chunks: the first half, held for the
    # second, is still the reasoning's when the answer ends there.
    keel.model.script = [Reply(text="<think>\nThe lease, maybe \ud83d", chunk_chars=3)]  # a JSON escape
    task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert task["status"]["state"] == "TASK_STATE_FAILED", task
    assert "held no text" in task["status"]["message"]["parts"][0]["text"]
    assert (updates, artifact_texts(task)) == ([], [])
    stored = await stored_messages(keel.state_dir / "runtime.db", task["contextId"])
    assert [m.text for m in stored if m.role == "assistant"] in ([], [""]), stored


@pytest.mark.parametrize("text", ["Wrap it as <think>...</think>, as qwen3 does.", "Magistral writes [THINK]...[/THINK] first."])
async def test_think_tags_the_answer_writes_after_its_start_are_the_answers(keel: Served, text: str) -> None:
    keel.model.script = [Reply(text=text, chunk_chars=3)]
    task = await keel.send("How does qwen3 mark its reasoning?")
    assert artifact_texts(task) == [text]


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (THINKING + ANSWER, ANSWER),
        (" \n<think>x</think>" + ANSWER, ANSWER),
        ("<think></think>" + ANSWER, ANSWER),
        ("<think>only reasoning", ""),
        ("<think>", ""),
        ("<b>" + ANSWER, "<b>" + ANSWER),
        ("<thinking>" + ANSWER, "<thinking>" + ANSWER),
        ("\n" + ANSWER, "\n" + ANSWER),
        ("<thi", "<thi"),
        (MAGISTRAL + ANSWER, ANSWER),
        (" \n[THINK]x[/THINK]" + ANSWER, ANSWER),
        ("[THINK][/THINK]" + ANSWER, ANSWER),
        ("[THINK]only reasoning", ""),
        ("[THINK]x</think>" + ANSWER, ""),  # a block ends with its own tag
        ("<think>x[/THINK]" + ANSWER, ""),
        ("[THI", "[THI"),
        ("[b]" + ANSWER, "[b]" + ANSWER),
        ("[THINKING]" + ANSWER, "[THINKING]" + ANSWER),
    ],
)
def test_the_answer_in_a_text_is_the_same_wherever_its_pieces_are_cut(text: str, answer: str) -> None:
    for cut in range(len(text) + 1):
        think = ThinkFilter()
        assert think.feed(text[:cut]) + think.feed(text[cut:]) + think.end() == answer, cut
    think = ThinkFilter()
    assert "".join(map(think.feed, text)) + think.end() == answer


@pytest.mark.parametrize("ignore_stream", [False, True], ids=["streamed", "one-body"])
async def test_calls_an_answer_gives_one_id_each_run_and_go_back_with_ids_of_their_own(
    fake_model: FakeModel, tmp_path: Path, ignore_stream: bool
) -> None:
    calls: list[dict[str, Any]] = []
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT, id="call_7"), Call("lookup", DNS, id="call_7")], ignore_stream=ignore_stream),
        Reply(text="Both leases expired."),
    ]
    async with serve_keel(tmp_path / "state", fake_model, agent=AgentSpec(tools=[lookup_tool(calls)])) as keel:
        task = await keel.send("Why did the leases expire?")
    assert (task["status"]["state"], calls) == ("TASK_STATE_COMPLETED", [{"service": "vault"}, {"service": "dns"}])
    sent = sent_messages(fake_model.bodies[1])
    called = [call["id"] for call in sent[1]["tool_calls"]]
    answered = [m["tool_call_id"] for m in sent if m["role"] == "tool"]
    assert called[0] == "call_7" and len(set(called)) == 2, called
    assert answered == called


@pytest.mark.parametrize(
    "first",
    [
        # A Mistral model writes its calls' ids itself, and a small one can give two calls one id.
        Reply(tool_calls=[Call("lookup", VAULT, id="aB3dE6gH9"), Call("lookup", DNS, id="aB3dE6gH9")]),
        # A server that sends its calls without ids.
        Reply(tool_calls=[Call("lookup", VAULT), Call("lookup", DNS)], no_call_ids=True),
    ],
    ids=["one-id-for-two-calls", "no-ids"],
)
async def test_ids_keel_gives_calls_are_ones_mistral_takes(fake_model: FakeModel, tmp_path: Path, first: Reply) -> None:
    # Mistral's API, and its models' chat templates as vLLM and llama.cpp's server apply them,
    # refuse any tool call id but 9 letters and digits: an id made otherwise would fail every
    # later request of the conversation.
    fake_model.nine_char_call_ids = True
    fake_model.script = [first, Reply(text="Both leases expired."), Reply(text="Still expired.")]
    calls: list[dict[str, Any]] = []
    async with serve_keel(tmp_path / "state", fake_model, agent=AgentSpec(tools=[lookup_tool(calls)])) as keel:
        task = await keel.send("Why did the leases expire?")
        assert (task["status"]["state"], calls) == ("TASK_STATE_COMPLETED", [{"service": "vault"}, {"service": "dns"}])
        again = await keel.send("And now?", contextId=task["contextId"])
        assert again["status"]["state"] == "TASK_STATE_COMPLETED", again
    sent = sent_messages(fake_model.bodies[1])
    called = [call["id"] for call in sent[1]["tool_calls"]]
    assert len(set(called)) == 2 and [m["tool_call_id"] for m in sent if m["role"] == "tool"] == called


@pytest.mark.parametrize("ignore_stream", [False, True], ids=["streamed", "one-body"])
async def test_what_a_server_attaches_to_a_call_goes_back_with_it_after_a_restart_too(
    fake_model: FakeModel, tmp_path: Path, ignore_stream: bool
) -> None:
    # Gemini's OpenAI-compatible API gives each call of a Gemini 3 model its thought signature in
    # "extra_content", and refuses a later request that sends the call back without it (HTTP 400).
    signature = json.dumps({"google": {"thought_signature": "CiQBjz1rX+sig/=="}})
    fake_model.wants_extra_content = True
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT, extra_content=signature)], ignore_stream=ignore_stream),
        Reply(text="The lease expired."),
        Reply(text="Still expired."),
    ]
    await two_turns_across_a_restart(fake_model, tmp_path)
    [call] = sent_messages(fake_model.bodies[2])[1]["tool_calls"]
    assert call["extra_content"] == json.loads(signature)


@pytest.mark.parametrize("ignore_stream", [False, True], ids=["streamed", "one-body"])
async def test_the_reasoning_before_a_models_tool_calls_goes_back_with_them_after_a_restart_too(
    fake_model: FakeModel, tmp_path: Path, ignore_stream: bool
) -> None:
    # DeepSeek's thinking mode (and Kimi) refuses, with HTTP 400, every later request of a
    # conversation in which an assistant message's tool calls come back without the
    # reasoning_content they came after. An answer's reasoning is never sent back.
    fake_model.wants_reasoning_back = True
    thought = "The user asks about the lease; look the vault up."
    fake_model.script = [
        Reply(reasoning=thought, tool_calls=[Call("lookup", VAULT)], ignore_stream=ignore_stream),
        Reply(reasoning="Answer plainly.", text="The lease expired.", ignore_stream=ignore_stream),
        Reply(text="Still expired."),
    ]
    await two_turns_across_a_restart(fake_model, tmp_path)
    sent = sent_messages(fake_model.bodies[2])
    assert [m.get("reasoning_content") for m in sent if m["role"] == "assistant"] == [thought, None]
    assert all("reasoning" not in m for m in sent)


def test_a_model_server_is_known_by_its_scheme_host_and_port_not_by_how_its_path_is_spelt() -> None:
    # DeepSeek's API is given as https://api.deepseek.com or with /v1: the same server, which
    # refuses the conversation if its calls come back without their reasoning.
    deepseek = ModelConfig(base_url="https://api.deepseek.com").server
    assert ModelConfig(base_url="https://api.deepseek.com/v1").server == deepseek
    assert ModelConfig(base_url="https://user:secret@api.deepseek.com/v1?key=k").server == deepseek
    assert len(deepseek) == 16 and "deepseek" not in deepseek
    others = ["https://api.openai.com/v1", "http://api.deepseek.com/v1", "https://api.deepseek.com:8443/v1"]
    assert deepseek not in {ModelConfig(base_url=url).server for url in others}


@pytest.mark.parametrize("ignore_stream", [False, True], ids=["streamed", "one-body"])
async def test_what_a_server_attached_goes_back_to_it_alone_when_the_conversation_moves_to_another(
    fake_model: FakeModel, nursery: trio.Nursery, tmp_path: Path, ignore_stream: bool
) -> None:
    # A conversation begun on one model server and gone on with on another (the operator moved
    # it): the reasoning and the thought signature the first attached to its calls are its own
    # fields, which another may refuse (OpenAI's API refuses a field it does not know; vLLM
    # before 0.8 refused reasoning_content). The first still gets them back when it comes back.
    other: FakeModel = await nursery.start(FakeModel().serve)
    thought = "The user asks about the lease; look the vault up."
    signature = json.dumps({"google": {"thought_signature": "CiQBjz1rX+sig/=="}})
    fake_model.wants_reasoning_back = fake_model.wants_extra_content = True
    fake_model.script = [
        Reply(reasoning=thought, tool_calls=[Call("lookup", VAULT, extra_content=signature)], ignore_stream=ignore_stream),
        Reply(text="The lease expired."),
        Reply(text="Back on the first server."),
    ]
    other.script = [Reply(text="Still expired.")]
    agent = AgentSpec(tools=[lookup_tool()])
    state = tmp_path / "state"
    async with serve_keel(state, fake_model, agent=agent) as keel:
        task = await keel.send("Why did the lease expire?")
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
    context = task["contextId"]
    for server, question in ((other, "And now?"), (fake_model, "And back?")):
        async with serve_keel(state, server, agent=agent) as keel:
            task = await keel.send(question, contextId=context)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task

    def the_call(body: dict[str, Any]) -> dict[str, Any]:
        [asked] = [m for m in sent_messages(body) if m.get("tool_calls")]
        return asked

    on_other = the_call(other.bodies[0])
    assert not [key for key in on_other if key.startswith("reasoning")] and "extra_content" not in on_other["tool_calls"][0]
    back = the_call(fake_model.bodies[2])
    assert back["reasoning_content"] == thought and back["tool_calls"][0]["extra_content"] == json.loads(signature)
    [stored] = [m for m in await stored_messages(state / "runtime.db", context) if m.tool_calls]
    assert stored.via == ModelConfig(base_url=fake_model.base_url).server != ModelConfig(base_url=other.base_url).server


@pytest.mark.parametrize("ignore_stream", [False, True], ids=["streamed", "one-body"])
@pytest.mark.parametrize(
    "fields",
    ["reasoning", "reasoning reasoning_details", "reasoning reasoning_content"],
    ids=["reasoning", "openrouter", "both-names"],
)
async def test_reasoning_under_other_names_goes_back_with_the_calls_as_it_came_after_a_restart_too(
    fake_model: FakeModel, tmp_path: Path, ignore_stream: bool, fields: str
) -> None:
    # vLLM (which reads only ``reasoning`` from an assistant message) and Ollama hand the reasoning
    # of the calls since the last user message to the chat template (Qwen3, MiniMax-M2, gpt-oss);
    # OpenRouter's Anthropic and Gemini 3 models want the reasoning_details of a message with tool
    # calls back unmodified, their pieces put together as streamed (by type and index).
    fake_model.wants_reasoning_back = True
    thought = "The user asks about the lease; look the vault up."
    fake_model.script = [
        Reply(reasoning=thought, reasoning_field=fields, tool_calls=[Call("lookup", VAULT)], ignore_stream=ignore_stream),
        Reply(reasoning="Answer plainly.", reasoning_field=fields, text="The lease expired.", ignore_stream=ignore_stream),
        Reply(text="Still expired."),
    ]
    await two_turns_across_a_restart(fake_model, tmp_path)
    [asked, answered] = [m for m in sent_messages(fake_model.bodies[2]) if m["role"] == "assistant"]
    expected: dict[str, Any] = {"reasoning": thought}
    if "reasoning_content" in fields:
        expected["reasoning_content"] = thought
    if "reasoning_details" in fields:
        head = {"format": "anthropic-claude-v1"}
        signed = {"type": "reasoning.text", "text": thought, "signature": REASONING_SIGNATURE, "index": 0, **head}
        encrypted = {"type": "reasoning.encrypted", "data": REASONING_ENCRYPTED, "index": 1, **head}
        expected["reasoning_details"] = [signed, encrypted]
    assert {key: asked[key] for key in asked if key.startswith("reasoning")} == expected
    assert not [key for key in answered if key.startswith("reasoning")]  # an answer's reasoning stays


@pytest.mark.parametrize(
    ("thought", "fields"),
    [
        ("x" * (MAX_REASONING_CHARS - 10), "reasoning_content"),  # under the bound on reasoning; with the call, over a message's
        ("x" * (MAX_REASONING_CHARS // 2), "reasoning reasoning_details"),  # given twice: all of it goes, the details too
    ],
    ids=["reasoning_content", "reasoning-and-details"],
)
async def test_reasoning_too_large_to_keep_with_its_calls_is_let_go_and_the_calls_run(
    fake_model: FakeModel, tmp_path: Path, thought: str, fields: str
) -> None:
    reply = Reply(reasoning=thought, reasoning_field=fields, tool_calls=[Call("lookup", VAULT)], chunk_chars=1 << 16)
    fake_model.script = [reply, Reply(text="The lease expired.")]
    calls: list[dict[str, Any]] = []
    async with serve_keel(tmp_path / "state", fake_model, agent=AgentSpec(tools=[lookup_tool(calls)])) as keel:
        task = await keel.send("Why did the lease expire?")
    assert (task["status"]["state"], calls) == ("TASK_STATE_COMPLETED", [{"service": "vault"}])
    stored = await stored_messages(tmp_path / "state" / "runtime.db", task["contextId"])
    [asked] = [m for m in stored if m.tool_calls]
    assert (asked.reasoning, asked.reasoning_details) == ("", "")
    assert "reasoning_content" not in sent_messages(fake_model.bodies[1])[2]
    assert not [key for key in sent_messages(fake_model.bodies[1])[2] if key.startswith("reasoning")]


def test_reasoning_details_are_put_together_by_type_and_index() -> None:
    details = ReasoningDetails()
    details.feed([{"type": "reasoning.summary", "summary": "Look", "index": 0}, {"type": "reasoning.text", "text": "Fi", "signature": None, "index": 0}])
    details.feed([{"type": "reasoning.text", "text": "rst", "index": 0}, {"type": "reasoning.summary", "summary": " up.", "index": 0}])
    details.feed([{"type": "reasoning.text", "text": "", "signature": "sig", "index": 0}, "not a detail", {"type": "reasoning.encrypted", "data": "e"}])
    assert json.loads(details.text()) == [
        {"type": "reasoning.summary", "summary": "Look up.", "index": 0},
        {"type": "reasoning.text", "text": "First", "signature": "sig", "index": 0},
        {"type": "reasoning.encrypted", "data": "e"},
    ]
    assert ReasoningDetails().text() == ""


def test_the_reasoning_details_of_one_body_are_kept_as_they_came() -> None:
    # Whole, not in pieces: two details of one type and index are two, as the server gave them.
    details = [{"type": "reasoning.encrypted", "data": "first", "index": 0}, {"type": "reasoning.encrypted", "data": "second", "index": 0}]
    call = {"id": "call00000", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    body = {"choices": [{"message": {"role": "assistant", "tool_calls": [call], "reasoning_details": details}, "finish_reason": "tool_calls"}]}
    message = parse_completion(body, model="m").message
    assert json.loads(message.reasoning_details) == details


def test_ids_made_distinct_are_distinct_from_every_id_the_answer_gives() -> None:
    calls = [ToolCall("call_7", "lookup"), ToolCall("call_7", "lookup"), ToolCall("call_7_2", "lookup"), ToolCall("x", "lookup")]
    assert [call.id for call in distinct_ids(calls)] == ["call_7", "call_7_2", "call_7_2_2", "x"]
    nine = [ToolCall("aB3dE6gH9", "lookup"), ToolCall("aB3dE6gH9", "lookup"), ToolCall("aB3dE6gH2", "lookup"), ToolCall("aB3dE6gH9", "lookup")]
    assert [call.id for call in distinct_ids(nine)] == ["aB3dE6gH9", "aB3dE6gH2", "aB3dE6gH3", "aB3dE6gH4"]


async def test_a_turn_that_spends_its_budget_on_tools_fails_naming_it_and_keeps_no_answer(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    fake_model.default = Reply(text="Let me look that up.", tool_calls=[Call("lookup", VAULT)])
    agent = AgentSpec(tools=[lookup_tool()], max_model_calls=2)
    async with serve_keel(tmp_path / "state", fake_model, agent=agent) as keel:
        task, updates = await streamed(keel, "Why did the vault lease expire?")
        assert len(fake_model.bodies) == 2
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    reason = task["status"]["message"]["parts"][0]["text"]
    assert "budget exhausted" in reason and "2 model calls" in reason and "AGENT_MAX_MODEL_CALLS" in reason, reason
    # The text before a tool call is not an answer: neither the task nor its streams keep it as one.
    assert "Let me look that up." not in artifact_texts(task), task
    assert put_together(updates) == ""


async def test_a_model_that_would_not_stop_reasoning_fails_its_task_saying_so_and_the_conversation_goes_on(keel: Served) -> None:
    looping = "I must check the lease again. " * (MAX_REASONING_CHARS // 30 + 100)
    keel.model.script = [Reply(text="never reached", reasoning=looping, chunk_chars=1 << 16), Reply(text=ANSWER)]
    task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert task["status"]["state"] == "TASK_STATE_FAILED" and updates == []
    assert task["status"]["message"]["parts"] == [{"text": (
        f"The task failed: model 'qwen3:4b-instruct' would not stop reasoning: it reasoned for more than {MAX_REASONING_CHARS}"
        " characters and had not started its answer; ask again, or for less in one message"
    )}]  # fmt: skip
    again, _ = await streamed(keel, "Why, in short?", contextId=task["contextId"])
    assert artifact_texts(again) == [ANSWER]
    assert "I must check" not in json.dumps(keel.model.bodies[-1])


async def test_a_model_that_goes_back_to_reasoning_and_would_not_stop_fails_its_task_keeping_what_it_had_said(
    keel: Served,
) -> None:
    # Its answer begun, the model reasons on and on: completed, the task passed its first words off as the answer.
    looping = "I must check the lease again. " * (MAX_REASONING_CHARS // 30 + 100)
    keel.model.script = [Reply(text="Let me think.", reasoning_after=looping, chunk_chars=1 << 16), Reply(text=ANSWER)]
    task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert task["status"]["message"]["parts"] == [{"text": (
        f"The task failed: model 'qwen3:4b-instruct' would not stop reasoning: it reasoned for more than {MAX_REASONING_CHARS}"
        " characters in one answer; ask again, or for less in one message"
    )}]  # fmt: skip
    assert artifact_texts(task) == [put_together(updates)] == ["Let me think."]
    again, _ = await streamed(keel, "Why, in short?", contextId=task["contextId"])
    assert artifact_texts(again) == [ANSWER]


async def test_a_model_that_sends_chunks_holding_none_of_its_answer_fails_its_task_once_the_model_timeout_passes(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # A server stuck before its first token, sending the opening chunk again and again: the task stayed WORKING for ever.
    empty = '{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": ""}}]}'
    fake_model.script = [Reply(text=ANSWER, hang_after_chunks=1, keepalive_s=0.02, keepalive_event=f"data: {empty}")]
    async with serve_keel(tmp_path / "state", fake_model, model_timeout_s=0.3) as keel:
        task, updates = await streamed(keel, "Why did the vault lease expire?")
    assert task["status"]["state"] == "TASK_STATE_FAILED" and updates == []
    assert "timed out: nothing arrived within 0.3s while waiting for the answer to start" in json.dumps(task["status"])
