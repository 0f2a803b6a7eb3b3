"""``twell_jax.xla_flags``: the device-conditionals flag is added once, never over a user's
command-buffer setting, and reaches a fresh process before its backend starts; profile-guided
scheduling is on by default only on a GPU mesh of several devices, and changes no result; the
all-reduce pipelining option is set only with FSDP, and this XLA knows it."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_profiled_steps_default_to_several_gpus_only():
    auto = xla_flags.PROFILED_STEPS
    assert auto > 0
    assert xla_flags.profiled_steps(-1, 2, "gpu") == auto
    assert xla_flags.profiled_steps(-1, 1, "gpu") == 0
    assert xla_flags.profiled_steps(-1, 8, "cpu") == 0
    assert xla_flags.profiled_steps(0, 2, "gpu") == 0  # a user's 0 turns it off
    assert xla_flags.profiled_steps(5, 1, "cpu") == 5  # and a count stands anywhere
    with pytest.raises(ValueError, match=">= -1"):
        xla_flags.profiled_steps(-2, 2, "gpu")


def test_all_reduce_pipelining_only_with_fsdp():
    on = xla_flags.PIPELINED_ALL_REDUCE
    assert xla_flags.step_compiler_options({"data": 2, "fsdp": 1}) == {}
    assert xla_flags.step_compiler_options({"data": 8}) == {}
    assert xla_flags.step_compiler_options({"data": 1, "fsdp": 2}) == on
    assert xla_flags.step_compiler_options({"data": 2, "fsdp": 4}) == on
    options = xla_flags.step_compiler_options({"fsdp": 2})
    options["other"] = "1"  # a copy: the module's value stays as it is
    assert "other" not in xla_flags.PIPELINED_ALL_REDUCE


def test_this_xla_knows_the_pipelining_option():
    """The option's name and value are this XLA's (a rename in a newer jax fails here, not on
    a GPU run): a function compiled with it gives its values, and XLA checks the value (one
    it does not know fails the compilation)."""
    x = jnp.arange(8.0)
    out = jax.jit(lambda a: a * 2, compiler_options=xla_flags.PIPELINED_ALL_REDUCE)(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 2)
    (name,) = xla_flags.PIPELINED_ALL_REDUCE
    with pytest.raises(Exception, match=name):
        jax.jit(lambda a: a * 3, compiler_options={name: "NOT_A_MODE"})(x)


def _compiles_and_outputs(fn, x, calls: int) -> tuple[int, list[np.ndarray]]:
    """(backend compilations, outputs) of ``calls`` calls of a fresh ``jax.jit(fn)``."""
    names = []
    listener = lambda name, *_, **__: names.append(name) if "backend_compile" in name else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jitted = jax.jit(fn)
        with warnings.catch_warnings():
            # Without a GPU the profile is empty (JAX says so) and the second compilation
            # gets no costs; the mechanism runs all the same.
            warnings.simplefilter("ignore", RuntimeWarning)
            outs = [np.asarray(jitted(x)) for _ in range(calls)]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(names), outs


def test_profile_guided_scheduling_compiles_again_and_changes_no_result():
    """Under the setting a jitted function is compiled twice (for its profiled calls, then
    with their costs), not once, and gives the same values as without; the setting ends with
    the block."""
    x = jax.random.normal(jax.random.key(0), (64, 64))
    fn = lambda a: jnp.tanh(a @ a.T).sum(axis=0)
    plain_compiles, (expected, *_) = _compiles_and_outputs(fn, x, 4)
    before = jax.config.jax_pgle_profiling_runs
    with xla_flags.profile_guided_scheduling(2):
        assert jax.config.jax_enable_pgle and jax.config.jax_pgle_profiling_runs == 2
        compiles, outs = _compiles_and_outputs(lambda a: fn(a), x, 4)
    assert not jax.config.jax_enable_pgle and jax.config.jax_pgle_profiling_runs == before
    assert (plain_compiles, compiles) == (1, 2)
    for out in outs:
        np.testing.assert_array_equal(out, expected)
