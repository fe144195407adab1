"""Reply text made fit to be said: the stream a language model writes, rewritten for the voice.

A model asked for short spoken replies still writes numbered lists, markdown, emoji and figures now
and then. `spoken_stream` rewrites the stream before the loop splits it into sentences, so the
transcript shows what the character says: list markers and headings dropped (each item ends as a
sentence), emphasis, code marks, links, tags and pictographs removed (`tts.clean_for_speech`), and
numbers, money, percentages, ordinals and a few symbols written as words ("3.5 km" -> "three point
five kilometres"). Text is released up to the last whitespace, so a word split across chunks is
rewritten whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from .tts import clean_for_speech, ends_a_sentence

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                  "nine": "ninth", "twelve": "twelfth"}


def _below_thousand(n: int) -> str:
    words = []
    if n >= 100:
        words.append(f"{_ONES[n // 100]} hundred")
        n %= 100
        if n:
            words.append("and")
    if n >= 20:
        words.append(_TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else ""))
    elif n or not words:
        words.append(_ONES[n])
    return " ".join(words)


def integer_words(n: int) -> str:
    """12 -> "twelve", 1005 -> "one thousand and five", -3 -> "minus three"."""
    if n < 0:
        return "minus " + integer_words(-n)
    if n < 1000:
        return _below_thousand(n)
    for scale, name in _SCALES:
        if n >= scale:
            head, rest = divmod(n, scale)
            tail = "" if rest == 0 else (" and " if rest < 100 else " ") + integer_words(rest)
            return f"{integer_words(head)} {name}{tail}"
    raise AssertionError(n)


def year_words(n: int) -> str:
    """A year as said: 1969 -> "nineteen sixty-nine", 2005 -> "two thousand and five", 1900 -> "nineteen hundred"."""
    if 2000 <= n <= 2009:
        return integer_words(n)
    head, tail = divmod(n, 100)
    if tail == 0:
        return f"{integer_words(head)} hundred"
    return f"{integer_words(head)} {'oh ' + _ONES[tail] if tail < 10 else integer_words(tail)}"


def ordinal_words(n: int) -> str:
    """3 -> "third", 21 -> "twenty-first", 100 -> "one hundredth"."""
    words = integer_words(n)
    head, sep, last = words.rpartition("-") if "-" in words.split()[-1] else words.rpartition(" ")
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def number_words(text: str) -> str:
    """A figure as words: "3" "3.25" "1,200" "-4"; a decimal's digits one by one ("three point two five")."""
    negative = text.startswith(("-", "−"))
    digits = text.lstrip("-−").replace(",", "")
    whole, _, fraction = digits.partition(".")
    words = integer_words(int(whole or "0"))
    if fraction:
        words += " point " + " ".join(_ONES[int(d)] for d in fraction)
    return ("minus " if negative else "") + words


_UNITS = {"km": "kilometres", "kg": "kilograms", "cm": "centimetres", "mm": "millimetres", "m": "metres",
          "g": "grams", "mph": "miles per hour", "km/h": "kilometres per hour", "°c": "degrees Celsius",
          "°f": "degrees Fahrenheit", "°": "degrees", "%": "percent", "h": "hours", "s": "seconds",
          "min": "minutes", "ml": "millilitres", "l": "litres", "lbs": "pounds", "lb": "pounds", "ft": "feet"}
_CURRENCY = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
             "€": ("euro", "euros", "cent", "cents")}
_SYMBOLS = {"&": " and ", "+": " plus ", "=": " equals ", "@": " at ", "×": " times ", "÷": " divided by ",
            "≈": " about ", "~": " about "}
_FIGURE = r"[-−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-−]?\d+(?:\.\d+)?"
_MONEY = re.compile(rf"([$£€])({_FIGURE})(?:\s?(million|billion|thousand))?")
_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
_DECADE = re.compile(r"\b(1\d|20)(\d)0s\b")
_YEAR = re.compile(r"(?<![\d.,$£€])(1[1-9]\d\d|20\d\d)(?!\d|[.,]\d|\s?(?:%|km|kg|m|g|cm|mm)\b)")
_RANGE = re.compile(rf"(?<![\w.])({_FIGURE})\s?[-–]\s?({_FIGURE})(?!\w|\.\d)")
_WITH_UNIT = re.compile(rf"(?<![\w.])({_FIGURE})\s?(km/h|°[CcFf]|°|%|mph|km|kg|cm|mm|ml|lbs|lb|ft|min|m|g|h|s|l)(?![\w/])")
_BARE = re.compile(rf"(?<![\w.])({_FIGURE})(?![\w])")
_TIME = re.compile(r"\b(\d{1,2}):(\d{2})\b")


def _money(m: re.Match) -> str:
    one, many, small_one, small_many = _CURRENCY[m.group(1)]
    amount, scale = m.group(2).replace(",", ""), m.group(3)
    if scale:
        return f"{number_words(amount)} {scale} {many}"
    whole, _, cents = amount.partition(".")
    words = f"{integer_words(int(whole))} {one if int(whole) == 1 else many}"
    if cents and int(cents[:2].ljust(2, "0")):
        c = int(cents[:2].ljust(2, "0"))
        words += f" and {integer_words(c)} {small_one if c == 1 else small_many}"
    return words


def _clock(m: re.Match) -> str:
    hours, minutes = int(m.group(1)), int(m.group(2))
    if hours > 23 or minutes > 59:
        return m.group(0)
    if minutes == 0:
        return f"{integer_words(hours)} o'clock"
    return f"{integer_words(hours)} {'oh ' + _ONES[minutes] if minutes < 10 else integer_words(minutes)}"


def say_figures(text: str) -> str:
    """Numbers and symbols in text written as words, as a listener would hear them read."""
    text = _MONEY.sub(_money, text)
    text = _TIME.sub(_clock, text)
    text = _ORDINAL.sub(lambda m: ordinal_words(int(m.group(1))), text)
    text = _DECADE.sub(lambda m: year_words(int(m.group(1) + m.group(2) + "0")).replace("ty", "ties")
                       if m.group(2) != "0" else year_words(int(m.group(1) + "00")) + "s", text)
    text = _YEAR.sub(lambda m: year_words(int(m.group(1))), text)
    text = _RANGE.sub(lambda m: f"{number_words(m.group(1))} to {number_words(m.group(2))}", text)
    text = _WITH_UNIT.sub(lambda m: f"{number_words(m.group(1))} {_UNITS[m.group(2).lower()]}", text)
    text = _BARE.sub(lambda m: number_words(m.group(1)), text)
    for symbol, words in _SYMBOLS.items():
        text = text.replace(symbol, words)
    return text


# A line's own markup: a heading, a quote, a list marker ("- ", "* ", "• ", "1. ", "2) ").
_LINE_LEAD = re.compile(r"^\s*(?:#{1,6}\s+|>\s*|[-*+•]\s+|\d{1,2}[.)]\s+)")
_ENDS_SENTENCE = re.compile(r"[.!?…][\"')\]]*$")
_ENDS_CLAUSE = re.compile(r"[,;:]$")
# A figure at the end of released text waits for the next word, which may be its unit ("3 km").
_TRAILING_FIGURE = re.compile(r"[$£€]?[-−]?\d[\d.,:]*\s+$")


_END_MARK = re.compile(r"[.!?…][\"')\]]*(?=\s)")
_BARE_MARKER = re.compile(r"^\s*(?:[-*+•]|\d{1,2}[.)])\s*$")


def sentence_ends(text: str) -> list[int]:
    """Where the sentences of raw reply text end as the voice will say them (SpokenText): just past end
    punctuation that ends a sentence (tts.ends_a_sentence: not "F. Scott", not a list item's "2.") and is followed
    by whitespace, and at each line break after a line that said something without it (a list item "1. Tea",
    or "Here are three:")."""
    ends = [m.end() for m in _END_MARK.finditer(text) if ends_a_sentence(text, m.start())]
    start = 0
    for line in text.split("\n")[:-1]:
        lead = _LINE_LEAD.match(line)
        said = line[lead.end():].strip() if lead else line.strip()
        if said and not _ENDS_SENTENCE.search(said):
            ends.append(start + len(line))
        start += len(line) + 1
    return sorted(ends)


def for_speech(text: str) -> str:
    """A piece of reply text with its markup gone and its figures in words, whitespace collapsed."""
    # Markup first (it holds * and # that would otherwise read as words), then the figures.
    return " ".join(say_figures(clean_for_speech(text)).split())


class SpokenText:
    """Streaming rewrite of reply text for speech: push chunks, take the text that is ready to say.

    Text is released up to its last whitespace (so the first sentence reaches speech synthesis as soon as the
    model has written it), but not inside an unclosed [link](...) and not before a line's leading markup is
    known. A line break ends a sentence: a line (a list item, a heading) that said something without end
    punctuation gets a full stop."""

    def __init__(self) -> None:
        self._buffer = ""
        self._line_start = True  # nothing of the current line said yet
        self._last = ""  # the text said last in the current line
        self._space_owed = False  # the last piece said wants a space before the next
        self._listing = False  # a line began with a list marker

    def push(self, chunk: str) -> str:
        self._buffer += chunk
        out = []
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            out.append(self._say(line, line_ends=True))
        cut = max(self._buffer.rfind(" "), self._buffer.rfind("\t"))
        ready = self._buffer[: cut + 1]
        figure = _TRAILING_FIGURE.search(ready)
        if figure:
            cut, ready = figure.start() - 1, ready[: figure.start()]
        if cut >= 0 and ready.count("[") <= ready.count("]") and ready.count("(") <= ready.count(")"):
            self._buffer = self._buffer[cut + 1:]
            out.append(self._say(ready, line_ends=False))
        return "".join(out)

    def flush(self) -> str:
        text, self._buffer = self._buffer, ""
        return self._say(text, line_ends=True)

    def _say(self, text: str, line_ends: bool) -> str:
        if self._line_start and self._listing and line_ends and _BARE_MARKER.match(text):
            text = ""  # the next item's number, and the reply ended before its words: "2."
        if self._line_start and text.strip():
            lead = _LINE_LEAD.match(text)
            if lead:
                text = text[lead.end():]
                self._listing = self._listing or not lead.group().strip().startswith(("#", ">"))
            self._line_start = False
        spoken = for_speech(text)
        if line_ends and (spoken or self._last) and not _ENDS_SENTENCE.search(spoken or self._last):
            # A line break ends a sentence: "Here is how:" -> "Here is how."
            if _ENDS_CLAUSE.search(spoken):
                spoken = spoken[:-1]
            spoken += "."
        if line_ends:
            self._line_start, self._last = True, ""
        elif spoken:
            self._last = spoken
        if not spoken:
            return ""
        # Pieces are joined by one space; a full stop closing an earlier piece of its line joins with none. A piece
        # that ends a sentence gets its space at once, so the sentence splitter can release it now.
        out = (" " if self._space_owed and spoken != "." else "") + spoken
        self._space_owed = not _ENDS_SENTENCE.search(spoken)
        return out if self._space_owed else out + " "


def spoken_stream(chunks: Iterable[str]) -> Iterator[str]:
    """The reply stream rewritten for speech (see SpokenText); empty pieces are left out."""
    spoken = SpokenText()
    for chunk in chunks:
        text = spoken.push(chunk)
        if text:
            yield text
    text = spoken.flush()
    if text:
        yield text
