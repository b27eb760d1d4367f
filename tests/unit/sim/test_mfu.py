"""Model FLOPs utilisation per step: `mfu` in metrics.jsonl and `MFU` in the progress line of a GPU run.

The model's FLOPs of a step (boostmpi.sim.model.model_flops_per_step, the count `boostmpi sim`
reports its MFU with) over what every rank's GPU could do in the step's time at the peak of its
built-in machine profile, chosen by the name and memory the driver reports
(boostmpi.sim.machines.profile_for_device); no profile (the CPU, an unknown GPU) reports none. On
the CuPy stand-in the device is an A100-SXM4-40GB.
"""

import pytest

from tests.support.gpu_setup import GPU
from tests.support.train_helpers import read_metrics, run_train, write_text_shards

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="the stand-in's device name and memory are known here")]


def test_profiles_follow_the_device_name():
    from boostmpi.sim.machines import profile_for_device

    GB = 10 ** 9
    assert profile_for_device("NVIDIA A100-SXM4-80GB", 80 * GB) == "a100-80gb"
    assert profile_for_device("NVIDIA A100-SXM4-40GB", 40 * GB) == "a100-40gb"
    assert profile_for_device("NVIDIA H100 80GB HBM3", 80 * GB) == "h100-sxm"
    assert profile_for_device("NVIDIA H100 PCIe", 80 * GB) is None  # lower peaks than the SXM part's profile
    assert profile_for_device("AMD Instinct MI250X", 64 * GB) == "mi250x-gcd"
    assert profile_for_device("NVIDIA GeForce RTX 4090", 24 * GB) is None


def _run(tmp_path, name):
    train, val = write_text_shards(tmp_path / "text", max_bytes=60_000)
    run_dir = tmp_path / name
    assert run_train(run_dir, train, val, "train.device=gpu", "train.steps=2", "train.log_every=1") == 0
    return read_metrics(run_dir)


def test_a_gpu_run_reports_its_mfu(tmp_path, capfd, monkeypatch):
    """Every step's `mfu` is the model's FLOPs over step time x ranks x the a100-40gb profile's
    float32 peak, and the progress line shows it. The mutant (no profile for the device) reports none."""
    from boostmpi.config import load_config
    from boostmpi.sim import machines
    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.model import model_flops_per_step
    from tests.support.train_helpers import TINY_CONFIG

    rows = [r for r in _run(tmp_path, "run") if "loss" in r]
    cfg = load_config(TINY_CONFIG, [])
    peak = load_machine("a100-40gb").peak("float32")
    assert rows and all("mfu" in r for r in rows)
    for r in rows:
        assert r["mfu"] == pytest.approx(model_flops_per_step(cfg) / (r["step_time_s"] * 1 * peak), rel=1e-9)
    assert "MFU " in capfd.readouterr().out
    monkeypatch.setattr(machines, "profile_for_device", lambda name, total: None)
    assert not any("mfu" in r for r in _run(tmp_path, "mutant"))
