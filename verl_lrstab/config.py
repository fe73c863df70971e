"""Options of the ``length_surge`` scheduler (pure: no verl, no torch).

In a verl config they live under ``actor_rollout_ref.actor.optim.length_surge``;
left unset, they follow arXiv 2602.01826 (period factor 1.8, halving, floor 0.1 x the initial
LR) with one change: the first halving comes right after the detected surge (``origin: surge``),
since real fast collapses crash ~1.1 x t_surge, long before the paper's first halving at
1.8 x t_surge. ``origin: start`` is the paper as published.

Each option is declared once, as a field of :class:`LengthSurgeConfig` made by :func:`option`: its
default, its allowed values (:class:`Allowed`), its meaning, which detector or trigger reads it and
what training does not read. The checks (``__post_init__``, :meth:`LengthSurgeConfig.check_training`),
the class's ``Args:`` section, the ``lrstab`` flags (:func:`option_docs`) and docs/configuration.md's
table (``scripts/gen_config_docs.py``) are generated from those declarations.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, TypeVar, Union, cast

from verl_lrstab.dataclass_reader import is_integer

SCHEDULER_NAME = "length_surge"
ORIGINS = ("start", "surge")
TRIGGERS = ("length", "mismatch", "either")
# ``cusum`` (default): verl_lrstab.cusum; ``ratio``: the first, simpler rule, verl_lrstab.ratio.
DETECTORS = ("cusum", "ratio")
# Non-negative mismatch figures a budget makes sense for (k1 can be negative).
MISMATCH_METRICS = ("k3", "seq_k3", "max_abs_diff", "frac_over_thr")
LENGTH_TOKENS = ("auto", "model", "all")

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
#: Who sets the options ``lrstab guard`` sets on each relaunch (they are in no user's table or ``--help``).
GUARD = "lrstab guard"

T = TypeVar("T")


@dataclass(frozen=True)
class Allowed:
    """The values an option takes: :meth:`admits` checks one, :attr:`text` says them (errors and docs).

    Args:
        kind (str): ``"number"`` (an int or a float, finite), ``"integer"``, ``"choice"`` or ``"flag"`` (a bool).
        low (float): the lowest number, included where ``low_in``.
        high (float): the highest number, included where ``high_in``; ``inf``: none.
        choices (tuple): the texts a ``"choice"`` takes.
        nullable (bool): null (None) is taken too.
    """

    kind: str
    low: float = -math.inf
    high: float = math.inf
    low_in: bool = True
    high_in: bool = True
    choices: tuple = ()
    nullable: bool = False

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if self.kind == "flag":
            return isinstance(value, bool)
        if self.kind == "integer" and not is_integer(value):
            return False
        v = _num(value)
        return (math.isfinite(v) and (v >= self.low if self.low_in else v > self.low)
                and (v <= self.high if self.high_in else v < self.high))

    @property
    def text(self) -> str:
        """The allowed values in words: ``a number in (0, 1)``, ``null or an integer >= 1``, ``one of [...]``."""
        if self.kind == "choice":
            words = f"one of {list(self.choices)}"
        elif self.kind == "flag":
            words = "true or false"
        else:
            name = "a number" if self.kind == "number" else "an integer"
            low = f"{self.low:g}" if self.kind == "number" else str(int(self.low))
            if math.isinf(self.high):
                words = f"{name} {'>=' if self.low_in else '>'} {low}"
            else:
                high = f"{self.high:g}" if self.kind == "number" else str(int(self.high))
                words = f"{name} in {'[' if self.low_in else '('}{low}, {high}{']' if self.high_in else ')'}"
        return f"null or {words}" if self.nullable else words

    @property
    def type(self) -> str:
        """The Python type, as an ``Args:`` entry names it (``int | None``)."""
        name = {"number": "float", "integer": "int", "choice": "str", "flag": "bool"}[self.kind]
        return f"{name} | None" if self.nullable else name


def number(low: float, high: float = math.inf, *, low_in: bool = False, high_in: bool = False,
           nullable: bool = False) -> Allowed:
    return Allowed("number", low, high, low_in, high_in, nullable=nullable)


def integer(low: int, high: float = math.inf, *, nullable: bool = False) -> Allowed:
    return Allowed("integer", low, high, nullable=nullable)


def one_of(*choices: str) -> Allowed:
    return Allowed("choice", choices=choices)


FLAG = Allowed("flag")


@dataclass(frozen=True)
class Unread:
    """Where training does not read an option: away from its default, :meth:`LengthSurgeConfig.check_training`
    refuses it.

    Args:
        why (str): why it is not read, for the error: a format string over the config's fields.
        when (Callable): whether a config is such a case (default: always).
        where (str): that case in words, for the docs (empty: always).
    """

    why: str
    when: Callable[[Any], bool] = lambda config: True
    where: str = ""


@dataclass(frozen=True)
class Option:
    """One option, as :func:`option` declares it.

    Args:
        default: its default.
        meaning (str): what it does, one line of Markdown (``code`` in single backticks).
        allowed (Allowed): its allowed values.
        read_with (tuple): ``(key, values)`` pairs: read only where one of these keys has one of its values
            (``(("detector", ("ratio",)),)``); empty: always read. Set away from its default where it is not
            read, it is refused.
        training (Unread | None): where training does not read it.
        set_by (str): ``"user"``, or :data:`GUARD` for the options ``lrstab guard`` sets on each relaunch.
        replayed (bool): whether ``lrstab replay`` reads it (``--help`` lists it); False: read only when a
            checkpoint is loaded.
        see (str): the manual's page that says more (``detector.md#the-surge-detector``), linked from its table.
    """

    default: Any
    meaning: str
    allowed: Allowed
    read_with: tuple = ()
    training: Optional[Unread] = None
    set_by: str = "user"
    replayed: bool = True
    see: str = ""

    @property
    def read_text(self) -> str:
        """Which options it is read with, as a sentence (empty: always read)."""
        if not self.read_with:
            return ""
        return "Read only with " + " or ".join(f"`{key}: {value}`" for key, values in self.read_with
                                               for value in values) + "."


def option(default: T, meaning: str, allowed: Allowed, **more: Any) -> T:
    """A field of :class:`LengthSurgeConfig` and its declaration (:class:`Option`'s arguments)."""
    return cast(T, field(default=default, metadata={"option": Option(default, meaning, allowed, **more)}))


_RATIO = (("detector", ("ratio",)),)
_CUSUM = (("detector", ("cusum",)),)
_MISMATCH = (("trigger", ("mismatch", "either")),)


def _fixed_period(config: Any) -> bool:
    return config.decay_period is not None and config.decay_from_step is None and not config.monitor_only


@dataclass
class LengthSurgeConfig:
    """Configuration of the response-length-surge LR decay.

    Schedule: ``lr(t) = lr0 * max(min_lr_ratio, gamma ** n(t))``, t = actor update, 1-based. Each field is
    declared by :func:`option`, once; the ``Args:`` below are generated from those declarations.
    """

    # The keys the user set (from_dict); None: built in code, every value chosen. Not an option.
    given_keys: ClassVar[Optional[frozenset]] = None

    period_factor: float = option(
        1.8, "the decay period `P = round(period_factor x t_surge)` updates (half up), `t_surge` the update the "
        "surge is detected at; 1.8 is the paper's (the bound keeps `P` within 10000000 updates)",
        number(0.0, MAX_PERIOD_FACTOR, high_in=True),
        training=Unread("a fixed decay_period={decay_period} halves the LR every {decay_period} steps from step 0; "
                        "period_factor sets a period from the detected surge, used without decay_period",
                        _fixed_period, "beside a fixed `decay_period`"))
    gamma: float = option(0.5, "the multiplier of the LR per period (0.5: halving)", number(0.0, 1.0))
    min_lr_ratio: float = option(0.1, "the LR's floor, as a fraction of the initial LR", number(0.0, 1.0, high_in=True))
    origin: str = option(
        "surge", "where the halvings are counted from: `surge`, the first applies to the first update after the "
        "surge is seen (detection step + 1), then one more every `P` updates; `start`, at multiples of `P` from "
        "step 0, so the first comes at `P = 1.8 x t_surge` (the paper as published). A checkpoint written with "
        "another origin keeps its own on resume unless `origin` is set (a WARNING names both); beside a fixed "
        "`decay_period` training takes `start` or unset only", one_of(*ORIGINS))
    decay_period: Optional[int] = option(
        None, "a fixed `P` for the paper's two-run workflow (`lrstab calibrate` finds it on a constant-LR run): "
        "the decay follows it from step 0 and the detector only reports; `null`: `P` comes from the detected surge",
        integer(1, MAX_DECAY_PERIOD, nullable=True),
        training=Unread("monitor_only: true never decays the LR; lrstab guard sets the period of the decay it "
                        "starts itself", lambda c: c.monitor_only, "with `monitor_only: true`"))
    decay_from_step: Optional[int] = option(
        None, "the guard's rollback: the decay starts at this update whatever the detector says or a checkpoint "
        "holds, as `origin: surge` does (the first halving applies to the next update, then one more every "
        "`decay_period` updates, which must be set; not with `monitor_only`)",
        integer(0, MAX_DECAY_PERIOD, nullable=True), set_by=GUARD)
    guard_rollbacks: int = option(
        0, "the rollbacks before this launch, logged as `actor/lrstab/rollbacks`", integer(0), set_by=GUARD)
    trigger: str = option(
        "length", "what starts the decay: `length` (the paper), `mismatch` (the mismatch KL exceeds its budget) or "
        "`either` (whichever fires first)", one_of(*TRIGGERS), see="mismatch.md#optional-mismatch-trigger-for-the-lr-decay")
    detector: str = option(
        "cusum", "the length-surge test: `cusum`, a CUSUM of noise-scaled "
        "log-length rises confirmed by witnesses (the score, the mismatch KL, the clip share and verl's "
        "`actor/grad_norm`, `actor/kl_loss`, `actor/pg_clipfrac`, `actor/entropy`); `ratio`, a simpler rule: the "
        "length's level against a baseline `horizon` steps back. An option the chosen detector does not read is "
        "refused", one_of(*DETECTORS), see="detector.md#the-surge-detector")
    skip_first_steps: int = option(
        10, "updates the detectors and the mismatch trigger ignore (warmup and format learning)", integer(0))
    fast_window: int = option(
        5, "steps in the median that gives the current length level (5: a single long batch cannot move it)",
        integer(1), read_with=_RATIO)
    horizon: int = option(
        30, "how many steps back the baseline is taken: a rise must happen within about this span to count as a "
        "surge (healthy growth of up to 1.5x over 100+ steps gives a ratio of ~1.15 over 30 steps; a surge of "
        "1.8x-4x within 20-40 steps 1.5 and more)", integer(1), read_with=_RATIO)
    baseline_window: int = option(10, "steps in the median that gives the baseline", integer(1), read_with=_RATIO)
    ratio_threshold: float = option(
        1.5, "a surge when the level is at least this x the baseline on `patience` consecutive steps", number(1.0),
        read_with=_RATIO)
    patience: int = option(
        3, "consecutive observations that must meet the condition: the ratio detector's level, the mismatch "
        "trigger's budget", integer(1), read_with=_RATIO + _MISMATCH)
    max_surges: int = option(
        1, "surges the detector reports per run; the schedule follows the first", integer(1),
        training=Unread("the schedule follows the first surge only"))
    cusum_span: int = option(
        30, "steps in the trailing baseline of the log length (its median and noise scale) and in the witnesses' "
        "reference window", integer(1), read_with=_CUSUM)
    cusum_lag: int = option(10, "the baseline ends this many steps back", integer(0), read_with=_CUSUM)
    cusum_drift: float = option(
        1.0, "the CUSUM's allowance per step, in noise units: `S = max(0, S + z - cusum_drift)`", number(0.0),
        read_with=_CUSUM)
    cusum_threshold: float = option(
        5.0, "the CUSUM's full length evidence, in noise units: at half of it, with the newest step at "
        "`cusum_min_rise` x the baseline, an alarm is armed; at all of it, with the level there and no witness "
        "logged, the alarm fires (way `length`)", number(0.0), read_with=_CUSUM)
    cusum_min_rise: float = option(
        1.2, "the least length, as a multiple of the baseline: of the newest step to arm an alarm and for the "
        "witnesses to fire it, of the level (median of the last 5 steps) for the score and the length alone",
        number(1.0), read_with=_CUSUM)
    cusum_noise_floor: float = option(
        0.05, "the smallest noise scale of the log length (0.05 = 5 %)", number(0.0), read_with=_CUSUM)
    cusum_rebound_margin: float = option(
        1.3, "a level below this x the run's earlier high (within `cusum_rebound_memory` steps) is a rebound, not "
        "a surge", number(1.0), read_with=_CUSUM)
    cusum_rebound_memory: int = option(
        100, "steps back the run's earlier high is looked for", integer(1), read_with=_CUSUM)
    cusum_confirm_steps: int = option(
        40, "an armed alarm's longest wait for a way to fire", integer(1), read_with=_CUSUM)
    cusum_score_z: float = option(
        3.5, "a score fall, or a witness rise, counts beyond this many noise units", number(0.0), read_with=_CUSUM)
    cusum_kl_rise: float = option(
        1.5, "the mismatch KL's least rise over its median in the baseline window to count as a risen witness "
        "(two votes; over its level before that window, this squared)", number(1.0), read_with=_CUSUM)
    cusum_clip_rise: float = option(
        0.25, "the least rise of the clip share (the share of responses at the response cap, fed in training as "
        "`actor/lrstab/clip_ratio`) to count as a risen witness (two votes)", number(0.0), read_with=_CUSUM)
    cusum_runaway_rise: float = option(
        2.5, "an armed alarm fires whatever the witnesses once the level is this x its baseline (way `runaway`: "
        "the paper's 3-4x surge may come with a rising score)", number(1.0), read_with=_CUSUM)
    cusum_spike_rise: float = option(
        1.2, "a length this x the steps before and after it is a one-step spike, left out of the level (one long "
        "batch is no surge), its score out of the score's", number(1.0), read_with=_CUSUM)
    mismatch_budget: Optional[float] = option(
        None, "a fixed budget on the mismatch KL; `null`: calibrated from the run's own early steps",
        number(0.0, nullable=True), read_with=_MISMATCH)
    mismatch_budget_factor: float = option(
        4.0, "the calibrated budget: this x the median mismatch KL of the calibration steps", number(0.0),
        read_with=_MISMATCH)
    mismatch_calibration_steps: int = option(
        10, "valid steps after `skip_first_steps` that calibrate the budget", integer(1), read_with=_MISMATCH)
    mismatch_metric: str = option(
        "k3", "the mismatch figure the trigger watches (and `detector: cusum` reads as a witness)",
        one_of(*MISMATCH_METRICS), read_with=_MISMATCH + _CUSUM, see="mismatch.md")
    monitor_only: bool = option(
        False, "run the detector(s) and log every `lrstab/*` and `mismatch/*` figure, but never decay: the LR is "
        "verl's constant schedule, warmup included (the constant-LR arm of a comparison)", FLAG)
    length_tokens: str = option(
        "auto", "which tokens of a response the detector counts as its length: `auto`, the model's own "
        "(`response_mask`) on a trainer step whose responses hold tokens the model did not sample (tool output in "
        "a multi-turn rollout), else every response token (verl's `response_length/mean`, the same number "
        "there); `model`, the model's own always; `all`, every response token always",
        one_of(*LENGTH_TOKENS), see="agentic.md")
    dismiss_trigger_step: Optional[int] = option(
        None, "the update at which a decay judged a false alarm started (`actor/lrstab/trigger_step`, the update "
        "the WARNING names): a run resumed from a checkpoint whose decay started there resumes at the initial LR "
        "with the detector re-armed from the checkpoint's step; a checkpoint without that decay, and a later "
        "decay, are not affected, so it may stay set; not with `decay_from_step`",
        integer(1, MAX_DECAY_PERIOD, nullable=True), replayed=False, see="integration.md",
        training=Unread("no detection starts a decay here (a fixed decay_period halves the LR from step 0 whatever the "
                        "detector says; monitor_only: true never decays), so there is none to dismiss",
                        lambda c: _fixed_period(c) or c.monitor_only,
                        "beside a fixed `decay_period` or with `monitor_only: true`"))

    def __post_init__(self):
        specs = options()
        for key, spec in specs.items():
            # numpy's scalars (a sweep's grid) become Python's: a checkpoint holding a numpy scalar is refused by
            # ``torch.load(weights_only=True)``
            object.__setattr__(self, key, _python_number(getattr(self, key), spec.allowed.kind))
            _check(spec.allowed.admits(getattr(self, key)), key, getattr(self, key), spec.allowed.text)
        if self.decay_from_step is not None:
            _check(self.decay_period is not None, "decay_from_step", self.decay_from_step,
                   "null unless decay_period is set too (the period of the decay it starts)")
            _check(not self.monitor_only, "decay_from_step", self.decay_from_step,
                   "null with monitor_only: true (a monitor never decays)")
        if self.dismiss_trigger_step is not None:
            _check(self.decay_from_step is None, "dismiss_trigger_step", self.dismiss_trigger_step,
                   "null with decay_from_step set (the guard's rollback decay is not a detection to dismiss)")
        # An option the chosen detector or trigger does not read would be a silent no-op: refuse it.
        for key, spec in specs.items():
            value = getattr(self, key)
            if spec.read_with and value != spec.default and not self._read(spec):
                where = " and ".join(f"{k}={getattr(self, k)!r}" for k, _ in spec.read_with)
                by = " or ".join(f"{k}: {' or '.join(values)}" for k, values in spec.read_with)
                _check(False, key, value, f"its default {spec.default!r} with {where} (it is read by {by} only)")

    def _read(self, spec: Option) -> bool:
        return any(getattr(self, key) in values for key, values in spec.read_with)

    def check_training(self) -> "LengthSurgeConfig":
        """Refuse what training never reads (each option's :class:`Unread`), naming the key; returns ``self``.

        Beside a fixed ``decay_period`` (the paper's second run; not with the guard's ``decay_from_step``,
        whose period the guard computed from ``period_factor``) ``origin: surge`` set explicitly is refused
        too: a fixed period counts its halvings from step 0 (``origin: start`` or unset). ``gamma``,
        ``min_lr_ratio``, ``period_factor`` and ``origin`` stay accepted under ``monitor_only``, which does not
        read them: ``lrstab guard`` resumes such a run with the decay on and reads them.
        """
        if _fixed_period(self) and self.is_given("origin") and self.origin != "start":
            raise ValueError(f"{OPTIONS_KEY}.origin={self.origin!r} is invalid beside a fixed "
                             f"decay_period={self.decay_period}: allowed values are 'start' or leaving origin unset "
                             f"(a fixed period halves the LR every {self.decay_period} steps counted from step 0, "
                             "the paper's second run; the detector only reports)")
        for key, spec in options().items():
            value, unread = getattr(self, key), spec.training
            if unread is not None and unread.when(self) and value != spec.default:
                raise ValueError(f"{OPTIONS_KEY}.{key}={value!r} is invalid in training: allowed values are its "
                                 f"default {spec.default!r} (not read: {unread.why.format(**self.to_dict())})")
        return self

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


def options() -> dict[str, Option]:
    """Every option's declaration, in the order of :class:`LengthSurgeConfig`'s fields."""
    return {f.name: f.metadata["option"] for f in fields(LengthSurgeConfig)}


def yaml_text(value: Any) -> str:
    """A default as a verl YAML writes it: ``null``, ``true``, ``surge``, ``1.8``."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def option_docs() -> dict[str, tuple[str, str]]:
    """``name -> (type, text)`` of every option, from its declaration (the text in reST: ``code`` in double
    backticks): its meaning, what it is read with, its allowed values and its default. The ``Args:`` of
    :class:`LengthSurgeConfig` and the ``lrstab`` flags' help are these texts."""
    docs = {}
    for key, spec in options().items():
        text = f"{spec.meaning}. {spec.read_text}".strip().replace("`", "``")
        docs[key] = (spec.allowed.type, f"{text} Allowed: {spec.allowed.text}. Default {yaml_text(spec.default)}.")
    return docs


def _args_section() -> str:
    lines = ["", "    Args:"]
    for key, (typ, text) in option_docs().items():
        lines += textwrap.wrap(f"{key} ({typ}): {text}", 112, initial_indent=" " * 8, subsequent_indent=" " * 12,
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"


LengthSurgeConfig.__doc__ = (LengthSurgeConfig.__doc__ or "").rstrip() + "\n" + _args_section()


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


def _python_number(value, kind: str):
    """``value`` as a Python ``int``/``float`` where it is another integral/real number type (numpy's
    ``int64``, ``float32``) of a ``"number"`` or ``"integer"`` option; anything else is returned as is
    (bools and texts stay refused)."""
    if kind not in ("number", "integer") or isinstance(value, (bool, str)) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if kind == "number" and isinstance(value, numbers.Real):
        return float(value)
    return value


def _num(value) -> float:
    # bool is an int in Python; a YAML `true` is never a sensible factor.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{OPTIONS_KEY}.{key}={value!r} is invalid: allowed values are {allowed}")
