"""Block-diagonal context parallelism for packed-sequence LLM training (NeMo Automodel style)."""
