"""The test kit shipped with the package (as ``torch.testing``): diagnostics for tests and benchmarks, not the
training path. Nothing in ``nemo_automodel.components`` or ``nemo_automodel.recipes`` imports it."""
