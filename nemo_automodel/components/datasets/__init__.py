"""Documents (synthetic or JSONL), tokenizers, packing into rows, and the per-rank row order."""
