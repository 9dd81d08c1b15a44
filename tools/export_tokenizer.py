"""Export the bundled SmolLM2 tokenizer (with its chat template) to .gpu_assets/smollm2-tokenizer,
for machines without the bundled model (tests/gpu/test_multi_gpu.py serves a SmolLM2-shaped
model with random weights there)."""

import os
import sys

from phalanx.llmapi.tokenizer import _gguf_tokenizer
from phalanx.models.source import bundled_model_path

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(".gpu_assets", "smollm2-tokenizer")
_gguf_tokenizer(bundled_model_path()).save_pretrained(out)
print(out, sorted(os.listdir(out)))
