"""The training loop's parts: loss, optimizer and schedule, one step, metrics, seeding, preemption."""
