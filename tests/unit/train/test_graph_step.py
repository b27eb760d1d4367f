"""The training step in a CUDA graph (boostmpi/train/graph_step.py) against the eager loop, on the GPU path.

On the CuPy stand-in the capture has CuPy's semantics (captured work is recorded, not run; a host read
or synchronize while capturing raises), so a replayed step that gives the eager step's numbers bitwise
shows that nothing of the step was left on the host or baked into the capture.
"""

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from boostmpi.train.optim import AdamW, learning_rate
from tests.support.gpu_steps import batches, config

pytestmark = pytest.mark.gpu

STEPS = 4
# the learning rate changes every step (warm-up, then cosine); the clipping threshold lies between the
# steps' gradient norms, so some steps are clipped and some are not (asserted below)
TRAIN = dict(lr=3e-3, warmup_steps=2, steps=STEPS, grad_clip=2.1, recompute="none")


def small_config(dtype="bfloat16", **train):
    cfg = config("cola", "gpu", dtype, train={**TRAIN, **train})
    return cfg.replace(**{"model.n_layers": 1, "model.seq_len": 8})


def step_batches(cfg, step):
    x = np.random.default_rng(100 + step).integers(0, cfg.model.vocab_size, (2, cfg.train.micro_batch_size,
                                                                             cfg.model.seq_len + 1))
    return [(m[:, :-1], m[:, 1:]) for m in x]


def state(engine, optimizer):
    """Everything a step changes, as bits: master weights, compute weights, both moments."""
    arrays = {"master": engine.master, "params": engine.cparams.data, "m": optimizer.m, "v": optimizer.v}
    return {name: a.get().view(np.uint8) for name, a in arrays.items()}


@functools.lru_cache(maxsize=None)
def eager_run(cfg):
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.trainer import optimizer_step

    e = Engine(cfg)
    opt = AdamW(e.params, e.specs, cfg.train, e.xp, shard=e.shard, master=e.master)
    out = []
    for s in range(STEPS):
        loss = e.forward_backward(step_batches(cfg, s))
        out.append((loss, optimizer_step(e, opt, learning_rate(s, cfg.train), cfg.train.grad_clip)))
    return out, state(e, opt)


def graph_run(cfg, warmup=1):
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.graph_step import GraphStep

    e = Engine(cfg)
    opt = AdamW(e.params, e.specs, cfg.train, e.xp, shard=e.shard, master=e.master)
    graph = GraphStep(e, opt, cfg.train.grad_clip, warmup=warmup)
    out = [graph.step(step_batches(cfg, s), learning_rate(s, cfg.train)) for s in range(STEPS)]
    return out, state(e, opt), graph


def assert_graph_steps_are_the_eager_steps(cfg, warmup=1):
    want, want_state = eager_run(cfg)
    got, got_state, graph = graph_run(cfg, warmup)
    norms = [norm for _, norm in want]
    assert min(norms) < cfg.train.grad_clip < max(norms), f"clipping active in some steps only: {norms}"
    assert len({learning_rate(s, cfg.train) for s in range(STEPS)}) >= 3
    assert got == want, f"(loss, norm) per step: graph {got}, eager {want}"
    for name in want_state:
        assert np.array_equal(got_state[name], want_state[name]), f"{name} differs after {STEPS} steps"
    return graph


def test_graph_steps_are_bitwise_the_eager_steps():
    """One eager step on the graph's stream, the capture, two replays: losses, norms, weights and moments
    bitwise those of four eager steps, with the learning rate changing and clipping on and off."""
    import cupy

    from boostmpi.gpu import pools

    graph = assert_graph_steps_are_the_eager_steps(small_config())
    assert graph.graph is not None and graph.eager_steps == 1
    # the step's memory is its private pool's (counted with the others), which nothing else allocates from
    private = graph.private.pool.total_bytes()
    assert private > 0 and pools.total_bytes(cupy) >= private + cupy.get_default_memory_pool().total_bytes()


@pytest.mark.slow  # a second case of what the default run covers (CI time): `-m slow` runs it
def test_graph_steps_with_lowrank_recompute_are_bitwise_the_eager_steps():
    """lowrank recompute (a tape of kept arrays from the kept pool, replayed before each layer's backward)
    captures as it is: the replays give the eager loop's bits."""
    graph = assert_graph_steps_are_the_eager_steps(small_config(recompute="lowrank"))
    assert graph.graph is not None


def _bake_the_scalars(monkeypatch):
    """The mutant: the update's numbers written into the kernel's buffer by fills whose values are the
    launch's arguments, as a step that bakes its learning rate would (right when run eagerly)."""
    real_scalars, real_step = AdamW.device_scalars, AdamW.step_on_device

    def remember(self, lr):
        self.host_scalars = real_scalars(self, lr)
        return self.host_scalars

    def baked(self, grad, scalars, grad_sq, max_norm):
        fixed = self.xp.empty(3, dtype=np.float32)
        for i, value in enumerate(self.host_scalars):
            fixed[i] = value
        real_step(self, grad, fixed, grad_sq, max_norm)

    monkeypatch.setattr(AdamW, "device_scalars", remember)
    monkeypatch.setattr(AdamW, "step_on_device", baked)


@pytest.mark.slow  # a mutant shown failing (CI time): the default run's lr changes across replays, so a baked lr fails it too
def test_a_step_that_bakes_its_learning_rate_is_caught(monkeypatch):
    """The mutant passes while every step runs eagerly (as the graph's step does before its capture: that
    step, too, is bitwise the eager loop) and fails once the step is captured and replayed."""
    _bake_the_scalars(monkeypatch)
    cfg = small_config()
    graph = assert_graph_steps_are_the_eager_steps(cfg, warmup=STEPS)
    assert graph.graph is None and graph.eager_steps == STEPS
    with pytest.raises(AssertionError, match="per step"):
        assert_graph_steps_are_the_eager_steps(cfg, warmup=1)


def test_a_host_read_inside_the_step_fails_the_capture(monkeypatch):
    """A step that reads the device from the host (here the squared norm, as the eager loop does) runs
    eagerly and is refused by the capture, with CuPy's error and a note naming the setting."""
    from boostmpi.parallel.engine import Engine

    real = Engine.forward_backward_on_device

    def reads(self, micro_batches):
        loss_sum, grad_sq = real(self, micro_batches)
        self.host_norm = float(grad_sq) ** 0.5
        return loss_sum, grad_sq

    monkeypatch.setattr(Engine, "forward_backward_on_device", reads)
    cfg = small_config()
    with pytest.raises(RuntimeError, match="capturing, so D2H transfers are disallowed") as refused:
        graph_run(cfg, warmup=1)
    assert "train.cuda_graph = false runs it eagerly" in "".join(refused.value.__notes__)


# ------------------------------------------------------------------------------ refusals


def fake_grid(world_size=1):
    return SimpleNamespace(world_size=world_size)


@pytest.mark.parametrize("change,fragment", [
    (dict(device="cpu", dtype="float32"), 'needs train.device = "gpu"'),
    (dict(dtype="float64"), "needs train.dtype = float32 or bfloat16"),
])
def test_what_the_config_alone_refuses(change, fragment):
    from boostmpi.config import config_from_dict
    from boostmpi.errors import ConfigError
    from boostmpi.train import graph_step

    train = {"device": "gpu", "dtype": "float32", "cuda_graph": True, **change}
    cfg = config_from_dict({"train": train})
    with pytest.raises(ConfigError, match=fragment) as refused:
        graph_step.check(cfg, fake_grid())
    assert "\n" not in str(refused.value)
    graph_step.check(cfg.replace(**{"train.cuda_graph": False}), fake_grid())  # the key off: nothing refused


def test_more_than_one_rank_is_refused():
    from boostmpi.train import graph_step

    cfg = small_config(cuda_graph=True)
    assert graph_step.refusal(cfg, fake_grid(1)) is None
    line = graph_step.refusal(cfg, fake_grid(4))
    assert "one rank, and this run has 4" in line and "host all-reduce" in line


def test_rocm_is_refused(monkeypatch):
    import cupy

    from boostmpi.train import graph_step

    monkeypatch.setattr(cupy.cuda.runtime, "is_hip", True)
    assert "CuPy cannot capture a graph on ROCm/HIP" in graph_step.refusal(small_config(), fake_grid())


@pytest.mark.parametrize("setting,fragment", [("torch", "train.attention = torch:"),
                                              ("auto", "train.attention = auto (which chose torch on this machine)")])
def test_torch_attention_is_refused(monkeypatch, setting, fragment):
    from boostmpi.gpu import attention
    from boostmpi.train import graph_step

    monkeypatch.setattr(attention, "current", lambda: SimpleNamespace(name="torch"))
    line = graph_step.refusal(small_config(attention=setting), fake_grid())
    assert fragment in line and "caching allocator" in line


def test_a_cpu_run_with_the_graph_is_one_line_exit_2(capfd, tmp_path):
    from tests.support.train_helpers import assert_refused, train_argv, write_text_shards

    train, val = write_text_shards(tmp_path / "data", 60_000)
    argv = train_argv(tmp_path / "run", train, val, "train.cuda_graph=true", "train.device=cpu")
    assert_refused(capfd, argv, tmp_path, "train.cuda_graph = true", 'train.device = "gpu"')
    assert not (tmp_path / "run").exists()


def test_graph_steps_with_cudnn_attention_are_bitwise_the_eager_steps(monkeypatch):
    """The same with cuDNN's attention (the cuDNN frontend's stand-in where no GPU is reached), whose
    graphs are built in the warm-up and whose `execute` the capture records."""
    from boostmpi.gpu import attention
    from tests.support.gpu_setup import use_cudnn_frontend

    _, forget = use_cudnn_frontend(monkeypatch)
    try:
        attention.use(attention.make("cudnn", "bfloat16"))
        assert attention.current().name == "cudnn"
        graph = assert_graph_steps_are_the_eager_steps(small_config(attention="cudnn"))
        assert graph.graph is not None
    finally:
        forget()
