"""The step benchmark's energy figures: NVML's counter read around the timed steps (lab/gpu_energy.py)."""

import logging
import time

import pytest
import torch

from lab import bench
from lab.gpu_energy import EnergyMeter, EnergyWindow


class _FakeMeter:
    """An energy counter that moves by `mj_per_read` at every read and a constant SM clock."""

    def __init__(self, start_mj: int = 5_000, mj_per_read: int = 0, clock_mhz: int = 1500):
        self.mj, self.mj_per_read, self.clock = start_mj, mj_per_read, clock_mhz
        self.reads = 0

    def millijoules(self) -> int:
        self.reads += 1
        value = self.mj
        self.mj += self.mj_per_read
        return value

    def sm_clock_mhz(self) -> int:
        return self.clock


def test_a_window_gives_joules_per_step_mean_watts_and_the_median_clock():
    meter = _FakeMeter(start_mj=1_000_000, mj_per_read=3_000, clock_mhz=1485)
    ticks = iter([10.0, 10.5])  # the window lasts 0.5 s by its clock
    with EnergyWindow(meter, sample_s=0.001, clock=lambda: next(ticks)) as window:
        time.sleep(0.01)  # a few clock samples
    r = window.result(steps=4)
    assert r["joules_per_step"] == pytest.approx(3.0 / 4)  # 3,000 mJ between the two reads, over 4 steps
    assert r["watts"] == pytest.approx(3.0 / 0.5)
    assert r["seconds"] == pytest.approx(0.5)
    assert r["sm_clock_mhz"] == 1485 and len(window.clocks) >= 1
    assert meter.reads == 2


def test_a_window_without_a_meter_measures_nothing_and_the_bench_adds_no_fields():
    with EnergyWindow(None) as window:
        pass
    assert window.result(steps=3) == {}
    assert bench._energy_stats(window, 3) == {}


def test_a_window_with_no_steps_is_an_error_that_says_so():
    with EnergyWindow(_FakeMeter(mj_per_read=10), sample_s=0.001) as window:
        time.sleep(0.002)
    with pytest.raises(ValueError, match="at least one step"):
        window.result(steps=0)


def test_the_step_benchmark_names_its_energy_figures():
    ticks = iter([0.0, 2.0])
    with EnergyWindow(_FakeMeter(mj_per_read=140_000, clock_mhz=1470), sample_s=0.001, clock=lambda: next(ticks)) as window:
        time.sleep(0.005)
    assert bench._energy_stats(window, 20) == {"step_joules": pytest.approx(7.0), "step_watts": pytest.approx(70.0),
                                               "sm_clock_mhz": 1470}
    assert bench._energy_stats(window, 20, "_at_realtime_cadence", clock=False) == {
        "step_joules_at_realtime_cadence": pytest.approx(7.0), "step_watts_at_realtime_cadence": pytest.approx(70.0)}


def test_the_window_holds_the_timed_steps_and_not_the_warm_up():
    """`_timed_steps` enters the energy window after its warm-up steps and leaves it after the last timed one."""
    from tests.helpers import started_tiny_session

    session, audio = started_tiny_session()
    seen = []

    class Recording(EnergyWindow):
        def __enter__(self):
            seen.append(session.steps_done)
            return super().__enter__()

        def __exit__(self, *exc):
            seen.append(session.steps_done)
            return super().__exit__(*exc)

    window = Recording(_FakeMeter(mj_per_read=1_000), sample_s=0.001)
    times, resets = bench._timed_steps(session, audio, 4, 2, torch.device("cpu"), resets=False, energy=window)
    assert seen == [2, 2 + len(times) + len(resets)] and len(times) == 4
    assert window.result(len(times) + len(resets))["joules_per_step"] == pytest.approx(1.0 / 4)


def test_no_meter_on_the_cpu_or_without_nvml(caplog):
    assert EnergyMeter.open(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        return
    with caplog.at_level(logging.INFO, logger="talkloop.bench"):
        assert EnergyMeter.open(torch.device("cuda", 0), library="libnvidia-ml-missing.so") is None
    assert "NVML" in caplog.text and "did not load" in caplog.text


@pytest.fixture
def gpu_meter():
    """GPU 0's meter, closed after the test; the test skips where that GPU's NVML has no energy counter."""
    meter = EnergyMeter.open(torch.device("cuda", 0))
    if meter is None:
        pytest.skip("this GPU's NVML has no energy counter (Volta and later data-centre GPUs have one)")
    with meter:
        yield meter


@pytest.mark.gpu
def test_the_gpu_energy_counter_moves_while_the_gpu_works(gpu_meter):
    device, meter = torch.device("cuda", 0), gpu_meter
    assert meter.power_limit_w() > 50 and meter.max_sm_clock_mhz() > 500
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    with EnergyWindow(meter, sample_s=0.01) as window:
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize(device)
    r = window.result(steps=1)
    # a second of matmuls: well above idle power and within what one board can draw
    assert 50 < r["watts"] < 2000 and r["joules_per_step"] == pytest.approx(r["watts"] * r["seconds"])
    assert 200 < r["sm_clock_mhz"] <= meter.max_sm_clock_mhz()


def test_sustained_energy_is_empty_without_a_meter():
    assert bench.sustained_energy(lambda: None, torch.device("cpu"), None) == {}


@pytest.mark.gpu
def test_sustained_energy_counts_every_call_in_its_window(gpu_meter):
    device, meter = torch.device("cuda", 0), gpu_meter
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    calls = []

    def matmul():
        calls.append(None)  # once per capture and warm-up only: replays run on the GPU alone
        torch.mm(a, a)
    r = bench.sustained_energy(matmul, device, meter, seconds=0.5, calls=10)
    one = bench.graph_call_ms(lambda: torch.mm(a, a), device, 5, calls=10)  # ms per call, clock unconstrained
    assert len(calls) == 20  # the warm-up call and the capture, each of 10 calls
    assert r["joules_per_call"] > 0 and 50 < r["watts"] < 2000
    assert 0.5 * 1000 * one < r["us_per_call"] < 5 * 1000 * one  # host gaps between replays add a little


class _FakeNvml:
    """NVML's entry points as EnergyMeter.open calls them, each answering `codes[name]` (0: success); counts the
    callers that nvmlInit_v2 and nvmlShutdown keep."""

    def __init__(self, **codes: int):
        self.codes, self.users = codes, 0

    def nvmlInit_v2(self) -> int:
        rc = self.codes.get("nvmlInit_v2", 0)
        self.users += rc == 0
        return rc

    def nvmlShutdown(self) -> int:
        self.users -= 1
        return 0

    def __getattr__(self, name: str):
        if not name.startswith("nvmlDevice"):
            raise AttributeError(name)
        return lambda *args: self.codes.get(name, 0)


@pytest.fixture
def fake_nvml(monkeypatch):
    """EnergyMeter.open on a fake CUDA device, with the fake NVML that `make(**codes)` returns loaded."""
    import types

    from lab import gpu_energy

    monkeypatch.setattr(gpu_energy.torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="0"))

    def make(**codes: int) -> _FakeNvml:
        nvml = _FakeNvml(**codes)
        monkeypatch.setattr(gpu_energy.ctypes, "CDLL", lambda library: nvml)
        return nvml
    return make


def test_an_open_meter_holds_nvml_until_it_is_closed(fake_nvml):
    nvml = fake_nvml()
    meter = EnergyMeter.open(torch.device("cuda", 0))
    assert meter is not None and nvml.users == 1
    with meter:
        meter.millijoules()
    assert nvml.users == 0
    meter.close()  # twice: nothing more to release
    assert nvml.users == 0
    with pytest.raises(RuntimeError, match="the energy meter is closed"):
        meter.millijoules()


@pytest.mark.parametrize("failing", ["nvmlDeviceGetHandleByUUID", "nvmlDeviceGetTotalEnergyConsumption"])
def test_a_gpu_that_gives_no_energy_figures_leaves_nvml_as_it_found_it(fake_nvml, failing, caplog):
    nvml = fake_nvml(**{failing: 3})  # NVML_ERROR_NOT_SUPPORTED
    with caplog.at_level(logging.INFO, logger="talkloop.bench"):
        assert EnergyMeter.open(torch.device("cuda", 0)) is None
    assert nvml.users == 0
    assert f"{failing} returned NVML error 3" in caplog.text


def test_an_nvml_that_does_not_start_is_not_shut_down(fake_nvml):
    nvml = fake_nvml(nvmlInit_v2=9)
    assert EnergyMeter.open(torch.device("cuda", 0)) is None
    assert nvml.users == 0
