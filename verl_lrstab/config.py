"""Options of the ``length_surge`` scheduler (pure: no verl, no torch).

In a verl config they live under ``actor_rollout_ref.actor.optim.length_surge``;
left unset, they follow arXiv 2602.01826 (period factor 1.8, halving, floor 0.1 x the initial
LR) with one change: the first halving comes right after the detected surge (``origin: surge``),
since real fast collapses crash ~1.1 x t_surge, long before the paper's first halving at
1.8 x t_surge. ``origin: start`` is the paper as published.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Mapping, Optional, Union

from verl_lrstab.dataclass_reader import is_integer

SCHEDULER_NAME = "length_surge"
ORIGINS = ("start", "surge")
TRIGGERS = ("length", "mismatch", "either")
# ``cusum`` (default): verl_lrstab.cusum; ``ratio``: the first, simpler rule, verl_lrstab.ratio.
DETECTORS = ("cusum", "ratio")
# Options read by one detector only: set away from their default under the other one, they are refused.
RATIO_ONLY = ("fast_window", "horizon", "baseline_window", "ratio_threshold")
# Non-negative mismatch figures a budget makes sense for (k1 can be negative).
MISMATCH_METRICS = ("k3", "seq_k3", "max_abs_diff", "frac_over_thr")

#: The actor's optimizer config in a verl config, and our options under it (the keys errors name).
OPTIM_KEY = "actor_rollout_ref.actor.optim"
OPTIONS_KEY = f"{OPTIM_KEY}.length_surge"
# Hydra's own keys of a config node (instantiate's); any other key starting with "_" is unknown.
HYDRA_KEYS = ("_target_", "_recursive_", "_convert_", "_partial_", "_args_")
# The longest decay period taken, in optimizer updates (10 million: no RL run comes near it; a
# larger one is a typo that would only fail, or overflow, at the surge step), and the largest
# period_factor (P = period_factor x the surge step stays within it for surges up to 10 000 steps).
MAX_DECAY_PERIOD = 10_000_000
MAX_PERIOD_FACTOR = 1000.0


@dataclass
class LengthSurgeConfig:
    """Configuration of the response-length-surge LR decay.

    Schedule (``lr(t) = lr0 * max(min_lr_ratio, gamma ** n(t))``, t = actor update, 1-based):

    Args:
        period_factor (float): ``P = round(period_factor * t_surge)``, in (0, 1000]. Default 1.8 (the paper).
        gamma (float): multiplicative decay per period, in (0, 1). Default 0.5 (halving).
        min_lr_ratio (float): the floor, as a fraction of the initial LR, in (0, 1]. Default 0.1.
        origin (str): where the halvings are counted from. ``"surge"`` (default): the first
            decay applies to the first update after the surge is seen (detection step + 1), then
            one more every ``P`` updates; in time for runs whose collapse follows the surge
            within a few steps (real bf16 GRPO collapses: ~1.1 x t_surge). ``"start"`` (the paper
            as read by public write-ups): ``n(t) = t // P``, so the first decay comes at
            ``P = 1.8 x t_surge``, in time only for a collapse near the paper's ~2.7 x t_surge.
            A checkpoint written with another origin keeps its own on resume unless ``origin``
            is set explicitly (a running schedule never changes silently).
        decay_period (int | None): fixed period for the paper's two-run workflow, in [1, 10000000]. When set,
            the decay follows it from the start (``origin`` is ignored) and the detector only
            reports. Default None (the period comes from the detected surge).
        decay_from_step (int | None): the guard's rollback (``lrstab guard``), in [0, 10000000]: the decay starts
            at this update whatever the detector says or a checkpoint holds, as ``origin:
            surge`` does (the first halving applies to the first update after it, then one more
            every ``decay_period`` updates, which must be set). Default None.
        guard_rollbacks (int): set by ``lrstab guard``: the rollbacks before this launch, logged
            as ``actor/lrstab/rollbacks`` (>= 0). Default 0.
        trigger (str): what starts the decay: ``"length"`` (default, the paper), ``"mismatch"``
            (the mismatch KL exceeds its budget) or ``"either"`` (whichever fires first).
        detector (str): the length-surge test: ``"cusum"`` (default: CUSUM of noise-scaled
            log-length rises, confirmed by witnesses: the score, the mismatch KL, the clip share and
            verl's ``actor/grad_norm``, ``actor/kl_loss``, ``actor/pg_clipfrac``, ``actor/entropy``;
            five ways to fire and five holds, docs/detector.md) or ``"ratio"`` (level vs a baseline
            ``horizon`` steps back; its options: ``fast_window``, ``horizon``, ``baseline_window``,
            ``ratio_threshold``, ``patience``).
        skip_first_steps (int): updates ignored by the detectors, warmup and format learning (>= 0).
            Default 10.
        fast_window (int): ratio detector: span in steps of the median that gives the current
            length level (>= 1). Default 5: a single long batch cannot move it.
        horizon (int): ratio detector: how many steps back the baseline is taken; a rise must happen within
            about this span to count as a surge (>= 1). Default 30 (healthy growth of up to ~1.5x
            over 100+ steps gives a ratio of ~1.15 over 30 steps; a surge of 1.8x-4x within
            20-40 steps gives 1.5 and more).
        baseline_window (int): ratio detector: span in steps of the median that gives the
            baseline (>= 1). Default 10.
        ratio_threshold (float): ratio detector: the surge condition: current level >=
            ratio_threshold x baseline (> 1). Default 1.5.
        patience (int): consecutive observations that must meet the condition (ratio detector
            and mismatch trigger; >= 1). Default 3.
        cusum_span (int): cusum: steps in the trailing baseline of the log length (>= 1). Default 30.
        cusum_lag (int): cusum: the baseline ends this many steps back (>= 0). Default 10.
        cusum_drift (float): cusum: CUSUM allowance per step, in noise units (> 0). Default 1.0.
        cusum_threshold (float): cusum: full length evidence, in noise units (> 0); half of it, with the
            newest step at ``cusum_min_rise``, arms an alarm. Default 5.0.
        cusum_min_rise (float): cusum: the length (newest step; for the score and the length alone, the
            median of 5 steps) must be at least this multiple of the baseline (> 1). Default 1.2.
        cusum_noise_floor (float): cusum: smallest noise scale of the log length (> 0; 0.05 = 5 %).
            Default 0.05.
        cusum_rebound_margin (float): cusum: a level below this multiple of the run's earlier high is a
            rebound, not a surge (> 1). Default 1.3.
        cusum_rebound_memory (int): cusum: steps back the earlier high is looked for (>= 1). Default 100.
        cusum_confirm_steps (int): cusum: an alarm's longest wait for a way to fire (>= 1). Default 40.
        cusum_score_z (float): cusum: a score fall, or a witness rise, counts beyond this many noise
            units (> 0). Default 3.5.
        cusum_kl_rise (float): cusum: the mismatch KL's least rise over its baseline-window median to
            count as a risen witness (> 1; over its level before that window, its square). Default 1.5.
        cusum_clip_rise (float): cusum: the least rise of the share of responses at the response cap
            to count as a risen witness (> 0; in training the glue feeds it as
            ``actor/lrstab/clip_ratio``). Default 0.25.
        cusum_runaway_rise (float): cusum: an armed alarm fires whatever the witnesses once the level
            is this multiple of its baseline and the run never was that long before (> 1). Default 2.5.
        cusum_spike_rise (float): cusum: a one-step spike is a length this multiple of the steps before
            and after it (> 1); it is left out of the level (one long batch is no surge). Default 1.2.
        max_surges (int): how many surges the detector reports per run (>= 1). Default 1. The
            schedule always follows the first one; later ones are only reported.
        mismatch_budget (float | None): fixed budget on the mismatch KL for the mismatch
            trigger (> 0). Default None: calibrated from the run's own early steps.
        mismatch_budget_factor (float): calibrated budget = factor x median mismatch KL over
            ``mismatch_calibration_steps`` valid steps after ``skip_first_steps`` (> 0). Default 4.0.
        mismatch_calibration_steps (int): steps used to calibrate the budget (>= 1). Default 10.
        mismatch_metric (str): which mismatch figure the trigger watches: ``"k3"`` (default),
            ``"seq_k3"``, ``"max_abs_diff"`` or ``"frac_over_thr"`` (see the mismatch metrics).
        monitor_only (bool): run the detector(s) and log every ``lrstab/*`` and ``mismatch/*``
            figure, but never decay: the LR is verl's constant schedule (warmup included).
            For the constant-LR baseline arms of a comparison. Default False.
        length_tokens (str): which tokens of a response the detector counts as its length:
            ``"auto"`` (default: the model's own tokens, ``response_mask``, on a trainer step
            whose responses hold tokens the model did not sample, as tool output in a multi-turn
            rollout; else every response token, verl's ``response_length/mean``, the same
            number there), ``"model"`` (the model's own tokens always) or ``"all"`` (every
            response token always, tool output included). docs/agentic.md.
        dismiss_trigger_step (int | None): the update at which a decay judged a false alarm
            started, in [1, 10000000] (``actor/lrstab/trigger_step``, the update the WARNING names). A run resumed
            from a checkpoint whose decay started at that update resumes at the initial LR with
            the surge detector re-armed from the checkpoint's step; a checkpoint without that
            decay, and a later decay, are not affected, so the option may stay set. Default None.
    """

    # The keys the user set (from_dict); None: built in code, every value chosen. Not an option.
    given_keys: ClassVar[Optional[frozenset]] = None

    period_factor: float = 1.8
    gamma: float = 0.5
    min_lr_ratio: float = 0.1
    origin: str = "surge"
    decay_period: Optional[int] = None
    decay_from_step: Optional[int] = None
    guard_rollbacks: int = 0
    trigger: str = "length"
    detector: str = "cusum"
    skip_first_steps: int = 10
    fast_window: int = 5
    horizon: int = 30
    baseline_window: int = 10
    ratio_threshold: float = 1.5
    patience: int = 3
    max_surges: int = 1
    cusum_span: int = 30
    cusum_lag: int = 10
    cusum_drift: float = 1.0
    cusum_threshold: float = 5.0
    cusum_min_rise: float = 1.2
    cusum_noise_floor: float = 0.05
    cusum_rebound_margin: float = 1.3
    cusum_rebound_memory: int = 100
    cusum_confirm_steps: int = 40
    cusum_score_z: float = 3.5
    cusum_kl_rise: float = 1.5
    cusum_clip_rise: float = 0.25
    cusum_runaway_rise: float = 2.5
    cusum_spike_rise: float = 1.2
    mismatch_budget: Optional[float] = None
    mismatch_budget_factor: float = 4.0
    mismatch_calibration_steps: int = 10
    mismatch_metric: str = "k3"
    monitor_only: bool = False
    length_tokens: str = "auto"
    dismiss_trigger_step: Optional[int] = None

    def __post_init__(self):
        _check(_positive(self.period_factor) and self.period_factor <= MAX_PERIOD_FACTOR, "period_factor",
               self.period_factor, f"a number > 0 and <= {MAX_PERIOD_FACTOR:g} (the decay period is period_factor x "
               f"the surge step, at most {MAX_DECAY_PERIOD} updates)")
        _check(0.0 < _num(self.gamma) < 1.0, "gamma", self.gamma, "a number in (0, 1)")
        _check(0.0 < _num(self.min_lr_ratio) <= 1.0, "min_lr_ratio", self.min_lr_ratio, "a number in (0, 1]")
        _check(self.origin in ORIGINS, "origin", self.origin, f"one of {list(ORIGINS)}")
        if self.decay_period is not None:
            _check(is_integer(self.decay_period) and 1 <= self.decay_period <= MAX_DECAY_PERIOD, "decay_period",
                   self.decay_period, f"null or an integer in [1, {MAX_DECAY_PERIOD}]")
        if self.decay_from_step is not None:
            _check(is_integer(self.decay_from_step) and 0 <= self.decay_from_step <= MAX_DECAY_PERIOD,
                   "decay_from_step", self.decay_from_step, f"null or an integer in [0, {MAX_DECAY_PERIOD}]")
            _check(self.decay_period is not None, "decay_from_step", self.decay_from_step,
                   "null unless decay_period is set too (the period of the decay it starts)")
            _check(not self.monitor_only, "decay_from_step", self.decay_from_step,
                   "null with monitor_only: true (a monitor never decays)")
        _check(is_integer(self.guard_rollbacks) and self.guard_rollbacks >= 0, "guard_rollbacks", self.guard_rollbacks,
               "an integer >= 0")
        _check(self.trigger in TRIGGERS, "trigger", self.trigger, f"one of {list(TRIGGERS)}")
        _check(is_integer(self.skip_first_steps) and self.skip_first_steps >= 0, "skip_first_steps",
               self.skip_first_steps, "an integer >= 0")
        for key in ("fast_window", "horizon", "baseline_window", "patience", "max_surges",
                    "mismatch_calibration_steps"):
            value = getattr(self, key)
            _check(is_integer(value) and value >= 1, key, value, "an integer >= 1")
        _check(_finite_above(self.ratio_threshold, 1.0), "ratio_threshold", self.ratio_threshold, "a number > 1")
        _check(self.detector in DETECTORS, "detector", self.detector, f"one of {list(DETECTORS)}")
        for key in ("cusum_span", "cusum_rebound_memory", "cusum_confirm_steps"):
            value = getattr(self, key)
            _check(is_integer(value) and value >= 1, key, value, "an integer >= 1")
        _check(is_integer(self.cusum_lag) and self.cusum_lag >= 0, "cusum_lag", self.cusum_lag, "an integer >= 0")
        for key in ("cusum_drift", "cusum_threshold", "cusum_noise_floor", "cusum_score_z", "cusum_clip_rise"):
            _check(_positive(getattr(self, key)), key, getattr(self, key), "a number > 0")
        for key in ("cusum_min_rise", "cusum_rebound_margin", "cusum_kl_rise", "cusum_runaway_rise",
                    "cusum_spike_rise"):
            _check(_finite_above(getattr(self, key), 1.0), key, getattr(self, key), "a number > 1")
        # An option the chosen detector does not read would be a silent no-op: refuse it.
        defaults = {f.name: f.default for f in fields(self)}
        unread = RATIO_ONLY if self.detector != "ratio" else [k for k in defaults if k.startswith("cusum_")]
        for key in unread:
            _check(getattr(self, key) == defaults[key], key, getattr(self, key),
                   f"its default {defaults[key]!r} with detector={self.detector!r} (it is read by "
                   f"detector: {'ratio' if key in RATIO_ONLY else 'cusum'} only)")
        if self.trigger == "length":
            for key in ("mismatch_budget", "mismatch_budget_factor", "mismatch_calibration_steps"):
                _check(getattr(self, key) == defaults[key], key, getattr(self, key),
                       f"its default {defaults[key]!r} with trigger='length' (it is read by trigger: mismatch "
                       "or either only)")
            if self.detector != "ratio":
                _check(self.patience == defaults["patience"], "patience", self.patience,
                       f"its default {defaults['patience']!r} with detector={self.detector!r} and trigger='length' "
                       "(it is read by detector: ratio and trigger: mismatch or either only)")
        if self.mismatch_budget is not None:
            _check(_positive(self.mismatch_budget), "mismatch_budget", self.mismatch_budget,
                   "null or a number > 0")
        _check(_positive(self.mismatch_budget_factor), "mismatch_budget_factor",
               self.mismatch_budget_factor, "a number > 0")
        _check(self.mismatch_metric in MISMATCH_METRICS, "mismatch_metric", self.mismatch_metric,
               f"one of {list(MISMATCH_METRICS)}")
        _check(isinstance(self.monitor_only, bool), "monitor_only", self.monitor_only, "true or false")
        _check(self.length_tokens in ("auto", "model", "all"), "length_tokens", self.length_tokens,
               "one of ['auto', 'model', 'all']")
        if self.dismiss_trigger_step is not None:
            _check(is_integer(self.dismiss_trigger_step) and 1 <= self.dismiss_trigger_step <= MAX_DECAY_PERIOD,
                   "dismiss_trigger_step", self.dismiss_trigger_step,
                   f"null or an integer in [1, {MAX_DECAY_PERIOD}] (the update at which the dismissed decay started)")
            _check(self.decay_from_step is None, "dismiss_trigger_step", self.dismiss_trigger_step,
                   "null with decay_from_step set (the guard's rollback decay is not a detection to dismiss)")

    @classmethod
    def from_dict(cls, options: "LengthSurgeConfig | Mapping[str, Any] | None") -> "LengthSurgeConfig":
        """Build from a mapping (a YAML node); unknown keys raise ``ValueError`` listing the known ones."""
        if options is None:
            return cls()._with_given(())
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"{OPTIONS_KEY} must be a mapping of options, got {type(options).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted((k for k in options if k not in known and k not in HYDRA_KEYS), key=str)
        if unknown:
            raise ValueError(f"unknown key(s) {[f'{OPTIONS_KEY}.{k}' for k in unknown]}; allowed keys: {known}")
        return cls(**{k: v for k, v in options.items() if k in known})._with_given(k for k in options if k in known)

    def to_dict(self) -> dict:
        return asdict(self)

    def is_given(self, key: str) -> bool:
        """Whether ``key`` was set by the user (True for a config built in code)."""
        return self.given_keys is None or key in self.given_keys

    def _with_given(self, keys) -> "LengthSurgeConfig":
        object.__setattr__(self, "given_keys", frozenset(keys))  # instance attribute: survives pickling
        return self



def option_docs() -> dict[str, tuple[str, str]]:
    """``name -> (type, text)`` of every option, from the ``Args:`` section of :class:`LengthSurgeConfig`'s
    docstring (the options' one documentation: the CLI's help and the docs' tables are checked against it)."""
    docs, name = {}, None
    for line in (LengthSurgeConfig.__doc__ or "").split("Args:", 1)[-1].splitlines():
        m = re.match(r"\s{8}(\w+) \(([^)]*)\): (.*)", line)
        if m:
            name = m.group(1)
            docs[name] = (m.group(2), m.group(3).strip())
        elif name and line.strip():
            docs[name] = (docs[name][0], docs[name][1] + " " + line.strip())
    return docs


def options_for(options: Union["LengthSurgeConfig", Mapping[str, Any], None], who: str,
                **selects: tuple) -> "LengthSurgeConfig":
    """The options of a detector or trigger built on its own (``who`` names it in errors).

    Args:
        options: a :class:`LengthSurgeConfig`, a mapping of its keys (checked as a YAML node is) or None
            (the defaults).
        **selects: the values of the keys that select ``who`` (``detector=("cusum",)``,
            ``trigger=("mismatch", "either")``): a mapping or None that leaves such a key unset gets the
            first; a value outside them is refused naming the key.
    """
    if not isinstance(options, LengthSurgeConfig):
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"{who} takes a LengthSurgeConfig or a mapping of {OPTIONS_KEY} options, "
                             f"got {type(options).__name__}")
        options = LengthSurgeConfig.from_dict({**{k: v[0] for k, v in selects.items()}, **(options or {})})
    for key, allowed in selects.items():
        value = getattr(options, key)
        _check(value in allowed, key, value, f"one of {list(allowed)} for {who}")
    return options


def _num(value) -> float:
    # bool is an int in Python; a YAML `true` is never a sensible factor.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _positive(value) -> bool:
    return _finite_above(value, 0.0)


def _finite_above(value, low: float) -> bool:
    v = _num(value)
    return math.isfinite(v) and v > low


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{OPTIONS_KEY}.{key}={value!r} is invalid: allowed values are {allowed}")
