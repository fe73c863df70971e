"""``detector: cusum``: a noise-aware surge detector with witnesses (pure Python).

The rule, every decision from data up to the current step only (docs/detector.md has it on one page):

**Length alarm.** On log-lengths, a trailing baseline (median of the ``cusum_span`` steps that end
``cusum_lag`` steps back) and a noise scale (1.4826 x their MAD, at least ``cusum_noise_floor``) give a
z-score per step; a one-sided CUSUM ``S = max(0, S + z - cusum_drift)`` accumulates it. An alarm is
armed when ``S >= cusum_threshold / 2`` and the newest step is at least ``cusum_min_rise`` x the baseline,
unless the run had that level before (a rebound).

**Ways to fire** (:data:`WAYS`), each on an armed alarm: the score's 5-step level falls ``cusum_score_z``
noise units, the length's level at ``cusum_min_rise`` x the baseline (``score``); two witnesses have risen,
the newest step at ``cusum_min_rise`` x (``witnesses``: verl's co-signals on their
newest row, the mismatch KL and the clip share counting as two); no witness is logged at all,
``S >= cusum_threshold`` and the level at ``cusum_min_rise`` x (``length``); the level reaches ``cusum_runaway_rise`` x the
alarm's baseline (``runaway``); and, on a return to an earlier high instead of an alarm, two of verl's
co-signals rising with it (``return``).

**Holds** (:data:`HOLDS`, and the spike exclusion): no baseline yet, its rows after ``skip_first_steps``
covering less than half of ``cusum_span`` (``warmup``); a level the run had before (``rebound``); an alarm whose
CUSUM fell back to 0 or that waited ``cusum_confirm_steps`` (``expiry``); a
one-step spike (``cusum_spike_rise`` x the steps before and after it) is left out of the level, and its score
out of the score's.

Windows count steps, not rows, so a log written every 5-10 steps uses the same options; a window
holding fewer than 8 rows is widened back to 8. NaN, inf, missing and non-positive lengths are
skipped. A witness is a list of observations: a missing value adds none and a repeat of the last
value is none either, so a sparse figure and the same figure forward-filled decide alike.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Mapping, Optional, Union, cast

from verl_lrstab._numbers import finite_float
from verl_lrstab.config import LengthSurgeConfig, options_for
from verl_lrstab.dataclass_reader import Row, from_state, require

logger = logging.getLogger("verl_lrstab")

_NAN = float("nan")
#: The ways to fire and the holds, in the order docs/detector.md tables them.
WAYS = ("score", "witnesses", "length", "runaway", "return")
HOLDS = ("warmup", "rebound", "expiry")
# the level's least rows: a return to an earlier high takes 2-4 steps, and a log written every 10 steps has
# 1 row in 5 steps. k3, measured on the length's own batches, is read over the same rows; the clip share over the
# last 5 steps' rows, at least the newest (its least rise is a quarter of a batch: no long batch's composition).
FAST_ROWS = 2
HALF = 0.5  # half the length evidence: half the CUSUM threshold, half-way to cusum_min_rise, half of cusum_span
LEVEL_STEPS = 5  # the level and every figure's "now": the last 5 steps (two odd batches cannot move a median of 5)
FEW_ROWS = 3  # a median of 3 ignores one odd batch (a grad-norm spike, a long batch)
MIN_ROWS = 8  # a window of a sparse log is widened back to this many rows (a median needs them) ...
NOISE_ROWS = 20  # ... and a noise scale this many (the MAD of 8 rows can understate a noise threefold)
# Slow figures (the score, the mismatch KL) are also compared with their level before the baseline
# window, back to OLD_STEPS steps: a slow surge sags the score and doubles k3 over the 20-30 steps
# before its alarm, i.e. within the baseline window itself.
OLD_STEPS = 60
MAD_SD = 1.4826  # a normal's sd / its median absolute deviation
# sqrt(pi / 2): a normal's sd / its mean absolute deviation, and about the sd of a median of a few values /
# the sd of their mean
MEDIAN_SD = math.sqrt(math.pi / 2)
# A witness has risen when its value now is ``cusum_score_z`` noise units above its median over the baseline window
# (a steadily growing KL loss or a noisy entropy is no rise), and at least this multiple of it (a figure logged
# with few digits has no noise to measure). The mismatch KL (the method's own signal: docs/detector.md) and the
# clip share count as two witnesses, at cusum_kl_rise / cusum_clip_rise.
WITNESS_RISE = 1.1
# k3 against its level before the baseline window must have grown cusum_kl_rise ** OLDER_KL_POWER (2.25x): a flat k3 reads
# 1.5x a level 25-50 steps older now and then in a log written every few steps
OLDER_KL_POWER = 2
COSIGNALS = ("entropy", "grad_norm", "kl_loss", "pg_clipfrac")
WITNESSES = 2  # risen witnesses that confirm: one alone (a grad-norm spike) never does
SCORE_FLOOR = 0.01  # the score's smallest noise scale, as a share of its level (a score logged with few digits)


def _window(rows, lo: int, hi: int, min_rows: Optional[int] = None) -> list[float]:
    """Values of ``rows`` (sorted [step, value]) in steps (lo, hi], widened back to ``min_rows`` rows (default
    MIN_ROWS, read when called: the ablation sets the constants) up to hi."""
    min_rows = MIN_ROWS if min_rows is None else min_rows
    upto = [r for r in rows if r[0] <= hi]
    inside = [v for s, v in upto if s > lo]
    return inside if len(inside) >= min_rows else [v for _, v in upto[-min_rows:]]


def _recent_rows(rows, step: int, least: int) -> list:
    """The rows of the last LEVEL_STEPS steps, widened back to the last ``least`` observations (a figure not
    logged lately is held at its last observations)."""
    inside = [r for r in rows if r[0] > step - LEVEL_STEPS]
    return inside if len(inside) >= least else rows[-least:]


def _recent(rows, step: int, least: int) -> list[float]:
    """The values of :func:`_recent_rows`."""
    return [v for _, v in _recent_rows(rows, step, least)]


def _row(step: int, v: float) -> Row:
    """A [step, value] row: a list, as the state is saved (JSON has no tuples)."""
    return cast(Row, [step, v])


def _add(rows: list, step: int, v: Optional[float]) -> None:
    if v is not None and not (rows and rows[-1][1] == v):
        rows.append(_row(step, v))


def _logs(values: list[float]) -> list[float]:
    return [math.log(v) for v in values if v > 0]


def _scale(values: list[float]) -> float:
    """The noise of the log length: MAD_SD x the median absolute deviation (robust to long batches)."""
    center = median(values)
    return MAD_SD * median(abs(v - center) for v in values)


def _mean_scale(values: list[float]) -> float:
    """The noise of a witness or the score: MEDIAN_SD x the mean absolute deviation from the median (a figure
    logged in steps of 1/batch has a median absolute deviation of 0 at times)."""
    center = median(values)
    return MEDIAN_SD * sum(abs(v - center) for v in values) / len(values)


@dataclass
class Alarm:
    """An armed length alarm (or a watched return to an earlier high): its references at the alarm step."""

    step: int
    baseline: float  # the length baseline, tokens
    is_return: bool = False  # a return to an earlier high: only ``return`` fires it


@dataclass
class _Rows:
    """Observations as [step, value] rows."""

    log: list[Row] = field(default_factory=list)  # log lengths
    high: list[Row] = field(default_factory=list)  # 5-row medians of the log length (the run's earlier levels)
    score: list[Row] = field(default_factory=list)
    kl: list[Row] = field(default_factory=list)
    clip: list[Row] = field(default_factory=list)
    co: dict[str, list[Row]] = field(default_factory=lambda: {name: [] for name in COSIGNALS})

    def __post_init__(self):
        require(set(self.co) == set(COSIGNALS), "co", sorted(self.co), f"a mapping of {list(COSIGNALS)}")


@dataclass
class CusumState:
    """:meth:`CusumDetector.state_dict` as a dataclass (saved as plain types: ``dataclasses.asdict``)."""

    rows: _Rows
    alarm: Optional[Alarm]
    cusum: float
    surge_steps: list[int]
    fired_by: list[str]  # the way each surge fired (WAYS)
    num_skipped: int
    last_step: Optional[int]
    # the last step's measurements (NaN: not formed), reported until the next step forms them
    level: float
    baseline: float
    ratio: float
    noise: float

    def __post_init__(self):
        require(math.isfinite(self.cusum) and self.cusum >= 0, "cusum", self.cusum, "a finite number >= 0")
        require(all(s >= 0 for s in self.surge_steps), "surge_steps", self.surge_steps, "integer steps >= 0")
        require(all(w in WAYS for w in self.fired_by), "fired_by", self.fired_by, f"ways among {list(WAYS)}")
        require(len(self.fired_by) == len(self.surge_steps), "fired_by", self.fired_by, "one way per surge step")
        require(self.num_skipped >= 0, "num_skipped", self.num_skipped, "an integer >= 0")


class CusumDetector:
    """Surge detector: CUSUM of noise-scaled log-length rises, confirmed by witnesses.

    Args:
        config (LengthSurgeConfig | Mapping | None): the options (:class:`verl_lrstab.config.LengthSurgeConfig`,
            where each is documented and checked): ``skip_first_steps``, ``max_surges`` and every ``cusum_*``
            key, each read as the attribute of its own name (``self.cusum_span``). A mapping is checked as a
            YAML node is; ``detector`` must be ``cusum``. None: the defaults.
    """

    def __init__(self, config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None):
        c = options_for(config, "CusumDetector", detector=("cusum",))
        self.skip_first_steps, self.max_surges = c.skip_first_steps, c.max_surges
        self.cusum_span, self.cusum_lag, self.cusum_drift = c.cusum_span, c.cusum_lag, c.cusum_drift
        self.cusum_threshold, self.cusum_min_rise = c.cusum_threshold, c.cusum_min_rise
        self.cusum_noise_floor, self.cusum_score_z = c.cusum_noise_floor, c.cusum_score_z
        self.cusum_rebound_margin, self.cusum_rebound_memory = c.cusum_rebound_margin, c.cusum_rebound_memory
        self.cusum_confirm_steps, self.cusum_kl_rise = c.cusum_confirm_steps, c.cusum_kl_rise
        self.cusum_clip_rise, self.cusum_runaway_rise = c.cusum_clip_rise, c.cusum_runaway_rise
        self.cusum_spike_rise = c.cusum_spike_rise
        self.rows = _Rows()
        self.alarm: Optional[Alarm] = None
        self._cusum = 0.0
        self.surge_steps: list[int] = []
        self.fired_by: list[str] = []  # the way each surge fired (WAYS)
        self.num_skipped = 0
        self.last_step: Optional[int] = None
        self.level = self.baseline = self.ratio = self.noise = _NAN

    @property
    def surge_step(self) -> Optional[int]:
        return self.surge_steps[0] if self.surge_steps else None

    @property
    def cusum(self) -> float:
        return self._cusum

    @property
    def armed_step(self) -> Optional[int]:
        return None if self.alarm is None or self.alarm.is_return else self.alarm.step

    #: The fed figures this detector reads (the schedule logs the ones it is fed).
    reads = ("response_length", "score", "mismatch_kl", "clip_ratio", *COSIGNALS)

    def metrics(self) -> dict:
        """The detector's own figures: the CUSUM, the armed step, the level, baseline, ratio and noise when
        formed, and ``fired_by/<way>`` (the step) once a way has fired."""
        out = {"cusum": self.cusum, "armed_step": -1 if self.armed_step is None else self.armed_step}
        for key, value in (("baseline", self.baseline), ("ratio", self.ratio), ("level", self.level),
                           ("noise", self.noise)):
            if math.isfinite(value):
                out[key] = value
        for step, way in zip(self.surge_steps, self.fired_by):
            out.setdefault(f"fired_by/{way}", step)
        return out

    # -- the update ----------------------------------------------------------------------------
    def add_cosignals(self, step: int, **cosignals: Optional[float]) -> None:
        """Add observations of step ``step`` of the figures in :data:`COSIGNALS` (None or NaN: not logged).

        They are read from the next step on (a decision at step t reads those of steps < t), so the
        trainer, which has an update's figures only after its LR step, and a replay of its log decide alike.
        """
        for name, value in cosignals.items():
            if name not in self.rows.co:
                raise ValueError(f"unknown co-signal {name!r}: allowed values are {list(COSIGNALS)}")
            _add(self.rows.co[name], step, finite_float(value))

    def update(self, step: int, value: Optional[float], score: Optional[float] = None,
               kl: Optional[float] = None, clip_ratio: Optional[float] = None, **cosignals: Optional[float]) -> bool:
        """Feed one step; return True if a surge is reported at this step (:attr:`fired_by` names the way)."""
        self.last_step = step
        rows = self.rows
        for col, v in ((rows.score, score), (rows.kl, kl), (rows.clip, clip_ratio)):
            _add(col, step, finite_float(v))
        self.add_cosignals(step, **cosignals)
        number = finite_float(value)
        if number is None or number <= 0:
            self.num_skipped += 1
            logger.warning("verl_lrstab: step %s: response length %r is not a positive finite number; "
                           "the surge detector skips it", step, value)
            self._prune(step)
            return False
        rows.log.append(_row(step, math.log(number)))
        if len(rows.log) >= LEVEL_STEPS:  # a level is a median of 5 rows: one long first row is none
            rows.high.append(_row(step, median(v for _, v in rows.log[-LEVEL_STEPS:])))
        self._prune(step)
        if not self._measure(step):
            return False
        if len(self.surge_steps) >= self.max_surges:
            return False
        way = self._fire(step)
        if way is None:
            return False
        self.surge_steps.append(step)
        self.fired_by.append(way)
        logger.warning("verl_lrstab: length surge at step %d (fired by %s; level %.4g = %.3g x baseline)",
                       step, way, self.level, self.ratio)
        self.alarm, self._cusum = None, 0.0
        if len(self.surge_steps) < self.max_surges:
            rows.log, rows.high = [], []  # a later surge is measured against the post-surge level
        return True

    def _measure(self, step: int) -> bool:
        """Level, baseline, noise and CUSUM of ``step``; False (the baseline NaN) while the warmup hold stands."""
        log = self.rows.log
        spikes = self._spikes()
        late = [(s, v) for s, v in log if s > self.skip_first_steps and s not in spikes]
        recent = [v for s, v in late if s > step - LEVEL_STEPS]
        if not late:
            return False
        self.level = math.exp(median(recent if len(recent) >= FAST_ROWS else [v for _, v in late[-FAST_ROWS:]]))
        if self._hold_warmup(step):
            self.baseline = self.ratio = self.noise = _NAN
            return False
        eligible = [r for r in log if self.skip_first_steps < r[0] <= step - self.cusum_lag]
        base = _window(eligible, step - self.cusum_lag - self.cusum_span, step)
        b = median(base)
        self.noise = max(_scale(base), self.cusum_noise_floor)
        self.baseline, self.ratio = math.exp(b), self.level / math.exp(b)
        self._cusum = max(0.0, self._cusum + (log[-1][1] - b) / self.noise - self.cusum_drift)
        return True

    def _fire(self, step: int) -> Optional[str]:
        """Arm, expire or decide the alarm of ``step``; the way that fired, or None."""
        b = math.log(self.baseline)
        if (self.alarm is None or self.alarm.is_return) and self._cusum >= self.cusum_threshold * HALF:
            if self._half_evidence() and not self._hold_rebound(step, b):
                self.alarm = self._arm(step, is_return=False)
                logger.info("verl_lrstab: length alarm at step %d (cusum %.1f, level %.4g = %.3g x baseline)",
                            step, self._cusum, self.level, self.ratio)
            elif self.alarm is None and self._fast() >= self.cusum_min_rise * self.baseline and self._returned(step, b):
                self.alarm = self._arm(step, is_return=True)
        a = self.alarm
        if a is None:
            return None
        if self._hold_expiry(step, a):
            self.alarm = None
            return None
        if a.is_return:
            return "return" if self._way_return(step, a) else None
        for way in WAYS[:-1]:  # ``return`` fires returns only
            if getattr(self, f"_way_{way}")(step, a):
                return way
        return None

    # -- ways to fire ----------------------------------------------------------------------------
    def _way_score(self, step: int, a: Alarm) -> bool:
        """The score's level falls ``cusum_score_z`` noise units below its pre-alarm level, the level at ``cusum_min_rise``."""
        z = self._score_z(step)
        return z is not None and z <= -self.cusum_score_z and self.ratio >= self.cusum_min_rise

    def _way_witnesses(self, step: int, a: Alarm) -> bool:
        """Two witnesses have risen with the length."""
        return self._half_evidence() and self._witnesses(step) >= WITNESSES

    def _way_length(self, step: int, a: Alarm) -> bool:
        """No witness is logged at all: the length alarm is the surge."""
        r = self.rows
        return self._full_evidence() and not (r.score or r.kl or r.clip or any(rows and rows[0][0] < step for rows in r.co.values()))

    def _way_runaway(self, step: int, a: Alarm) -> bool:
        """The level reached ``cusum_runaway_rise`` x the alarm's baseline (the paper's 3-4x surge may come with a
        rising score)."""
        # at least 3 rows: in a sparse log the 5-step level is one noisy row
        level = min(self.level, math.exp(median(v for _, v in self.rows.log[-FEW_ROWS:])))
        return level >= self.cusum_runaway_rise * a.baseline

    def _way_return(self, step: int, a: Alarm) -> bool:
        """A return to an earlier high whose witnesses (verl's co-signals) rise with it."""
        return self._witnesses(step, fresh=True) >= WITNESSES

    # -- holds -----------------------------------------------------------------------------------
    def _hold_warmup(self, step: int) -> bool:
        """No baseline yet: the steps after ``skip_first_steps`` and ``cusum_lag`` steps back cover less than half the
        span (the first steps' format learning moves the length; they still count as earlier levels)."""
        eligible = [s for s, _ in self.rows.log if self.skip_first_steps < s <= step - self.cusum_lag]
        return not eligible or eligible[-1] - eligible[0] < int(self.cusum_span * HALF)

    def _hold_rebound(self, step: int, b: float) -> bool:
        """The run was ``cusum_min_rise`` x the baseline before (its 5-row medians) and the level is below
        ``cusum_rebound_margin`` x that earlier high."""
        old = self._earlier_high(step)
        return (old is not None and old >= b + math.log(self.cusum_min_rise)
                and math.log(self.level) < old + math.log(self.cusum_rebound_margin))

    def _hold_expiry(self, step: int, a: Alarm) -> bool:
        """The CUSUM fell back to 0 (a return: its last 2 steps below ``cusum_min_rise`` x its baseline), or the alarm
        waited ``cusum_confirm_steps``."""
        if a.is_return:
            return self._fast() < self.cusum_min_rise * a.baseline or step - a.step > self.cusum_confirm_steps
        return self._cusum <= 0 or step - a.step > self.cusum_confirm_steps

    # -- pieces ----------------------------------------------------------------------------------
    def _arm(self, step: int, is_return: bool) -> Alarm:
        return Alarm(step=step, baseline=self.baseline, is_return=is_return)

    def _score_refs(self, step: int, rows: list) -> Optional[tuple]:
        """The score's references at ``step``: its medians over the baseline window and OLD_STEPS/2-OLD_STEPS
        steps back (with their row counts) and its noise scale over the OLD_STEPS steps before the baseline
        window ends (a steadier scale than 20 steps give); None without a score there."""
        hi = step - self.cusum_lag
        ref = _window(rows, hi - self.cusum_span, hi)
        if not ref:
            return None
        old = _window(rows, step - OLD_STEPS, hi - self.cusum_span)
        noise = max(_mean_scale(_window(rows, hi - OLD_STEPS, hi, NOISE_ROWS)), SCORE_FLOOR * abs(median(ref)))
        if not noise > 0:
            return None  # a score stuck at 0 has no noise to measure a fall in
        return median(ref), len(ref), median(old) if old else _NAN, len(old), noise

    def _full_evidence(self) -> bool:
        """The CUSUM at its threshold and the level (5 steps) at ``cusum_min_rise`` x the baseline."""
        return self._cusum >= self.cusum_threshold and self.ratio >= self.cusum_min_rise

    def _half_evidence(self) -> bool:
        """Half the length evidence: the CUSUM at half its threshold (checked by the caller) and the last 2
        steps at ``cusum_min_rise`` (the 5-step level may still trail a fast rise's first steps)."""
        return math.exp(self.rows.log[-1][1]) >= self.cusum_min_rise * self.baseline

    def _fast(self) -> float:
        """The level of the last 2 steps (a return to an earlier high takes 2-4 steps)."""
        return math.exp(median(v for _, v in self.rows.log[-FAST_ROWS:]))

    def _returned(self, step: int, b: float) -> bool:
        """The last 2 steps returned to an earlier high (a rebound, watched for a collapse)."""
        old = self._earlier_high(step)
        return old is not None and old >= b + math.log(self.cusum_min_rise)

    def _score_z(self, step: int) -> Optional[float]:
        """The score's level now (its last LEVEL_STEPS steps, at least LEVEL_STEPS observations) against its
        references, in noise units: the lower of the two (None: no score to compare). The score of a one-step
        length spike is left out, as the spike is (its dip is that batch's composition: long answers are more
        often wrong or cut off)."""
        spikes = self._spikes()
        rows = [r for r in self.rows.score if r[0] not in spikes]
        refs = self._score_refs(step, rows)
        # at least LEVEL_STEPS observations for a fall: in a log written every few steps two long batches in a
        # row score lower by their composition; a median of 5 ignores them
        now = _recent(rows, step, LEVEL_STEPS)
        if refs is None or not now:
            return None
        ref, n_ref, old, n_old, noise = refs
        z = (median(now) - ref) / (MEDIAN_SD * noise * math.sqrt(1 / len(now) + 1 / n_ref))
        if n_old:
            z = min(z, (median(now) - old) / (MEDIAN_SD * noise * math.sqrt(1 / len(now) + 1 / n_old)))
        return z

    def _witnesses(self, step: int, fresh: bool = False) -> int:
        """Risen witnesses, against their medians over the current baseline window (the window the length
        rose over; steps after ``skip_first_steps`` only), ended before the observations compared with it: each
        of verl's co-signals (one each, its newest row: entropy, grad norm and KL loss jump on a fast surge's
        first update), the mismatch KL and the clip share (two each, measured on the length's batches: k3's "now"
        is the level's rows, the clip share's the last LEVEL_STEPS steps' rows, at least the newest). The mismatch KL has also risen
        where, the level at ``cusum_min_rise``, it grew over the baseline window as much as the length did, and
        ``cusum_kl_rise`` (1.5) x.
        ``fresh`` (a return): verl's co-signals only, from their observations of the last FEW_ROWS steps (they
        must rise with the return, not be held at values from before it)."""
        hi = step - self.cusum_lag
        up = 0
        for name, rows in self.rows.co.items():
            past = [r for r in rows if r[0] < step]  # read from the next step on (see add_cosignals)
            # the newest observation; a return's: its observations of the last FEW_ROWS steps (they rise with it)
            now = [r for r in past if r[0] >= step - FEW_ROWS] if fresh else past[-1:]
            # the reference ends before the observations it is compared with
            end = min(hi, now[0][0] - 1) if now else hi
            up += self._risen(_logs([v for _, v in now]), past, math.log(WITNESS_RISE), end, log=True)
        if fresh:
            return up  # a return's k3 rises with its length (a recovery's did, in a real-model pilot): verl's only
        if self.rows.kl:
            kl_now = _logs(_recent(self.rows.kl, step, FAST_ROWS))
            risen = self._risen(kl_now, self.rows.kl, math.log(self.cusum_kl_rise), hi, log=True)
            if not risen and self._cusum >= self.cusum_threshold and self.ratio >= 1 + (self.cusum_min_rise - 1) * HALF:
                # k3 doubles over the 20-30 steps before a slow surge's alarm: against its level before the
                # baseline window too (the OLD_STEPS steps that end there), once the CUSUM is at its threshold
                # and the level half-way to cusum_min_rise (a KL drifting for 100+ steps is no surge on one long
                # batch that lifts the CUSUM to half its threshold), by cusum_kl_rise ** OLDER_KL_POWER
                risen = self._risen(kl_now, self.rows.kl, OLDER_KL_POWER * math.log(self.cusum_kl_rise), hi - self.cusum_span,
                                    log=True)
            if not risen and self.ratio >= self.cusum_min_rise and kl_now:
                # k3 grew over the baseline window at least as much as the length did (the method: the
                # mismatch grows with the length): the surge's own sign, whatever k3's noise
                ref = _logs(_window(self.rows.kl, hi - self.cusum_span, hi))
                risen = bool(ref) and median(kl_now) - median(ref) >= max(math.log(self.cusum_kl_rise), math.log(self.ratio))
            up += WITNESSES * risen
        if self.rows.clip:
            recent = _recent_rows(self.rows.clip, step, 1)
            up += WITNESSES * self._risen([v for _, v in recent], self.rows.clip, self.cusum_clip_rise, min(hi, recent[0][0] - 1))
        return up

    def _risen(self, now: list, rows: list, least: float, hi: int, log: bool = False) -> bool:
        """The median of ``now`` is at least ``least`` and ``cusum_score_z`` noise units above the median of ``rows``
        over the ``cusum_span`` steps that end at ``hi`` (``log``: of their logs); the noise over the OLD_STEPS
        steps that end there, or the span's when longer (more rows than the span's: a steadier scale)."""
        rows = [r for r in rows if r[0] > self.skip_first_steps]  # the first steps' format learning moves every figure
        ref = _window(rows, hi - self.cusum_span, hi)
        noise = _window(rows, hi - max(OLD_STEPS, self.cusum_span), hi, NOISE_ROWS)
        if log:
            ref, noise = _logs(ref), _logs(noise)
        if not now or len(ref) <= 1:
            return False  # (the noise window holds the reference window's rows)
        rise = median(now) - median(ref)
        return rise >= least and rise >= self.cusum_score_z * MEDIAN_SD * _mean_scale(noise) * math.sqrt(1 / len(now) + 1 / len(ref))

    def _spikes(self) -> set:
        """One-step spikes: steps ``cusum_spike_rise`` x the steps before and after them (t-1 and t+1 both logged)."""
        bar, rows, out = math.log(self.cusum_spike_rise), self.rows.log, set()
        for i in range(1, len(rows) - 1):
            (s0, y0), (s1, y1), (s2, y2) = rows[i - 1], rows[i], rows[i + 1]
            if s1 - s0 == 1 and s2 - s1 == 1 and y1 - y0 >= bar and y1 - y2 >= bar:
                out.add(s1)
        return out

    def _earlier_high(self, step: int) -> Optional[float]:
        """The highest 5-row median of the last ``cusum_rebound_memory`` steps before the baseline window, skipped
        early steps included (a log value), or None."""
        start = step - self.cusum_lag - self.cusum_span
        old = [v for s, v in self.rows.high
               if s > step - self.cusum_rebound_memory and (s <= start or s <= self.skip_first_steps)]
        return max(old) if old else None

    def _prune(self, step: int) -> None:
        keep = self.cusum_lag + self.cusum_span + self.cusum_rebound_memory
        r = self.rows
        for rows in (r.log, r.high, r.score, r.kl, r.clip, *r.co.values()):
            while len(rows) > NOISE_ROWS and rows[0][0] <= step - keep:
                rows.pop(0)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full state, :class:`CusumState` as plain Python types (safe for ``torch.load(weights_only=True)``)."""
        return asdict(CusumState(
            rows=self.rows, alarm=self.alarm, cusum=self._cusum, surge_steps=list(self.surge_steps),
            fired_by=list(self.fired_by), num_skipped=self.num_skipped, last_step=self.last_step,
            level=self.level, baseline=self.baseline, ratio=self.ratio, noise=self.noise))

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a state this detector cannot read (a field missing, unknown or of another
        type) raises :class:`~verl_lrstab.dataclass_reader.StateFieldError` naming the field."""
        s = from_state(CusumState, state, "detector")
        self.rows, self.alarm, self._cusum = s.rows, s.alarm, s.cusum
        self.surge_steps, self.fired_by = s.surge_steps, s.fired_by
        self.num_skipped, self.last_step = s.num_skipped, s.last_step
        self.level, self.baseline, self.ratio, self.noise = s.level, s.baseline, s.ratio, s.noise
