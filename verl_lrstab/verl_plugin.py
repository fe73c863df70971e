"""The only module that touches verl's internals (verl 0.9.x).

verl has no registry for LR schedulers, so the plugin replaces a few of verl's functions,
each the moment its module is first imported. They are listed once, in :data:`WRAPS`
(module, class, attribute, the signature the wrapper relies on, the wrapper factory and the
other assumptions it makes); ``patches/README.md`` gives the reason for each.

Fail-safe: a target that is missing or has another shape than expected (checked with
``inspect.signature`` and the checks of :func:`shape_checks`, which ``patches/check_verl.py``
prints), or a factory that raises, leaves verl's original in place, logs one ERROR naming
verl's version and the target, and makes a config that names ``length_surge`` fail at
config time with that cause (:mod:`verl_lrstab._hooks`). Runs that do not name
``length_surge`` then run verl's own code. Every wrapper passes ``*args, **kwargs`` through
and calls verl's original unless the run uses ``length_surge``.

To wrap another target, append a :class:`Wrap` to :data:`WRAPS`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from verl_lrstab._hooks import SCHEDULER_NAME, check_usable, report_failure, when_imported

logger = logging.getLogger("verl_lrstab")

_lock = threading.Lock()
_installed = False

#: Non-tensor keys the driver-side wraps add to the actor batch (popped by the worker wrap).
STEP_POSITION_KEY = "lrstab_step_position"  # [index of this actor update in the trainer step, updates per step]
PRE_RS_STATS_KEY = "lrstab_pre_rs_mismatch_stats"  # mismatch stats over the tokens before rejection sampling

Check = tuple  # (assumption, ok, detail)


@dataclass(frozen=True)
class Wrap:
    """One verl attribute the plugin replaces.

    Args:
        module: the module whose import installs the wrap.
        owner: class in ``module`` holding the attribute (dotted for a nested one); None for a
            module attribute.
        attribute: the attribute replaced.
        parameters: leading parameter names of verl's function the wrapper relies on
            (further parameters must be optional); None for a non-function (a class).
        make: ``make(original) -> replacement``.
        checks: ``checks(module, original) -> iterable of (assumption, ok, detail)``: the other
            assumptions the wrapper makes about verl's code (cheap: run at install time).
        also_in: further modules whose attribute of the same name is replaced as well.
    """

    module: str
    owner: Optional[str]
    attribute: str
    parameters: Optional[tuple]
    make: Callable[[Any], Any]
    checks: Optional[Callable[[Any, Any], Iterable[Check]]] = None
    also_in: tuple = ()

    @property
    def target(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.attribute) if p)


class VerlShapeError(RuntimeError):
    """verl's target does not have the shape the wrapper relies on."""


# -- installation ------------------------------------------------------------------------------
def install() -> None:
    """Install every wrap of :data:`WRAPS` now if its module is loaded, else when it is imported."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    by_module: dict[str, list[Wrap]] = {}
    for wrap in WRAPS:
        by_module.setdefault(wrap.module, []).append(wrap)
    for name, wraps in by_module.items():
        when_imported(name, functools.partial(_apply_all, wraps), on_error=report_failure)
    _mark_process()


def _mark_process() -> None:
    """With ``LRSTAB_PLUGIN_MARKER_DIR`` set, leave ``<dir>/<pid>``: the tests' proof of which processes loaded us."""
    import os

    directory = os.environ.get("LRSTAB_PLUGIN_MARKER_DIR")
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, str(os.getpid())), "w") as marker:
                marker.write(" ".join(__import__("sys").argv)[:500])
        except OSError as exc:
            logger.warning("verl_lrstab: could not write the plugin marker in %s: %r", directory, exc)


def _apply_all(wraps: list, module) -> None:
    for wrap in wraps:
        apply(wrap, module)


def apply(wrap: Wrap, module) -> bool:
    """Install ``wrap`` on ``module``; on any failure leave verl's original and report it."""
    try:
        owner = owner_of(wrap, module)
        current = getattr(owner, wrap.attribute)
        if getattr(current, "_lrstab_wrapped", False):
            return True
        problems = [f"{name} ({detail})" if detail else name
                    for name, ok, detail in shape_checks(wrap, module, current) if not ok]
        if problems:
            raise VerlShapeError("; ".join(problems))
        replacement = wrap.make(current)
        if wrap.parameters is not None:
            replacement = functools.wraps(current)(replacement)  # keeps verl's decorator attributes
        replacement._lrstab_wrapped = True
        replacement._lrstab_original = current
        for name in wrap.also_in:
            other = _loaded(name)
            if other is not None and getattr(other, wrap.attribute, None) is current:
                setattr(other, wrap.attribute, replacement)
        setattr(owner, wrap.attribute, replacement)
        return True
    except Exception as exc:  # noqa: BLE001 - never break verl's import; report and refuse length_surge
        report_failure(wrap.target, exc)
        return False


def owner_of(wrap: Wrap, module):
    """The object holding ``wrap.attribute``: the module, or the (dotted) ``owner`` in it."""
    return functools.reduce(getattr, wrap.owner.split("."), module) if wrap.owner else module


def original(obj):
    """verl's own object behind a wrapper (the object itself if not wrapped)."""
    return getattr(obj, "_lrstab_original", obj)


def shape_checks(wrap: Wrap, module, current) -> Iterable[Check]:
    """The assumptions ``wrap`` makes about verl's target, as ``(assumption, ok, detail)``."""
    target = original(current)
    if wrap.parameters is not None:
        yield _signature_check(wrap, target)
    if wrap.checks is not None:
        yield from wrap.checks(module, target)


def _signature_check(wrap: Wrap, func) -> Check:
    name = f"{wrap.target}{tuple(wrap.parameters)}"
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        return name, False, f"no signature: {exc}"
    head = [p.name for p in params[: len(wrap.parameters)]]
    extra_required = [p.name for p in params[len(wrap.parameters):]
                      if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    ok = head == list(wrap.parameters) and not extra_required
    return name, ok, "" if ok else f"verl has {inspect.signature(func)}"


def _source_contains(obj, *needles: str) -> tuple:
    """(ok, detail) for "each needle is in obj's source"; unreadable source is not a failure."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return True, "source not available, not checked"
    missing = [n for n in needles if n not in source]
    return not missing, f"not found: {missing}" if missing else ""


def _loaded(name: str):
    import sys

    return sys.modules.get(name)


# -- 1. the config class -------------------------------------------------------------------------
def _make_config(original_cls):
    from verl_lrstab.verl_config import LengthSurgeOptimizerConfig

    if not issubclass(LengthSurgeOptimizerConfig, original_cls):
        raise VerlShapeError(f"LengthSurgeOptimizerConfig does not derive from {original_cls!r}")
    return LengthSurgeOptimizerConfig


def _config_checks(module, cls):
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    needed = {"lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "total_training_steps", "warmup_style"}
    yield "FSDPOptimizerConfig has the fields the scheduler reads", needed <= fields, sorted(needed - fields)
    yield ("FSDPOptimizerConfig.__post_init__ asserts the scheduler name",
           *_source_contains(cls.__post_init__, '"constant", "cosine"'))


# -- 2. the engine builds our scheduler ------------------------------------------------------------
def _make_build_lr_scheduler(original_fn):
    def _build_lr_scheduler(self, *args, **kwargs):
        optim_config = self.optimizer_config
        if getattr(optim_config, "lr_scheduler_type", None) != SCHEDULER_NAME:
            return original_fn(self, *args, **kwargs)
        check_usable()  # a wrap failed in this process: refuse rather than run a scheduler nobody feeds
        optimizer = args[0] if args else kwargs["optimizer"]
        return build_length_surge_scheduler(optimizer, optim_config, verbose=getattr(self, "rank", 0) == 0)

    return _build_lr_scheduler


def _engine_checks(module, build):
    engine = module.FSDPEngine
    yield "FSDPEngine._build_lr_scheduler raises NotImplementedError for unknown names", *_source_contains(
        build, "NotImplementedError")
    yield "FSDPEngine.initialize() hands the scheduler to FSDPCheckpointManager", *_source_contains(
        engine.initialize, "lr_scheduler=self.lr_scheduler")
    yield "FSDPEngine.lr_scheduler_step() calls step() with no argument", *_source_contains(
        engine.lr_scheduler_step, "self.lr_scheduler.step()")


def build_length_surge_scheduler(optimizer, optim_config, verbose: bool = False):
    """Build :class:`LengthSurgeLR` from verl's optimizer config, resolving warmup as verl does."""
    from verl_lrstab.scheduler import LengthSurgeLR

    _check_assumptions_once()
    warmup = optim_config.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optim_config.lr_warmup_steps_ratio * optim_config.total_training_steps)
    scheduler = LengthSurgeLR(optimizer, getattr(optim_config, "length_surge", None), warmup_steps=max(0, warmup))
    scheduler._lrstab_configured_warmup = max(0, warmup)
    if verbose:
        print(f"verl_lrstab: length_surge scheduler, warmup {warmup} steps, options {scheduler.config.to_dict()}")
    return scheduler


# -- 3. the worker feeds the scheduler and reports its figures -------------------------------------
def _make_train_mini_batch(original_fn):
    def train_mini_batch(self, *args, **kwargs):
        try:
            scheduler = _length_surge_scheduler(self)
        except Exception:  # noqa: BLE001 - a stock run must reach verl's code whatever happens here
            scheduler = None
        if scheduler is None:
            return original_fn(self, *args, **kwargs)
        data = args[0] if args else kwargs["data"]
        return _train_mini_batch_length_surge(self, scheduler, data, lambda: original_fn(self, *args, **kwargs))

    return train_mini_batch


def _worker_checks(module, mini):
    worker = module.TrainingWorker
    yield "TrainingWorker.train_mini_batch steps the scheduler on its last mini-batch only", *_source_contains(
        mini, "update_lr_scheduler=batch_idx == total_num_iterations - 1")
    yield "TrainingWorker.train_mini_batch returns metrics under 'metrics'", *_source_contains(mini, '"metrics": metrics')
    yield "TrainingWorker.train_batch calls engine.lr_scheduler_step()", *_source_contains(
        worker.train_batch, "self.engine.lr_scheduler_step()")


def _train_mini_batch_length_surge(worker, scheduler, data, run_original):
    """One actor update of a ``length_surge`` run; the scheduler steps once per trainer step.

    verl's V1 ``separate_async`` trainer runs ``parameter_sync_step`` updates per trainer step
    (the driver-side wrap tells the worker which one this is). The glue sums the length and
    mismatch figures over the step's updates, holds the LR within the step, and feeds the
    scheduler once, on the step's last update, with the figures of the whole trainer step:
    windows, surge step and decay period are in trainer steps, the step verl logs.
    """
    from verl.utils import tensordict_utils as tu

    index, count = _step_position(tu.pop(data, key=STEP_POSITION_KEY, default=None))
    pre_rs = tu.pop(data, key=PRE_RS_STATS_KEY, default=None)
    _warmup_in_trainer_steps(scheduler, count)
    group = worker.engine.get_data_parallel_group()
    acc = scheduler.__dict__.setdefault("_lrstab_step", StepAccumulator())
    if index == 0:
        acc.reset()
    length_stats, mismatch_stats = global_length_stats(data, group), global_mismatch_stats(data, group, pre_rs)
    acc.add_score(global_score_stats(data, group))
    if _is_bypass(mismatch_stats):  # bypass mode: mismatch/* from the loss's own forward (verl_lrstab.bypass)
        return _train_mini_batch_bypass(worker, scheduler, data, run_original, acc, length_stats, index == count - 1)
    acc.add(length_stats, mismatch_stats)
    if index < count - 1:  # not the step's last update: the LR stays, nothing is logged
        with _hold_lr(worker.engine, scheduler):
            return run_original()
    length, mismatch = acc.result(scheduler.config.mismatch_metric)
    scheduler.pending_score = acc.score_mean()
    acc.reset()
    scheduler.pending_response_length = length
    if mismatch is not None:
        scheduler.pending_mismatch_kl = mismatch.get(f"mismatch/{scheduler.config.mismatch_metric}")
    output = run_original()
    _probe_rank(scheduler)
    return _with_metrics(output, {**scheduler.metrics(), **(mismatch or {})})


def _is_bypass(mismatch_stats) -> bool:
    from verl_lrstab.bypass import is_bypass

    return is_bypass(mismatch_stats)


def _train_mini_batch_bypass(worker, scheduler, data, run_original, acc, length_stats, last: bool):
    """An update in verl's bypass mode (``old_log_probs := rollout_log_probs``, 0 by construction).

    ``mismatch/*`` come instead from the log-probs verl's loss gets for the update's first
    mini-batch (before any optimizer step) against ``rollout_log_probs``: ``worker.loss_fn``,
    which the engine reads per mini-batch, observes them for this call only; the sums are
    all-reduced at the first optimizer step (a torch step pre-hook), before the scheduler steps.
    """
    from verl_lrstab import mismatch
    from verl_lrstab.bypass import BYPASS_KEY, capture_first_mini_batch

    mismatch.warn_once("bypass")
    key = f"mismatch/{scheduler.config.mismatch_metric}"
    acc.add_length(length_stats)
    figures = {}
    if last:
        scheduler.pending_response_length, _ = acc.result()
        scheduler.pending_score = acc.score_mean()
        scheduler.pending_mismatch_kl = None

    def on_reduced(measured):  # once, on every rank alike
        acc.add_mismatch(capture.global_stats if measured is not None else None)
        if last:
            figures.update(acc.result(scheduler.config.mismatch_metric)[1] or {})
            scheduler.pending_mismatch_kl = figures.get(key)

    engine = worker.engine
    with contextlib.nullcontext() if last else _hold_lr(engine, scheduler), capture_first_mini_batch(
            worker, _first_mini_batch_size(worker, data), bypass_micro_batch_view,
            optimizer=getattr(engine, "optimizer", None), group=engine.get_data_parallel_group(),
            on_reduced=on_reduced) as capture:
        output = run_original()
    if not last:  # not the step's last update: the LR stays, nothing is logged
        return output
    acc.reset()
    scheduler.pending_mismatch_kl = None  # consumed; or set after the step (no optimizer hook): not for the next
    _probe_rank(scheduler)
    if not figures:
        mismatch.warn_once("bypass_failed")
    else:
        figures[BYPASS_KEY] = 1.0
    return _with_metrics(output, {**scheduler.metrics(), **figures})


def _first_mini_batch_size(worker, data) -> int:
    """The rank's first mini-batch (sequences), as ``TrainingWorker.train_mini_batch`` splits the batch."""
    from verl.utils import tensordict_utils as tu

    n = int(data.shape[0])
    try:
        mini_batch_size = tu.get(data, key="mini_batch_size", default=None)
        num_mini_batch = tu.get(data, key="num_mini_batch", default=None)
        if mini_batch_size is not None:
            n = min(n, int(mini_batch_size) // worker.engine.get_data_parallel_size())
        elif num_mini_batch is not None:
            n = n // int(num_mini_batch)
    except Exception as exc:  # noqa: BLE001 - the optimizer hook still bounds the capture
        logger.warning("verl_lrstab: could not read the mini-batch size (%r); counting the whole batch", exc)
    return max(1, n)


def bypass_micro_batch_view(model_output, data):
    """The trainer's and the rollout's log-probs of one micro-batch, padded as verl's ``ppo_loss`` pads them."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_probs = no_padding_2_padding(model_output["log_probs"], data)
    padded = data.select("rollout_log_probs", "response_mask").to_padded_tensor()
    return log_probs, padded["rollout_log_probs"], padded["response_mask"], int(data.shape[0])


def _probe_rank(scheduler) -> None:
    """With ``LRSTAB_PLUGIN_MARKER_DIR`` set, append this rank's LR and scheduler state (the tests' per-rank view)."""
    import hashlib
    import json
    import os

    directory = os.environ.get("LRSTAB_PLUGIN_MARKER_DIR")
    if not directory:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    state = json.dumps(scheduler.state_dict(), sort_keys=True)
    record = {"rank": rank, "pid": os.getpid(), "update": scheduler.last_epoch, "lr": scheduler.get_last_lr()[0],
              "state_sha1": hashlib.sha1(state.encode()).hexdigest()}
    with open(os.path.join(directory, f"lr_rank{rank}_{os.getpid()}.jsonl"), "a") as probe:
        probe.write(json.dumps(record) + "\n")


def _step_position(value) -> tuple:
    if value is None:
        return 0, 1
    index, count = (int(v) for v in value)
    if not 0 <= index < count:
        raise ValueError(f"verl_lrstab: bad trainer-step position {value!r}")
    return index, count


def _warmup_in_trainer_steps(scheduler, count: int) -> None:
    """verl resolves the warmup in actor updates (V1 multiplies the total by the updates per step)."""
    if count > 1 and getattr(scheduler, "_lrstab_updates_per_step", 1) != count:
        scheduler._lrstab_updates_per_step = count
        configured = getattr(scheduler, "_lrstab_configured_warmup", scheduler.schedule.warmup_steps)
        scheduler.schedule.warmup_steps = -(-configured // count)


@contextlib.contextmanager
def _hold_lr(engine, scheduler):
    """Within a trainer step, verl's ``engine.lr_scheduler_step()`` reports the LR without stepping."""
    engine.lr_scheduler_step = lambda: scheduler.get_last_lr()[0]
    try:
        yield
    finally:
        del engine.lr_scheduler_step


class StepAccumulator:
    """Sums the global length, score and mismatch figures of the actor updates of one trainer step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.length = [0.0, 0.0]  # sum, count
        self.score = [0.0, 0.0]  # sum, count (NaN sum: some update had no score)
        self.mismatch = None  # stats tensor (sums, then max) or None
        self.mismatch_valid = True

    def add(self, length_stats, mismatch_stats) -> None:
        self.add_length(length_stats)
        self.add_mismatch(mismatch_stats)

    def add_length(self, length_stats) -> None:
        self.length = [self.length[0] + length_stats[0], self.length[1] + length_stats[1]]

    def add_score(self, score_stats) -> None:
        self.score = [self.score[0] + score_stats[0], self.score[1] + score_stats[1]]

    def score_mean(self) -> Optional[float]:
        """The step's mean sequence score, or None (the detector then runs without it)."""
        total, count = self.score
        return total / count if count > 0 and math.isfinite(total) else None

    def add_mismatch(self, mismatch_stats) -> None:
        if mismatch_stats is None:
            self.mismatch_valid = False
        elif self.mismatch_valid:
            if self.mismatch is None:
                self.mismatch = mismatch_stats.clone()
            else:
                self.mismatch[:-1] += mismatch_stats[:-1]
                self.mismatch[-1] = max(self.mismatch[-1], mismatch_stats[-1])

    def result(self, metric: str = "k3"):
        from verl_lrstab import mismatch

        total, count = self.length
        length = total / count if count > 0 else math.nan
        return length, mismatch.finalize(self.mismatch if self.mismatch_valid else None)


def _length_surge_scheduler(worker):
    from verl_lrstab.scheduler import LengthSurgeLR

    scheduler = getattr(getattr(worker, "engine", None), "lr_scheduler", None)
    # Megatron's (verl_lrstab.megatron) is loaded whenever one of its schedulers exists.
    megatron = _loaded("verl_lrstab.megatron")
    classes = (LengthSurgeLR,) + ((megatron.LengthSurgeParamScheduler,) if megatron is not None else ())
    return scheduler if isinstance(scheduler, classes) else None


# -- 4. driver side: where an actor update sits in the trainer step, mismatch before rejection ----
def _make_v1_update_actor(original_fn):
    def _update_actor(self, *args, **kwargs):
        batch = args[0] if args else kwargs["batch"]
        try:
            extra = getattr(batch, "extra_info", None)
            if extra is not None and _names_length_surge(self.config):
                count = int(getattr(self, "parameter_sync_step", 1) or 1)
                extra[STEP_POSITION_KEY] = [int(getattr(self, "local_trigger_step", 0)), count]
                stats = _pop_pre_rs_stats()
                if stats is not None:
                    extra[PRE_RS_STATS_KEY] = stats
        except Exception as exc:  # noqa: BLE001 - the worker then treats each update as a step (and warns)
            logger.error("verl_lrstab: could not tag the actor batch: %r", exc)
        return original_fn(self, *args, **kwargs)

    return _update_actor


def _v1_trainer_checks(module, fn):
    trainer = module.PPOTrainer
    yield "V1 PPOTrainer.step runs parameter_sync_step updates, local_trigger_step = index", *_source_contains(
        trainer.step, "for trigger_idx in range(self.parameter_sync_step)", "self.local_trigger_step = trigger_idx")
    yield "V1 PPOTrainer._update_actor sends batch.extra_info to update_actor", *_source_contains(
        fn, "batch.extra_info.update", "update_actor(batch)")


def _make_v0_update_actor(original_fn):
    def _update_actor(self, *args, **kwargs):
        batch = args[0] if args else kwargs["batch"]
        try:
            if _names_length_surge(self.config):
                stats = _pop_pre_rs_stats()
                if stats is not None:
                    batch.meta_info[PRE_RS_STATS_KEY] = stats
        except Exception as exc:  # noqa: BLE001
            logger.error("verl_lrstab: could not tag the actor batch: %r", exc)
        return original_fn(self, *args, **kwargs)

    return _update_actor


def _v0_trainer_checks(module, fn):
    yield "V0 RayPPOTrainer._update_actor sends the whole batch with attention_mask (the length's source)", \
        *_source_contains(fn, "batch_td = batch.to_tensordict()", "left_right_2_no_padding(batch_td)")


_pre_rs = threading.local()


def _make_rollout_correction(original_fn):
    def compute_rollout_correction_and_add_to_batch(batch, *args, **kwargs):
        try:
            _stash_pre_rs_stats(batch)
        except Exception as exc:  # noqa: BLE001 - the worker then measures over the post-rejection mask
            logger.error("verl_lrstab: could not measure the mismatch before rejection sampling: %r", exc)
        return original_fn(batch, *args, **kwargs)

    return compute_rollout_correction_and_add_to_batch


def _rollout_correction_checks(module, fn):
    yield "compute_rollout_correction_and_add_to_batch overwrites batch response_mask", *_source_contains(
        fn, 'batch.batch["response_mask"] = modified_response_mask')


def _stash_pre_rs_stats(batch) -> None:
    """The mismatch stats of the whole batch over ``response_mask`` before rejection sampling."""
    from verl_lrstab import mismatch

    tensors = batch.batch
    _pre_rs.stats = None
    if "rollout_log_probs" in tensors.keys() and "old_log_probs" in tensors.keys():
        stats = mismatch.compute_stats(tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"])
        _pre_rs.stats = None if stats is None else stats.cpu().tolist()


def _pop_pre_rs_stats():
    stats, _pre_rs.stats = getattr(_pre_rs, "stats", None), None
    return stats


def _names_length_surge(config) -> bool:
    try:
        optim = config.actor_rollout_ref.actor.optim
        return SCHEDULER_NAME in (optim.get("lr_scheduler_type"), optim.get("lr_decay_style"))  # FSDP, Megatron
    except Exception:  # noqa: BLE001
        return False


# -- 5. explicit refusals: roles, engines and trainers where length_surge would do nothing --------
SUPPORTED = ("the actor (actor_rollout_ref.actor.optim) of the FSDP engine (strategy fsdp/fsdp2) and of the "
             "Megatron engine (strategy megatron, lr_decay_style) in verl's main_ppo, V0 and V1 (sync, "
             "colocate_async, separate_async)")


class LengthSurgeNotSupported(ValueError):
    """``length_surge`` named where it would have no effect."""


def refuse(key: str, where: str) -> LengthSurgeNotSupported:
    return LengthSurgeNotSupported(f"{key}={SCHEDULER_NAME} is not supported for {where}: it would never be fed "
                                   f"and do nothing. Supported: {SUPPORTED}; elsewhere use constant or cosine.")


def _make_post_init_refusal(key: str, where: str, get=lambda self: self.lr_scheduler_type):
    def make(original_fn):
        def __post_init__(self, *args, **kwargs):
            if get(self) == SCHEDULER_NAME:
                raise refuse(key, where)
            return original_fn(self, *args, **kwargs)

        return __post_init__

    return make


def _make_init_refusal(key: str, where: str, get: Callable):
    def make(original_fn):
        def method(self, *args, **kwargs):
            config = args[0] if args else kwargs.get("config", getattr(self, "config", None))
            try:
                named = get(config) == SCHEDULER_NAME
            except Exception:  # noqa: BLE001 - the key is absent: nothing to refuse
                named = False
            if named:
                raise refuse(key, where)
            return original_fn(self, *args, **kwargs)

        return method

    return make


def _make_kwarg_refusal(key: str, where: str):
    def make(original_fn):
        def __init__(self, *args, **kwargs):
            if kwargs.get("lr_scheduler_type") == SCHEDULER_NAME:
                raise refuse(key, where)
            return original_fn(self, *args, **kwargs)

        return __init__

    return make


def _critic_optim_type(critic_config) -> Optional[str]:
    optim = getattr(critic_config, "optim", None)
    return optim.get("lr_scheduler_type") if hasattr(optim, "get") else getattr(optim, "lr_scheduler_type", None)


def _lazy(module: str, name: str) -> Callable:
    """``verl_lrstab.<module>.<name>``, imported at its first call (megatron.py needs megatron-core)."""

    def call(*args):
        return getattr(importlib.import_module(f"verl_lrstab.{module}"), name)(*args)

    return call


WRAPS: list = [
    Wrap("verl.workers.config", None, "FSDPOptimizerConfig", None, _make_config, _config_checks,
         also_in=("verl.workers.config.optimizer",)),
    Wrap("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine", "_build_lr_scheduler", ("self", "optimizer"),
         _make_build_lr_scheduler, _engine_checks),
    Wrap("verl.workers.engine_workers", "TrainingWorker", "train_mini_batch", ("self", "data"),
         _make_train_mini_batch, _worker_checks),
    Wrap("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "_update_actor", ("self", "batch", "metrics"),
         _make_v1_update_actor, _v1_trainer_checks),
    Wrap("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", "_update_actor", ("self", "batch"),
         _make_v0_update_actor, _v0_trainer_checks),
    Wrap("verl.trainer.ppo.rollout_corr_helper", None, "compute_rollout_correction_and_add_to_batch",
         ("batch", "rollout_corr_config"), _make_rollout_correction, _rollout_correction_checks,
         also_in=("verl.trainer.ppo.v1.trainer_base",)),
    # verl's Megatron engine: the code lives in verl_lrstab.megatron_config / verl_lrstab.megatron
    Wrap("verl.workers.config", None, "McoreOptimizerConfig", None, _lazy("megatron_config", "make_config"),
         _lazy("megatron_config", "config_checks"), also_in=("verl.workers.config.optimizer",)),
    Wrap("verl.workers.engine.megatron.transformer_impl", "MegatronEngine", "_build_lr_scheduler", ("self",),
         _lazy("megatron", "make_build_lr_scheduler"), _lazy("megatron", "engine_checks")),
    # refusals
    Wrap("verl.workers.config.optimizer", "VeOmniOptimizerConfig", "__post_init__", ("self",),
         _make_post_init_refusal("actor_rollout_ref.actor.optim.lr_scheduler_type",
                                 "the VeOmni engine (VeOmniOptimizerConfig)")),
    Wrap("verl.workers.config.optimizer", "TorchtitanOptimizerConfig", "__init__", ("self",),
         _make_kwarg_refusal("actor_rollout_ref.actor.optim.lr_scheduler_type",
                             "the TorchTitan engine (TorchtitanOptimizerConfig has no lr_scheduler_type)")),
    Wrap("verl.workers.config.critic", "CriticConfig", "__post_init__", ("self",),
         _make_post_init_refusal("critic.optim.lr_scheduler_type", "the critic (role critic, any engine)",
                                 get=_critic_optim_type)),
    Wrap("verl.trainer.sft_trainer", "SFTTrainer", "_build_config", ("self",),
         _make_init_refusal("optim.lr_scheduler_type", "the SFT trainer (verl.trainer.sft_trainer)",
                            get=lambda config: config.optim.lr_scheduler_type)),
    Wrap("verl.trainer.sft_trainer_ray", "SFTTrainer", "_build_config", ("self",),
         _make_init_refusal("optim.lr_scheduler_type", "the SFT trainer (verl.trainer.sft_trainer_ray)",
                            get=lambda config: config.optim.lr_scheduler_type)),
    Wrap("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer.__ray_actor_class__",
         "__init__", ("self", "config", "tokenizer", "role_worker_mapping", "resource_pool_manager"),
         _make_init_refusal("actor_rollout_ref.actor.optim.lr_scheduler_type", "the fully-async trainer "
                            "(verl.experimental.fully_async_policy)",
                            get=lambda config: config.actor_rollout_ref.actor.optim.lr_scheduler_type)),
]


# -- the figures ---------------------------------------------------------------------------------
def response_lengths(data):
    """Per-sample response token counts, as verl's ``response_length/*`` metrics count them.

    V1 sends ``responses`` as a jagged tensor (verl logs ``responses.offsets().diff()`` over the
    samples that are not synthetic padding); V0 sends left/right-padded ``attention_mask`` (verl
    logs ``attention_mask[:, -R:].sum(-1)`` with R the padded response width).
    """
    responses = data.get("responses", None) if hasattr(data, "get") else None
    if responses is not None and getattr(responses, "is_nested", False):
        return _drop_v1_padding(responses.offsets().diff(), data.get("response_mask", None))
    attention_mask, response_mask = data.get("attention_mask", None), data.get("response_mask", None)
    if attention_mask is not None and response_mask is not None and not attention_mask.is_nested:
        width = response_mask.shape[-1]
        return attention_mask[:, -width:].sum(-1)
    raise KeyError("verl_lrstab: the actor batch has neither jagged 'responses' (V1) nor 'attention_mask' with "
                   "'response_mask' (V0), so the response length cannot be measured as verl logs it "
                   f"(response_mask alone would leave out tool tokens); keys: {list(data.keys())}")


def sequence_scores(data):
    """Per-sample scores, the reward summed over the response (verl's ``critic/score/*`` then leave
    out the aborted, empty responses: :func:`global_score_stats` does too).

    V0 sends ``token_level_scores`` (padded, zeros past the response); V1 sends ``rm_scores``
    (jagged, one value per response token), whose synthetic padding samples are left out as
    for the length. None when the batch carries neither (the detector then runs on the length).
    """
    scores = data.get("token_level_scores", None)
    if scores is not None and not scores.is_nested:
        return scores.sum(-1)
    scores = data.get("rm_scores", None)
    if scores is None:
        return None
    if scores.is_nested:
        import torch

        offsets = scores.offsets()
        cumsum = torch.cat([offsets.new_zeros(1, dtype=torch.float64), scores.values().double().cumsum(0)])
        totals = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
        responses = data.get("responses", None)
        if responses is not None and getattr(responses, "is_nested", False):
            keep = _v1_real_samples(responses.offsets().diff(), data.get("response_mask", None))
            if keep is not None and keep.numel() == totals.numel():
                totals = totals[keep]
        return totals
    return scores.sum(-1)


def _v1_real_samples(lengths, response_mask):
    """Boolean mask of the samples that are not V1's synthetic padding (None if it cannot tell)."""
    if response_mask is None or not response_mask.is_nested or response_mask.size(0) != lengths.numel():
        return None
    import torch

    offsets = response_mask.offsets()
    cumsum = torch.cat([offsets.new_zeros(1), response_mask.values().to(offsets.dtype).cumsum(0)])
    masked = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
    return ~((lengths == 1) & (masked == 0))


def _drop_v1_padding(lengths, response_mask):
    """Leave out V1's synthetic padding samples, as verl's metrics do (they skip ``is_padding`` tags).

    The tags do not reach the worker; a padding sample is recognisable by its one response
    token with a zero response mask (``padding_utils.construct_minimal_padding_template``,
    checked by :func:`assumption_checks`), which no real sample has (its first response token
    is always generated, mask 1).
    """
    keep = _v1_real_samples(lengths, response_mask)
    return lengths if keep is None else lengths[keep]


def assumption_checks() -> Iterable[Check]:
    """Behaviour of verl the figures rely on, beyond the wrapped targets (run by check_verl.py and on first use)."""
    import torch

    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template

    sample = {"responses": torch.tensor([5, 6, 7]), "prompts": torch.tensor([1, 2]),
              "input_ids": torch.tensor([1, 2, 5, 6, 7]), "attention_mask": torch.ones(5, dtype=torch.int64),
              "position_ids": torch.arange(5), "response_mask": torch.ones(3, dtype=torch.int64)}
    try:
        pad, tag = construct_minimal_padding_template(sample, {}, eos_token_id=2)
        ok = (tag.get("is_padding") and pad["responses"].numel() == 1 and int(pad["response_mask"].sum()) == 0)
        detail = "" if ok else f"template responses {pad['responses'].tolist()}, mask {pad['response_mask'].tolist()}"
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, repr(exc)
    yield "V1 padding samples have one response token with mask 0 (construct_minimal_padding_template)", ok, detail


_assumptions_checked = False


def _check_assumptions_once() -> None:
    global _assumptions_checked
    if _assumptions_checked:
        return
    failed = [f"{name} ({detail})" for name, ok, detail in assumption_checks() if not ok]
    if failed:
        raise VerlShapeError("verl_lrstab: verl no longer behaves as the length_surge figures assume: "
                             + "; ".join(failed))
    _assumptions_checked = True


def global_length_stats(data, dp_group=None) -> list:
    """``[sum, count]`` of the response lengths over the global batch (all-reduced over ``dp_group``).

    A rank that cannot measure contributes NaN, so every rank gets NaN and skips the step alike.
    """
    import torch

    try:
        lengths = response_lengths(data)
        local = torch.stack([lengths.sum().double(), torch.tensor(float(lengths.numel()), dtype=torch.float64)])
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a metric
        logger.warning("verl_lrstab: could not measure the response length (%s); the step is skipped", exc)
        local = torch.tensor([math.nan, 0.0], dtype=torch.float64)
    return _sum_over_ranks(local, dp_group)


_score_missing_warned = False


def global_score_stats(data, dp_group=None) -> list:
    """``[sum, count]`` of the sequence scores over the global batch (all-reduced over ``dp_group``).

    A batch without scores (or a rank that fails) gives NaN on every rank alike: the detector
    then runs on the length alone this step (``detector: cusum`` loses its learning check).
    """
    global _score_missing_warned
    import torch

    try:
        scores = sequence_scores(data)
        if scores is None:
            raise KeyError(f"neither 'token_level_scores' nor 'rm_scores' in the actor batch (keys: {list(data.keys())})")
        lengths = response_lengths(data)
        if lengths.numel() != scores.numel():
            raise ValueError(f"{scores.numel()} scores for {lengths.numel()} responses")
        scores = scores[lengths > 0].double()  # verl's critic/score/* leave out aborted (empty) responses
        local = torch.stack([scores.sum(), torch.tensor(float(scores.numel()), dtype=torch.float64)])
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a co-signal
        if not _score_missing_warned:
            _score_missing_warned = True
            logger.warning("verl_lrstab: no score for the surge detector (%s); it runs on the length alone", exc)
        local = torch.tensor([math.nan, 0.0], dtype=torch.float64)
    return _sum_over_ranks(local, dp_group)


def _sum_over_ranks(local, dp_group) -> list:
    """``local`` (a float64 ``[sum, count]``) summed over ``dp_group``, as a list."""
    import torch.distributed as dist

    if _distributed(dp_group):
        reduced = local.to(_collective_device(dp_group))
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=dp_group)
        local = reduced.cpu()
    return local.tolist()


def global_mean_response_length(data, dp_group=None) -> float:
    """Mean response length over the global batch: local sums all-reduced over ``dp_group``."""
    total, count = global_length_stats(data, dp_group)
    return total / count if count > 0 else math.nan


def global_mismatch_stats(data, dp_group=None, pre_rejection_stats=None):
    """The global mismatch stats tensor (``mismatch.STAT_FIELDS``), or None on every rank alike.

    ``pre_rejection_stats`` (measured by the driver over the whole batch before rejection
    sampling overwrote ``response_mask``) wins over the worker's own measurement. Otherwise a
    validity flag is all-reduced with the sums: if any rank could not compute, every rank gets
    None, so every rank takes the same decision and keeps the same LR.
    """
    import torch
    import torch.distributed as dist

    from verl_lrstab import mismatch

    if pre_rejection_stats is not None:
        return torch.tensor(list(pre_rejection_stats), dtype=torch.float64)
    if "rollout_log_probs" not in data.keys() or "old_log_probs" not in data.keys():
        mismatch.warn_once("missing")
        return None
    try:
        stats = mismatch.compute_stats(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a metric
        logger.warning("verl_lrstab: could not compute the mismatch figures (%s); none logged this step", exc)
        stats = None
    invalid = 1.0 if stats is None else 0.0
    n_fields = len(mismatch.STAT_FIELDS)
    if stats is None:
        stats = torch.zeros(n_fields, dtype=torch.float64)
    # sums, then the invalid-rank count (SUM), then the max (MAX)
    packed = torch.cat([stats[:-1].double(), torch.tensor([invalid], dtype=torch.float64), stats[-1:].double()])
    if _distributed(dp_group):
        packed = packed.to(_collective_device(dp_group))
        dist.all_reduce(packed[:-1], op=dist.ReduceOp.SUM, group=dp_group)
        dist.all_reduce(packed[-1:], op=dist.ReduceOp.MAX, group=dp_group)
        packed = packed.cpu()
    if packed[-2].item() > 0:
        mismatch.warn_once("missing")
        return None
    return torch.cat([packed[:-2], packed[-1:]])


def global_mismatch_metrics(data, dp_group=None, pre_rejection_stats=None):
    """``mismatch/*`` over the global batch, or None (on every rank alike) when it cannot be measured."""
    acc = StepAccumulator()
    acc.add([0.0, 0.0], global_mismatch_stats(data, dp_group, pre_rejection_stats))
    return acc.result()[1]


def _distributed(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _collective_device(group):
    """The device the group's backend reduces on: verl's current accelerator, or the CPU for gloo."""
    import torch
    import torch.distributed as dist

    from verl.utils.device import get_device_name, get_torch_device

    name = get_device_name()
    if name == "cpu" or str(dist.get_backend(group)).lower() == "gloo":
        return torch.device("cpu")
    return torch.device(name, int(get_torch_device().current_device()))  # this rank's device, not device 0


def _with_metrics(output, extra: dict):
    """Return verl's ``train_mini_batch`` output with ``extra`` added to its metrics."""
    if output is None:  # ranks that do not report
        return output
    from verl.utils import tensordict_utils as tu

    metrics = dict(tu.get(output, "metrics"))
    for key, value in extra.items():
        metrics[key] = [value]
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()
