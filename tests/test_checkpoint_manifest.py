"""Checkpoint manifests: every damage is named and the resume falls back to the newest intact checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_automodel.components.checkpoint.dcp import TrainerState, newest_intact, save_checkpoint
from nemo_automodel.components.checkpoint.manifest import MANIFEST


def _save_two(root: str) -> None:
    """Pool worker: checkpoints of steps 1 and 2 of a tiny model (every rank writes its shard and RNG)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        state = TrainerState(step, 2 * step, {}, dist.get_world_size(), dist.get_world_size(), 1)
        save_checkpoint(Path(root), state, model, optimizer, keep=2, rank=dist.get_rank())


def _newest_intact(root: str) -> str | None:
    found = newest_intact(Path(root), dist.get_rank())
    return None if found is None else found.name


def _zero_a_shard(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))  # same size, zeroed: only the checksum sees it


def _truncate_rng(path: Path) -> None:
    rng = path / "rng_rank1.pt"
    rng.write_bytes(rng.read_bytes()[:100])


DAMAGE = {
    "zeroed-shard": (_zero_a_shard, "SHA-256 differs from the manifest's"),
    "truncated-rng": (_truncate_rng, "rng_rank1.pt: size 100 bytes, the manifest says"),
    "deleted-trainer-state": (lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json: missing"),
    "bad-manifest": (lambda p: (p / MANIFEST).write_text("{"), "manifest.json: unreadable manifest"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_is_used(pools, tmp_path, kind):
    pool = pools.get(2)
    pool.run_ok(_save_two, str(tmp_path), timeout=120)
    manifest = json.loads((tmp_path / "step_00000002" / MANIFEST).read_text())["files"]
    assert {"trainer_state.json", "rng_rank0.pt", "rng_rank1.pt", ".metadata"} <= set(manifest)
    assert pool.run_ok(_newest_intact, str(tmp_path), timeout=60) == ["step_00000002"] * 2  # intact: verified

    DAMAGE[kind][0](tmp_path / "step_00000002")
    (tmp_path / ".tmp-step_00000003").mkdir()  # a save that died: no live run owns it
    found = pool.run_ok(_newest_intact, str(tmp_path), timeout=60)
    assert found == ["step_00000001"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged-step_00000002", "step_00000001"]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_the_damage_message_names_the_file_and_the_failed_check(tmp_path, kind):
    from nemo_automodel.components.checkpoint.manifest import damage, write_manifest

    checkpoint = tmp_path / "step_00000002"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"tensor bytes" * 10)
    (checkpoint / "rng_rank1.pt").write_bytes(b"r" * 300)
    (checkpoint / "trainer_state.json").write_text("{}")
    write_manifest(checkpoint, rank=0)
    assert damage(checkpoint) is None
    DAMAGE[kind][0](checkpoint)
    problem = damage(checkpoint)
    assert problem is not None and DAMAGE[kind][1] in problem and str(checkpoint) in problem


def _save_on_a_full_disk(root: str) -> str:
    """Pool worker: a checkpoint whose RNG write fails with ENOSPC; return the error's message."""
    import errno

    from nemo_automodel.components.checkpoint import dcp as dcp_module

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())

    def full() -> dict:
        raise OSError(errno.ENOSPC, "No space left on device")

    real, dcp_module.rng_state = dcp_module.rng_state, full
    try:
        save_checkpoint(Path(root), TrainerState(1, 2, {}, 1, 1, 1), model, optimizer, keep=2, rank=dist.get_rank())
    except OSError as exc:
        return str(exc)
    finally:
        dcp_module.rng_state = real
    return "saved"


def test_a_full_disk_says_no_space_left_on_the_checkpoint_dir(pools, tmp_path):
    (message,) = pools.get(1).run_ok(_save_on_a_full_disk, str(tmp_path), timeout=60)
    assert f"no space left on {tmp_path} while writing a checkpoint (the previous checkpoint is intact)" in message
