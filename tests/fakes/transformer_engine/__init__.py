"""Stand-in for TransformerEngine (only ``transformer_engine.pytorch.DotProductAttention``)."""
