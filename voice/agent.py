"""Reply agents: one small interface, two implementations.

An agent turns the user's final transcript into reply text, streamed as chunks
so speech synthesis can start on the first sentence while the rest is coming.
The conversation so far is passed in by the caller (the voice loop records what
was actually spoken, so a reply cut off by barge-in is remembered as cut off).
`cancelled` is set by a barge-in or Stop: the agent stops generating at once.
The default is `llm.LocalLLMAgent` (a small instruct model in process);
`OpenAIChatAgent` talks to any OpenAI-compatible /v1/chat/completions endpoint
(llama.cpp server, Ollama, vLLM, ...) with streaming server-sent events, for
bigger models a user serves.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from http.client import HTTPResponse
from typing import Protocol, runtime_checkable

from .personas import DEFAULT_PERSONA, Persona
from .personas import system_prompt as persona_prompt


# One exchange of the conversation: (what the user said, what the character said).
Exchange = tuple[str, str]


@runtime_checkable
class ReplyAgent(Protocol):
    def stream_reply(self, user_text: str, history: Sequence[Exchange] = (),
                     cancelled: threading.Event | None = None) -> Iterator[str]:
        """Yield the reply to user_text as text chunks; once `cancelled` is set (or the iterator is closed) no
        more is generated."""
        ...


# --- OpenAI-compatible client ------------------------------------------------------------------


class OpenAIChatAgent:
    """Stream replies from an OpenAI-compatible chat completions endpoint.

    Sends the system prompt, the last `max_history_turns` exchanges and the new
    user text. Uses the standard library only; `api_key` defaults to the
    OPENAI_API_KEY environment variable and may be empty for local servers.
    `timeout_s` bounds each wait for data from the server; a failure the server
    reports, or a reply cut off before [DONE], raises rather than passing for a
    short reply.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080/v1",
        model: str = "local",
        system_prompt: str | None = None,
        persona: Persona = DEFAULT_PERSONA,
        api_key: str | None = None,
        temperature: float = 0.7,
        max_tokens: int = 200,
        timeout_s: float = 30.0,
        max_history_turns: int = 8,
        think_opened: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.base_url = base_url
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.persona = persona
        self.prompt_template = system_prompt
        # Only {name} and {personality} are filled in: a prompt may hold other braces (JSON examples, code).
        self.system_prompt = persona_prompt(persona, system_prompt)
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_history_turns = max_history_turns
        # The model's chat template opens <think> itself, so replies start with reasoning closed by </think>.
        self.think_opened = think_opened

    def messages(self, user_text: str, history: Sequence[Exchange] = ()) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system_prompt}]
        for said, answered in list(history)[-self.max_history_turns :] if self.max_history_turns > 0 else []:
            out.append({"role": "user", "content": said})
            out.append({"role": "assistant", "content": answered})
        out.append({"role": "user", "content": user_text})
        return out

    def for_persona(self, persona: Persona) -> "OpenAIChatAgent":
        """The same endpoint and settings, speaking as another persona."""
        return OpenAIChatAgent(self.base_url, self.model, self.prompt_template, persona, self.api_key, self.temperature,
                               self.max_tokens, self.timeout_s, self.max_history_turns, self.think_opened)

    def describe(self) -> str:
        return f"{self.model} at {self.base_url}"

    def stream_reply(self, user_text: str, history: Sequence[Exchange] = (),
                     cancelled: threading.Event | None = None) -> Iterator[str]:
        body = {
            "model": self.model,
            "messages": self.messages(user_text, history),
            "stream": True,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as err:
            detail = err.read(300).decode("utf-8", "replace")
            raise RuntimeError(f"chat endpoint {self.url} answered HTTP {err.code}: {detail}") from err
        except TimeoutError as err:
            # Connected and sent the request, but no answer came (a URLError wraps a connect timeout instead).
            raise self._stalled() from err
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(f"chat endpoint {self.url} unreachable: {err}") from err
        try:
            for text in without_thinking(self._contents(response), opened=self.think_opened):
                if cancelled is not None and cancelled.is_set():
                    return
                yield text
        except TimeoutError as err:
            raise self._stalled() from err
        finally:
            # Also runs when the caller abandons the reply (barge-in): the server sees
            # the connection close and can stop generating.
            response.close()

    def _stalled(self) -> TimeoutError:
        return TimeoutError(f"chat endpoint {self.url} gave no data for {self.timeout_s:g} s")

    def _contents(self, response: HTTPResponse) -> Iterator[str]:
        """The reply text of a response: an event stream, or a whole completion from a server that ignores "stream"."""
        kind = response.headers.get_content_type()
        if kind == "text/event-stream":
            return _sse_contents(response, self.url)
        if kind == "application/json":
            return iter(_completion_content(response.read(_MAX_JSON_BYTES), self.url))
        start = response.read(120).decode("utf-8", "replace")
        raise RuntimeError(f"chat endpoint {self.url} answered with Content-Type {kind}, not an event stream: {start!r}")


_MAX_JSON_BYTES = 1 << 20  # a whole chat completion is a few kB


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def without_thinking(chunks: Iterable[str], opened: bool = False) -> Iterator[str]:
    """A text stream with reasoning models' <think>...</think> blocks left out (they are not for saying), the
    tags found across chunk boundaries too.

    opened: the chat template already opened <think>, so the reply starts with reasoning closed by a lone </think>.
    Text is then held back until that </think> (and dropped with it), or until a <think> shows the model opens its
    own blocks; a stream with neither tag is said in full at its end."""
    if opened:
        chunks = _after_leading_close(chunks)
    buffer, inside = "", False
    for chunk in chunks:
        buffer += chunk
        out = []
        while True:
            tag = THINK_CLOSE if inside else THINK_OPEN
            at = buffer.find(tag)
            if at >= 0:
                if not inside:
                    out.append(buffer[:at])
                buffer, inside = buffer[at + len(tag):], not inside
                continue
            # keep back what may be the start of a tag split across chunks
            keep = next((n for n in range(min(len(tag) - 1, len(buffer)), 0, -1) if tag.startswith(buffer[-n:])), 0)
            if not inside:
                out.append(buffer[: len(buffer) - keep])
            buffer = buffer[len(buffer) - keep:]
            break
        text = "".join(out)
        if text:
            yield text
    if buffer and not inside:
        yield buffer


def _after_leading_close(chunks: Iterable[str]) -> Iterator[str]:
    """The stream without everything up to a </think> that comes before any <think>."""
    stream = iter(chunks)
    held = ""
    for chunk in stream:
        held += chunk
        close, open_ = held.find(THINK_CLOSE), held.find(THINK_OPEN)
        if close >= 0 and (open_ < 0 or close < open_):
            held = held[close + len(THINK_CLOSE):]
            break
        if open_ >= 0:
            break
    if held:
        yield held
    yield from stream


def _error_message(error: object) -> str:
    """The message of an error report: {"error": {"message": ...}}, the inner object alone, or plain text."""
    inner = error.get("error", error) if isinstance(error, dict) else error
    if isinstance(inner, dict):
        return str(inner.get("message") or json.dumps(inner))
    return str(inner)


def _json_object(payload: str, url: str) -> dict:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError as err:
        raise RuntimeError(f"malformed JSON from chat endpoint {url}: {payload[:120]!r}") from err
    if not isinstance(event, dict):
        raise RuntimeError(f"chat endpoint {url} sent an event that is not a JSON object: {payload[:120]!r}")
    return event


def _choices(event: dict, url: str) -> list[dict]:
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise RuntimeError(f"chat endpoint {url} sent malformed choices: {json.dumps(event)[:120]!r}")
    return choices


def _sse_contents(lines: Iterable[bytes], url: str) -> Iterator[str]:
    """Text deltas of a chat-completions event stream, until [DONE].

    An error reported in the stream (llama.cpp sends an `error:` line, e.g. when the prompt is over the context
    size) and a stream that ends before [DONE] raise RuntimeError: the reply is missing or cut short. A stream
    whose last choice gave its finish_reason is whole without [DONE] (some servers never send it)."""
    finished = False
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip()
        field, _, value = line.partition(":")
        if field == "error":
            raise RuntimeError(f"chat endpoint {url} error: {_error_message(_json_or_text(value.strip()))}")
        if field != "data":
            continue  # blank separators, comments, event names
        payload = value.strip()
        if payload == "[DONE]":
            return
        event = _json_object(payload, url)
        if "error" in event:
            raise RuntimeError(f"chat endpoint {url} error: {_error_message(event)}")
        for choice in _choices(event, url):
            finished = finished or bool(choice.get("finish_reason"))
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if content:
                yield str(content)
    if not finished:
        raise RuntimeError(f"chat endpoint {url} ended the stream before [DONE]: the reply is cut short")


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _completion_content(body: bytes, url: str) -> list[str]:
    """The reply of a whole (non-streamed) chat completion, as one chunk."""
    completion = _json_object(body.decode("utf-8", "replace"), url)
    if "error" in completion:
        raise RuntimeError(f"chat endpoint {url} error: {_error_message(completion)}")
    choices = _choices(completion, url)
    message = choices[0].get("message") if choices else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise RuntimeError(f"chat endpoint {url} answered JSON that is not a chat completion: {body[:120]!r}")
    return [content] if content else []
