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
