import os
from pathlib import Path

# The C++ kernel is JIT-built on first use when setup.py did not build it; keep that build in
# the project so every test run after the first finds it cached.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"))
