"""Rollout configurations that bias the mismatch figures, or that no LR schedule can fix.

Pure functions of verl's config tree (an OmegaConf node, a dict or verl's dataclasses): each
:class:`Finding` names the keys, says why, and what to set. The admission check (`lrstab admit`)
reports them per candidate; a training run that names ``length_surge`` logs them as warnings when
its trainer is built (:mod:`verl_lrstab.glue.driver`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLLOUT = "actor_rollout_ref.rollout"
RC = "algorithm.rollout_correction"


@dataclass(frozen=True)
class Finding:
    """One configuration problem: ``code`` (stable, for the JSON), the ``keys`` involved, the message."""

    code: str
    keys: tuple
    message: str


def config_value(cfg, path: str, default: Any = None) -> Any:
    """``cfg`` at the dotted ``path`` (OmegaConf, dicts or dataclasses), or ``default`` when a key is
    missing, null or an interpolation that does not resolve."""
    node = cfg
    for key in path.split("."):
        try:
            node = node.get(key) if hasattr(node, "get") else getattr(node, key)
        except Exception:  # noqa: BLE001 - a missing key or an unresolvable interpolation
            return default
        if node is None:
            return default
    return node


def _changes_distribution(cfg) -> list[str]:
    """The sampling parameters that make the sampled distribution differ from the model's softmax."""
    out = []
    temperature = config_value(cfg, f"{ROLLOUT}.temperature", 1.0)
    if temperature is not None and float(temperature) != 1.0:
        out.append(f"{ROLLOUT}.temperature={temperature}")
    top_p = config_value(cfg, f"{ROLLOUT}.top_p", 1.0)
    if top_p is not None and float(top_p) < 1.0:
        out.append(f"{ROLLOUT}.top_p={top_p}")
    top_k = config_value(cfg, f"{ROLLOUT}.top_k", -1)
    if top_k is not None and int(top_k) > 0:
        out.append(f"{ROLLOUT}.top_k={top_k}")
    return out


def check_rollout_config(cfg) -> list[Finding]:
    """The configuration checks of the admission check (docs/admit.md).

    Args:
        cfg: verl's whole config tree (``ppo_trainer`` as composed).

    Returns:
        The findings, in a fixed order; empty when nothing is known to bias the figures.
    """
    findings: list[Finding] = []
    if not config_value(cfg, f"{ROLLOUT}.calculate_log_probs", True):
        findings.append(Finding(
            "no_rollout_log_probs", (f"{ROLLOUT}.calculate_log_probs",),
            f"{ROLLOUT}.calculate_log_probs=false: the rollout engine returns no log-probs, so no mismatch "
            "figure can be measured (actor/mismatch/* are not logged). Set it to true."))
    mode = str(config_value(cfg, f"{ROLLOUT}.logprobs_mode", "processed_logprobs"))
    shaping = _changes_distribution(cfg)
    if mode != "processed_logprobs" and shaping:
        findings.append(Finding(
            "raw_logprobs_with_shaped_sampling", (f"{ROLLOUT}.logprobs_mode", *[s.split("=")[0] for s in shaping]),
            f"{ROLLOUT}.logprobs_mode={mode} with {', '.join(shaping)}: the engine reports log-probs before "
            "the sampling parameters apply while it samples after them, so the measured mismatch is the "
            "sampling parameters' effect, not the engines' disagreement (a system mismatch no LR schedule "
            "fixes). Set logprobs_mode=processed_logprobs."))
    top = [s for s in shaping if not s.startswith(f"{ROLLOUT}.temperature")]
    if top and (config_value(cfg, f"{RC}.rollout_is") is not None or config_value(cfg, f"{RC}.rollout_rs") is not None
                or config_value(cfg, f"{RC}.bypass_mode", False)):
        findings.append(Finding(
            "truncated_sampling_with_rollout_correction", (*[s.split("=")[0] for s in top], RC),
            f"{', '.join(top)} with rollout correction ({RC}): the sampler draws from a truncated "
            "distribution the trainer does not score (its log-probs are over the full vocabulary), which "
            "biases the IS ratio and the mismatch figures upward. Sample with top_p=1 and top_k=-1, or "
            "read the figures as an upper bound."))
    use_v1 = bool(config_value(cfg, "trainer.use_v1", True))
    if not use_v1 and config_value(cfg, f"{RC}.bypass_mode", False):
        set_keys = [k for k in ("rollout_is", "rollout_rs") if config_value(cfg, f"{RC}.{k}") is not None]
        if str(config_value(cfg, f"{RC}.loss_type", "ppo_clip")) != "ppo_clip":
            set_keys.append("loss_type")
        loss_mode = str(config_value(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"))
        if set_keys and loss_mode != "bypass_mode":
            findings.append(Finding(
                "v0_bypass_correction_not_applied",
                (*[f"{RC}.{k}" for k in set_keys], "actor_rollout_ref.actor.policy_loss.loss_mode"),
                f"verl 0.9.1's V0 trainer in bypass mode hands {', '.join(f'{RC}.{k}' for k in set_keys)} to the "
                "loss by editing the driver's copy of actor.policy_loss after the workers were built: the "
                "workers keep loss_mode=vanilla and the correction is silently off. Also set ++actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode "
                f"and ++actor_rollout_ref.actor.policy_loss.rollout_correction=${{{RC}}}, or use trainer.use_v1=true."))
    return findings
