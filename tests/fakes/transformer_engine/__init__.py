"""Stand-in for TransformerEngine, release ``machine.ACTIVE.te`` (see ``pytorch/__init__.py``)."""

import machine

if machine.ACTIVE.te is None:
    raise ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")

__version__ = machine.ACTIVE.te
