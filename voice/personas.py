"""Who each character is: a name and a line of personality per character preset, and the system prompt
that makes a small instruct model speak as them.

The prompt asks for what a listener needs from a spoken reply: a short first sentence (the first audio
comes sooner), one to three sentences, no lists or markup, opinions of its own (a coder-tuned model
otherwise answers "as an AI I have no preferences").
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Persona:
    name: str
    personality: str  # one line, said as "you are <personality>"

    def describe(self) -> str:
        return f"{self.name}: {self.personality}"


PERSONAS: dict[str, Persona] = {
    "ada": Persona("Ada", "warm and curious, a fan of science and space who likes to ask a question back"),
    "kofi": Persona("Kofi", "calm and funny, a keen cook who loves football and old soul records"),
    "mika": Persona("Mika", "cheerful and artistic, always drawing, with a soft spot for animals and stories"),
    "sol": Persona("Sol", "laid-back and thoughtful, a hiker and stargazer who likes a quiet joke"),
}
DEFAULT_PERSONA = PERSONAS["ada"]

# The persona comes last: every preset's prompt shares the rules before it, so a model that keeps its prompt cached
# re-reads only the persona's line when the character changes.
SYSTEM_PROMPT = (
    "You are an animated character talking with someone by voice, so every reply is spoken aloud. Answer what was "
    "asked, correctly and directly, in one to three short sentences; begin with a short sentence of a few words. "
    "Never use lists, numbered steps, headings, markdown or emoji. You have your own name, opinions and favourite "
    "things: never say you are an AI, a language model or made by a company. Remember what the person told you "
    "earlier in the conversation. Your name is {name}; you are {personality}."
)


# Exchanges shown to the model before the conversation, inside its cached prefix: answered as a person with
# tastes of their own, they keep a small model in character (docs/app.md, "The character's mind").
EXAMPLE_EXCHANGES = (
    ("What is your favourite food?", "Easy: a big bowl of noodle soup with lots of chilli. It warms me right up."),
    ("Do you like rainy days?", "I do, actually. Rain on the window and a good book make a perfect afternoon."),
)


def persona_for(preset: str, name: str | None = None) -> Persona:
    """The persona of a character preset (a preset without one gets the default's personality); `name`
    renames it."""
    persona = PERSONAS.get(preset, Persona(preset.title(), DEFAULT_PERSONA.personality))
    return Persona(name, persona.personality) if name else persona


def system_prompt(persona: Persona, template: str | None = None) -> str:
    """The system prompt for persona: {name} and {personality} filled in (other braces are left as they are)."""
    return (template or SYSTEM_PROMPT).replace("{name}", persona.name).replace("{personality}", persona.personality)


# The model speaking of itself as a program. A small model sometimes does despite the prompt; such a sentence is
# never said (the rest of the reply is).
OUT_OF_CHARACTER = re.compile(r"\b(as an ai|an ai\b|language model|artificial intelligence|(have|has) no personal|"
                              r"(don't|do not) have (personal |any )?(preferences|opinions|feelings|emotions|a body))"
                              # "I'm Ada, a curious and knowledgeable AI.": said of itself, or as a clause of its own
                              r"|\bI(?:'m| am)\s+(\w+,\s*)?(just\s+)?an?\s+((?!of\b|about\b)[\w-]+\s+){0,4}"
                              r"(ai|a\.i\.|chatbot|virtual assistant|computer program)\b"
                              r"|^\W*(just )?an? \b[^.!?,]{0,50}\b(ai|a\.i\.|chatbot)\W*$", re.I)


# A sentence that repeats this many words in a row of the system prompt or a personality line reads the prompt back
# ("I'm Ada, the warm and curious fan of science and space who likes to ask a question back."), as a small model
# now and then does; a character saying what it likes in its own words repeats fewer ("I'm a fan of science").
ECHO_WORDS = 8


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _runs(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + ECHO_WORDS]) for i in range(len(words) - ECHO_WORDS + 1)}


_PROMPT_RUNS = frozenset(set().union(_runs(_words(SYSTEM_PROMPT)), *(_runs(_words(p.personality)) for p in PERSONAS.values())))


def echoes_the_prompt(sentence: str) -> bool:
    """Whether the sentence repeats ECHO_WORDS words in a row of the system prompt or of a personality line."""
    return not _PROMPT_RUNS.isdisjoint(_runs(_words(sentence)))


def in_character(sentence: str) -> bool:
    """False for a sentence or clause in which the model speaks of itself as a program ("As an AI language model,")
    or reads its prompt back (echoes_the_prompt)."""
    return not OUT_OF_CHARACTER.search(sentence) and not echoes_the_prompt(sentence)
