"""The admission check's verdict: a candidate rollout's mismatch against a budget.

Pure functions over the per-step ``actor/mismatch/*`` figures of a few no-update steps (verl's
``main_ppo`` at LR 0: the trainer scores exactly what the rollout engine sampled). The runner
that produces them is :mod:`verl_lrstab.admit.runner`; a user can call these on figures logged by
their own LR-0 runs.

The default budget is a median k3 of 5e-4 per token: below the smallest k3 of the public
collapsing runs this method is about (6e-4 to 1.2e-3, the Qwen3-1.7B mismatch study in
docs/method.md), so a candidate over it is where those runs were.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Optional, Sequence

from verl_lrstab._numbers import finite_float
from verl_lrstab.mismatch import TAIL_EDGES, TAIL_LABELS
from verl_lrstab.plot_extra import load_plots

FIGURES = ("k1", "k3", "seq_k3", "max_abs_diff", "frac_over_thr")
DEFAULT_BUDGET_K3 = 5e-4
DRIFT_FACTOR = 1.5  # the fitted growth of k3 over the steps, at LR 0
MIN_DRIFT_STEPS = 4
# one-sided 1 % critical values of Student's t by degrees of freedom (1..30; 2.326 beyond): the
# slope of log k3 must stand out of the per-step noise this clearly to be called a drift
T_CRIT_01 = (31.82, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681, 2.650, 2.624, 2.602,
             2.583, 2.567, 2.552, 2.539, 2.528, 2.518, 2.508, 2.500, 2.492, 2.485, 2.479, 2.473, 2.467, 2.462, 2.457)


@dataclass(frozen=True)
class Budget:
    """The mismatch budget on the median per-token k3.

    Args:
        value (float): the budget (> 0).
        source (str): ``default`` (:data:`DEFAULT_BUDGET_K3`), ``fixed`` (given), or
            ``reference`` (a trusted candidate's median k3 x ``factor``).
        reference (str | None): the reference candidate's name.
        factor (float | None): the factor on the reference.
    """

    value: float
    source: str = "default"
    reference: Optional[str] = None
    factor: Optional[float] = None

    def __post_init__(self):
        if finite_float(self.value) is None or self.value <= 0:
            raise ValueError(f"--budget must be a number > 0, got {self.value!r}")


@dataclass
class CandidateReport:
    """One candidate's figures (median and spread over the steps), verdict and reasons."""

    name: str
    steps: int = 0
    figures: dict = field(default_factory=dict)  # figure -> {"median", "min", "max"}
    k3: Optional[float] = None
    drift_ratio: Optional[float] = None
    ratio_to_budget: Optional[float] = None
    verdict: str = "reject"
    reasons: list = field(default_factory=list)
    findings: list = field(default_factory=list)  # mismatch_checks codes
    error: Optional[str] = None
    tail: dict = field(default_factory=dict)  # "1e-3" -> share of all the steps' tokens with |d| > 1e-3


def summarize(per_step: Sequence[dict]) -> dict:
    """``{figure: {"median", "min", "max"}}`` over the steps (``mismatch/<figure>`` or the bare name)."""
    out = {}
    for name in FIGURES:
        values = [v for row in per_step if (v := _figure(row, name)) is not None]
        if values:
            out[name] = {"median": median(values), "min": min(values), "max": max(values)}
    return out


def _figure(row: dict, name: str):
    return finite_float(row.get(f"actor/mismatch/{name}", row.get(f"mismatch/{name}", row.get(name))))


def tail_shares(per_step: Sequence[dict]) -> dict:
    """``{label: share}``: the tokens of all the steps with ``|d| >`` each edge of
    :data:`~verl_lrstab.mismatch.TAIL_EDGES` (each step weighted by its ``n_tokens``; 1 without it)."""
    out = {}
    for label in TAIL_LABELS:
        pairs = [(share, _figure(row, "n_tokens") or 1.0) for row in per_step
                 if (share := _figure(row, f"frac_over_{label}")) is not None]
        if pairs:
            out[label] = sum(s * n for s, n in pairs) / sum(n for _, n in pairs)
    return out


def drift_fit(k3_by_step: Sequence[float]) -> Optional[tuple[float, float]]:
    """``(growth, t)``: the least-squares slope of log k3 on the step, as the fitted growth over the
    steps (``exp(slope x (n - 1))``) and its t statistic against the per-step noise (the residuals'
    spread). None with fewer than 4 positive figures."""
    values = [v for v in (finite_float(x) for x in k3_by_step) if v is not None and v > 0]
    n = len(values)
    if n < MIN_DRIFT_STEPS:
        return None
    xs, ys = list(range(n)), [math.log(v) for v in values]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys)) / (n - 2)
    se = math.sqrt(resid / sxx)
    t = math.inf if se == 0 and slope > 0 else (0.0 if se == 0 else slope / se)
    return math.exp(slope * (n - 1)), t


def drift_ratio(k3_by_step: Sequence[float]) -> Optional[float]:
    """The fitted growth of k3 over the steps (:func:`drift_fit`; None with fewer than 4 steps)."""
    fit = drift_fit(k3_by_step)
    return None if fit is None else fit[0]


def is_drifting(k3_by_step: Sequence[float]) -> bool:
    """k3 grows at LR 0: a fitted growth >= :data:`DRIFT_FACTOR` whose slope is above the per-step
    noise at the 1 % level (one-sided t test on log k3); a stationary sampler passes 99 % of the time."""
    fit = drift_fit(k3_by_step)
    if fit is None:
        return False
    growth, t = fit
    n = len([v for v in (finite_float(x) for x in k3_by_step) if v is not None and v > 0])
    crit = T_CRIT_01[n - 3] if n - 2 <= len(T_CRIT_01) else 2.326
    return growth >= DRIFT_FACTOR and t >= crit


def judge(name: str, per_step: Sequence[dict], budget: Budget, findings: Sequence = (),
          error: Optional[str] = None) -> CandidateReport:
    """The verdict of one candidate: ``admit`` when its median k3 is within the budget, its k3 does not
    drift at LR 0 (:func:`is_drifting`) and it has figures at all; ``failed`` when its run failed
    (``error``); else ``reject`` with the reasons."""
    report = CandidateReport(name=name, findings=[getattr(f, "code", str(f)) for f in findings], error=error)
    report.reasons += [getattr(f, "message", str(f)) for f in findings]
    if error is not None:
        report.verdict = "failed"  # not a verdict on the sampler: it was never measured
        report.reasons.insert(0, f"the run failed: {error}")
        return report
    report.steps = len(per_step)
    report.figures = summarize(per_step)
    report.tail = tail_shares(per_step)
    if "k3" not in report.figures:
        report.reasons.insert(0, "no actor/mismatch/k3 was logged (the rollout's log-probs are needed)")
        return report
    report.k3 = report.figures["k3"]["median"]
    report.ratio_to_budget = report.k3 / budget.value
    k3 = [_figure(row, "k3") for row in per_step]
    report.drift_ratio = drift_ratio(k3)
    over = report.ratio_to_budget > 1
    drifting = is_drifting(k3)
    if over:
        report.reasons.insert(0, f"median k3 {report.k3:.3g} is {report.ratio_to_budget:.3g} x the budget "
                                 f"{budget.value:.3g} ({budget.source})")
    if drifting:
        report.reasons.insert(0, f"k3 grows at LR 0 (x{report.drift_ratio:.2f} over the steps, fitted, >= {DRIFT_FACTOR} "
                                 "and above the per-step noise at 1 %): the engines disagree for a system reason, which no LR "
                                 "schedule fixes (a sampler/trainer configuration, a version regression)")
    report.verdict = "reject" if over or drifting else "admit"
    return report


def calibrated_budget(reports: Sequence[CandidateReport], reference: str, factor: float) -> Budget:
    """``factor`` x the median k3 of the trusted ``reference`` candidate."""
    ref = next((r for r in reports if r.name == reference), None)
    if ref is None:
        raise ValueError(f"--reference {reference!r} is not a candidate: allowed values are "
                         f"{[r.name for r in reports]}")
    if ref.k3 is None or ref.k3 <= 0:
        raise ValueError(f"--reference {reference!r} has no positive median k3 to calibrate on")
    if finite_float(factor) is None or factor <= 0:
        raise ValueError(f"--budget-factor must be a number > 0, got {factor!r}")
    return Budget(ref.k3 * factor, "reference", reference, factor)


def by_k3(reports: Sequence[CandidateReport]) -> list[CandidateReport]:
    """The candidates by median k3, those without one (failed, unmeasured) last."""
    return sorted(reports, key=lambda r: (r.k3 is None, r.k3 or 0.0))


def report_json(budget: Budget, reports: Sequence[CandidateReport]) -> dict:
    """The JSON contract: ``{"budget": {...}, "candidates": [{"name", "k3", "verdict", ...}]}``."""
    return {"budget": asdict(budget), "candidates": [asdict(r) for r in reports]}


def report_table(budget: Budget, reports: Sequence[CandidateReport]) -> str:
    """A markdown table, candidates by median k3 (failed ones last)."""
    order = by_k3(reports)
    lines = [f"budget: median k3 <= {budget.value:.3g} ({budget.source}"
             + (f": {budget.factor:g} x {budget.reference})" if budget.source == "reference" else ")"),
             "", "| candidate | steps | k3 median (min-max) | k1 | seq k3 | max abs diff | x budget | drift | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]

    def fig(r, key):
        f = r.figures.get(key)
        return "-" if f is None else f"{f['median']:.3g}"

    for r in order:
        k3 = r.figures.get("k3")
        k3_cell = "-" if k3 is None else f"{k3['median']:.3g} ({k3['min']:.3g}-{k3['max']:.3g})"
        lines.append(f"| {r.name} | {r.steps} | {k3_cell} | {fig(r, 'k1')} | {fig(r, 'seq_k3')} | {fig(r, 'max_abs_diff')} | "
                     f"{'-' if r.ratio_to_budget is None else f'{r.ratio_to_budget:.3g}'} | "
                     f"{'-' if r.drift_ratio is None else f'{r.drift_ratio:.2f}'} | **{r.verdict}** |")
    return "\n".join(lines)


def plot_tails(reports: Sequence[CandidateReport], path, title: str = "per-token |log p_trainer - log p_rollout|",
               say=None):
    """Each candidate's survival function of the per-token ``|d|`` on log-log axes: the share of
    tokens above each decade edge (the largest ``|d|`` seen is in the legend).

    Returns:
        The path written, or None when no candidate has tail figures or matplotlib does not import
        (then one line through ``say``, default stderr, says how to get the figure).
    """
    curves = []
    for r in by_k3(reports):
        points = [(edge, r.tail[label]) for edge, label in zip(TAIL_EDGES, TAIL_LABELS) if r.tail.get(label, 0) > 0]
        if not points:
            continue
        top = (r.figures.get("max_abs_diff") or {}).get("max")
        label = r.name + (f": k3 {r.k3:.2g}" if r.k3 is not None else "") + (f", max |d| {top:.2g}" if top else "")
        curves.append((label + f" ({r.verdict})", points))
    plots = load_plots(f"figure {path}", say) if curves else None
    if plots is None:
        return None
    return plots.plot_survival(curves, title, "|d| (nats)", "share of response tokens with |d| > x", path)
