"""Read a logged training run into one table (step x metric).

Three formats, detected from the path:

- verl's file logger (``trainer.logger=[file]``): JSON lines ``{"step": N, "data": {...}}``;
- a TensorBoard log directory (verl's ``tensorboard`` logger), read with TensorBoard's own
  event reader; the directory must hold the event files of one run;
- a CSV with a step column (``step``, ``Step``, ``_step`` or ``global_step``; a wandb export
  for instance). Lines starting with ``#`` are comments.

A JSONL or CSV file may be gzipped (``metrics.jsonl.gz``): read as it is, the format told from
the name without ``.gz``.

The result is a :class:`pandas.DataFrame` indexed by ``step`` (int, sorted), one column per
metric, named as logged (``response_length/mean``, ``actor/lr``, ``val-core/...``). Steps
logged several times (verl logs validation and training metrics of a step in two calls)
are merged, the later value winning. Errors raise :class:`RunError` with a one-line message.

A row is read under its step label, except a training row of verl's fully-async trainer, which is
read under the update (the sync cycle) it holds (:class:`UpdateKeys`): that trainer logs a cycle's
figures one cycle late, under the next cycle's label.
"""

from __future__ import annotations

import contextlib
import csv
import fnmatch
import gzip
import io
import json
import math
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

# lrstab shows this logger's warnings: what a reader left out
logger = logging.getLogger("verl_lrstab.runs")

STEP_COLUMNS = ("step", "Step", "_step", "global_step", "trainer/global_step")
# Above this size a progress bar is shown (on a terminal only: tqdm's disable=None).
LARGE_BYTES = 5 * 2**20


class RunError(Exception):
    """A run that cannot be read or used; ``str(err)`` is one line fit for the user."""


class MissingMetricError(RunError):
    """A metric the caller asked for is not in the run, or is there without a value.

    Args:
        metric: the name (or names) looked for.
        available: the metric names the run has.
        source: the run's path, for the message.
        empty: those of ``metric`` the run has as columns without a value (every row NaN or empty).
    """

    def __init__(self, metric: str | Sequence[str], available: Iterable[str], source: str = "run",
                 empty: Sequence[str] = ()):
        self.metric = metric
        self.available = sorted(available)
        wanted = metric if isinstance(metric, str) else " or ".join(metric)
        shown = ", ".join(self.available[:40]) + (" ..." if len(self.available) > 40 else "")
        if empty:
            super().__init__(f"metric {empty[0]} in {source} has no value: every row of it is NaN or empty")
        else:
            super().__init__(f"metric {wanted} not found in {source}; available: {shown or '(none)'}")

    @classmethod
    def in_run(cls, metric: str | Sequence[str], df: pd.DataFrame) -> "MissingMetricError":
        """The error for ``metric`` (a name or candidates) found in no column of ``df`` holding a value."""
        names = [metric] if isinstance(metric, str) else list(metric)
        return cls(metric, [c for c in df.columns if df[c].notna().any()], df.attrs.get("source", "run"),
                   empty=[n for n in names if n in df.columns])


def load_run(path: str | os.PathLike) -> pd.DataFrame:
    """Load a logged run (verl JSONL, TensorBoard directory or CSV) into a step-indexed table.

    Args:
        path: the file or directory.

    Returns:
        A DataFrame indexed by ``step``; ``df.attrs["source"]`` holds the path.

    Raises:
        RunError: missing, unreadable, empty or malformed input.
    """
    p = Path(path)
    if not p.exists():
        raise RunError(f"{p}: no such file or directory")
    if p.is_dir() or p.name.startswith("events.out.tfevents"):
        df = _read_tensorboard(p if p.is_dir() else p.parent)
    elif p.stat().st_size == 0:
        raise RunError(f"{p}: the file is empty")
    elif _suffix(p) in (".jsonl", ".json", ".ndjson") or (_suffix(p) != ".csv" and _first_char(p) == "{"):
        df = _read_jsonl(p)
    else:
        df = _read_csv(p)
    if df.empty or len(df.columns) == 0:
        raise RunError(f"{p}: no metrics logged")
    df = df.sort_index()
    df.index.name = "step"
    df.attrs["source"] = str(p)
    return df


def metric_series(df: pd.DataFrame, name: str) -> pd.Series:
    """One metric as floats, its unlogged steps dropped (sparse logs are fed as logged).

    Args:
        df: a table from :func:`load_run`.
        name: the metric, exactly as logged.

    Raises:
        MissingMetricError: no such column, or it has no values.
        RunError: the column holds values that are not numbers.
    """
    source = df.attrs.get("source", "run")
    if name not in df.columns:
        raise MissingMetricError.in_run(name, df)
    raw = df[name]
    values = pd.to_numeric(raw, errors="coerce")
    bad = raw.notna() & values.isna()
    if bad.any():
        step = bad.idxmax()
        raise RunError(f"metric {name} in {source} has non-numeric values (first: {raw[step]!r} at step {step})")
    values = values.dropna().astype(float)
    if values.empty:
        raise MissingMetricError.in_run(name, df)
    return values


def find_metric(df: pd.DataFrame, candidates: Sequence[str]) -> str | None:
    """The first candidate logged in ``df``; candidates may be ``fnmatch`` patterns (``val-core/*``)."""
    for cand in candidates:
        if "*" in cand:
            hits = sorted(c for c in df.columns if fnmatch.fnmatchcase(c, cand) and df[c].notna().any())
            if hits:
                return hits[0]
        elif cand in df.columns and df[cand].notna().any():
            return cand
    return None


# -- readers -------------------------------------------------------------------------------------
_WARNED: set = set()  # ((device, inode), line number) of the unreadable lines already warned about
_LINE_SHAPE = '({"step": <int>, "data": {...}} expected)'

#: verl's fully-async trainer: a training row's update counter, the weight version its batch was
#: fetched under, and the rollouter's static figures that give the updates per sync cycle
GLOBAL_STEP = "training/global_step"
ASYNC_VERSION = "fully_async/count/current_param_version"
ASYNC_STATIC = "fully_async/static/"


class UpdateKeys:
    """The step a row of a verl log is read under, fed the rows in the order they were logged.

    A row is read under its label, except a training row of verl's fully-async trainer (it carries
    ``training/global_step`` and ``fully_async/count/current_param_version``): that trainer logs a sync
    cycle's figures when the next cycle ends, under the next cycle's label, and the last cycle's, when
    ``test_freq`` > 0, under the same label again; after a resume its ``training/global_step`` runs one
    ahead of the updates (it restarts at ``k * version + 2``). Such a row is read under the cycle whose
    scheduler figures it holds: with ``k`` updates a cycle (``trigger_parameter_sync_step``, read from
    the rollouter's ``fully_async/static/*`` figures; 1 where they are absent) and ``g`` its
    ``training/global_step``, ``g // k``, or ``(g - 1) // k`` in a resumed launch. Each cycle is then
    read once, in order; with ``k`` = 1 a cycle is one update and the key its number, as the run's
    scheduler counts it. Rows without those keys (validation, the rollouter's timing; every row of
    ``main_ppo`` and of the one-step-off trainer) are read under their label.
    """

    def __init__(self) -> None:
        self._last: tuple[int, bool] | None = None  # (label, resumed) of the previous fully-async training row

    def __call__(self, label: int, data: dict) -> int:
        step, version = _number(data.get(GLOBAL_STEP)), _number(data.get(ASYNC_VERSION))
        if step is None or version is None:
            return label
        k = _updates_per_cycle(data)
        # the row's last update is update j of its cycle: j = step - k * version, one more when resumed. A row
        # in the cycle's course holds j = k - 1, the last cycle's j = k; with k = 1 every row j = 1.
        j = int(step) - k * int(version)
        if j != k or k == 1:
            resumed = j > k
        elif self._last is not None and self._last[0] == label:  # the last cycle's row, after its label's row
            resumed = self._last[1]
        else:
            resumed = True
        self._last = (label, resumed)
        return (int(step) - int(resumed)) // k


def _number(value) -> float | None:
    """A logged figure as a finite float, None where it is absent or not a number (a table's NaN)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _updates_per_cycle(data: dict) -> int:
    """``trigger_parameter_sync_step`` of a fully-async row: verl's rollouter logs ``max_required_samples``
    = int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step); 1 where it does not."""
    required, most, staleness = (_number(data.get(ASYNC_STATIC + key))
                                 for key in ("required_samples", "max_required_samples", "staleness_threshold"))
    if not required or most is None or staleness is None or required * (staleness + 1) < 1:
        return 1
    # int() truncates by less than one sample: the quotient lies in (k - 1, k]
    return max(1, math.ceil(most / (required * (staleness + 1)) - 1e-9))


def read_metrics(path: os.PathLike, name: os.PathLike | None = None, strict: bool = False) -> dict[int, dict]:
    """verl's file-logger JSONL (``{"step": N, "data": {...}}`` per line) as ``{step: data}``.

    Each line is read under its step (:class:`UpdateKeys`: a fully-async training row under the update
    it holds); lines of the same step are merged, later values winning. A ``.gz`` file is read as it is.

    Args:
        path: the file.
        name: the file's name in messages, when ``path`` is another way to it (a descriptor's).
        strict: a line not of that shape (not JSON, ``data`` not a mapping, ``step`` missing or not a
            finite whole number) raises :class:`RunError` naming the file and the line, and a missing
            file raises too (a finished log, read whole), but a last line without its newline that does
            not read whole (a run killed mid-line) is left out with one warning. Else, the default (a
            log being written): a missing file reads as empty, a last line without its newline that
            does not read whole is still being written and ignored, and any other such line is skipped
            with one warning naming the file and the line (once per line, however often the file is read
            again).
    """
    out: dict[int, dict] = {}
    path = Path(path)
    keys = UpdateKeys()
    try:
        raw = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError):
        if strict:
            raise RunError(f"{path}: no such file") from None
        return out
    with contextlib.ExitStack() as stack:
        stack.enter_context(raw)
        info = os.fstat(raw.fileno())
        ident = (info.st_dev, info.st_ino)  # the file, whatever its name now (a guard's abandoned segment)
        # The bar (strict reads: load_run's) counts the bytes on disk (compressed ones for a .gz).
        bar = stack.enter_context(_progress(path, total=info.st_size, unit="B", unit_scale=True)) if strict else None
        f = stack.enter_context(gzip.open(raw, "rb")) if path.suffix == ".gz" else raw
        for lineno, line in enumerate(_lines(f, path), 1):
            if bar is not None:
                bar.update(raw.tell() - bar.n)
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8", "strict" if strict else "replace"))
                step, data = record["step"], record["data"]
                if not isinstance(data, dict) or isinstance(step, bool):
                    raise TypeError
                step = _as_step(step)
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                if not line.endswith(b"\n"):  # the last line, cut short: a run still writing, or killed mid-line
                    if strict:
                        logger.warning("verl_lrstab: %s:%d: the last line is incomplete (a run still writing, or "
                                       "stopped mid-line): read without it", name or path, lineno)
                    continue
                if strict:
                    raise RunError(f"{path}:{lineno}: not a verl file-logger line {_LINE_SHAPE}") from None
                if (ident, lineno) not in _WARNED:
                    _WARNED.add((ident, lineno))
                    text = line.decode("utf-8", "replace").strip()
                    shown = text if len(text) <= 80 else text[:77] + "..."
                    logger.warning("verl_lrstab: %s:%d: skipped, not a verl file-logger line %s: %s",
                                   name or path, lineno, _LINE_SHAPE, shown)
                continue
            out.setdefault(keys(step, data), {}).update(data)
    return out


def read_events(path: os.PathLike) -> list[dict]:
    """An ``lrstab_events.jsonl`` (one JSON object per line) as a list; a line that is not one (cut
    off by a guard killed mid-write) is skipped with one warning naming the file and the line."""
    out = []
    path = Path(path)
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            if not isinstance(event, dict):
                raise TypeError
        except (ValueError, TypeError, RecursionError):
            logger.warning("verl_lrstab: %s:%d: skipped, not an event (a JSON object expected)", path, lineno)
            continue
        out.append(event)
    return out


def _suffix(p: Path) -> str:
    return Path(p.stem).suffix if p.suffix == ".gz" else p.suffix


def _open_bytes(p: Path):
    return gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")


def _first_char(p: Path) -> str:
    with _open_bytes(p) as f:
        try:
            return f.read(4096).decode("utf-8", "replace").lstrip()[:1]
        except (OSError, EOFError) as err:  # a truncated or not-gzip .gz
            raise RunError(f"{p}: unreadable gzip file ({err})") from None


def _progress(p: Path, **kw):
    from tqdm import tqdm  # imported on first read, not when the package is imported

    big = p.stat().st_size >= LARGE_BYTES
    return tqdm(desc=f"reading {p.name}", disable=None if big else True, leave=False, **kw)


def _read_jsonl(p: Path) -> pd.DataFrame:
    rows = read_metrics(p, strict=True)
    if not rows:
        raise RunError(f"{p}: the file has no records")
    return pd.DataFrame.from_dict(rows, orient="index")


def _keyed_by_update(df: pd.DataFrame, source: Path) -> pd.DataFrame:
    """A table indexed by step label (a CSV's rows in the file's order, TensorBoard's by step) with its rows
    under :class:`UpdateKeys`' steps, the rows of a step merged (the later value winning)."""
    if GLOBAL_STEP in df.columns and ASYNC_VERSION in df.columns:
        keys = UpdateKeys()
        df = df.copy()
        df.index = [keys(int(label), row) for label, row in zip(df.index, df.to_dict("records"))]
    _warn_overwritten(df, source)
    return df.groupby(level=0, sort=True).last()


def _warn_overwritten(df: pd.DataFrame, source: Path) -> None:
    """One warning where rows of one step disagree on a metric (a log appended to by a resumed run, two
    exports pasted together): the later value is read, which may move a surge."""
    twice = df[df.index.duplicated(keep=False)]
    if twice.empty:
        return
    differ = twice.groupby(level=0).nunique(dropna=True).gt(1).any(axis=1)
    steps = differ.index[differ.to_numpy()].tolist()
    if steps:
        logger.warning("verl_lrstab: %s: %d step(s) logged on several rows with different values (first: step %s): "
                       "the later row's values are read", source, len(steps), steps[0])


def _lines(f, p: Path):
    try:
        yield from f
    except (OSError, EOFError) as err:  # a .gz cut off or not gzip at all
        raise RunError(f"{p}: unreadable gzip file ({err})") from None


def _read_csv(p: Path) -> pd.DataFrame:
    with io.TextIOWrapper(_open_bytes(p), encoding="utf-8", errors="replace", newline="") as f, \
            _progress(p, unit=" lines") as bar:
        lines = []
        for line in _lines(f, p):
            bar.update(1)
            if not line.lstrip().startswith("#") and line.strip():
                lines.append(line)
    if not lines:
        raise RunError(f"{p}: the file has no header and no rows")
    try:
        df = pd.read_csv(io.StringIO("".join(lines)), dtype=str)  # NaN, empty, null... -> NA
    except (pd.errors.ParserError, csv.Error, UnicodeDecodeError) as err:
        raise RunError(f"{p}: not a readable CSV ({str(err).splitlines()[0]})") from None
    step_col = next((c for c in STEP_COLUMNS if c in df.columns), None)
    if step_col is None:
        raise RunError(f"{p}: no step column (one of {list(STEP_COLUMNS)}); columns: {list(df.columns)}")
    if df.empty:
        raise RunError(f"{p}: the file has a header but no rows")
    try:
        steps = [_as_step(s) for s in df.pop(step_col)]
    except (TypeError, ValueError):
        raise RunError(f"{p}: column {step_col} must hold integer step numbers") from None
    df = _tidy_wandb_columns(df).apply(_numeric_if_possible)
    df.index = steps
    # A step on several rows: merge them, the later value winning.
    return _keyed_by_update(df, p)


def _tidy_wandb_columns(df: pd.DataFrame) -> pd.DataFrame:
    """wandb panel exports name columns ``<run> - <metric>`` and add ``__MIN``/``__MAX`` twins."""
    df = df[[c for c in df.columns if not c.endswith(("__MIN", "__MAX"))]]
    prefixes = {c.split(" - ", 1)[0] for c in df.columns if " - " in c}
    if len(prefixes) == 1 and all(" - " in c for c in df.columns):
        df = df.rename(columns=lambda c: c.split(" - ", 1)[1])
    return df


def _numeric_if_possible(col: pd.Series) -> pd.Series:
    # Columns that are all numbers become floats; others stay text (metric_series names them).
    try:
        return pd.to_numeric(col)
    except (ValueError, TypeError):
        return col


def _read_tensorboard(d: Path) -> pd.DataFrame:
    try:  # verl brings tensorboard; a machine without verl reading a copied log may not have it
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.util import tensor_util
    except ImportError as err:
        raise RunError(f"{d}: reading TensorBoard logs needs the tensorboard package ({err}): "
                       "pip install tensorboard") from None

    run_dirs = sorted({f.parent for f in d.rglob("events.out.tfevents.*")})
    if not run_dirs:
        raise RunError(f"{d}: no TensorBoard event files (events.out.tfevents.*) in this directory")
    if len(run_dirs) > 1:
        names = ", ".join(str(r) for r in run_dirs[:10])
        raise RunError(f"{d}: holds {len(run_dirs)} TensorBoard runs, pass one of: {names}")
    acc = ea.EventAccumulator(str(run_dirs[0]), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    try:
        acc.Reload()
    except Exception as err:  # noqa: BLE001 - the reader raises assorted protobuf/IO errors
        raise RunError(f"{run_dirs[0]}: unreadable TensorBoard events ({type(err).__name__}: {err})") from None
    tags = acc.Tags()
    columns: dict[str, dict[int, float]] = {}
    from tqdm import tqdm

    for tag in tqdm(tags.get("scalars", []), desc="reading scalars", disable=None, leave=False):
        columns[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    # Newer writers (tf.summary, tensorboardX with new-style summaries) log scalars as tensors.
    for tag in tags.get("tensors", []):
        vals = {}
        for e in acc.Tensors(tag):
            arr = tensor_util.make_ndarray(e.tensor_proto)
            if arr.size == 1 and arr.dtype.kind in "fiu":
                vals[e.step] = float(arr.reshape(-1)[0])
        if vals:
            columns.setdefault(tag, vals)
    if not columns:
        raise RunError(f"{run_dirs[0]}: the TensorBoard events hold no scalars")
    return _keyed_by_update(pd.DataFrame(columns).sort_index(), d)


def _as_step(value) -> int:
    f = float(value)
    if not math.isfinite(f) or f != int(f):
        raise ValueError(value)
    return int(f)


# -- the detector's co-signals in a log ----------------------------------------------------------------
#: The figures verl logs on every step that ``detector: cusum`` reads, by the name
#: :meth:`verl_lrstab.cusum.CusumDetector.add_cosignals` takes: what a length_surge run's trainer
#: consumed (``actor/lrstab/...``) first, then verl's own columns.
COSIGNAL_METRICS = {
    # actor/entropy: verl's old-log-prob pass (recompute); actor/entropy_loss: the update's own, where it computes
    # one (bypass mode with calculate_entropy): the figures the trainer feeds, in that order
    "entropy": ("actor/lrstab/entropy", "actor/entropy", "actor/entropy_loss"),
    "grad_norm": ("actor/lrstab/grad_norm", "actor/grad_norm"),
    "kl_loss": ("actor/lrstab/kl_loss", "actor/kl_loss"),
    "pg_clipfrac": ("actor/lrstab/pg_clipfrac", "actor/pg_clipfrac"),
}


def cosignal_columns(df: pd.DataFrame) -> dict[str, str]:
    """``{co-signal: column}`` of the co-signals ``df`` logs (:data:`COSIGNAL_METRICS`; absent ones left out).

    A length_surge run (it logs ``actor/lrstab/*``) is read as its trainer consumed it: its
    ``actor/lrstab/`` columns only, none where it logged none.
    """
    ours = any(str(c).startswith(("actor/lrstab/", "lrstab/")) for c in df.columns)
    out = {}
    for name, candidates in COSIGNAL_METRICS.items():
        found = find_metric(df, candidates[:1] if ours else candidates[1:])
        if found is not None:
            out[name] = found
    return out


def replay_with_cosignals(steps, values, config=None, warmup_steps: int = 0, mismatch_kl=None, score=None,
                          clip_ratio=None, cosignals: dict | None = None):
    """:func:`verl_lrstab.log_replay.replay` with the detector's co-signals fed too.

    ``cosignals``: ``{name: column}`` (names of :data:`COSIGNAL_METRICS`), each aligned with
    ``steps`` (None/NaN where a step did not log it). Without any it is ``replay`` itself. Each
    step's figures are handed to the detector after the step's own decision, as the trainer does
    (it has an update's figures only after the update); the detector reads them from the next
    step on, so the order does not change a decision.
    """
    from verl_lrstab.log_replay import replay

    return replay(steps, values, config, warmup_steps, mismatch_kl=mismatch_kl, score=score, clip_ratio=clip_ratio,
                  cosignals=cosignals)


# -- which response length a log is replayed on -------------------------------------------------------
#: The mean number of the model's own tokens per response (``response_mask``), as a length_surge run logs it
#: beside verl's ``response_length/mean`` (which counts every response token, tool output included).
MODEL_TOKEN_METRICS = ("actor/lrstab/model_tokens", "lrstab/model_tokens")
READS_MODEL_TOKENS = "the model's own tokens per response (response_mask)"
READS_ALL_TOKENS = "every response token (verl's response_length/mean)"
# verl logs response_length/mean as a float32 mean: a model-token figure within this of it is the same length
_FLOAT32_REL = 1e-6


def length_column(df: pd.DataFrame, given: str | None, length_tokens: str,
                  candidates: Sequence[str]) -> tuple[str, str]:
    """``(column, what it counts)``: the response length a replay of ``df`` reads, as the trainer reads it.

    ``given`` (``--metric``) wins. Else by ``length_tokens`` (the scheduler option): ``model``: the
    model-token column (:data:`MODEL_TOKEN_METRICS`); ``all``: the first of ``candidates`` (verl's
    ``response_length/mean``); ``auto``: the model-token column where the log has one and its responses
    held tokens the model did not sample (on some step it is below verl's length), else the first of
    ``candidates``: a single-turn log replays the length it always did.

    Raises:
        MissingMetricError: no such column (``model`` without a model-token column names the metric it needs).
    """
    if given == "":
        raise RunError("--metric='' is invalid: allowed values are a metric the run logs (leave it unset for the "
                       "default)")
    if given:
        return given, READS_MODEL_TOKENS if given in MODEL_TOKEN_METRICS else f"as named ({given})"
    model = find_metric(df, MODEL_TOKEN_METRICS)
    full = find_metric(df, candidates)
    if length_tokens == "model":
        if model is None:
            raise MissingMetricError.in_run(MODEL_TOKEN_METRICS, df)
        return model, READS_MODEL_TOKENS
    if length_tokens == "auto" and model is not None and (full is None or _below(df, model, full)):
        return model, READS_MODEL_TOKENS
    if full is None:
        raise MissingMetricError.in_run(candidates, df)
    return full, READS_ALL_TOKENS + _multi_turn_note(df, model)


def _below(df: pd.DataFrame, model: str, full: str) -> bool:
    both = pd.concat([metric_series(df, model), metric_series(df, full)], axis=1, join="inner")
    return bool((both.iloc[:, 0] < both.iloc[:, 1] * (1.0 - _FLOAT32_REL)).any())


def _multi_turn_note(df: pd.DataFrame, model: str | None) -> str:
    """A warning for a multi-turn log without a model-token figure (verl counts a single turn as 2 turns)."""
    turns = find_metric(df, ("num_turns/max",))
    if model is not None or turns is None or metric_series(df, turns).max() <= 2:
        return ""
    return (f"; the log shows multi-turn responses ({turns} up to {metric_series(df, turns).max():g}) and no "
            "model-token figure, so this length counts tool output too")
