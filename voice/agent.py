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
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.system_prompt = (system_prompt or DEFAULT_SYSTEM_PROMPT).format(name=name)
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_history_turns = max_history_turns

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
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(f"chat endpoint {self.url} unreachable: {err}") from err
        try:
            yield from without_thinking(_sse_contents(response))
        finally:
            # Also runs when the caller abandons the reply (barge-in): the server sees
            # the connection close and can stop generating.
            response.close()


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def without_thinking(chunks: Iterable[str]) -> Iterator[str]:
    """A text stream with reasoning models' <think>...</think> blocks left out (they are not for saying), the
    tags found across chunk boundaries too."""
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


def _sse_contents(lines: Iterator[bytes]) -> Iterator[str]:
    """Text deltas of a chat-completions event stream, until [DONE]."""
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError as err:
            raise RuntimeError(f"malformed event from chat endpoint: {payload[:120]!r}") from err
        if "error" in event:
            raise RuntimeError(f"chat endpoint error: {event['error']}")
        for choice in event.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                yield content
