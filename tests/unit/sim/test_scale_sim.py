"""The performance model learns ZeRO-1 and the per-rank checkpoint: optimizer memory is the dp share,
the dp bytes add the all-gather of the slices as docs/COMMUNICATION.md counts it, and the checkpoint's
bytes are what the rank files hold."""

from boostmpi.checkpoint import rank_pieces
from boostmpi.config import config_from_dict
from boostmpi.model.params import param_specs
from boostmpi.sim.machines import load_machine
from boostmpi.sim.model import checkpoint_bytes, comm_bytes, predict

MODEL = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, attn_rank=8, mlp_rank=12)


def config(zero, tp=2, dp=3, dtype="float64"):
    train = {"dtype": dtype} if dtype == "float64" else {"dtype": dtype, "device": "gpu"}
    return config_from_dict({"model": MODEL, "parallel": {"tp": tp, "dp": dp, "zero_stage": zero}, "train": train})


def test_zero_stage_1_in_the_performance_model():
    machine = load_machine("a100-80gb")
    replicated, sharded = predict(config(0), machine), predict(config(1), machine)
    n = max(sum(s.local_numel for s in param_specs(config(0), t, 0)) for t in range(2))
    assert replicated.memory_bytes["optimizer"] == 2 * 8 * n
    assert sharded.memory_bytes["optimizer"] == 2 * 8 * -(-n // 3)
    assert sharded.memory_bytes["grads"] == 8 * (n + -(-n // 3))
    locals_ = [sum(s.local_numel for s in param_specs(config(1), t, 0)) for t in range(2)]
    assert comm_bytes(config(1))["dp"] == 8 * (sum(locals_) + sum(-(-x // 3) for x in locals_))
    assert comm_bytes(config(0))["dp"] == 8 * sum(locals_)


def test_zero_stage_1_under_bf16_keeps_float32_master_weights_for_the_slice_and_gathers_bf16():
    machine = load_machine("a100-80gb")
    replicated, sharded = predict(config(0, dtype="bfloat16"), machine), predict(config(1, dtype="bfloat16"), machine)
    n = max(sum(s.local_numel for s in param_specs(config(0), t, 0)) for t in range(2))
    assert replicated.memory_bytes["params"] == (4 + 2) * n
    assert sharded.memory_bytes["params"] == 4 * -(-n // 3) + 2 * n
    locals_ = [sum(s.local_numel for s in param_specs(config(1), t, 0)) for t in range(2)]
    assert comm_bytes(config(1, dtype="bfloat16"))["dp"] == 4 * sum(locals_) + 2 * sum(-(-x // 3) for x in locals_)


def test_checkpoint_bytes_are_what_the_rank_files_hold():
    cfg = config(1)
    sizes = [3 * 8 * sum(p.size for p in rank_pieces(cfg, t, 0, d)[2]) for t in range(2) for d in range(3)]
    largest, total = checkpoint_bytes(cfg)
    assert total == sum(sizes)  # every element of every tensor once, in three arrays
    assert largest >= max(sizes)  # tp-replicated tensors are written by tp rank 0 only
