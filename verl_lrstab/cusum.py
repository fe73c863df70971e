"""``detector: cusum``: a noise-aware surge detector with co-signals (pure Python).

Two stages, every decision from data up to the current step only:

1. **Length alarm.** On log-lengths, a trailing baseline (median of the ``span`` steps that end
   ``lag`` steps back) and a robust noise scale (1.4826 x their MAD, at least ``noise_floor``)
   give a z-score per step; a one-sided CUSUM ``S = max(0, S + z - drift)`` accumulates it, so
   a fast sustained rise crosses ``threshold`` within a few steps while noise and slow drift
   (absorbed by the trailing baseline) do not. The alarm also needs the level (median of the
   last 5 steps, at least 2 rows: two odd batches cannot move it) at ``min_rise`` x the
   baseline or more. It is not raised when the run was already at that level before (a
   **rebound**: the highest 5-row median of the last ``rebound_memory`` steps before the
   baseline, skipped early steps included, is at least ``min_rise`` x the baseline and the
   level is below ``rebound_margin`` x it), whatever the co-signals (a score does not skip this
   test: a sparse score would let early rebounds fire).
2. **Co-signals.** With a score (verl's ``critic/score/mean``), an alarm arms the detector for
   up to ``confirm_steps`` steps (while the level stays at ``min_rise`` x the alarm's
   baseline) and it fires on the first step where the score **falls** (its 5-step median is
   ``score_z`` noise units below its pre-alarm level, below its level 20-60 steps back (a slow
   rise sags the score from its start), or below a peak since the alarm that was itself a
   clear rise), or where it is not rising and the mismatch KL has grown ``kl_rise`` x
   (5-step median vs the median 30-60 steps back) or the clip ratio has risen by
   ``clip_rise``. A length rise with a rising score is learning and is held; so is one with a
   flat score and no other sign. Without a score but with the mismatch KL, the KL (or the clip
   ratio) must confirm; with neither score nor KL, the alarm is the surge. Half the length
   evidence (``threshold / 2``, a level half-way to ``min_rise``) is enough when the score
   already falls by 1.5 x ``score_z``, or when the KL / clip ratio confirms and the last 2
   steps are at ``min_rise``: the early rise of a fast collapse (not while a run whose length
   had fallen, an earlier 5-row median 1.5x the baseline or more, climbs back below it).
   **The mismatch KL risen with the length** confirms too: k3 grown over the alarm's own
   baseline window at least as much as the length (and ``KL_WITH_MIN`` x), in the alarm's first
   5 steps, while the length is up (k3 "now": its last 5 steps, at least 2 rows, against a
   stricter bar from fewer than 5 rows); so a slow surge whose k3 rises with it decides no later than
   the length alone, even where k3 settled from a higher early level (the steps 30-60 back).
   **One-step spikes**: a length ``spike_rise`` x the steps before and after it (a single long
   batch, back the next step) is no part of the level, and a score observation on it, or on a
   newest step ``spike_rise`` x the step before (whether it reverts is known at the next step), never
   confirms: long answers are more often wrong or cut off, so a same-step score dip on a long
   batch is the batch's composition, not a trend. In a log written every few steps a row's
   neighbours are 5-10 steps away; where the score is its only witness there (verl's co-signals
   logged and flat, no mismatch KL), the same test runs on rows, and a score fall needs
   ``SPARSE_SCORE_BAR`` x its noise units (a rebound's collapse too, back near a modest high).
3. **Runaway.** Whatever the co-signals say, an armed alarm fires once the level reaches
   ``runaway_rise`` x the alarm's baseline and the run was not that long before (not a rebound):
   the paper's surge (1000 -> 3000-4000 tokens within a few steps, METHOD.md) may come with a
   rising score, and a decay that waits for the score to fall would never come there; the
   healthy phenomena stay below it (excursions of long runs up to 1.9x, growth absorbed by the
   trailing baseline, early rebounds to a level the run had).

Windows count steps, not rows, so a log written every 5-10 steps uses the same options; a
window holding fewer than 8 rows is widened back to 8, and a baseline needs 3 rows covering
at least half the span. NaN, inf, missing and non-positive lengths are skipped. A co-signal is
a list of observations: a missing value adds none and a repeat of the last value is none
either, so a sparse figure and the same figure forward-filled decide alike; once seen, a
co-signal that stops is held at its last observations (an alarm never fires *because* a
co-signal went missing). Score noise: 1.2533 x the mean absolute deviation over the
60 steps before the baseline ends (at least 20 rows), floored at 1 % of the score.
"""

from __future__ import annotations

import copy
import logging
import math
from statistics import median
from typing import Optional

from verl_lrstab._numbers import finite_float

logger = logging.getLogger("verl_lrstab")

_NAN = float("nan")
LEVEL_STEPS = 5  # the current level: median of the last 5 steps (two odd batches cannot move it)
LEVEL_ROWS = 2
NOW_STEPS = 5  # co-signals "now": median of the last 5 steps
KL_BACK = (30, 60)  # the mismatch KL's reference: the steps 30-60 back
SCORE_OLD = (20, 60)  # the score's level before a slow rise: the steps 20-60 back
MIN_ROWS = 8  # windows of a sparse log are widened back to this many rows (a noise scale needs them)
SCORE_NOISE_STEPS = 60  # the score's noise scale: over the 60 steps before the baseline ends
KL_ROWS = 5  # the mismatch KL "now": at least 5 observations (k3 is noisy: 15 % a batch)
FAST_STEPS = 2  # the early level of a KL- or clip-confirmed alarm: mean of the last 2 steps ...
FAST_SLACK = 1.1  # ... which the 5-step level may trail by at most this factor (one odd batch cannot pass)
MEDIAN_SD = 1.25  # sd of a median of a few values / sd of their mean (~sqrt(pi / 2))
# The half-evidence rule holds back while the level is below an earlier high of at least this x
# the baseline: a run whose length fell by a third or more and climbs back (a real-model pilot:
# ~45 -> ~23-token answers -> ~30 with k3 doubling) is recovering; a warm-up high of 1.2-1.3x
# (class A's first steps) is no such fall and must not delay the early alarm of a collapse.
RECOVERY_HIGH = 1.5
# The figures verl logs on every step, each optional. A co-signal has risen when its
# median over the last COSIGNAL_NOW_STEPS steps (at least its last 2 observations) is this multiple of
# its median over the alarm's baseline window. The clip share is not among them: it is the length
# seen at the cap (a healthy excursion raises it as much), no independent evidence.
COSIGNAL_RISE = {"entropy": 1.1, "grad_norm": 1.6, "kl_loss": 1.6, "pg_clipfrac": 1.6}
COSIGNALS = tuple(COSIGNAL_RISE)
COSIGNAL_NOW_STEPS = 3  # median of 3: one odd batch (a grad-norm spike) cannot move it
COSIGNAL_VOTES = 2  # this many risen co-signals confirm a surge; one alone (a grad-norm spike) never does
# A sparse co-signal (one observation in the last COSIGNAL_NOW_STEPS steps) has also risen when that fresh
# observation alone passes the rise raised to this power, rather than waiting for a second row: a single
# value's log-noise is ~1.5x that of a median of 3 (sd of the median of 3 normals: 0.67 sd), so the bar
# keeps the dense rule's false-positive rate (one noisy grad norm at 1.6x confirmed a growth twin, L,
# with the plain bar). The median of its last 2 observations at the plain bar counts too, as before.
SINGLE_RISE_POWER = 1.5
# A rebound whose score collapses is no rebound: the score's latest observation at most this
# share of its pre-alarm level, and COLLAPSE_Z x score_z noise units below it (the noise test is the
# guard; the share only keeps a near-noiseless score's tiny dip out). 0.8, not 0.6: the collapse's
# first step, not its second (the rebound-with-collapse class: a step earlier in the median seed; A: one run more caught in
# two sparse forms; the other classes unchanged, 0 false alarms; scripts/research/bench_detector.py).
COLLAPSE_SHARE = 0.8
# The mismatch KL risen with the length (CusumDetector._kl_with_length) needs at least this growth over
# the length's baseline window, whatever the length's: k3 is noisy (15 % a batch), and a median of 5
# against one of 20 passes 1.25x by chance on ~1 decision in 100.
KL_WITH_MIN = 1.35
COLLAPSE_Z = 1.0
# Where the score is the only witness of a log written every few steps (CusumDetector._score_alone), a
# score fall counts at this multiple of its noise units: there the one-step-spike test cannot tell a long
# batch that reverts from a rise that holds (its neighbours are 5-10 steps away), so the score's "now" may
# hold a long batch's composition dip, and verl's flat co-signals are evidence of a healthy run.
SPARSE_SCORE_BAR = 1.25


def _window(rows, lo: int, min_rows: int = MIN_ROWS) -> list[float]:
    """Values of ``rows`` (sorted [step, value]) after step ``lo``, widened back to ``min_rows`` rows."""
    inside = [v for s, v in rows if s > lo]
    return inside if len(inside) >= min_rows else [v for _, v in rows[-min_rows:]]


def _add(rows: list, step: int, v: Optional[float]) -> None:
    # A co-signal is a list of observations: a missing value adds none, and a repeat of the last
    # value is no new observation either, so a log that forward-fills a sparse figure decides
    # exactly as the sparse log does (what changes is how stale the figure is).
    if v is not None and not (rows and rows[-1][1] == v):
        rows.append([step, v])


def _mad_scale(values: list[float], center: float) -> float:
    return 1.4826 * median(abs(v - center) for v in values)


class CusumDetector:
    """Surge detector: CUSUM of robust z-scores of the log length, confirmed by co-signals.

    Args:
        skip_first_steps (int): steps ``<= skip_first_steps`` never raise an alarm (they still
            count as the run's earlier level for the rebound test). Default 10.
        span (int): steps in the trailing baseline. Default 20.
        lag (int): the baseline ends this many steps before the current step. Default 3.
        drift (float): CUSUM allowance per step, in noise units. Default 1.0.
        threshold (float): CUSUM alarm level, in noise units. Default 5.0.
        min_rise (float): the level must be at least this multiple of the baseline. Default 1.2.
        noise_floor (float): smallest noise scale, in log units (0.05 = 5 %). Default 0.05.
        rebound_margin (float): a rise back to below this multiple of the run's earlier high is
            a rebound, not a surge. Default 1.3.
        rebound_memory (int): how many steps back the earlier high is looked for. Default 100.
        confirm_steps (int): how long an alarm waits for the co-signals. Default 40.
        score_z (float): a score change is a fall or a rise beyond this many noise units. Default 3.5
            (the score is tested on every step of an alarm; docs/detector.md "Measured" on 3 vs 3.5).
        kl_rise (float): mismatch-KL growth that confirms an alarm. Default 1.5.
        clip_rise (float): clip-ratio increase that confirms an alarm. Default 0.25.
        runaway_rise (float): an armed alarm fires, whatever the co-signals, once the level is
            this multiple of the alarm's baseline (and not a rebound). Default 2.5.
        spike_rise (float): a length at least this multiple of the steps before and after it is a
            one-step spike: no part of the level, and no score observation of it (nor of a newest
            step this multiple of the step before) confirms an alarm; rows count as steps where the
            score is a sparse log's only witness (:meth:`_score_alone`). Default 1.2.
        max_surges (int): surges reported at most. Default 1.
    """

    def __init__(self, skip_first_steps: int = 10, span: int = 20, lag: int = 3, drift: float = 1.0,
                 threshold: float = 5.0, min_rise: float = 1.2, noise_floor: float = 0.05,
                 rebound_margin: float = 1.3, rebound_memory: int = 100, confirm_steps: int = 40,
                 score_z: float = 3.5, kl_rise: float = 1.5, clip_rise: float = 0.25, max_surges: int = 1,
                 runaway_rise: float = 2.5, spike_rise: float = 1.2):
        for name, value, low in (("skip_first_steps", skip_first_steps, 0), ("span", span, 1), ("lag", lag, 0),
                                 ("rebound_memory", rebound_memory, 1), ("confirm_steps", confirm_steps, 1),
                                 ("max_surges", max_surges, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name, value, low in (("drift", drift, 0.0), ("threshold", threshold, 0.0), ("noise_floor", noise_floor, 0.0),
                                 ("score_z", score_z, 0.0), ("clip_rise", clip_rise, 0.0)):
            if finite_float(value) is None or value <= low:
                raise ValueError(f"{name} must be a number > {low:g}, got {value!r}")
        for name, value in (("min_rise", min_rise), ("rebound_margin", rebound_margin), ("kl_rise", kl_rise),
                            ("runaway_rise", runaway_rise), ("spike_rise", spike_rise)):
            if finite_float(value) is None or value <= 1.0:
                raise ValueError(f"{name} must be a number > 1, got {value!r}")
        self.skip_first_steps, self.span, self.lag = skip_first_steps, span, lag
        self.drift, self.threshold, self.min_rise = float(drift), float(threshold), float(min_rise)
        self.noise_floor, self.rebound_margin = float(noise_floor), float(rebound_margin)
        self.rebound_memory, self.confirm_steps, self.score_z = rebound_memory, confirm_steps, float(score_z)
        self.kl_rise, self.clip_rise, self.max_surges = float(kl_rise), float(clip_rise), max_surges
        self.runaway_rise, self.spike_rise = float(runaway_rise), float(spike_rise)
        # rows (step, value): log lengths, rolling 5-row medians, co-signals
        self._log: list[list] = []
        self._high: list[list] = []
        self._score: list[list] = []
        self._kl: list[list] = []
        self._clip: list[list] = []
        self._co: dict[str, list] = {name: [] for name in COSIGNALS}  # verl's per-step figures
        self._watch: Optional[dict] = None  # a rebound alarm, fired by a score collapse or risen co-signals
        self._cusum = 0.0
        self._armed: Optional[dict] = None
        self.surge_steps: list[int] = []
        self.num_skipped = 0
        self.last_step: Optional[int] = None
        self.level = self.baseline = self.ratio = self.noise = _NAN
        self.score_z_now = self.kl_ratio = self.clip_delta = _NAN
        self.kl_with_length = False  # the mismatch KL has risen with the length (at the last decision)
        self.cosignals_up = 0  # how many of COSIGNALS have risen (at the last decision)

    @property
    def surge_step(self) -> Optional[int]:
        return self.surge_steps[0] if self.surge_steps else None

    @property
    def cusum(self) -> float:
        return self._cusum

    @property
    def armed_step(self) -> Optional[int]:
        return None if self._armed is None else self._armed["step"]

    #: The fed figures this detector reads (the schedule logs the ones it is fed).
    reads = ("response_length", "score", "mismatch_kl", "clip_ratio", *COSIGNALS)

    def metrics(self) -> dict:
        """The detector's own figures (``{name: value}``): the CUSUM and the armed step always, the
        others when finite."""
        out = {"cusum": self.cusum, "armed_step": -1 if self.armed_step is None else self.armed_step}
        for key, value in (("baseline", self.baseline), ("ratio", self.ratio), ("level", self.level),
                           ("noise", self.noise), ("score_z", self.score_z_now), ("kl_ratio", self.kl_ratio),
                           ("clip_delta", self.clip_delta)):
            if math.isfinite(value):
                out[key] = value
        return out

    # -- the update ----------------------------------------------------------------------------
    def observe(self, step: int, **cosignals: Optional[float]) -> None:
        """Add observations of step ``step`` of the figures in :data:`COSIGNALS` (``entropy``,
        ``grad_norm``, ``kl_loss``, ``pg_clipfrac``; None or NaN: not logged).

        They are read from the next step on (a decision at step t reads those of steps < t), so
        the trainer, which has an update's figures only after its LR step, and a replay of its
        log, which has them on the row of that step, decide alike whichever comes first.
        """
        for name, value in cosignals.items():
            if name not in self._co:
                raise ValueError(f"unknown co-signal {name!r}: allowed values are {list(COSIGNALS)}")
            _add(self._co[name], step, finite_float(value))

    def update(self, step: int, value: Optional[float], score: Optional[float] = None,
               kl: Optional[float] = None, clip_ratio: Optional[float] = None, **cosignals: Optional[float]) -> bool:
        """Feed one step; return True if a surge is reported at this step.

        ``cosignals``: figures of :data:`COSIGNALS` logged at this step (see :meth:`observe`).
        """
        self.last_step = step
        for rows, v in ((self._score, finite_float(score)), (self._kl, finite_float(kl)),
                        (self._clip, finite_float(clip_ratio))):
            _add(rows, step, v)
        self.observe(step, **cosignals)
        number = finite_float(value)
        if number is None or number <= 0:
            self.num_skipped += 1
            logger.warning("verl_lrstab: step %s: response length %r is not a positive finite number; "
                           "the surge detector skips it", step, value)
            self._prune(step)
            return False
        y = math.log(number)
        self._log.append([step, y])
        recent = [v for _, v in self._log[-LEVEL_STEPS:]]
        self._high.append([step, median(recent)])
        self._prune(step)
        if step <= self.skip_first_steps:
            return False
        base_rows = self._baseline_rows(step)
        # the level: the last LEVEL_STEPS steps, at least LEVEL_ROWS rows (one row of a sparse log is one batch)
        spikes = self._one_step_spikes()
        late = [(s, v) for s, v in self._log if s > self.skip_first_steps and s not in spikes]
        recent = [v for s, v in late if s > step - LEVEL_STEPS]
        if sum(s > step - LEVEL_STEPS for s, _ in self._log) < LEVEL_ROWS:
            recent = [v for _, v in late[-LEVEL_ROWS:]]
        self.level = math.exp(median(recent))
        if len(base_rows) < 3:
            self.baseline = self.ratio = self.noise = _NAN
            return False
        b = median(base_rows)
        self.noise = max(_mad_scale(base_rows, b), self.noise_floor)
        self.baseline, self.ratio = math.exp(b), self.level / math.exp(b)
        self._cusum = max(0.0, self._cusum + (y - b) / self.noise - self.drift)
        if len(self.surge_steps) >= self.max_surges:
            return False  # done; the figures above are still reported
        fast = math.exp(median(v for _, v in self._log[-FAST_STEPS:])) / math.exp(b)
        if self._armed is None and self._cusum >= self.threshold and self.ratio >= self.min_rise:
            refs = self._refs(step, b)
            if not self._rebound(step, b):  # a rebound is no surge, whatever the co-signals ...
                self._armed = refs
                logger.info("verl_lrstab: length alarm at step %d (cusum %.1f, level %.4g = %.3g x baseline)",
                            step, self._cusum, self.level, self.ratio)
        fired = self._rebound_collapses(step, b, fast)  # ... unless its score collapses or its co-signals rise
        if self._armed is not None and (self.level < self.min_rise * self._armed["baseline"]
                                        or step - self._armed["step"] > self.confirm_steps):
            self._disarm()  # the length came back down, or no co-signal confirmed it in time
        if not fired and self._armed is not None:
            fired = self._decide(step, self._armed) is not None or self._runaway(self._armed)
        elif not fired and (self._cusum >= self.threshold / 2 and max(self.ratio, fast) >= (1 + self.min_rise) / 2
              and not self._rebound(step, b, margin=1.0, high=RECOVERY_HIGH)):
            # half the length evidence (a level half-way to min_rise) is enough when a co-signal
            # already says collapse: the score falls clearly, or the mismatch KL / clip ratio has
            # grown and the last 2 steps are at min_rise (the early rise of a fast collapse); not
            # while a run whose length had fallen climbs back below its earlier high.
            # Two of verl's co-signals risen confirm as soon as the last 2 steps are half-way
            # to min_rise (the 5-step level may still trail: the explosion's first steps)
            half = (1 + self.min_rise) / 2
            if self.ratio < half and not (fast >= half and self._up(step, self._refs(step, b)) >= COSIGNAL_VOTES):
                return False
            why = self._decide(step, {**self._refs(step, b), "z_factor": 1.5})
            fired = ((why == "score" and self.ratio >= half)
                     or (why in ("kl", "clip") and self.ratio >= half and min(fast, self.ratio * FAST_SLACK) >= self.min_rise)
                     or (why == "cosignals" and fast >= half and not self._rebound(step, b)))
        elif not fired:
            return False
        if fired:
            self.surge_steps.append(step)
            self._disarm()
            if len(self.surge_steps) < self.max_surges:
                self._log = []  # a later surge is measured against the post-surge level
            return True
        return False

    # -- pieces ----------------------------------------------------------------------------------
    def _prune(self, step: int) -> None:
        keep = max(self.lag + max(self.span, SCORE_NOISE_STEPS), KL_BACK[1], self.rebound_memory) + 1
        for rows in (self._log, self._high, self._score, self._kl, self._clip, *self._co.values()):
            while len(rows) > 24 and rows[0][0] <= step - keep:
                rows.pop(0)

    def _baseline_rows(self, step: int) -> list[float]:
        eligible = [(s, v) for s, v in self._log if self.skip_first_steps < s <= step - self.lag]
        rows = _window(eligible, step - self.lag - self.span)
        if not eligible or eligible[-1][0] - eligible[0][0] < self.span // 2:
            return []  # not enough history yet: a baseline covers at least half the span
        return rows

    def _rebound(self, step: int, b: float, rows=None, margin: Optional[float] = None,
                 high: Optional[float] = None) -> bool:
        """True if the run was already at least ``high`` (default ``min_rise``) x the baseline before.

        ``rows`` are the earlier levels looked at: the 5-row medians by default. The level is a
        rebound while below ``margin`` (default ``rebound_margin``) x the earlier high.
        """
        old = self._earlier_high(step, rows)
        if old is None or old < b + math.log(self.min_rise if high is None else high):
            return False
        return math.log(self.level) < old + math.log(self.rebound_margin if margin is None else margin)

    def _earlier_high(self, step: int, rows=None) -> Optional[float]:
        """The highest of ``rows`` (default: the 5-row medians) of the last ``rebound_memory`` steps before
        the baseline window, skipped early steps included (a log value), or None."""
        start = step - self.lag - self.span
        old = [v for s, v in (self._high if rows is None else rows)
               if s > step - self.rebound_memory and (s <= start or s <= self.skip_first_steps)]
        return max(old) if old else None

    def _one_step_spikes(self, adjacent: bool = True) -> set:
        """Steps whose length is a **one-step spike**: at least ``spike_rise`` x the length of the step
        before and of the step after (adjacent steps, both logged), i.e. it reverted the next step.

        A long-tailed length has single long batches (+20-50 %) that are back the next step; they are
        no part of the run's level, and their same-step score dip (long answers are more often wrong
        or cut off) is the batch's composition, not a trend. In a log written every few steps a row's
        neighbours are 5-10 steps away, and a high row between them may be a short excursion (a 10x
        one lasts 8 steps) rather than one batch: nothing there is a one-step spike. ``adjacent=False``:
        rows, whatever the steps between them (see :meth:`_composition_free_score`).
        """
        bar, rows, out = math.log(self.spike_rise), self._log, set()
        for (s0, y0), (s1, y1), (s2, y2) in zip(rows, rows[1:], rows[2:]):
            if (not adjacent or (s1 - s0 == 1 and s2 - s1 == 1)) and y1 - y0 >= bar and y1 - y2 >= bar:
                out.add(s1)
        return out

    def _jumped(self, step: int, adjacent: bool = True) -> bool:
        """The length of ``step`` (the newest row) is ``spike_rise`` x the step before's (``adjacent``: the
        row of ``step - 1``): whether it reverts (a one-step spike) is known only at the next step."""
        rows = self._log
        return (len(rows) >= 2 and rows[-1][0] == step and (not adjacent or rows[-2][0] == step - 1)
                and rows[-1][1] - rows[-2][1] >= math.log(self.spike_rise))

    def _composition_free_score(self, step: int, rows: bool = False) -> list:
        """The score's observations less those of one-step spikes and of a newest step whose length just
        jumped: a score is never confirmed by a same-step dip on a long batch alone.

        ``rows``: the same test on rows, whatever the steps between them (a log written every few steps,
        where the score is the only witness: see :meth:`_score_alone`): a row ``spike_rise`` x the rows
        before and after it, and a newest row ``spike_rise`` x the row before, are left out too. The
        level keeps them (a high row there may be a short excursion); only their score is set aside.
        """
        drop = self._one_step_spikes(adjacent=not rows)
        if self._jumped(step, adjacent=not rows):
            drop.add(step)
        return [r for r in self._score if r[0] not in drop] if drop else self._score

    def _score_alone(self, step: int, up: int) -> bool:
        """The score is the only witness of a log written every few steps: the newest length row is more
        than one step after the row before, verl's co-signals are logged and none has risen (``up``),
        and no mismatch KL is logged.

        There a row is one batch whose neighbours are 5-10 steps away: whether a long row reverts (a
        one-step spike, its score dip the batch's composition) is known only at the next row, and flat
        co-signals are evidence of a healthy run. So a long row's score waits for the next row, and a
        score fall counts at ``SPARSE_SCORE_BAR`` x its noise units. Where the KL is logged, or no verl
        co-signal is, the plain rule stands (its witnesses, or their absence, say nothing of health).
        """
        log = self._log
        return (len(log) >= 2 and log[-1][0] == step and log[-1][0] - log[-2][0] > 1 and not self._kl
                and self._cosignals_seen(step) and up == 0)

    def _runaway(self, alarm: dict) -> bool:
        """The level reached ``runaway_rise`` x the alarm's baseline, a level the run did not have before."""
        # at least 3 rows: in a sparse log the 5-step level is one noisy row
        level = min(self.level, math.exp(median(v for _, v in self._log[-3:])))
        if level < self.runaway_rise * alarm["baseline"]:
            return False
        # against every earlier row, not 5-row medians: in a log written every 5 steps a median of
        # 5 rows spans 25 steps and hides a short early high (an early rebound would pass for a runaway)
        return not self._rebound(alarm["step"], math.log(alarm["baseline"]), rows=self._log)

    @staticmethod
    def _ref(rows, lo: int, hi: int, min_rows: int = MIN_ROWS) -> tuple[float, int, list]:
        vals = _window([r for r in rows if r[0] <= hi], lo, min_rows)
        return (median(vals), len(vals), vals) if vals else (_NAN, 0, vals)

    @staticmethod
    def _recent(rows, step: int, rows_min: int = 2) -> tuple[float, int]:
        """Median of the last NOW_STEPS steps, widened back to the last ``rows_min`` observations.

        A figure not logged lately is held at its last observations (never "unavailable" once seen).
        """
        vals = [v for s, v in rows if s > step - NOW_STEPS]
        if len(vals) < rows_min:
            vals = [v for _, v in rows[-rows_min:]]
        return (median(vals), len(vals)) if vals else (_NAN, 0)

    def _refs(self, step: int, b: float) -> dict:
        lo, hi = step - self.lag - self.span, step - self.lag
        ref, n_ref, _ = self._ref(self._score, lo, hi)
        noise = _NAN
        if n_ref:
            _, _, vals = self._ref(self._score, hi - SCORE_NOISE_STEPS, hi, min_rows=20)
            center = median(vals)  # mean absolute deviation: steadier than the MAD on 10-20 values
            noise = max(1.2533 * sum(abs(v - center) for v in vals) / len(vals), 0.01 * abs(ref), 1e-3)
        clip_ref = self._ref(self._clip, lo, hi)[0]
        kl_ref = self._ref(self._kl, step - KL_BACK[1], step - KL_BACK[0])[0]
        kl_with = self._ref(self._kl, lo, hi)[0]
        old, n_old, _ = self._ref(self._score, step - SCORE_OLD[1], step - SCORE_OLD[0])
        return {"step": step, "baseline": math.exp(b), "score_ref": ref, "score_n": n_ref, "score_old": old,
                "score_old_n": n_old,
                "score_noise": noise, "score_peak": ref, "kl_ref": kl_ref, "kl_with_ref": kl_with,
                "clip_ref": clip_ref, "z_factor": 1.0,
                "co_ref": {name: self._ref([r for r in rows if r[0] < step], lo, hi)[0]
                           for name, rows in self._co.items()}}

    def _up(self, step: int, a: dict, fresh: bool = False) -> int:
        """How many of verl's co-signals have risen against the alarm's references.

        ``fresh``: from their observations of the last COSIGNAL_NOW_STEPS steps only (a rebound's
        co-signals must rise with the return, not be held at values from before it).
        """
        up = 0
        for name, rows in self._co.items():
            ref = a.get("co_ref", {}).get(name, _NAN)
            past = [r for r in rows if r[0] < step]  # read from the next step on (see observe)
            if not past or not ref > 0:
                continue
            now = [v for s, v in past if s >= step - COSIGNAL_NOW_STEPS]
            rise = COSIGNAL_RISE[name]
            if len(now) >= 2:
                up += median(now) >= rise * ref
                continue
            # a sparse log: its last 2 observations (one noisy batch cannot confirm), or a fresh row
            # alone against the stricter bar (decided at the first step that reads it)
            up += ((not fresh and median(v for _, v in past[-2:]) >= rise * ref)
                   or (len(now) == 1 and now[0] >= rise ** SINGLE_RISE_POWER * ref))
        self.cosignals_up = up
        return up

    def _cosignals_seen(self, step: int) -> bool:
        return any(rows and rows[0][0] < step for rows in self._co.values())

    def _rebound_collapses(self, step: int, b: float, fast: float) -> bool:
        """A rise back to a level the run had, while the score collapses, fires.

        A rebound raises no alarm (the run was that long before), but one whose score falls to
        ``COLLAPSE_SHARE`` of its level or less is a collapse: it is watched (up to
        ``confirm_steps`` while the last 2 steps stay at ``min_rise``) for that fall, or for two of
        verl's co-signals risen with it (the score not rising), as an armed alarm is: what confirms a
        surge confirms a return too, and a run without a score has no other witness.
        """
        if (self._watch is None and self._cusum >= self.threshold / 2 and fast >= self.min_rise
                and self._rebound(step, b, margin=None)):
            self._watch = w = self._refs(step, b)
            w["high"] = self._earlier_high(step)  # a log value (a rebound has one)
            # the score's noise over the baseline window alone: the 60 steps of the usual scale may
            # hold the run's early climb (a trend, not noise), all the more in a sparse score
            vals = self._ref(self._score, step - self.lag - self.span, step - self.lag)[2]
            if vals:
                local = _mad_scale(vals, median(vals))  # the MAD: a robust scale, the climb's rows are outliers
                w["score_noise"] = max(min(w["score_noise"], local), 0.01 * abs(w["score_ref"]), 1e-3)
        w = self._watch
        if w is None:
            return False
        if fast < self.min_rise * w["baseline"] / math.exp(b) or step - w["step"] > self.confirm_steps:
            self._watch = None
            return False
        up = self._up(step, w, fresh=True)
        if up >= COSIGNAL_VOTES and not self._score_rising(step, w):
            return True  # two of verl's co-signals risen with the return, the score not rising: a surge
        if not w["score_n"] or not self._score or not w["score_ref"] > 0:
            return False
        now = self._score[-1][1]  # its latest observation: a fall to 60 % is no noise (at 7 units too)
        unit = MEDIAN_SD * w["score_noise"] * math.sqrt(1 + 1 / w["score_n"])
        # a return to a high under RECOVERY_HIGH x the baseline is within a long-tailed length's reach of one
        # batch: where the score is the only witness of a sparse log, its fall needs the stricter bar too
        high = w.get("high")  # a watch of an older checkpoint has none: the plain bar
        near = high is not None and high < math.log(RECOVERY_HIGH * w["baseline"])
        strict = near and self._score_alone(step, up)
        bar = COLLAPSE_Z * self.score_z * (SPARSE_SCORE_BAR if strict else 1.0)
        return now <= COLLAPSE_SHARE * w["score_ref"] and (w["score_ref"] - now) / unit >= bar

    def _score_rising(self, step: int, a: dict) -> bool:
        """The score's 5-step level is ``score_z`` noise units above the alarm's pre-alarm level (learning)."""
        now, n_now = self._recent(self._score, step)
        if not a["score_n"] or not n_now:
            return False
        unit = MEDIAN_SD * a["score_noise"] * math.sqrt(1 / n_now + 1 / a["score_n"])
        return (now - a["score_ref"]) / unit >= self.score_z

    def _disarm(self) -> None:
        self._armed = self._watch = None
        self._cusum = 0.0

    def _decide(self, step: int, a: dict) -> Optional[str]:
        """What confirms the length alarm ``a``: ``"score"`` (it falls), ``"kl"``, ``"clip"``,
        ``"length"`` (a log with no co-signal at all), or None (held)."""
        kl_now = self._recent(self._kl, step, rows_min=KL_ROWS)[0]
        self.kl_ratio = kl_now / a["kl_ref"] if a["kl_ref"] > 0 else _NAN  # NaN compares False
        self.kl_with_length = self._kl_with_length(step, a)
        self.clip_delta = self._recent(self._clip, step, rows_min=1)[0] - a["clip_ref"]
        up = self._up(step, a)
        alone = self._score_alone(step, up)
        now, n_now = self._recent(self._composition_free_score(step, rows=alone), step)
        if not n_now and self._score and a["score_n"]:
            return None  # a score is logged, but so far only on one-step spikes: held, never the length alone
        if not a["score_n"] or not n_now:
            self.score_z_now = _NAN
            if up >= COSIGNAL_VOTES:
                return "cosignals"  # two of verl's co-signals have risen with the length
            if self._kl:
                # no score, but the mismatch KL: it (or the clip ratio) must confirm. A length
                # excursion of a healthy run looks like a collapse's onset for its first steps; a
                # flat mismatch says the engines still agree. (A flat clip ratio says little: the
                # cap may be far, so with the clip ratio alone the length decides.)
                return self._kl_or_clip()
            if self._cosignals_seen(step):
                return None  # verl's co-signals are logged and say nothing: held, as with a flat KL
            return "length"  # the length alone: the length alarm is the surge
        unit = MEDIAN_SD * a["score_noise"] * math.sqrt(1 / n_now + 1 / a["score_n"])
        a["score_peak"] = max(a["score_peak"], now)
        self.score_z_now = (now - a["score_ref"]) / unit
        # A fall from the pre-alarm level, or from a peak since the alarm that was a clear rise.
        top = a["score_peak"] if (a["score_peak"] - a["score_ref"]) / unit >= 2 * self.score_z else a["score_ref"]
        old_unit = MEDIAN_SD * a["score_noise"] * math.sqrt(1 / n_now + 1 / a["score_old_n"]) if a["score_old_n"] else 0
        bar = self.score_z * a["z_factor"] * (SPARSE_SCORE_BAR if alone else 1.0)
        if ((top - now) / unit >= bar or (old_unit and (a["score_old"] - now) / old_unit >= bar)) and \
                not self._jumped(step):
            # the score falls while the length is up: the pre-collapse signature (not on a row whose
            # length just jumped: whether that is a one-step spike is known at the next row)
            return "score"
        if self.score_z_now >= self.score_z:
            return None  # rising score: learning
        if up >= COSIGNAL_VOTES:
            return "cosignals"  # with the score not rising, two co-signals confirm without waiting for it to fall
        return self._kl_or_clip()

    def _kl_with_length(self, step: int, a: dict) -> bool:
        """The **mismatch KL risen with the length**: while the length is up (its level at least
        ``min_rise`` x its current baseline), k3 grew over the alarm's baseline window at least as much as
        the length did (its level now / its median there >= the level / the alarm's baseline), and at
        least ``KL_WITH_MIN`` x, within the alarm's first ``NOW_STEPS`` steps (the rise it confirms is the
        length's; tested on every step of a 40-step alarm, k3's noise alone would pass the bar now and then).

        k3 rising over the very window the length rose over is the mismatch surge's own sign
        (METHOD.md: the mismatch grows with the response length); it confirms as soon as the length
        alarms. The KL's growth against the steps 30-60 back reads low where k3 settled from a
        higher early level over those steps, and the alarm would wait for the score to fall instead.
        """
        ref = a.get("kl_with_ref", _NAN)
        # k3 "now" as the level counts it: the last NOW_STEPS steps, at least LEVEL_ROWS rows (a log
        # written every 5-10 steps has one row there); from fewer than KL_ROWS observations, a noisier
        # median, the bar is stricter (the dense rule's chance rate, as for a sparse co-signal's fresh row)
        kl_now, n_now = self._recent(self._kl, step, rows_min=LEVEL_ROWS)
        bar = KL_WITH_MIN if n_now >= KL_ROWS else KL_WITH_MIN ** SINGLE_RISE_POWER
        return (ref > 0 and self.ratio >= self.min_rise and step - a["step"] < NOW_STEPS
                and kl_now / ref >= max(self.level / a["baseline"], bar))

    def _kl_or_clip(self) -> Optional[str]:
        if self.kl_ratio >= self.kl_rise or self.kl_with_length:
            return "kl"
        return "clip" if self.clip_delta >= self.clip_rise else None

    # -- state ---------------------------------------------------------------------------------
    _STATE = ("_log", "_high", "_score", "_kl", "_clip", "_cusum", "_armed", "surge_steps", "num_skipped",
              "last_step", "level", "baseline", "ratio", "noise", "score_z_now", "kl_ratio", "clip_delta")
    # the co-signals' state; an older checkpoint has none of it (starts empty: no co-signal seen)
    _STATE_OPTIONAL = {"_co": lambda: {name: [] for name in COSIGNALS}, "_watch": lambda: None, "cosignals_up": lambda: 0,
                       "kl_with_length": lambda: False}

    def state_dict(self) -> dict:
        """The full state as plain Python types (safe for ``torch.load(weights_only=True)``)."""
        out = {}
        for key in self._STATE:
            value = getattr(self, key)
            out[key.lstrip("_")] = ([list(r) for r in value] if key.startswith("_") and isinstance(value, list)
                                    else dict(value) if isinstance(value, dict) else
                                    list(value) if isinstance(value, list) else value)
        for key in self._STATE_OPTIONAL:
            out[key.lstrip("_")] = copy.deepcopy(getattr(self, key))
        return out

    def load_state_dict(self, state: dict) -> None:
        for key in self._STATE:
            value = state[key.lstrip("_")]
            if isinstance(value, list):
                value = [list(r) if isinstance(r, (list, tuple)) else r for r in value]
            elif isinstance(value, dict):
                value = dict(value)
            setattr(self, key, value)
        for key, empty in self._STATE_OPTIONAL.items():
            value = state.get(key.lstrip("_"))
            setattr(self, key, empty() if value is None else copy.deepcopy(value))
        if isinstance(self._armed, dict):
            self._armed = copy.deepcopy(self._armed)
