"""The arms of the comparison: Hydra overrides on ``configs/cpu_demo.yaml`` (:data:`BASE` + the arm's).

Every arm but ``control`` runs with the injected mismatch (:func:`mismatch_overrides`):
bf16 generation against the fp32 trainer, plus fresh weight noise of ``noise x std(param)``
in the rollout server after every weight sync. The constant-LR arms use the
``length_surge`` scheduler with ``monitor_only: true``: the LR stays verl's constant, and
the detector's ``actor/lrstab/*`` and the ``actor/mismatch/*`` figures are still logged.
"""

from __future__ import annotations

LS = "++actor_rollout_ref.actor.optim.length_surge"

# The setting of the committed table (scripts/research/repro/README.md, pilots 7-8): the largest LR at which
# the no-mismatch control is stable on the 3-4-digit warm start (1e-3 is not), and a weight noise
# that separates the mismatch arms from the control (0.03-0.1 did not, on the 2-3-digit task).
DEFAULT_LR = 5e-4
DEFAULT_NOISE = 0.3  # ++: cpu_demo.yaml lists only some options

# What every run shares, on top of configs/cpu_demo.yaml (cpu_demo sets hydra.searchpath, so it
# can only be the primary config: the repro settings are overrides, not a config inheriting it).
BASE = [
    "trainer.use_v1=false",  # V0 trainer: ~4x faster per step on CPU
    "data.train_batch_size=8",
    "data.max_prompt_length=24",
    "data.max_response_length=64",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # 8 prompts x 8 samples = ONE optimizer step per RL step
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.rollout.engine_kwargs.transformers.batch_wait_ms=50",  # the 64 requests of a step: one batch
    "reward.custom_reward_function.path=${oc.env:LRSTAB_REPRO_REWARD}",
    "reward.custom_reward_function.name=compute_score",
    "trainer.val_before_train=true",
    "trainer.test_freq=10",
    # validation SAMPLES like the rollout (4 per prompt): greedy decoding picks the warm start's
    # majority mode (direct answers) and hides the shift to worked answers that RL makes
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.rollout.val_kwargs.n=4",
    # the paper rule (P = 1.8 t_surge, halvings, floor 0.1) and the detector the published pilots
    # and table used (`ratio`, the first, simpler rule, with its default windows):
    # cpu_demo.yaml shortens them for its 40-step demo, so they are set back here. (Windows scaled
    # down to skip 5 / horizon 20 / baseline 5 missed the gradual rise of pilot 3 until step 144.)
    *[f"~actor_rollout_ref.actor.optim.length_surge.{k}" for k in ("cusum_span", "cusum_lag", "cusum_runaway_rise")],
    f"{LS}.period_factor=1.8",
    f"{LS}.origin=start",
    f"{LS}.detector=ratio",
    f"{LS}.skip_first_steps=10",
    f"{LS}.fast_window=5",
    f"{LS}.horizon=30",
    f"{LS}.baseline_window=10",
    f"{LS}.ratio_threshold=1.5",
    f"{LS}.patience=3",
]

ARMS: dict[str, dict] = {
    "const": {"mismatch": True, "overrides": [f"{LS}.monitor_only=true"],
              "doc": "constant LR, injected mismatch"},
    "const_tis": {"mismatch": True,
                  "overrides": [f"{LS}.monitor_only=true", "algorithm.rollout_correction.rollout_is=token",
                                "algorithm.rollout_correction.rollout_is_threshold=2.0"],
                  "doc": "constant LR + token TIS (verl rollout_correction, cap 2.0)"},
    "ls_start": {"mismatch": True, "overrides": [f"{LS}.origin=start"],
                 "doc": "length_surge, origin start (paper rule: halvings at multiples of P = 1.8 t_surge)"},
    "ls_surge": {"mismatch": True, "overrides": [f"{LS}.origin=surge"],
                 "doc": "length_surge, origin surge (first halving right after the surge)"},
    "control": {"mismatch": False, "overrides": [f"{LS}.monitor_only=true"],
                "doc": "constant LR, NO injected mismatch (fp32 generation, no noise)"},
    "mm_trigger": {"mismatch": True, "overrides": [f"{LS}.trigger=mismatch", f"{LS}.origin=surge"],
                   "doc": "LR decay started by the mismatch-KL trigger (extra arm)"},
}


def run_overrides(arm: str, seed: int, steps: int, lr: float) -> list[str]:
    """What one run of either recipe sets besides its base and arm: seeds, steps, LR, experiment name."""
    return [
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.total_training_steps={steps}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"trainer.experiment_name={arm}-s{seed}",
    ]


def mismatch_overrides(enabled: bool, noise: float) -> list[str]:
    """The rollout-side mismatch knobs.

    Args:
        enabled: False for the control (fp32 generation, no noise).
        noise: weight-noise sigma, as a fraction of each parameter's std.

    Returns:
        Hydra overrides.
    """
    kw = "actor_rollout_ref.rollout.engine_kwargs.transformers.weight_noise"
    if not enabled:
        return ["actor_rollout_ref.rollout.dtype=float32", f"{kw}=0.0"]
    if noise < 0:
        raise ValueError(f"--noise must be >= 0, got {noise}")
    return ["actor_rollout_ref.rollout.dtype=bfloat16", f"{kw}={noise}"]


def arm_overrides(arm: str, seed: int, steps: int, lr: float, noise: float) -> list[str]:
    """All overrides of one run.

    Args:
        arm: a key of :data:`ARMS`.
        seed: data order and rollout sampling seed.
        steps: RL steps (= optimizer steps).
        lr: initial actor LR.
        noise: weight-noise sigma of the mismatch arms.

    Returns:
        Hydra overrides for ``configs/cpu_demo.yaml``.
    """
    if arm not in ARMS:
        raise ValueError(f"--arm {arm!r} is not an arm: allowed values are {sorted(ARMS)}")
    spec = ARMS[arm]
    return [
        *BASE,
        *run_overrides(arm, seed, steps, lr),
        *mismatch_overrides(spec["mismatch"], noise),
        *spec["overrides"],
    ]
