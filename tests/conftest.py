"""Settings for every test."""

import os

# The experiment scripts keep compiled programs in a cache folder by default
# (twell_jax/cli.py, --compile-cache); tests that run them in-process leave the user's
# cache alone. test_train checks the cache itself, in a subprocess.
os.environ["TWELL_COMPILE_CACHE"] = ""
