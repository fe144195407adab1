"""The GPU's energy counter, power limit and SM clock through NVML (the driver's library, through ctypes).

A benchmark that runs a GPU back to back for seconds meets its power limit: the driver then lowers the
SM clock until the board draws no more than the limit, and time per step follows energy per step. An
`EnergyWindow` around the timed steps reports both, so a benchmark can say which bound it hit:

    meter = EnergyMeter.open(device)          # None where NVML or its energy counter is missing (logged once)
    with EnergyWindow(meter) as window:
        run_steps()
    window.result(steps)  # {"joules_per_step", "watts", "sm_clock_mhz", "seconds"}
    if meter:
        meter.close()                         # NVML counts its users: each open meter is one

NVML's energy counter (millijoules since the driver loaded) exists on Volta and later data-centre GPUs.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import threading
import time
from typing import Callable

import torch

log = logging.getLogger("talkloop.bench")

_NVML_SUCCESS = 0
_NVML_CLOCK_SM = 1  # nvmlClockType_t: graphics 0, SM 1, memory 2


class EnergyMeter:
    """One GPU's NVML handle: its energy counter (mJ), power limit (W) and SM clocks (MHz)."""

    def __init__(self, nvml, handle) -> None:
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, device: torch.device, library: str = "libnvidia-ml.so.1") -> EnergyMeter | None:
        """The meter for a CUDA `device` (found by its UUID, so CUDA_VISIBLE_DEVICES cannot mix GPUs up), or None
        with one log line saying why (no GPU, no NVML, no energy counter)."""
        if device.type != "cuda":
            return None
        try:
            nvml = ctypes.CDLL(library)
        except OSError as e:
            log.info("no GPU energy figures: NVML (%s) did not load: %s", library, e)
            return None
        uuid = torch.cuda.get_device_properties(device).uuid
        if (rc := nvml.nvmlInit_v2()) != _NVML_SUCCESS:
            log.info("no GPU energy figures: nvmlInit_v2 returned NVML error %d", rc)
            return None
        handle = ctypes.c_void_p()
        meter = cls(nvml, handle)
        try:
            if (rc := nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode(), ctypes.byref(handle))) != _NVML_SUCCESS:
                raise RuntimeError(f"nvmlDeviceGetHandleByUUID returned NVML error {rc}")
            meter.millijoules()
        except RuntimeError as e:
            log.info("no GPU energy figures: %s", e)
            meter.close()
            return None
        return meter

    def close(self) -> None:
        """Let NVML go (nvmlInit_v2 and nvmlShutdown count its users; this meter is one). Closing twice is harmless."""
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    def __enter__(self) -> EnergyMeter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _query(self, call: str, out, *args) -> None:
        if self._nvml is None:
            raise RuntimeError(f"{call}: the energy meter is closed")
        if (rc := getattr(self._nvml, call)(self._handle, *args, ctypes.byref(out))) != _NVML_SUCCESS:
            raise RuntimeError(f"{call} returned NVML error {rc}")

    def millijoules(self) -> int:
        """Energy the GPU has used since the driver loaded."""
        out = ctypes.c_ulonglong()
        self._query("nvmlDeviceGetTotalEnergyConsumption", out)
        return out.value

    def power_limit_w(self) -> float:
        """The power limit the driver holds the board to."""
        out = ctypes.c_uint()
        self._query("nvmlDeviceGetEnforcedPowerLimit", out)
        return out.value / 1000

    def sm_clock_mhz(self) -> int:
        out = ctypes.c_uint()
        self._query("nvmlDeviceGetClockInfo", out, _NVML_CLOCK_SM)
        return out.value

    def max_sm_clock_mhz(self) -> int:
        out = ctypes.c_uint()
        self._query("nvmlDeviceGetMaxClockInfo", out, _NVML_CLOCK_SM)
        return out.value


class EnergyWindow:
    """Energy and time between entering and leaving, with the SM clock sampled every `sample_s` on a host
    thread (the GPU's work is not touched). Without a meter it measures nothing and `result` is empty.
    The caller synchronises the GPU before leaving, so the window holds all of its work."""

    def __init__(self, meter: EnergyMeter | None, sample_s: float = 0.02,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.meter, self.sample_s, self._clock = meter, sample_s, clock
        self.clocks: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.joules = self.seconds = 0.0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.clocks.append(self.meter.sm_clock_mhz())
            self._stop.wait(self.sample_s)

    def __enter__(self) -> EnergyWindow:
        if self.meter is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
            self._mj0, self._t0 = self.meter.millijoules(), self._clock()
        return self

    def __exit__(self, *exc) -> None:
        if self.meter is None:
            return
        mj1, t1 = self.meter.millijoules(), self._clock()
        self._stop.set()
        self._thread.join()
        self.joules, self.seconds = (mj1 - self._mj0) / 1000, t1 - self._t0

    def result(self, steps: int) -> dict:
        """Per step of the `steps` run in the window: joules; and the window's mean power and median SM clock."""
        if self.meter is None:
            return {}
        if steps < 1 or self.seconds <= 0:
            raise ValueError(f"an energy window needs at least one step and some time, got {steps} steps in {self.seconds} s")
        out = {"joules_per_step": self.joules / steps, "watts": self.joules / self.seconds, "seconds": self.seconds}
        if self.clocks:
            out["sm_clock_mhz"] = statistics.median(self.clocks)
        return out
