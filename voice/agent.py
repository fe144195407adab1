"""Reply agents: one small interface, two implementations.

An agent turns the user's final transcript into reply text, streamed as chunks
so speech synthesis can start on the first sentence while the rest is coming.
The conversation so far is passed in by the caller (the voice loop records what
was actually spoken, so a reply cut off by barge-in is remembered as cut off),
which keeps agents free of state.
`PersonaAgent` is the offline default (rules and templates, answers at once);
`OpenAIChatAgent` talks to any OpenAI-compatible /v1/chat/completions endpoint
(llama.cpp server, Ollama, vLLM, ...) with streaming server-sent events.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from http.client import HTTPResponse
from typing import Protocol, runtime_checkable

DEFAULT_NAME = "Joe"
DEFAULT_SYSTEM_PROMPT = (
    "You are {name}, a friendly animated character having a spoken conversation. "
    "Answer in one to three short sentences that sound natural when read aloud. "
    "Put a short first sentence first. No lists, no markdown, no emoji."
)


# One exchange of the conversation: (what the user said, what the character said).
Exchange = tuple[str, str]


@runtime_checkable
class ReplyAgent(Protocol):
    def stream_reply(self, user_text: str, history: Sequence[Exchange] = ()) -> Iterator[str]:
        """Yield the reply to user_text as text chunks; closing the iterator abandons it."""
        ...


# --- offline persona -------------------------------------------------------------------------

_PRONOUN_SWAP = {
    "i": "you", "me": "you", "my": "your", "mine": "yours", "myself": "yourself",
    "am": "are", "i'm": "you're", "i've": "you've", "i'll": "you'll", "i'd": "you'd",
    "you": "I", "your": "my", "yours": "mine", "yourself": "myself",
    "you're": "I'm", "you've": "I've", "you'll": "I'll",
}
_TOPIC_LEADS = re.compile(
    r"^(?:(?:so|well|okay|ok|hey|um|uh|and|but|please|can you|could you|would you|will you)\s+)*"
    r"(?:tell me (?:about|something about)|talk about|what do you (?:think|know) (?:about|of)|"
    r"do you (?:know|like) (?:about )?|have you heard (?:of|about)|what is|what's|what are|who is|who's|"
    r"who are|where is|where's|how does|how do|why is|why do|why does|explain|describe|let's talk about|"
    r"i want to talk about|i'd like to talk about)\s+",
    re.IGNORECASE,
)
_JOKES = (
    ["Why did the computer go to the doctor?", "It had a virus!"],
    ["Why do programmers prefer dark mode?", "Because light attracts bugs."],
    ["What do you call a sleeping robot?", "A bot nap."],
)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _swap_pronouns(text: str) -> str:
    return " ".join(_PRONOUN_SWAP.get(w.lower(), w) for w in text.split())


def extract_topic(text: str, max_words: int = 6) -> str:
    """The gist of what was said, from the listener's side ('my dog' -> 'your dog')."""
    cleaned = re.sub(r"[^\w\s']", " ", text).strip()
    cleaned = _TOPIC_LEADS.sub("", cleaned)
    words = cleaned.split()[:max_words]
    return _swap_pronouns(" ".join(words))


class PersonaAgent:
    """A built-in character that answers common conversation at once, without a model.

    Replies are short, with a short first sentence so the first audio is early.
    `clock` is injectable so tests can pin the time.
    """

    def __init__(self, name: str = DEFAULT_NAME, clock: Callable[[], _dt.datetime] = _dt.datetime.now, seed: int = 0) -> None:
        self.name = name
        self.clock = clock
        self._rng = random.Random(seed)

    def stream_reply(self, user_text: str, history: Sequence[Exchange] = ()) -> Iterator[str]:
        for sentence in self.reply_sentences(user_text):
            yield sentence + " "

    def reply_sentences(self, user_text: str) -> list[str]:
        text = " ".join(user_text.split())
        words = _words(text)
        joined = " ".join(words)
        has = lambda *keys: any(re.search(rf"\b{k}\b", joined) for k in keys)  # noqa: E731
        if not words:
            return ["Sorry, I didn't catch that.", "Could you say it again?"]
        if has("bye", "goodbye", "good night", "see you", "talk to you later"):
            return ["Goodbye!", "It was nice talking with you."]
        if has("thanks", "thank you", "cheers"):
            return ["You're welcome!", "Anything else on your mind?"]
        if has("what time", "the time", "time is it"):
            now = self.clock()
            return [f"It's {now.strftime('%I:%M').lstrip('0')} {'in the morning' if now.hour < 12 else 'in the afternoon' if now.hour < 18 else 'in the evening'}."]
        if has("what day", "the date", "today's date", "what's the date", "which day"):
            now = self.clock()
            return [f"Today is {now.strftime('%A')}.", f"It's {now.strftime('%B')} {now.day}."]
        if has("your name", "who are you", "what are you", "introduce yourself"):
            return [f"I'm {self.name}.", "I'm an animated character running right here on your computer, and I love a good chat."]
        if has("how are you", "how are you doing", "how's it going", "how do you feel", "how you doing"):
            return ["I'm doing great, thanks!", "How about you?"]
        if has("what can you do", "can you help", "help me"):
            return ["I can chat with you.", "Ask me about myself, the time, or tell me what's on your mind."]
        if has("joke", "funny"):
            return list(self._rng.choice(_JOKES))
        if has("weather", "raining", "sunny"):
            return ["I can't see outside from here.", "Is it nice where you are?"]
        if words[0] in ("hi", "hello", "hey", "hiya", "greetings", "howdy") or has("good morning", "good afternoon", "good evening"):
            return ["Hi there!", "Nice to hear you. What would you like to talk about?"]
        if has("yes", "yeah", "yep", "sure") and len(words) <= 3:
            return ["Great!", "Tell me more."]
        if has("no", "nope", "nah") and len(words) <= 3:
            return ["Okay, no problem.", "What else is on your mind?"]
        topic = extract_topic(text)
        if text.endswith("?") or words[0] in ("what", "who", "why", "how", "where", "when", "which", "can", "could", "do", "does", "is", "are", "will", "would", "should"):
            return [
                "Good question!",
                f"I'm a simple offline character, so I don't know much about {topic}, but I'd love to hear what you think.",
            ]
        return ["Oh, interesting!", f"{topic[:1].upper()}{topic[1:]}, tell me more about that."]


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
        name: str = DEFAULT_NAME,
        api_key: str | None = None,
        temperature: float = 0.7,
        max_tokens: int = 200,
        timeout_s: float = 30.0,
        max_history_turns: int = 8,
        think_opened: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        # Only {name} is filled in: a prompt may hold other braces (JSON examples, code).
        self.system_prompt = (system_prompt or DEFAULT_SYSTEM_PROMPT).replace("{name}", name)
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

    def stream_reply(self, user_text: str, history: Sequence[Exchange] = ()) -> Iterator[str]:
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
            yield from without_thinking(self._contents(response), opened=self.think_opened)
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
