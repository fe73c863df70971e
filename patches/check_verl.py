"""Check that the three verl functions verl-lrstab wraps still have the expected shape.

Exit status 0 when every check passes; otherwise one line per failed check and status 1.
"""

from __future__ import annotations

import inspect
import sys


def _source(obj) -> str:
    return inspect.getsource(obj)


def checks():
    """Yield (name, ok, detail) for each assumption the glue makes about verl."""
    import verl
    from verl.workers.config import optimizer as optim_mod
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers import engine_workers

    yield "verl version 0.9.x", verl.__version__.startswith("0.9."), verl.__version__

    original_cfg = optim_mod.FSDPOptimizerConfig
    # The plugin may already have replaced it; look at verl's own class.
    while original_cfg.__module__ != "verl.workers.config.optimizer":
        original_cfg = original_cfg.__mro__[1]
    fields = set(original_cfg.__dataclass_fields__)
    needed = {"lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "total_training_steps", "warmup_style"}
    yield "1 FSDPOptimizerConfig fields", needed <= fields, sorted(needed - fields)
    yield ("1 FSDPOptimizerConfig asserts the scheduler name",
           '"constant", "cosine"' in _source(original_cfg.__post_init__), "assert not found")

    engine = transformer_impl.FSDPEngine
    build = getattr(engine._build_lr_scheduler, "__wrapped__", engine._build_lr_scheduler)
    yield ("2 FSDPEngine._build_lr_scheduler(self, optimizer)",
           list(inspect.signature(build).parameters) == ["self", "optimizer"], str(inspect.signature(build)))
    yield ("2 unknown names raise NotImplementedError", "NotImplementedError" in _source(build), "")
    yield ("2 initialize() hands the scheduler to FSDPCheckpointManager",
           "lr_scheduler=self.lr_scheduler" in _source(engine.initialize), "")
    yield ("2 lr_scheduler_step() calls step() with no argument",
           "self.lr_scheduler.step()" in _source(engine.lr_scheduler_step), "")

    worker = engine_workers.TrainingWorker
    mini = getattr(worker.train_mini_batch, "__wrapped__", worker.train_mini_batch)
    yield ("3 TrainingWorker.train_mini_batch(self, data)",
           list(inspect.signature(mini).parameters) == ["self", "data"], str(inspect.signature(mini)))
    yield ("3 train_mini_batch steps the scheduler on its last mini-batch only",
           "update_lr_scheduler=batch_idx == total_num_iterations - 1" in _source(mini), "")
    yield ("3 train_mini_batch returns metrics under 'metrics'", '"metrics": metrics' in _source(mini), "")
    yield ("3 train_batch calls engine.lr_scheduler_step()",
           "self.engine.lr_scheduler_step()" in _source(worker.train_batch), "")


def main() -> int:
    failed = 0
    for name, ok, detail in checks():
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail and not ok else ""))
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
