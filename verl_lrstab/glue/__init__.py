"""The only code that knows verl's internals (verl 0.9.x), a module a concern.

- :mod:`.imports`: run a hook right after a module is imported, never breaking the import.
- :mod:`.failsafe`: what a failure of the glue does (report loudly, refuse ``length_surge``).
- :mod:`.wraps`: how one verl attribute is replaced, checked and dispatched.
- :mod:`.registry`: the list of targets, their installation, what a ``length_surge`` run requires.
- :mod:`.configs`: verl's optimizer configs accepting ``length_surge`` (FSDP, Megatron): built, and by name.
- :mod:`.engine`: the engines build our scheduler.
- :mod:`.worker`: the actor update (``TrainingWorker.train_mini_batch``) and the old-log-prob pass.
- :mod:`.batch_figures`: the batch's figures, measured as verl logs them, over the global batch (one collective).
- :mod:`.steps`: one trainer step's state, and an update from its figures to verl's, in both modes.
- :mod:`.update_metrics`: verl's update metrics: the co-signals read from them (one collective), fed; the step's
  figures added to them.
- :mod:`.driver`: the trainer-side checks and tags (V0, V1), pre-rejection mismatch.
- :mod:`.nodes`: every node of the run's Ray cluster imports the package (checked by the driver).
- :mod:`.refusals`: where ``length_surge`` is refused by name.

Importing this package does nothing; the ``verl.plugins`` entry point (``verl_lrstab._entry``)
installs the glue.
"""
