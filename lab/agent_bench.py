"""What the character says: the reply agent on a fixed set of spoken-style questions, scored on facts.

    python -m lab.agent_bench --json

Each conversation is a fresh session; its turns carry the conversation so far, as the voice loop
does. Every turn names the facts a right answer must contain (each fact: any one of its spellings,
matched on the spoken text, so "8" and "eight" both pass as "eight"). Follow-ups need the turn
before them; asked for its own taste, any answer a person would give is right. A reply that speaks of itself
as an AI or a language model is wrong whatever it says. Replies go through the same path as in the loop (`spoken_stream`, then
`SentenceSplitter`), and what would reach speech synthesis is checked for list or markdown syntax,
emoji and figures. Timings: first text and the whole reply, per turn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from voice.llm import DEFAULT_MODEL, MODELS, LocalLLM, LocalLLMAgent
from voice.options import EXIT_INTERRUPTED, report_failure
from voice.personas import OUT_OF_CHARACTER, PERSONAS, in_character
from voice.spoken import spoken_stream
from voice.trace import summarize
from voice.tts import SentenceSplitter


@dataclass(frozen=True)
class Turn:
    said: str
    facts: tuple[tuple[str, ...], ...]  # every fact must be in the reply; a fact is any one of its spellings
    kind: str = "fact"  # small talk, fact, request or follow-up


def T(said: str, *facts: str | tuple[str, ...], kind: str = "fact") -> Turn:
    return Turn(said, tuple((f,) if isinstance(f, str) else f for f in facts), kind)


# Spoken-style questions, as speech recognition writes them. Conversations are played in order, each one fresh.
CONVERSATIONS: tuple[tuple[Turn, ...], ...] = (
    (T("Hi there, what's your name?", "ada", kind="small talk"),
     T("How are you doing today?", ("good", "great", "fine", "well", "wonderful", "fantastic", "happy", "excellent"), kind="small talk"),
     T("Do you like music?", ("yes", "love", "like", "enjoy"), kind="small talk")),
    (T("What's the capital of France?", "paris"),
     T("And what's the capital of Japan?", "tokyo", kind="follow-up")),
    (T("How many legs does a spider have?", "eight"),),
    (T("Which planet is known as the red planet?", "mars"),),
    (T("Who wrote Romeo and Juliet?", "shakespeare"),),
    (T("What's the largest ocean on Earth?", "pacific"),),
    (T("How many days are there in a week?", "seven"),),
    (T("What do bees make?", "honey"),),
    (T("What gas do plants take in from the air?", ("carbon dioxide", "co2", "c o two")),),
    (T("At what temperature does water boil in Celsius?", ("one hundred", "a hundred", "hundred degrees")),),
    (T("What colour do you get if you mix blue and yellow?", "green"),),
    (T("How many continents are there?", "seven"),),
    (T("What's the tallest mountain in the world?", "everest"),),
    (T("Who painted the Mona Lisa?", ("leonardo", "da vinci")),),
    (T("What language do people speak in Brazil?", "portuguese"),),
    (T("How many hours are there in a day?", ("twenty-four", "twenty four")),),
    (T("What is five plus seven?", "twelve"),),
    (T("What's the biggest animal in the world?", "whale"),),
    (T("Can you give me a word that rhymes with cat?", ("hat", "bat", "mat", "rat", "sat", "fat", "pat", "chat", "flat", "splat", "brat", "spat", "vat", "gnat"), kind="request"),),
    (T("How do you say good morning in Spanish?", ("buenos días", "buenos dias"), kind="request"),),
    (T("Could you count from one to five for me?", "one", "two", "three", "four", "five", kind="request"),),
    (T("Name a fruit that is yellow.", ("banana", "lemon", "pineapple", "mango", "grapefruit"), kind="request"),),
    (T("My favourite colour is green.", ("green",), kind="small talk"),
     T("So what's my favourite colour?", "green", kind="follow-up")),
    (T("I have a dog called Biscuit.", ("biscuit", "dog"), kind="small talk"),
     T("What's my dog's name?", "biscuit", kind="follow-up")),
    (T("I live in Lisbon.", ("lisbon", "portugal"), kind="small talk"),
     T("Which country is that in?", "portugal", kind="follow-up")),
    (T("Who was the first person to walk on the moon?", "armstrong"),
     T("What year did he do that?", ("nineteen sixty-nine", "nineteen sixty nine"), kind="follow-up")),
    (T("My name is Sam.", "sam", kind="small talk"),
     T("Do you remember my name?", "sam", kind="follow-up")),
    (T("I'm going to Paris next week.", ("paris", "trip", "fun", "great", "wonderful", "exciting", "lovely"), kind="small talk"),
     T("What famous tower should I visit there?", "eiffel", kind="follow-up")),
    (T("Let's talk about cats.", ("cat",), kind="small talk"),
     T("How many legs do they have?", "four", kind="follow-up")),
    (T("I'm thinking of the number seven.", ("seven",), kind="small talk"),
     T("What number was I thinking of?", "seven", kind="follow-up")),
    (T("What's the biggest planet in our solar system?", "jupiter"),
     T("Is it bigger than Earth?", "yes", kind="follow-up")),
    # Asked for its own taste: any answer is right that a person would give (never "as an AI, I have no preferences").
    (T("What would you recommend for dinner tonight?", kind="opinion"),),
    (T("What's your favourite movie?", kind="opinion"),),
    (T("Which is better, cats or dogs?", kind="opinion"),),
    (T("What music do you like?", kind="opinion"),),
    (T("What's the best season of the year?", kind="opinion"),),
    (T("What would you do with a free afternoon?", kind="opinion"),),
    (T("Thanks, that was really helpful.", ("welcome", "glad", "pleasure", "happy", "anytime"), kind="small talk"),),
)

# What must never reach speech synthesis: list markers, markdown, emoji; and figures (said as words instead).
_LIST_OR_MARKUP = re.compile(r"(^|\s)(\d+[.)]|[-*•+])\s|[*_#`|\[\]]|https?://")
_PICTOGRAPH = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf]")
_FIGURE = re.compile(r"\d")


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9'áéíóúñ\- ]+", " ", text.lower().replace("’", "'")).split())


def has_fact(reply: str, spellings: tuple[str, ...]) -> bool:
    """Whether any spelling is in reply as whole words (a plural counts: "whale" is in "whales")."""
    words = normalise(reply)
    return any(re.search(rf"(?<![\w'-]){re.escape(normalise(s))}(?:s|es)?(?![\w'-])", words) for s in spellings)


def tts_sentences(chunks) -> list[str]:
    """The sentences speech synthesis would get from a reply stream, as the voice loop splits them."""
    splitter = SentenceSplitter()
    out: list[str] = []
    for chunk in spoken_stream(chunks):
        out.extend(splitter.push(chunk))
    out.extend(splitter.flush())
    return out


def run_conversations(agent, conversations=CONVERSATIONS) -> list[dict[str, Any]]:
    results = []
    for number, conversation in enumerate(conversations):
        history: list[tuple[str, str]] = []
        if hasattr(agent, "prepare"):
            agent.prepare(history)  # the prompt prefix, as the app does when a session starts
        for turn in conversation:
            started = time.perf_counter()
            first: list[float] = []

            def timed(stream):
                for chunk in stream:
                    if not first:
                        first.append(time.perf_counter() - started)
                    yield chunk

            written = tts_sentences(timed(agent.stream_reply(turn.said, history)))
            total = time.perf_counter() - started
            sentences = [s for s in written if in_character(s)]  # what the voice loop says
            reply = " ".join(sentences)
            missing = [f[0] for f in turn.facts if not has_fact(reply, f)]
            out_of_character = bool(OUT_OF_CHARACTER.search(" ".join(written)))  # the model's own text, said or not
            results.append({
                "conversation": number, "kind": turn.kind, "said": turn.said, "reply": reply,
                "correct": not missing and not out_of_character, "missing": missing,
                "out_of_character": out_of_character,
                "markup_to_tts": [s for s in sentences if _LIST_OR_MARKUP.search(s) or _PICTOGRAPH.search(s)],
                "figures_to_tts": [s for s in sentences if _FIGURE.search(s)],
                "sentences": len(sentences),
                "first_text_s": round(first[0], 3) if first else None, "reply_s": round(total, 3),
            })
            history.append((turn.said, reply))
            if hasattr(agent, "prepare"):
                agent.prepare(history)  # between turns, as the voice loop does
    return results


def score(results: list[dict[str, Any]]) -> dict[str, Any]:
    def share(rows):
        return round(sum(r["correct"] for r in rows) / len(rows), 3) if rows else None

    follow_ups = [r for r in results if r["kind"] == "follow-up"]
    return {
        "turns": len(results),
        "correct_share": share(results),
        "follow_up_share": share(follow_ups),
        "by_kind": {k: share([r for r in results if r["kind"] == k]) for k in sorted({r["kind"] for r in results})},
        "replies_out_of_character": sum(r["out_of_character"] for r in results),
        "replies_with_markup_to_tts": sum(bool(r["markup_to_tts"]) for r in results),
        "replies_with_figures_to_tts": sum(bool(r["figures_to_tts"]) for r in results),
        "sentences_median": sorted(r["sentences"] for r in results)[len(results) // 2] if results else None,
        "first_text_s": summarize([r["first_text_s"] for r in results if r["first_text_s"] is not None]),
        "reply_s": summarize([r["reply_s"] for r in results]),
        "targets": {"correct_share >= 0.8": (share(results) or 0) >= 0.8,
                    "follow_up_share >= 0.8": (share(follow_ups) or 0) >= 0.8,
                    "replies_with_markup_to_tts == 0": not any(r["markup_to_tts"] for r in results)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.agent_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--llm", choices=tuple(MODELS), default=DEFAULT_MODEL, help="the language model")
    parser.add_argument("--llm-threads", type=int, default=None, help="CPU threads for the language model (default: picked by cores)")
    parser.add_argument("--preset", choices=tuple(PERSONAS), default="ada", help="whose persona answers")
    parser.add_argument("--conversations", type=int, default=len(CONVERSATIONS), help=f"how many of the {len(CONVERSATIONS)} conversations")
    args = parser.parse_args(argv)
    if not 1 <= args.conversations <= len(CONVERSATIONS):
        parser.error(f"--conversations must be between 1 and {len(CONVERSATIONS)}")
    try:
        llm = LocalLLM(args.llm, threads=args.llm_threads)
        agent = LocalLLMAgent(llm, PERSONAS[args.preset])
        results = run_conversations(agent, CONVERSATIONS[: args.conversations])
    except KeyboardInterrupt:
        return report_failure("interrupted", args.json, EXIT_INTERRUPTED)
    except (ValueError, OSError, RuntimeError) as err:
        return report_failure(f"{type(err).__name__}: {err}", args.json)
    report = {
        "benchmark": "reply agent: spoken-style questions scored on facts",
        "model": llm.describe(), "load_s": round(llm.load_s, 2), "preset": args.preset,
        "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        **score(results), "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            mark = "ok " if r["correct"] else "BAD"
            print(f"{mark} [{r['kind']}] {r['said']!r} -> {r['reply']!r} ({r['first_text_s']} s to first text)")
        print({k: v for k, v in report.items() if k != "results"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
