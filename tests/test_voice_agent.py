import datetime as dt
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from voice.agent import OpenAIChatAgent, PersonaAgent, ReplyAgent, extract_topic, without_thinking

FIXED_NOW = dt.datetime(2024, 5, 6, 15, 5)  # a Monday afternoon


@pytest.fixture
def persona() -> PersonaAgent:
    return PersonaAgent(name="Joe", clock=lambda: FIXED_NOW)


def reply(agent, text: str) -> str:
    return "".join(agent.stream_reply(text)).strip()


def test_persona_implements_the_agent_interface(persona):
    assert isinstance(persona, ReplyAgent)
    assert isinstance(OpenAIChatAgent(), ReplyAgent)


@pytest.mark.parametrize(
    "said, expected",
    [
        ("Hello there.", "Hi there!"),
        ("Good morning!", "Hi there!"),
        ("What is your name?", "I'm Joe."),
        ("Who are you?", "I'm Joe."),
        ("What time is it?", "It's 3:05 in the afternoon."),
        ("What day is it today?", "Today is Monday."),
        ("How are you doing?", "I'm doing great"),
        ("Thank you so much.", "You're welcome!"),
        ("Okay, goodbye.", "Goodbye!"),
        ("Tell me a joke.", "?"),
        ("", "Sorry, I didn't catch that."),
    ],
)
def test_persona_answers_common_conversation(persona, said, expected):
    assert expected in reply(persona, said)


def test_persona_echoes_the_topic_from_the_listeners_side(persona):
    assert "your holiday plans" in reply(persona, "I want to talk about my holiday plans.").lower()
    assert "the capital of France" in reply(persona, "What is the capital of France?")
    assert extract_topic("Tell me about the moon and the stars") == "the moon and the stars"


def test_persona_streams_a_short_first_sentence_at_once(persona):
    for said in ("Hello", "What is your name?", "Tell me about volcanoes", "Why is the sky blue?", "I like trains"):
        started = time.perf_counter()
        first = next(iter(persona.stream_reply(said)))
        assert time.perf_counter() - started < 0.05
        assert first.endswith(" ") and len(first.split()) <= 6


class FakeChatServer:
    """A tiny OpenAI-compatible endpoint on 127.0.0.1 that streams canned deltas."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.deltas: list[str] = ["Hello", " there", "! How", " can I help?"]
        self.status = 200
        self.delay_s = 0.0
        self.error_event = False
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
                self.send_response(200)
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
    agent = OpenAIChatAgent(base_url=server.url, model="tiny-llm", system_prompt="You are {name}, be brief.", name="Ada", api_key="sk-test")
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
