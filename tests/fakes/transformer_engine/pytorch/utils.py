"""``transformer_engine.pytorch.utils.get_cudnn_version``: the cuDNN TE loaded (``machine.ACTIVE.cudnn``)."""

import machine


def get_cudnn_version():
    """``(major, minor, patch)`` of the loaded cuDNN."""
    return machine.ACTIVE.cudnn
