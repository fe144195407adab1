"""The engine on a CPU shared with the voice models and the browser: its threads, its numbers (bfloat16 where the
CPU multiplies it in hardware, against float32, the reference), and the page re-rendering only what changed."""

import gradio as gr
import numpy as np
import pytest
import torch

import app.engine_host as engine_host
from app.config import AppConfig, build_config
from app.ui import changed_only
from engine.build import build_engine, load
from engine.config import get_spec
from engine.options import EngineOptions, check_options, codec_dtype, model_dtype, parse_options


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (4, 2), (16, 8)])
def test_the_engine_takes_half_the_cores_by_default(monkeypatch, cores, threads):
    monkeypatch.setattr(engine_host.os, "cpu_count", lambda: cores)
    options = engine_host.engine_options(AppConfig(device="cpu"), torch.device("cpu"))
    assert options.threads == threads


def test_engine_threads_is_a_setting_and_only_for_an_engine_in_this_process_on_the_cpu():
    assert engine_host.engine_options(AppConfig(device="cpu", engine_threads=3), torch.device("cpu")).threads == 3
    assert engine_host.engine_options(AppConfig(device="cpu", tp=2), torch.device("cpu")).threads is None
    with pytest.raises(ValueError, match="engine_threads must be >= 1, got 0"):
        build_config(None, {"engine_threads": 0})
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        check_options(EngineOptions(device="cpu", threads=0))


def test_loading_an_engine_on_the_cpu_sets_its_threads():
    spec = get_spec("tiny")
    before = torch.get_num_threads()
    load(EngineOptions(spec="tiny", device="cpu", threads=1), spec, None)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


@pytest.mark.parametrize("has_bf16, asked, chosen", [
    (True, "auto", "bfloat16"), (False, "auto", "auto"), (True, "float32", "float32"), (False, "bfloat16", "bfloat16"),
])
def test_the_app_takes_bfloat16_on_a_cpu_that_multiplies_it(monkeypatch, has_bf16, asked, chosen):
    monkeypatch.setattr(engine_host, "cpu_has_bf16", lambda: has_bf16)
    options = engine_host.engine_options(AppConfig(device="cpu", engine_dtype=asked), torch.device("cpu"))
    assert options.dtype == chosen
    assert model_dtype(options, torch.device("cpu")) == (torch.float32 if chosen in ("auto", "float32") else torch.bfloat16)


def test_dtype_auto_keeps_the_defaults_and_a_bad_dtype_is_refused():
    auto = EngineOptions()
    assert model_dtype(auto, torch.device("cpu")) == torch.float32 and codec_dtype(auto) == torch.float32
    assert model_dtype(auto, torch.device("cuda")) == torch.bfloat16
    assert parse_options("reference,dtype=bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, got 'fp16'"):
        check_options(EngineOptions(dtype="fp16"))
    with pytest.raises(ValueError, match="engine_dtype must be"):
        build_config(None, {"engine_dtype": "fp16"})


def _frames(dtype: str, steps: int = 8) -> np.ndarray:
    spec = get_spec("demo-cpu")
    built = build_engine(EngineOptions(spec="demo-cpu", device="cpu", kv_dtype="fp32", dtype=dtype), spec, look="ada")
    try:
        assert built.trained
        speech = 0.1 * np.random.default_rng(0).standard_normal(16000 * 2).astype(np.float32)
        built.character.push_audio(speech, 16000)
        return np.stack([f.rgb for _ in range(steps) for f in built.character.make_step()]).astype(np.float32)
    finally:
        built.close()


def test_bfloat16_draws_the_float32_character_within_tolerance():
    """The shipped CPU character in bfloat16 (model and codec) against float32, the reference: per pixel, on
    0..255, a mean difference below 1.5 and 99% of them below 12 (one run here: 0.40 and 4)."""
    reference, fast = _frames("float32"), _frames("bfloat16")
    difference = np.abs(reference - fast)
    assert difference.mean() < 1.5
    assert np.percentile(difference, 99) < 12
    assert fast.std(axis=0).mean() > 1.0  # a moving character, not one picture in both


def test_the_page_is_sent_only_the_panels_that_changed():
    first = (["hi"], "<table>1</table>", "health 24 fps")
    assert changed_only(first, None) == first
    later = (["hi"], "<table>1</table>", "health 23 fps")
    sent = changed_only(later, first)
    assert sent[0] == gr.skip() and sent[1] == gr.skip() and sent[2] == "health 23 fps"


@pytest.mark.parametrize("cores, device, light_installed, chosen", [
    (2, "cpu", True, "qwen2.5-0.5b"),  # a small CPU machine: the lighter model
    (2, "cpu", False, "qwen2.5-1.5b"),  # ... unless it is not installed (and the page says how to install it)
    (4, "cpu", True, "qwen2.5-1.5b"),
    (16, "cpu", True, "qwen2.5-1.5b"),
])
def test_llm_auto_takes_the_lighter_model_only_on_a_small_cpu_machine(monkeypatch, cores, device, light_installed, chosen):
    import voice.llm
    from app.controller import choose_llm

    monkeypatch.setattr(voice.llm, "installed", lambda key: light_installed or key != "qwen2.5-0.5b")
    model, why = choose_llm(AppConfig(device=device), cores=cores)
    assert model == chosen and why.startswith("auto:")
    if cores <= 2 and not light_installed:
        assert 'pip install -e ".[lite]"' in why


def test_a_named_llm_is_taken_as_named():
    from app.controller import choose_llm

    assert choose_llm(AppConfig(device="cpu", llm="qwen2.5-1.5b"), cores=2) == ("qwen2.5-1.5b", "chosen")
    assert build_config(None, {}).llm == "auto"
    with pytest.raises(ValueError, match="llm must be"):
        build_config(None, {"llm": "gpt-4"})


def test_installed_checks_every_part_at_its_pinned_version(monkeypatch):
    import importlib.metadata

    from voice.llm import MODELS, installed

    model = MODELS["qwen2.5-0.5b"]
    versions = {model.distribution(i): model.version for i in range(1, model.parts + 1)}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name] if name in versions
                        else (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name)))
    assert installed("qwen2.5-0.5b")
    versions[model.distribution(2)] = "0.0.1"
    assert not installed("qwen2.5-0.5b")
    del versions[model.distribution(2)]
    assert not installed("qwen2.5-0.5b")


def test_cpu_share_times_every_case_and_refuses_bad_counts(capsys):
    from lab.cpu_share import main, run

    result = run("tiny", steps=2, warmup=0)
    cases = {(r["dtype"], r["threads"], r["case"]) for r in result["rows"]}
    assert {case for _, _, case in cases} == {"alone", "beside a busy core", "beside a Python thread busy 30%"}
    assert all(r["step_ms_median"] > 0 and r["step_ms_p90"] >= r["step_ms_median"] for r in result["rows"])
    assert result["real_time_step_ms"] == round(1000 * 4 / 24, 1)
    with pytest.raises(SystemExit):
        main(["--spec", "tiny", "--steps", "0"])
    assert "need --steps >= 1" in capsys.readouterr().err
