"""spec auto: the app serves the largest shipped character that keeps real time on this machine."""

import pytest
import torch

import app.engine_host as engine_host
from app.config import AppConfig, build_config
from app.engine_host import choose_spec, steps_per_second
from engine.build import load
from engine.config import get_spec


class Measured:
    """Stands in for loading and timing a character: each spec's steps a second are given."""

    def __init__(self, rates: dict[str, float]) -> None:
        self.rates = rates
        self.loaded: list[str] = []

    def load(self, options, spec, placement):
        self.loaded.append(spec.name)
        return type("Loaded", (), {"spec": spec.name, "close": lambda self: None})()

    def steps_per_second(self, loaded, options, spec, steps=3):
        return self.rates[spec.name]


@pytest.mark.parametrize("rates, chosen, below", [
    ({"demo": 30.0, "demo-cpu": 60.0}, "demo", False),  # a GPU: the largest
    ({"demo": 2.0, "demo-cpu": 11.0}, "demo-cpu", False),  # two cores
    ({"demo": 7.0, "demo-cpu": 11.0}, "demo-cpu", False),  # demo is above 6 but not 1.25x above it
    ({"demo": 1.0, "demo-cpu": 4.0}, "demo-cpu", True),  # nothing keeps real time: the fastest, and said so
])
def test_auto_takes_the_largest_character_that_keeps_real_time(monkeypatch, rates, chosen, below):
    measured = Measured(rates)
    monkeypatch.setattr(engine_host, "load", measured.load)
    monkeypatch.setattr(engine_host, "steps_per_second", measured.steps_per_second)
    name, why = choose_spec(AppConfig(device="cpu"), torch.device("cpu"))
    assert name == chosen
    assert ("BELOW REAL TIME" in why) is below
    assert all(f"{spec} {rate:.1f} steps/s" in why for spec, rate in rates.items() if spec in measured.loaded)
    assert measured.loaded[0] == "demo"  # the largest is tried first


def test_the_measurement_runs_the_real_character_and_counts_steps():
    spec = get_spec("tiny")
    config = AppConfig(device="cpu", spec="tiny")
    options = engine_host.engine_options(config, torch.device("cpu"))
    loaded = load(options, spec, None)
    rate = steps_per_second(loaded, options, spec, steps=2)
    assert 0 < rate < 1e5


def test_the_measurement_hands_an_audio_conditioned_codec_its_rows():
    from dataclasses import replace

    from engine.codec import build_codec, codec_config

    spec = get_spec("tiny")
    config = AppConfig(device="cpu", spec="tiny")
    options = engine_host.engine_options(config, torch.device("cpu"))
    loaded = load(options, spec, None)
    loaded = replace(loaded, codec=build_codec(spec, cfg=codec_config(spec, audio=True)))
    assert loaded.codec.audio_mels and 0 < steps_per_second(loaded, options, spec, steps=2) < 1e5


def test_auto_is_a_spec_the_config_takes_and_an_unknown_one_is_refused():
    assert build_config(None, {}).spec == "auto"
    with pytest.raises(ValueError, match="unknown spec 'huge'; known: auto"):
        build_config(None, {"spec": "huge"})
