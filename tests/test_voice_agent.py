import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from voice.agent import OpenAIChatAgent, ReplyAgent, without_thinking
from voice.personas import PERSONAS, Persona, persona_for, system_prompt


def test_the_openai_client_implements_the_agent_interface():
    assert isinstance(OpenAIChatAgent(), ReplyAgent)


def test_every_character_preset_has_a_persona_and_a_prompt_in_its_name():
    from engine.character import PRESETS

    assert set(PERSONAS) == set(PRESETS)
    for preset in PRESETS:
        persona = persona_for(preset)
        prompt = system_prompt(persona)
        assert prompt.endswith(f"Your name is {persona.name}; you are {persona.personality}.")
        assert "{" not in prompt and "no lists" not in prompt.lower()  # filled in; the rule is "Never use lists"
    assert persona_for("ada", "Zoe") == Persona("Zoe", PERSONAS["ada"].personality)


class FakeChatServer:
    """A tiny OpenAI-compatible endpoint on 127.0.0.1 that streams canned deltas."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.deltas: list[str] = ["Hello", " there", "! How", " can I help?"]
        self.status = 200
        self.delay_s = 0.0
        self.error_event = False
        self.header_delay_s = 0.0  # a server that takes the request and then says nothing
        self.send_done = True
        self.raw_reply: tuple[str, bytes] | None = None  # (Content-Type, body) sent as is instead of the events
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.headers.append(dict(self.headers))
                if server.status != 200:
                    self.send_response(server.status)
                    self.end_headers()
                    self.wfile.write(b'{"error": "model not loaded"}')
                    return
                time.sleep(server.header_delay_s)
                self.send_response(200)
                if server.raw_reply is not None:
                    content_type, raw = server.raw_reply
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                events = [{"choices": [{"delta": {"role": "assistant"}}]}]
                events += [{"choices": [{"delta": {"content": d}}]} for d in server.deltas]
                if server.error_event:
                    events.append({"error": {"message": "out of memory"}})
                try:
                    self.wfile.write(b": keep-alive\n\n")
                    for event in events:
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(server.delay_s)
                    if server.send_done:
                        self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client walked away (barge-in)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    fake = FakeChatServer()
    yield fake
    fake.close()


def test_client_streams_deltas_and_sends_a_proper_request(server):
    agent = OpenAIChatAgent(base_url=server.url, model="tiny-llm", system_prompt="You are {name}, be brief.",
                            persona=persona_for("ada"), api_key="sk-test")
    chunks = list(agent.stream_reply("Hi!"))
    assert chunks == ["Hello", " there", "! How", " can I help?"]
    request = server.requests[0]
    assert request["model"] == "tiny-llm" and request["stream"] is True
    assert request["messages"] == [{"role": "system", "content": "You are Ada, be brief."}, {"role": "user", "content": "Hi!"}]
    assert server.headers[0]["Authorization"] == "Bearer sk-test"


def test_a_reasoning_models_thinking_is_not_said(server):
    server.deltas = ["<thi", "nk>The user greets me", ", so I greet back.</th", "ink>Hello", " there!"]
    assert "".join(OpenAIChatAgent(base_url=server.url, api_key="").stream_reply("Hi!")) == "Hello there!"
    assert "".join(without_thinking(["A <b>bold</b> ", "<thinking> word"])) == "A <b>bold</b> <thinking> word"
    assert "".join(without_thinking(["Sure.<think>unfinished"])) == "Sure."


def test_client_sends_the_conversation_it_is_given(server):
    agent = OpenAIChatAgent(base_url=server.url, api_key="", max_history_turns=2)
    history = [("One?", "Uno."), ("Two?", "Dos."), ("Three?", "Tres.")]
    list(agent.stream_reply("Four?", history))
    messages = server.requests[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages[1:]] == ["Two?", "Dos.", "Three?", "Tres.", "Four?"]
    assert "Authorization" not in server.headers[0]


def test_abandoning_a_reply_closes_the_stream_promptly(server):
    server.deltas = [f" word{i}" for i in range(100)]
    server.delay_s = 0.05
    agent = OpenAIChatAgent(base_url=server.url, api_key="")
    stream = agent.stream_reply("Talk a lot.")
    assert next(stream) == " word0"
    started = time.perf_counter()
    stream.close()
    assert time.perf_counter() - started < 0.5


def test_client_errors_are_clear(server):
    server.status = 503
    with pytest.raises(RuntimeError, match="HTTP 503"):
        list(OpenAIChatAgent(base_url=server.url, api_key="").stream_reply("Hi"))
    server.status = 200
    server.error_event = True
    with pytest.raises(RuntimeError, match="out of memory"):
        list(OpenAIChatAgent(base_url=server.url, api_key="").stream_reply("Hi"))
    port = server.httpd.server_address[1]
    server.close()
    with pytest.raises(ConnectionError, match="unreachable"):
        list(OpenAIChatAgent(base_url=f"http://127.0.0.1:{port}/v1", api_key="", timeout_s=2).stream_reply("Hi"))


def test_system_prompt_braces_other_than_name_are_kept(server):
    prompt = 'You are {name}. Never write JSON such as {"say": "hi"} or {0}.'
    agent = OpenAIChatAgent(base_url=server.url, system_prompt=prompt, persona=persona_for("ada"), api_key="")
    assert agent.system_prompt == 'You are Ada. Never write JSON such as {"say": "hi"} or {0}.'
    assert agent.for_persona(persona_for("kofi")).system_prompt.startswith("You are Kofi.")


def test_a_cancelled_reply_reads_no_further(server):
    server.deltas = [f" word{i}" for i in range(50)]
    cancelled = threading.Event()
    stream = OpenAIChatAgent(base_url=server.url, api_key="").stream_reply("Talk a lot.", cancelled=cancelled)
    assert next(stream) == " word0"
    cancelled.set()
    assert list(stream) == []


def _sse(*lines: str) -> tuple[str, bytes]:
    return "text/event-stream", "".join(line + "\n\n" for line in lines).encode()


HELLO_EVENT = 'data: {"choices": [{"delta": {"content": "Hello"}}]}'


@pytest.mark.parametrize("reply, message", [
    # llama.cpp reports a failure inside the stream with an `error:` line
    (_sse(HELLO_EVENT, 'error: {"code": 400, "message": "request (4476 tokens) exceeds the available context size"}'),
     "error: request \\(4476 tokens\\) exceeds the available context size"),
    (_sse(HELLO_EVENT), "ended the stream before \\[DONE\\]"),  # connection cut mid-reply
    (_sse('data: "hi"', "data: [DONE]"), "not a JSON object"),
    (_sse('data: {"choices": "none"}', "data: [DONE]"), "malformed choices"),
    (("text/html", b"<html><body>Welcome to the proxy login page</body></html>"), "Content-Type text/html, not an event stream"),
    (("application/json", b'{"object": "list", "data": []}'), "not a chat completion"),
    (("application/json", b'{"error": {"message": "model not loaded"}}'), "model not loaded"),
])
def test_a_failed_or_unreadable_reply_is_an_error_naming_the_endpoint(server, reply, message):
    server.raw_reply = reply
    agent = OpenAIChatAgent(base_url=server.url, api_key="")
    with pytest.raises(RuntimeError, match=message) as caught:
        list(agent.stream_reply("Hi"))
    assert agent.url in str(caught.value)


def test_a_stream_whose_last_choice_finished_is_whole_without_done(server):
    """Some servers (older llama.cpp builds, ik_llama.cpp by default) end the stream after the chunk that gives the
    finish_reason, with no [DONE]: that reply is whole."""
    server.raw_reply = _sse(HELLO_EVENT, 'data: {"choices": [{"delta": {"content": " there."}, "finish_reason": "stop"}]}')
    assert "".join(OpenAIChatAgent(base_url=server.url, api_key="").stream_reply("Hi")) == "Hello there."


def test_a_whole_json_completion_is_taken_as_the_reply(server):
    """A server that ignores "stream": true answers with one chat completion."""
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "<think>Greet.</think>Hi there!"}}]}
    server.raw_reply = ("application/json", json.dumps(completion).encode())
    assert "".join(OpenAIChatAgent(base_url=server.url, api_key="").stream_reply("Hi")) == "Hi there!"


def test_a_silent_server_is_reported_as_silent_not_unreachable(server):
    server.header_delay_s = 1.5
    agent = OpenAIChatAgent(base_url=server.url, api_key="", timeout_s=0.3)
    with pytest.raises(TimeoutError, match=f"chat endpoint {agent.url} gave no data for 0.3 s"):
        list(agent.stream_reply("Hi"))
    server.header_delay_s = 0.0
    server.delay_s = 1.5  # stalls after its first event
    with pytest.raises(TimeoutError, match=f"chat endpoint {agent.url} gave no data for 0.3 s"):
        list(agent.stream_reply("Hi"))
    with pytest.raises(ValueError, match="timeout_s"):
        OpenAIChatAgent(timeout_s=0)


def test_reasoning_from_a_template_that_opened_think_is_not_said(server):
    reasoning = ["The user greets", " me, so I gre", "et back.</th", "ink>Hello", " there!"]
    # Without the option the template's open tag is unseen: nothing marks the reasoning.
    assert "".join(without_thinking(reasoning)) == "The user greets me, so I greet back.</think>Hello there!"
    assert "".join(without_thinking(reasoning, opened=True)) == "Hello there!"
    server.deltas = reasoning
    agent = OpenAIChatAgent(base_url=server.url, api_key="", think_opened=True)
    assert "".join(agent.stream_reply("Hi!")) == "Hello there!"
    # A model that opens its own blocks, or uses none, is said as usual; a tag mentioned later stays.
    assert "".join(without_thinking(["Sure. <think>hmm</think>Yes, ", "</think> is a tag."], opened=True)) == "Sure. Yes, </think> is a tag."
    assert "".join(without_thinking(["Just ", "an answer."], opened=True)) == "Just an answer."
