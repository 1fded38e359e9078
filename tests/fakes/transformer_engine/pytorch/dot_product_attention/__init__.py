"""``transformer_engine.pytorch.dot_product_attention`` exists in TE 2.2 only (2.3 moved it under ``attention``)."""

from transformer_engine.pytorch import flash_view

if flash_view.TE[:2] != (2, 2):
    raise ModuleNotFoundError(
        "No module named 'transformer_engine.pytorch.dot_product_attention'",
        name="transformer_engine.pytorch.dot_product_attention",
    )
