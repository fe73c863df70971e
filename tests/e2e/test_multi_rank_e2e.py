"""Issue 11 §3: verl's real main_ppo on CPU with 2 FSDP ranks: every rank logs the same LR every step.

Each rank appends its LR and a hash of its scheduler state after every scheduler step (the
``sitecustomize`` fixture's ``rank_probes``, test code only); the two ranks' records must agree
step for step, and with the ``actor/lr`` verl logged. Two FSDP workers fit the 2 cores: the run
took 56 s (``pytest -m "" tests/e2e/test_multi_rank_e2e.py``), so it is in ``make test``.
"""

from __future__ import annotations

import json

import pytest

from test_main_ppo_cpu import SURGE, TRAINER, series

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 4


def test_two_fsdp_ranks_log_the_same_lr_every_step(main_ppo, tmp_path_factory, sitecustomize):
    probes = tmp_path_factory.mktemp("rank-probes")
    run = main_ppo("dp2", SURGE + TRAINER["v0"] + [
        f"trainer.total_training_steps={STEPS}",
        "trainer.n_gpus_per_node=2",
        "ray_kwargs.ray_init.num_gpus=2",
        # 32 samples per step, 16 per rank: micro-batches must divide them
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.dtype=bfloat16",  # a mismatch too, so both figures are all-reduced
        "actor_rollout_ref.actor.optim.length_surge.trigger=either",
    ], env=sitecustomize(rank_probes=probes))
    by_rank = {}
    for path in sorted(probes.glob("lr_rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        by_rank.setdefault(records[0]["rank"], []).extend(records)
    assert sorted(by_rank) == [0, 1], sorted(probes.iterdir())
    r0, r1 = by_rank[0], by_rank[1]
    assert [r["update"] for r in r0] == [r["update"] for r in r1] == list(range(1, STEPS + 1))
    assert r0[0]["pid"] != r1[0]["pid"]
    lr = series(run.metrics, "actor/lr")
    for a, b in zip(r0, r1, strict=True):
        assert a["lr"] == b["lr"] == pytest.approx(lr[a["update"]], rel=1e-12), (a, b)
        assert a["state_sha1"] == b["state_sha1"], (a, b)  # the whole scheduler state, bit for bit
    # both ranks' figures fed the scheduler (the global ones): the logged k3 is the trainer's
    assert set(series(run.metrics, "actor/mismatch/k3")) == set(range(1, STEPS + 1))
