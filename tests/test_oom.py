"""CUDA out-of-memory back-off of every agent, on the CPU: a ``torch.OutOfMemoryError`` injected into a module-level
function of ``algos/<name>.py`` (run in this process) hands the live state over, the algorithm's rule halves num_envs
(PPO, A2C) or the batch / num_envs (SAC, DQN), and training re-enters from that state, warns and trains on to its full
step count; repeated errors stop it with ``OutOfMemoryBackoffError`` and its last checkpoint, from which it resumes;
an error at setup (``harness.make_env``) backs off too.

What a GPU adds (CUDA-graph re-capture, the memory actually handed back) is not covered here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import A2C_TINY, DQN_TINY, PPO_TINY, SAC_TINY, load_algo

from algos import harness


@dataclass(frozen=True)
class Case:
    """One agent's tiny run and where an out-of-memory error is injected into it.

    ``args`` are the tiny settings (``extra`` is added after them), ``total`` the env steps of the run and
    ``per_iteration`` its env steps per iteration at the asked-for num_envs. ``update`` is a module-level function
    called in each update.
    """

    args: list[str]
    total: int
    per_iteration: int
    update: str
    extra: list[str] = field(default_factory=list)


CASES = {
    # 4 envs x 48 steps = 192 steps per iteration; a checkpoint every iteration
    "ppo": Case(PPO_TINY, total=576, per_iteration=192, update="update"),
    # 4 envs x 8 steps = 32 steps per iteration; a log and a checkpoint every 6 iterations
    "a2c": Case(A2C_TINY, total=384, per_iteration=32, update="update"),
    # 4 envs, 2 critic steps per iteration from step 64 on; batch 128, so it can halve once above its floor of 64
    "sac": Case(SAC_TINY, total=384, per_iteration=4, update="update_critic",
                extra=["--batch-size", "128"]),
    # 4 envs x 2 steps = 8 steps per iteration, 2 gradient steps per iteration from step 64 on; batch 128 likewise
    "dqn": Case(DQN_TINY, total=256, per_iteration=8, update="update",
                extra=["--batch-size", "128"]),
}  # fmt: skip

INJECTED = "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)"


def inject_oom(monkeypatch, module, name: str, fails, ckpt=None) -> dict:
    """Replace ``module.<name>`` by a wrapper that raises ``torch.OutOfMemoryError`` on the calls (counted from 1)
    for which ``fails(n)`` is true and otherwise calls the original.

    Returns a dict that counts ``calls`` and ``raised`` and, if ``ckpt`` is given, keeps in ``ckpt_bytes`` the
    checkpoint file's bytes at the last raise (None while there is none).
    """
    real = getattr(module, name)
    seen = {"calls": 0, "raised": 0, "ckpt_bytes": None}

    def wrapper(*args, **kwargs):
        seen["calls"] += 1
        if fails(seen["calls"]):
            seen["raised"] += 1
            if ckpt is not None:
                seen["ckpt_bytes"] = ckpt.read_bytes() if ckpt.is_file() else None
            raise torch.OutOfMemoryError(INJECTED)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def train(name: str, site_toml, out, total: int, *extra: str) -> dict:
    """Run ``algos/<name>.py``'s ``main`` in this process with the case's tiny settings; returns its result."""
    module = load_algo(name)
    case = CASES[name]
    argv = [
        "--site",
        str(site_toml),
        "--output-dir",
        str(out),
        "--total-timesteps",
        str(total),
        "--eval-split",
        "none",
        "--seed",
        "3",
        *case.args,
        *case.extra,
        *extra,
    ]
    return module.main(harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, argv))


def tensorboard_text(out) -> bytes:
    """The bytes of the run's TensorBoard event files (text summaries are stored verbatim)."""
    return b"".join(p.read_bytes() for p in sorted(out.glob("events.out.tfevents.*")))


def assert_finished(out, total: int) -> pd.DataFrame:
    """The run in ``out`` trained ``total`` steps: metrics end there with increasing steps, the checkpoint says so
    and the policy was exported. Returns the metrics."""
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics.global_step.iloc[-1] == total, metrics.global_step.tolist()
    assert metrics.global_step.is_monotonic_increasing and metrics.global_step.is_unique
    assert torch.load(out / "checkpoint.pt", weights_only=False)["global_step"] == total
    assert (out / "policy.pt2").is_file()
    return metrics


# ---------------------------------------------------------------------------------------------- mid-training
MID_TRAINING = {
    # (algorithm, function, failing call, the halving the warning reports, the sizes at the end)
    "ppo": ("ppo", "update", 2, "at global_step 192 (iteration 2): num_envs 4 -> 2 (batch 192 -> 96, minibatch 96 -> 48)",  # noqa: E501
            {"num_envs": 2}),
    "a2c": ("a2c", "update", 4, "at global_step 96 (iteration 4): num_envs 4 -> 2 (batch 32 -> 16)", {"num_envs": 2}),
    # in the gradient steps: the batch halves first
    "sac-update": ("sac", "update_critic", 5, "at global_step 72 (iteration 18), in the gradient steps: batch_size 128 -> 64",  # noqa: E501
                   {"num_envs": 4, "batch_size": 64}),
    "dqn-update": ("dqn", "update", 5, "at global_step 80 (iteration 10), in the gradient steps: batch_size 128 -> 64",
                   {"num_envs": 4, "batch_size": 64}),
    # stepping the envs: num_envs halves (the envs are rebuilt, the replay buffer kept)
    # (sample_action runs once per env step from learning_starts on: its 14th call is in iteration 30)
    "sac-envs": ("sac", "sample_action", 14, "at global_step 116 (iteration 30), stepping the envs: num_envs 4 -> 2",
                 {"num_envs": 2, "batch_size": 128}),
    "dqn-envs": ("dqn", "rollout", 10, "at global_step 72 (iteration 10), stepping the envs: num_envs 4 -> 2",
                 {"num_envs": 2, "batch_size": 128}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MID_TRAINING))
def test_an_oom_in_training_halves_warns_and_the_run_finishes(case, site_toml, tmp_path, monkeypatch, capsys):
    name, function, call, halving, sizes = MID_TRAINING[case]
    module = load_algo(name)
    total = CASES[name].total
    seen = inject_oom(monkeypatch, module, function, lambda n: n == call)
    result = train(name, site_toml, tmp_path, total)

    assert seen["raised"] == 1
    err = capsys.readouterr().err
    assert f"warning: CUDA out of memory {halving}" in err and "; continuing" in err, err[-2000:]
    assert result["global_step"] == total  # the budget is kept: more, smaller iterations after the halving
    metrics = assert_finished(tmp_path, total)
    events = tensorboard_text(tmp_path)
    assert halving.encode() in events  # TensorBoard text "oom"
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    for key, value in sizes.items():  # the values used are logged, not the ones asked for
        assert result[key] == value and metrics[key].iloc[-1] == value, (key, metrics[key].tolist())
        assert saved["sizes"][key] == value  # the sizes in use; Args keeps what was asked for
        assert f"|{key}|{value}|".encode() in events  # the hyperparameters again, as used at the end
    if name in ("ppo", "a2c"):  # annealed linearly over the steps, so with no jump at the halving
        num_steps = int(CASES[name].args[CASES[name].args.index("--num-steps") + 1])
        before = metrics.global_step - metrics.num_envs * num_steps  # the step at which the logged iteration began
        expected = module.Args.learning_rate * (1.0 - before / total)
        np.testing.assert_allclose(metrics.learning_rate, expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- repeated errors
REPEATED = {
    # failing calls of the case's update function: one early halving, then every call from some point on
    "ppo": (lambda n: n == 2 or n >= 4),  # 4 -> 2 envs, a checkpoint at 2 envs, 2 -> 1, then the stop
    "a2c": (lambda n: n == 2 or n >= 10),  # 4 -> 2 envs, a checkpoint at 2 envs (iteration 6), 2 -> 1, the stop
    "sac": (lambda n: n == 5 or n >= 100),  # batch 128 -> 64, a checkpoint (iteration 48), num_envs 4 -> 2, the stop
    "dqn": (lambda n: n == 3 or n >= 40),  # batch 128 -> 64, a checkpoint (iteration 16), num_envs 4 -> 2, the stop
}


@pytest.mark.parametrize("name", list(CASES))
def test_repeated_ooms_stop_with_an_explanatory_error_and_the_run_resumes_from_its_checkpoint(
    name, site_toml, tmp_path, monkeypatch, capsys
):
    module = load_algo(name)
    case = CASES[name]
    ckpt = tmp_path / "checkpoint.pt"
    seen = inject_oom(monkeypatch, module, case.update, REPEATED[name], ckpt)
    with pytest.raises(harness.OutOfMemoryBackoffError) as info:
        train(name, site_toml, tmp_path, case.total, "--max-oom-retries", "2")

    message = str(info.value)
    assert seen["raised"] == 3  # two halvings, then the stop
    assert "no further back-off: max_oom_retries=2 halvings" in message and "made already" in message, message
    assert message.count("CUDA out of memory at global_step") == 3  # the stop and the two halvings it lists
    assert f"the last good checkpoint {ckpt} is left untouched" in message
    assert "--num-envs" in message and "--max-oom-retries" in message and INJECTED in message
    assert capsys.readouterr().err.count("warning: CUDA out of memory") == 2
    # no checkpoint from the failed state, nor a policy: the checkpoint is the one there at the last error
    assert seen["ckpt_bytes"] is not None and ckpt.read_bytes() == seen["ckpt_bytes"]
    assert not (tmp_path / "policy.pt2").exists()
    saved = torch.load(ckpt, weights_only=False)
    assert 0 < saved["global_step"] < case.total

    # resumed with the command line's sizes (no more errors), the run trains two more of its iterations
    monkeypatch.undo()
    end = saved["global_step"] + 2 * case.per_iteration
    result = train(name, site_toml, tmp_path, end, "--resume")
    assert result["global_step"] == end
    assert_finished(tmp_path, end)


# ---------------------------------------------------------------------------------------------- setup
@pytest.mark.parametrize("name", list(CASES))
def test_an_oom_at_setup_halves_num_envs(name, site_toml, tmp_path, monkeypatch, capsys):
    load_algo(name)
    case = CASES[name]
    seen = inject_oom(monkeypatch, harness, "make_env", lambda n: n == 1)
    result = train(name, site_toml, tmp_path, case.total)
    assert seen["raised"] == 1 and seen["calls"] == 2  # built again once, at half the size
    assert "warning: CUDA out of memory at setup: num_envs 4 -> 2" in capsys.readouterr().err
    assert result["num_envs"] == 2 and result["global_step"] == case.total
    metrics = assert_finished(tmp_path, case.total)
    assert (metrics.num_envs == 2).all()
    assert b"CUDA out of memory at setup: num_envs 4 -> 2" in tensorboard_text(tmp_path)


@pytest.mark.parametrize("name", ["sac", "dqn"])
def test_a_replay_buffer_that_does_not_fit_is_halved_down_to_its_floor(name, site_toml, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    inject_oom(monkeypatch, harness, "ReplayBuffer", lambda n: n <= 2)
    result = train(name, site_toml, tmp_path / "halved", case.total, "--batch-size", "16")
    start = int(case.args[case.args.index("--buffer-size") + 1])
    assert result["buffer_size"] == start // 4
    err = capsys.readouterr().err
    assert f"buffer_size {start} -> {start // 2}" in err and f"buffer_size {start // 2} -> {start // 4}" in err
    assert_finished(tmp_path / "halved", case.total)

    # never fits: the halving stops at max(num_envs, batch_size) rows, with a clear error
    inject_oom(monkeypatch, harness, "ReplayBuffer", lambda n: True)
    with pytest.raises(harness.OutOfMemoryBackoffError, match="--buffer-size"):
        train(name, site_toml, tmp_path / "never", case.total, "--batch-size", "16")
    assert not (tmp_path / "never" / "checkpoint.pt").exists()


# ---------------------------------------------------------------------------------------------- the pieces
def test_out_of_memory_message_finds_the_error_behind_another():
    assert harness.out_of_memory_message(torch.OutOfMemoryError(INJECTED + "\nmore lines")) == INJECTED
    assert harness.out_of_memory_message(RuntimeError("shape mismatch")) is None
    # a failed capture or compilation raises its own error while handling (or from) the allocator's
    for chain in ("context", "cause"):
        try:
            try:
                raise torch.cuda.OutOfMemoryError(INJECTED)
            except RuntimeError as oom:
                if chain == "cause":
                    raise RuntimeError("compilation failed") from oom
                raise RuntimeError("operation failed during capture")  # noqa: B904
        except RuntimeError as exc:
            assert harness.out_of_memory_message(exc) == INJECTED


def test_ppo_halving_stops_where_num_envs_cannot_be_halved():
    ppo = load_algo("ppo")
    with pytest.raises(ValueError, match="num_envs 1 cannot be halved"):
        ppo.halve_num_envs(ppo.Sizes(num_envs=1, num_steps=4, num_minibatches=2))
    # under --cudagraphs the halved batch must still split into equal minibatches: 6 envs x 1 step into 2, 3 x 1 not
    sizes, change = ppo.halve_num_envs(ppo.Sizes(12, 1, 2), cudagraphs=True)
    assert change == "num_envs 12 -> 6 (batch 12 -> 6, minibatch 6 -> 3)"
    with pytest.raises(ValueError, match="equal minibatches"):
        ppo.halve_num_envs(sizes, cudagraphs=True)
    assert (sizes.num_envs, sizes.batch_size, sizes.minibatch_size) == (6, 6, 3)


def test_off_policy_halving_order_batch_then_envs():
    """SAC's and DQN's rule (the harness's): the batch in the gradient steps, down to its floor, else num_envs."""
    sizes = harness.ReplaySizes(num_envs=2, batch_size=256, buffer_size=1000)
    sizes, change = harness.halve_batch_or_envs(sizes, True)
    assert change == "batch_size 256 -> 128"
    sizes, change = harness.halve_batch_or_envs(sizes, False)
    assert change == "num_envs 2 -> 1"  # stepping the envs: always num_envs
    sizes, change = harness.halve_batch_or_envs(sizes, True)
    assert change == "batch_size 128 -> 64"
    with pytest.raises(ValueError, match="num_envs 1 cannot be halved and batch_size 64 would drop below 64"):
        harness.halve_batch_or_envs(sizes, True)  # the batch is at its floor, one env left
    with pytest.raises(ValueError, match="num_envs 1 cannot be halved$"):
        harness.halve_batch_or_envs(sizes, False)
    assert sizes == harness.ReplaySizes(1, 64, 1000)
