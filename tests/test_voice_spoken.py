"""voice/spoken.py: reply text rewritten for speech, whole or streamed in any chunking."""

import random

import pytest

from voice.spoken import integer_words, ordinal_words, say_figures, sentence_ends, spoken_stream, year_words
from voice.tts import split_sentences


@pytest.mark.parametrize("n, words", [
    (0, "zero"), (7, "seven"), (13, "thirteen"), (40, "forty"), (42, "forty-two"), (100, "one hundred"),
    (115, "one hundred and fifteen"), (1005, "one thousand and five"), (1200, "one thousand two hundred"),
    (384400, "three hundred and eighty-four thousand four hundred"), (2_000_000, "two million"), (-3, "minus three"),
])
def test_integers_in_words(n, words):
    assert integer_words(n) == words


def test_years_and_ordinals_in_words():
    assert [year_words(y) for y in (1969, 1900, 2005, 2024, 1805)] == [
        "nineteen sixty-nine", "nineteen hundred", "two thousand and five", "twenty twenty-four", "eighteen oh five"]
    assert [ordinal_words(n) for n in (1, 2, 3, 5, 12, 21, 40, 100)] == [
        "first", "second", "third", "fifth", "twelfth", "twenty-first", "fortieth", "one hundredth"]


@pytest.mark.parametrize("text, said", [
    ("Spiders have 8 legs.", "Spiders have eight legs."),
    ("It costs $4.50, or £3.", "It costs four dollars and fifty cents, or three pounds."),
    ("About 384,400 km away.", "About three hundred and eighty-four thousand four hundred kilometres away."),
    ("In 1969, Apollo 11 landed.", "In nineteen sixty-nine, Apollo eleven landed."),
    ("Water boils at 100°C.", "Water boils at one hundred degrees Celsius."),
    ("About 60% of it, 3.5 m tall.", "About sixty percent of it, three point five metres tall."),
    ("Meet at 7:30 or 10:00.", "Meet at seven thirty or ten o'clock."),
    ("Born on the 21st, in the 1990s.", "Born on the twenty-first, in the nineteen nineties."),
    ("Pages 10-20.", "Pages ten to twenty."),
])
def test_figures_are_said_as_words(text, said):
    assert " ".join(say_figures(text).split()) == said


LIST_REPLY = ("Sure! Here is how:\n1. Boil **water** in a kettle\n2. Add the tea 🍵\n- Steep for 3 min\n\n"
              "### Enjoy\nSee [the guide](https://example.org/tea) for more.")
SAID = "Sure! Here is how. Boil water in a kettle. Add the tea. Steep for three minutes. Enjoy. See the guide for more."


def test_a_written_list_is_said_as_sentences_in_any_chunking():
    assert "".join(spoken_stream([LIST_REPLY])).strip() == SAID
    rng = random.Random(0)
    for _ in range(20):  # tokens arrive in pieces of any size: the result is the same
        pieces, i = [], 0
        while i < len(LIST_REPLY):
            n = rng.randint(1, 6)
            pieces.append(LIST_REPLY[i:i + n])
            i += n
        assert "".join(spoken_stream(pieces)).strip() == SAID


def test_text_is_released_as_soon_as_a_word_is_whole():
    stream = spoken_stream(iter(["Hello", " there", ". I am", " Ada", "."]))
    assert next(stream) == "Hello"  # out once " there" shows the word was whole
    assert "".join(stream).strip() == "there. I am Ada."


def test_a_figure_waits_for_its_unit():
    assert "".join(spoken_stream(["It is 3 ", "km away."])).strip() == "It is three kilometres away."


def test_sentence_ends_count_the_sentences_the_voice_says():
    """A reply's sentences counted on its raw text (where the agent stops a reply) are the sentences it is said in:
    a list item ends one at its line break, and neither an item's number nor an initial ends one."""
    for reply in (LIST_REPLY, "My pick:\n1. The Great Gatsby by F. Scott Fitzgerald\n2. Emma by Jane Austen.\n",
                  "Ask Dr. Lee. She knows e.g. the moon. So do I. "):
        said = list(split_sentences(spoken_stream([reply])))
        assert len(sentence_ends(reply + "\n")) == len(said), (reply, said)


def test_a_reply_cut_after_a_list_number_does_not_say_the_number():
    assert "".join(spoken_stream(["Two books:\n1. Emma\n2."])).strip() == "Two books. Emma."
    assert "".join(spoken_stream(["5."])).strip() == "five."  # a reply that is only a figure is said
