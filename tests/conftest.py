"""Test-session set-up that must run before torch is imported."""

import os
import sys
import tempfile
from pathlib import Path

# The examples' helpers (make_hf_model, hf_trainer) import from the last place on the path:
# examples/lightning.py must not stand in for the lightning package.
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))

# TorchInductor's compile cache does not key its kernels on ATen's CPU kernel set, so a
# kernel compiled under ATEN_CPU_CAPABILITY=avx2 was reused by a later run under another
# set (wrong codes from the compiled quantizer, once a crash). One cache per set.
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "native")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"zeropp-inductor-{_CAPABILITY}"))

# A rank imports the test module of the function it runs, and several import transformers
# and a model (about 3 s a rank, four ranks on two cores): the fork server imports them once
# instead (test_hugging_face and test_generation: 45 s -> 14 s). It starts with the first
# spawn_ranks call, not here.
from zeropp import launch  # noqa: E402 (after the environment above)

launch.FORKSERVER_PRELOAD += ["zeropp.hf", "transformers", "transformers.models.auto.modeling_auto",
                             "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"]
