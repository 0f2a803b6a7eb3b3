"""``twell_jax.xla_flags``: the device-conditionals flag is added once, never over a user's
command-buffer setting, and reaches a fresh process before its backend starts."""

from __future__ import annotations

import os
import subprocess
import sys

from twell_jax import xla_flags


def test_the_flag_is_appended_to_other_flags():
    assert xla_flags.with_device_conditionals("") == xla_flags.DEVICE_CONDITIONALS
    flags = "--xla_force_host_platform_device_count=2"
    assert (xla_flags.with_device_conditionals(flags)
            == f"{flags} {xla_flags.DEVICE_CONDITIONALS}")


def test_a_users_command_buffer_setting_stands():
    for flags in ("--xla_gpu_enable_command_buffer=", "--xla_gpu_enable_command_buffer=FUSION",
                  f"--foo=1 {xla_flags.DEVICE_CONDITIONALS}"):
        assert xla_flags.with_device_conditionals(flags) == flags
    once = xla_flags.with_device_conditionals("")
    assert xla_flags.with_device_conditionals(once) == once  # idempotent


def test_a_fresh_process_runs_with_it():
    """Set before the first computation, the flag is in the environment when the backend
    starts, and XLA accepts it on the CPU; after that the call reports it came too late."""
    code = ("import jax, os\n"
            "from twell_jax import xla_flags\n"
            "assert xla_flags.use_device_conditionals()\n"
            "print(float(jax.numpy.ones(3).sum()), os.environ['XLA_FLAGS'])\n"
            "assert xla_flags.backends_started()\n"
            "assert not xla_flags.use_device_conditionals()\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.split() == ["3.0", xla_flags.DEVICE_CONDITIONALS]
