"""`lr_decay_style: length_surge` through verl's real Megatron trainer config and engine code.

verl's ``ppo_megatron_trainer`` YAML composed with Hydra, ``McoreOptimizerConfig`` built by verl's
``omega_conf_to_dataclass``, verl's own scheduler builder as the reference for warmup and
decay steps, the plugin's wrap of ``MegatronEngine._build_lr_scheduler`` and the rename
simulation (a renamed Megatron target never breaks a stock Megatron run).
"""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
import torch  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from megatron.core.optimizer.optimizer import ChainedOptimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl_lrstab.config import LengthSurgeConfig  # noqa: E402
from verl_lrstab.megatron import LengthSurgeParamScheduler, build_length_surge_param_scheduler  # noqa: E402
from verl_lrstab.glue.configs import LengthSurgeMcoreOptimizerConfig  # noqa: E402

OPTIM = "actor_rollout_ref.actor.optim"


def megatron_actor(*overrides):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer",
                      overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def optimizer():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    inner = torch.optim.AdamW([{"params": [params[0]], "wd_mult": 1.0}, {"params": [params[1]], "wd_mult": 0.0}])
    return ChainedOptimizer([inner])


# -- config ------------------------------------------------------------------------------------
def test_megatrons_own_key_selects_the_paper_defaults_and_exact_resume():
    actor = megatron_actor(f"{OPTIM}.lr_decay_style=length_surge", f"{OPTIM}.lr=1e-6")
    optim = actor.optim
    assert actor.strategy == "megatron" and isinstance(optim, LengthSurgeMcoreOptimizerConfig)
    assert optim.lr_decay_style == "length_surge" and optim.length_surge == LengthSurgeConfig()
    # verl's YAML default is false (a resumed run restarts its schedule): length_surge turns it on.
    assert optim.use_checkpoint_opt_param_scheduler is True


def test_fsdp_key_and_options_node_work_on_megatron_too():
    optim = megatron_actor(f"+{OPTIM}.lr_scheduler_type=length_surge", f"+{OPTIM}.length_surge.origin=start",
                           f"+{OPTIM}.length_surge.decay_period=50").optim
    assert optim.lr_decay_style == "length_surge"
    assert optim.length_surge.origin == "start" and optim.length_surge.decay_period == 50


def test_stock_megatron_config_is_unchanged():
    optim = megatron_actor().optim
    # verl's own class, built by verl's own checks
    assert type(optim) is LengthSurgeMcoreOptimizerConfig._lrstab_original and optim.lr_decay_style == "constant"
    assert not hasattr(optim, "length_surge") and not hasattr(optim, "lr_scheduler_type")
    assert optim.use_checkpoint_opt_param_scheduler is False
    optim = megatron_actor(f"{OPTIM}.lr_decay_style=cosine", f"{OPTIM}.use_checkpoint_opt_param_scheduler=true").optim
    assert optim.lr_decay_style == "cosine" and optim.use_checkpoint_opt_param_scheduler is True


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([f"{OPTIM}.lr_decay_style=length-surge"],
         r"lr_decay_style='length-surge' is not supported: allowed values are \['constant', 'linear', 'cosine', "
         r"'inverse-square-root', 'WSD', 'length_surge'\]"),
        ([f"+{OPTIM}.lr_scheduler_type=cosine"], r"lr_scheduler_type='cosine' is not supported on Megatron"),
        ([f"+{OPTIM}.lr_scheduler_type=length_surge", f"{OPTIM}.lr_decay_style=cosine"],
         r"lr_scheduler_type='length_surge' conflicts with .*lr_decay_style='cosine'"),
        ([f"{OPTIM}.lr_decay_style=length_surge", f"+{OPTIM}.length_surge.gamma=1.5"],
         r"length_surge\.gamma=1\.5.*\(0, 1\)"),
        ([f"{OPTIM}.lr_decay_style=length_surge", f"+{OPTIM}.length_surge.ratio=2"],
         r"unknown key.*length_surge\.ratio.*allowed keys"),
        ([f"{OPTIM}.lr_decay_style=length_surge", f"+{OPTIM}.length_surge.max_surges=2"],
         r"length_surge\.max_surges=2 is invalid in training: allowed values are its default 1"),
        ([f"{OPTIM}.lr_decay_style=length_surge", f"{OPTIM}.min_lr=1e-7"],  # never read (FSDP's
         r"optim\.min_lr=1e-07 is not read by lr_decay_style=length_surge: allowed values are \[0\.0\]"),  # min_lr_ratio too)
    ],
)
def test_bad_megatron_config_names_key_and_allowed_values(overrides, message):
    with pytest.raises((InstantiationException, ValueError), match=message):
        megatron_actor(*overrides)


def test_options_without_the_name_warn():
    with pytest.warns(UserWarning, match="length_surge options are ignored"):
        megatron_actor(f"+{OPTIM}.length_surge.period_factor=1.2")


# -- the scheduler verl's engine gets ------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    [],  # ratio 0, warmup -1: no warmup
    [f"{OPTIM}.lr_warmup_steps=5", f"{OPTIM}.lr_warmup_init=1e-8"],
    [f"{OPTIM}.lr_warmup_steps_ratio=0.1"],
    [f"{OPTIM}.lr_warmup_steps_ratio=0.1", f"{OPTIM}.lr_decay_steps=50"],  # (min_lr: refused, never read)
])
def test_builder_resolves_steps_as_verls_own_builder(overrides):
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler

    base = [f"{OPTIM}.lr=1e-6", f"{OPTIM}.total_training_steps=200", f"{OPTIM}.weight_decay=0.1", *overrides]
    stock = get_megatron_optimizer_param_scheduler(optimizer(), megatron_actor(*base).optim)
    ours = build_length_surge_param_scheduler(optimizer(), megatron_actor(f"{OPTIM}.lr_decay_style=length_surge",
                                                                           *base).optim)
    keys = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "start_wd", "end_wd",
            "wd_incr_steps", "wd_incr_style")
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(stock, k) for k in keys}
    assert isinstance(ours, OptimizerParamScheduler) and ours.use_checkpoint_opt_param_scheduler
    for _ in range(30):  # no surge: Megatron's constant schedule, warmup included
        stock.step(1)
        ours.step(1, response_length=100.0)
    if stock.lr_decay_style == "constant":
        assert [g["lr"] for g in ours.optimizer.param_groups] == [g["lr"] for g in stock.optimizer.param_groups]
    assert [g["weight_decay"] for g in ours.optimizer.param_groups] == [0.1, 0.0]


def test_builder_refuses_a_config_that_would_not_resume():
    class Plain(dict):  # verl's stock config object, not ours: the flag was not turned on
        __getattr__ = dict.__getitem__

    config = Plain(lr=1e-6, lr_warmup_init=0.0, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.0, lr_decay_steps=None,
                   min_lr=0.0, weight_decay=0.01, weight_decay_incr_style="constant", total_training_steps=10,
                   use_checkpoint_opt_param_scheduler=False, length_surge=None)
    with pytest.raises(ValueError, match="use_checkpoint_opt_param_scheduler=False.*Allowed values: true"):
        build_length_surge_param_scheduler(optimizer(), config)


# -- the glue: verl's MegatronEngine and TrainingWorker ----------------------------------------------
def engine_with(optim_config):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    engine = object.__new__(MegatronEngine)  # the method needs only these two attributes
    engine.optimizer_config, engine.optimizer = optim_config, optimizer()
    return engine


def test_wrapped_engine_builds_ours_only_for_length_surge():
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    assert getattr(MegatronEngine._build_lr_scheduler, "_lrstab_original", None) is not None
    base = [f"{OPTIM}.total_training_steps=100"]
    ours = engine_with(megatron_actor(f"{OPTIM}.lr_decay_style=length_surge", *base).optim)._build_lr_scheduler()
    stock = engine_with(megatron_actor(*base).optim)._build_lr_scheduler()
    assert type(ours) is LengthSurgeParamScheduler and type(stock) is OptimizerParamScheduler


def test_worker_glue_feeds_the_megatron_scheduler():
    from verl_lrstab.glue import worker

    scheduler = engine_with(megatron_actor(f"{OPTIM}.lr_decay_style=length_surge",
                                           f"{OPTIM}.total_training_steps=100").optim)._build_lr_scheduler()

    class Worker:
        engine = type("Engine", (), {"lr_scheduler": scheduler})()

    assert worker._engine_has_our_scheduler(Worker()) is True
    Worker.engine.lr_scheduler = OptimizerParamScheduler(
        optimizer(), init_lr=0.0, max_lr=1e-6, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant")
    assert worker._engine_has_our_scheduler(Worker()) is False  # a stock scheduler: verl's own path


RENAME = """
import logging, sys
logging.basicConfig(level=logging.ERROR, stream=sys.stdout, format="%(levelname)s %(message)s")
# verl renames the method before the plugin sees it (as a future verl might).
import verl.workers.engine.megatron.transformer_impl as impl
impl.MegatronEngine._build_lr_scheduler_v2 = impl.MegatronEngine._build_lr_scheduler
del impl.MegatronEngine._build_lr_scheduler
from verl_lrstab.glue import registry
registry.install()
from hydra import compose, initialize_config_module
from verl.utils.config import omega_conf_to_dataclass
def actor(*o):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer",
                      overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *o])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
stock = actor("actor_rollout_ref.actor.optim.total_training_steps=10").optim
print("STOCK", type(stock).__name__, stock.lr_decay_style)
try:
    actor("actor_rollout_ref.actor.optim.lr_decay_style=length_surge")
    print("LENGTH_SURGE accepted")
except Exception as exc:
    print("LENGTH_SURGE refused:", exc)
"""


def test_renamed_megatron_target_never_breaks_a_stock_run():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RENAME)], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR verl-lrstab: cannot use verl.workers.engine.megatron.transformer_impl.MegatronEngine." \
           "_build_lr_scheduler with verl 0.9.1: " in out
    assert "STOCK McoreOptimizerConfig constant" in out  # the stock config still builds (verl's own class)
    assert "LENGTH_SURGE refused:" in out and "cannot be used: the verl-lrstab plugin failed" in out
