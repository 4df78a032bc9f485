"""Converts a GGUF checkpoint to a local Hugging Face folder vLLM can load (vLLM 0.32 loads no
GGUF without a CUDA-only plugin). Offline: the tokenizer and config come from the GGUF file.

    python convert-gguf-to-hf.py MODEL.gguf OUT_DIR

The weights are dequantized to bfloat16 (transformers' GGUF loader keeps quantized blocks unless
asked to dequantize, and vLLM cannot read those). OUT_DIR is written through a temporary folder
and renamed at the end, so a finished OUT_DIR always holds a whole model.
"""

import os
import shutil
import sys

import torch  # noqa: F401  (before transformers: the venv's torch)
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    gguf, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    folder, name = os.path.split(gguf)
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf, dequantize=True))
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(out)


if __name__ == "__main__":
    main()
