"""The GPU's power and energy counters sampled while a benchmark runs (NVML through ctypes)."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable, Sequence

import numpy as np




ENERGY_WINDOW_S = 3.0
"""Energy is measured over at least this long of repeated calls: NVML's board power on the
H100 is a one-second average, and the driver's energy counter moves in steps, so a loop of a
few short calls (0.3-0.5 s for the 0.5b model's training steps) reads them wrong, both ways."""


# NVML clock event reasons (nvmlClocksEventReason*): the board holding its power limit.
_POWER_CAP_REASONS = 0x4 | 0x80  # SW power cap, HW power brake


class PowerSampler:
    """Board power, SM clock and clock event reasons from NVML (ctypes; no package needed),
    sampled in a thread; energy from the driver's counter, the power samples integrated beside
    it as a cross-check."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.error = None
        try:
            self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self._check(self.nvml.nvmlInit_v2())
            self.handle = ctypes.c_void_p()
            self._check(self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)))
        except Exception as e:  # no NVIDIA driver (CPU runs): energy is reported as null
            self.nvml, self.error = None, f"NVML unavailable: {e}"

    @property
    def available(self) -> bool:
        return self.nvml is not None

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"NVML error {status}")

    def _uint(self, name: str, *args) -> int:
        value = ctypes.c_uint()
        self._check(getattr(self.nvml, name)(self.handle, *args, ctypes.byref(value)))
        return value.value

    def power_w(self) -> float:
        return self._uint("nvmlDeviceGetPowerUsage") / 1e3

    def energy_mj(self) -> int:
        mj = ctypes.c_ulonglong()
        self._check(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)))
        return mj.value

    def sm_clock_mhz(self) -> int:
        """The SM clock (MHz; 0 where the driver does not report it)."""
        try:
            return self._uint("nvmlDeviceGetClockInfo", 1)  # NVML_CLOCK_SM
        except RuntimeError:
            return 0

    def limits(self) -> dict:
        """The board's power limit (W) and the SM clock's maximum (MHz), where reported."""
        try:
            return {"power_limit_w": self._uint("nvmlDeviceGetEnforcedPowerLimit") / 1e3,
                    "sm_clock_max_mhz": self._uint("nvmlDeviceGetMaxClockInfo", 1)}
        except RuntimeError:
            return {}

    def clock_reasons(self) -> int:
        """The clock event reasons' bit mask (0 where the driver does not report them)."""
        reasons = ctypes.c_ulonglong()
        for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                     "nvmlDeviceGetCurrentClocksThrottleReasons"):  # the older name
            fn = getattr(self.nvml, name, None)
            if fn is not None and fn(self.handle, ctypes.byref(reasons)) == 0:
                return reasons.value
        return 0

    def sample(self) -> tuple[float, float, int, int]:
        """(time s, power W, SM clock MHz, clock event reasons)."""
        return time.perf_counter(), self.power_w(), self.sm_clock_mhz(), self.clock_reasons()

    def measure(self, fn: Callable[[], None]) -> dict:
        """Runs fn while sampling; returns the energy counter's difference (``energy_j``), the
        power samples integrated (``energy_sampled_j``, trapezoid), mean watts and SM clock,
        and the fraction of samples in which the board held its power limit."""
        if not self.available:
            fn()
            return {"energy_j": None, "energy_note": self.error}
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                samples.append(self.sample())
                time.sleep(self.period_s)

        thread = threading.Thread(target=sample, daemon=True)
        counter0 = self.energy_mj()
        thread.start()
        fn()
        stop.set()
        thread.join()
        counter1 = self.energy_mj()
        return summarize_power(samples, (counter1 - counter0) / 1e3, self.limits())


def summarize_power(samples: Sequence[tuple[float, float, int, int]], counter_j: float,
                    limits: dict) -> dict:
    """The energy fields of ``PowerSampler.measure`` from its samples (time s, power W, SM
    clock MHz, clock event reasons) and the energy counter's difference in joules."""
    t, w, clock, reasons = (np.asarray(a) for a in zip(*samples)) if len(samples) > 1 else (
        np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2, np.int64))
    capped = (reasons.astype(np.int64) & _POWER_CAP_REASONS) != 0
    return {"energy_j": counter_j,
            "energy_sampled_j": float(np.sum((w[1:] + w[:-1]) / 2 * np.diff(t))),
            "mean_power_w": float(np.mean(w)), "mean_sm_clock_mhz": float(np.mean(clock)),
            "power_capped_fraction": float(np.mean(capped)), "power_samples": len(samples),
            **limits}
