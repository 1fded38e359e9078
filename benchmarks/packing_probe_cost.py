"""Start-up cost of the packing-isolation probe (``verify_packing_isolation``) at cp=1, one process.

Usage::

    python benchmarks/packing_probe_cost.py              # the recipe's default model and a Llama 3.2 1B shape
    python benchmarks/packing_probe_cost.py --only default

Both models are random-init Llamas in float32 on the CPU (or the first GPU when there is one); each probe runs
twice (the first call includes lazy imports and allocator warm-up) and prints its seconds, the largest relative
difference it measured (an exact model: rounding only) and its CP attention calls.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nemo_automodel.components.models import cp_attention
from nemo_automodel.components.models.packing_probe import run_packing_probe

SHAPES: dict[str, dict[str, int]] = {
    # conf/model/tiny_llama.yaml with the byte tokenizer
    "default": {
        "vocab_size": 256,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    # Llama 3.2 1B: 16 layers of 2048, 32/8 heads of 64, vocabulary 128256 (1.2 B parameters, untied head)
    "1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SHAPES), help="one shape only")
    args = parser.parse_args()
    cp_attention.register_cp_attention()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, shape in SHAPES.items():
        if args.only and name != args.only:
            continue
        torch.manual_seed(0)
        config = LlamaConfig(**shape, tie_word_embeddings=False, use_cache=False)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=cp_attention.CP_ATTN_IMPLEMENTATION
        ).to(device)
        for run in range(2):
            began = time.perf_counter()
            report = run_packing_probe(model, None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(
                f"{name} on {device.type}: run {run} {time.perf_counter() - began:.2f} s, "
                f"documents {report.doc_lengths}, largest difference {report.leak:.2g}, "
                f"attention calls {report.attention_calls}",
                flush=True,
            )


if __name__ == "__main__":
    main()
