"""Packing, the row schedule, the Slurm environment, exit codes, and checkpoint atomicity."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_automodel.components.checkpoint import dcp as dcp_module
from nemo_automodel.components.checkpoint.dcp import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint
from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.loader import RowSchedule, prepare_data
from nemo_automodel.components.datasets.packing import pack_documents
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer
from nemo_automodel.components.launcher.env import detect_launch, first_slurm_host, slurm_rendezvous_env
from nemo_automodel.components.training.preemption import EXIT_PREEMPTED, combined_exit_code


def _docs(*lengths: int) -> list[list[int]]:
    return [[10 * (d + 1) + i for i in range(n)] for d, n in enumerate(lengths)]


@pytest.mark.parametrize("algorithm", ["first_fit_decreasing", "first_fit_shuffle"])
def test_packed_labels_never_cross_a_document_and_positions_restart(algorithm):
    rows = pack_documents(_docs(5, 3, 7, 1, 6, 2), seq_len=10, algorithm=algorithm, pad_id=0, seed=3)
    for r in range(len(rows)):
        ids, labels, pos, seq = (t[r] for t in (rows.input_ids, rows.labels, rows.position_ids, rows.seq_ids))
        for i in range(10):
            if seq[i] == 0:
                assert labels[i] == -100 and ids[i] == 0  # padding tail
            elif i + 1 < 10 and seq[i + 1] == seq[i]:
                assert labels[i] == ids[i + 1]
            else:
                assert labels[i] == -100, "the last token of a document has no label"
            if seq[i] and (i == 0 or seq[i - 1] != seq[i]):
                assert pos[i] == 0
            elif seq[i]:
                assert pos[i] == pos[i - 1] + 1
    tokens = sorted(int(t) for t in rows.input_ids[rows.seq_ids > 0])
    assert tokens == sorted(t for d in _docs(5, 3, 7, 1, 6, 2) for t in d), "every token packed exactly once"


def test_long_documents_are_split_or_truncated():
    split = pack_documents(_docs(25), seq_len=10, algorithm="first_fit_decreasing", pad_id=0, seed=0)
    assert sorted(int((split.seq_ids[r] > 0).sum()) for r in range(len(split))) == [5, 10, 10]
    cut = pack_documents(_docs(25), 10, "first_fit_decreasing", 0, 0, long_documents="truncate")
    assert len(cut) == 1 and cut.input_ids[0].tolist() == _docs(25)[0][:10]


def test_synthetic_corpus_is_deterministic_long_tailed_and_exceeds_a_shard():
    cfg = DataConfig(seq_len=256, num_documents=300, max_doc_len=400)
    a, b = prepare_data(cfg, ByteTokenizer()).train, prepare_data(cfg, ByteTokenizer()).train
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.seq_ids, b.seq_ids)
    lengths = torch.cat([torch.unique_consecutive(r[r > 0], return_counts=True)[1] for r in a.seq_ids])
    assert lengths.min() <= 8 and lengths.max() > 128, "from a few tokens to more than a cp=2 shard"
    assert (lengths < 32).float().mean() > 0.5, "long-tailed: most documents short"


def test_row_schedule_deals_each_epoch_once_and_is_a_function_of_the_step():
    schedule = RowSchedule(num_rows=10, dp_size=2, grad_accum=1, seed=5)
    epoch = [schedule.row_index(s, 0, d) for s in range(5) for d in range(2)]
    assert sorted(epoch) == list(range(10))
    again = RowSchedule(num_rows=10, dp_size=1, grad_accum=2, seed=5)
    assert [again.row_index(s, m, 0) for s in range(5) for m in range(2)] == epoch


def test_slurm_srun_environment_is_derived():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
    }
    assert slurm_rendezvous_env(env, master_port=None) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": "29500",
    }
    assert first_slurm_host("node-a,node-b") == "node-a"
    assert first_slurm_host("n[1,3-4]") == "n1"


def test_launch_mode_detection(monkeypatch):
    monkeypatch.setattr("os.environ", {})
    assert detect_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).mode == "torchrun"
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).mode == "local"  # a 1-task allocation
    slurm = detect_launch({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "x1"})
    assert (slurm.mode, slurm.rank, slurm.world) == ("slurm", 1, 2)


def test_exit_codes_failure_beats_preemption_beats_success():
    assert combined_exit_code([0, 0]) == 0
    assert combined_exit_code([0, EXIT_PREEMPTED]) == EXIT_PREEMPTED
    assert combined_exit_code([EXIT_PREEMPTED, 1]) == 1


def _save_then_crash_mid_save(root: str) -> dict:
    """Pool worker: checkpoint step 1, crash while writing step 2, then load what is there."""
    from pathlib import Path

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    state = TrainerState(step=1, rows_consumed=2, scheduler={}, world=1, dp=1, cp=1)
    save_checkpoint(Path(root), state, model, optimizer, keep=2, rank=dist.get_rank())

    real_rng_state = dcp_module.rng_state

    def crash() -> dict:  # called after the tensors of step 2 are written into the temp dir
        raise OSError("disk full (injected)")

    dcp_module.rng_state = crash
    with torch.no_grad():
        model.weight.add_(1.0)
    try:
        save_checkpoint(Path(root), TrainerState(2, 4, {}, 1, 1, 1), model, optimizer, keep=2, rank=dist.get_rank())
    except OSError:
        pass
    finally:
        dcp_module.rng_state = real_rng_state
    latest = latest_checkpoint(Path(root))
    loaded = load_checkpoint(latest, model, optimizer, dist.get_rank())
    same = all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    return {
        "latest": latest.name,
        "step": loaded.step,
        "weights_restored": same,
        "leftovers": sorted(p.name for p in Path(root).iterdir()),
    }


def test_crash_mid_save_keeps_the_previous_checkpoint_loadable(pools, tmp_path):
    (result,) = pools.get(1).run_ok(_save_then_crash_mid_save, str(tmp_path), timeout=120)
    assert result["latest"] == "step_00000001" and result["step"] == 1
    assert result["weights_restored"]
    assert result["leftovers"] == [".tmp-step_00000002", "step_00000001"]
