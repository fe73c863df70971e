"""`lr_scheduler_type: length_surge` through verl's real Hydra config and config dataclasses."""

import subprocess
import sys
import textwrap

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException

from verl.utils.config import omega_conf_to_dataclass
from verl_lrstab.config import LengthSurgeConfig

OPTIM = "actor_rollout_ref.actor.optim"


def actor_config(*overrides):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer",
                      overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_name_alone_selects_the_paper_defaults():
    optim = actor_config(f"{OPTIM}.lr_scheduler_type=length_surge", f"{OPTIM}.lr=1e-6").optim
    assert optim.lr_scheduler_type == "length_surge" and optim.lr == 1e-6
    assert optim.length_surge == LengthSurgeConfig()
    assert (optim.length_surge.period_factor, optim.length_surge.gamma, optim.length_surge.min_lr_ratio) == (1.8, 0.5, 0.1)


def test_options_with_plus_on_stock_config():
    optim = actor_config(
        f"{OPTIM}.lr_scheduler_type=length_surge",
        f"+{OPTIM}.length_surge.period_factor=1.2",
        f"+{OPTIM}.length_surge.origin=surge",
        f"+{OPTIM}.length_surge.gamma=0.7",
    ).optim
    assert optim.length_surge.period_factor == 1.2 and optim.length_surge.origin == "surge"
    assert optim.length_surge.gamma == 0.7
    # a fixed decay_period (period_factor is then never read: refused, tests/test_glue_guarantees.py)
    assert actor_config(f"{OPTIM}.lr_scheduler_type=length_surge",
                        f"+{OPTIM}.length_surge.decay_period=50").optim.length_surge.decay_period == 50


def test_stock_config_is_unchanged():
    from verl.workers.config import optimizer

    optim = actor_config().optim  # verl's own class, built by verl's own checks (the plugin's is not involved)
    assert type(optim) is optimizer.FSDPOptimizerConfig._lrstab_original and optim.lr_scheduler_type == "constant"
    assert not hasattr(optim, "length_surge")


@pytest.mark.parametrize(
    "override,message",
    [
        (f"{OPTIM}.lr_scheduler_type=length_surgee", r"lr_scheduler_type='length_surgee'.*\['constant', 'cosine', 'length_surge'\]"),
        (f"+{OPTIM}.length_surge.period_factor=-1", r"length_surge\.period_factor=-1.*allowed values are a number in \(0, 1000\]"),
        (f"+{OPTIM}.length_surge.min_lr_ratio=0", r"length_surge\.min_lr_ratio=0.*\(0, 1\]"),
        (f"+{OPTIM}.length_surge.gamma=1.5", r"length_surge\.gamma=1\.5.*\(0, 1\)"),
        (f"+{OPTIM}.length_surge.decay_period=0", r"length_surge\.decay_period=0.*an integer in \[1, 10000000\]"),
        (f"+{OPTIM}.length_surge.origin=end", r"length_surge\.origin='end'.*\['start', 'surge'\]"),
        (f"+{OPTIM}.length_surge.ratio=2", r"unknown key.*length_surge\.ratio.*allowed keys"),
    ],
)
def test_bad_config_names_key_and_allowed_values(override, message):
    overrides = [f"{OPTIM}.lr_scheduler_type=length_surge", override]
    with pytest.raises((InstantiationException, ValueError), match=message):
        actor_config(*overrides)


@pytest.mark.parametrize(
    "override,message",
    [
        # verl's cosine-only options: length_surge does not read them (its floor is length_surge.min_lr_ratio)
        (f"{OPTIM}.min_lr_ratio=0.2", r"min_lr_ratio=0\.2 is not read by lr_scheduler_type=length_surge.*"
                                      r"allowed values are \[None, 0\.0\]"),
        (f"{OPTIM}.num_cycles=1.0", r"num_cycles=1\.0 is not read by lr_scheduler_type=length_surge.*\[0\.5\]"),
        (f"{OPTIM}.zero_indexed_step=false",
         r"zero_indexed_step=False is not read by lr_scheduler_type=length_surge.*\[True\]"),
        # options the training glue never feeds
        (f"+{OPTIM}.length_surge.max_surges=2",
         r"length_surge\.max_surges=2 is invalid in training: allowed values are its default 1"),
    ],
)
def test_options_length_surge_does_not_read_are_refused(override, message):
    with pytest.raises((InstantiationException, ValueError), match=message):
        actor_config(f"{OPTIM}.lr_scheduler_type=length_surge", override)
    if ".length_surge." not in override:  # verl's own options: accepted by verl's own schedules
        assert actor_config(f"{OPTIM}.lr_scheduler_type=cosine", override).optim.lr_scheduler_type == "cosine"


def test_warmup_style_length_surge_is_refused():
    # warmup_style is verl's deprecated alias: naming length_surge there is refused, not aliased
    with pytest.raises((InstantiationException, ValueError),
                       match=r"warmup_style='length_surge' is not supported.*lr_scheduler_type=length_surge"):
        actor_config(f"{OPTIM}.warmup_style=length_surge")
    assert actor_config(f"{OPTIM}.warmup_style=cosine").optim.lr_scheduler_type == "cosine"  # verl's alias


def test_verls_own_checks_still_apply_to_length_surge():
    # the subclass runs verl's __post_init__ (with constant in place of the name): its checks hold
    optim = actor_config(f"{OPTIM}.lr_scheduler_type=length_surge", f"+{OPTIM}.grad_clip=0.5").optim
    assert optim.clip_grad == 0.5 and optim.lr_scheduler_type == "length_surge"


def test_options_without_the_name_warn():
    with pytest.warns(UserWarning, match="length_surge options are ignored"):
        actor_config(f"+{OPTIM}.length_surge.period_factor=1.2")


def run_python(code, **env):
    import os

    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=120)


@pytest.mark.parametrize("broken,target", [
    ("verl_lrstab.glue.registry", "verl_lrstab.glue (the glue itself)"),
    ("verl_lrstab.detectors", "the package module verl_lrstab.detectors"),
])
def test_failed_plugin_is_not_silent_when_the_scheduler_is_named(broken, target):
    # Make a module of the glue unimportable, as a broken install would: verl swallows the plugin
    # error, but naming the scheduler must then fail with the cause.
    proc = run_python(
        f"""
        import sys
        sys.modules[{broken!r}] = None  # ImportError on import
        import verl
        from verl.workers.config import FSDPOptimizerConfig
        FSDPOptimizerConfig(lr=1e-6)  # other names are unaffected
        try:
            FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge")
        except RuntimeError as exc:
            print("RAISED:", type(exc).__name__, exc)
        """
    )
    assert "RAISED: GlueUnavailable" in proc.stdout, proc.stderr
    assert "length_surge cannot be used: the verl-lrstab plugin failed to load" in proc.stdout
    assert f"{target}: ModuleNotFoundError" in proc.stdout and "verl 0.9.1" in proc.stdout, proc.stdout
    # logged once at ERROR (verl itself would log a failing plugin at debug level only)
    assert proc.stderr.count(f"verl-lrstab: cannot use {target} with verl 0.9.1: ModuleNotFoundError") == 1, proc.stderr


def test_explicit_target_works_with_plugins_disabled():
    proc = run_python(
        """
        from hydra import compose, initialize_config_module
        from verl.utils.config import omega_conf_to_dataclass
        import verl.workers.engine.fsdp.transformer_impl as impl
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=[
                "actor_rollout_ref.actor.optim._target_=verl_lrstab.glue.configs.LengthSurgeOptimizerConfig",
                "actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge"])
        optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
        print("OK", type(optim).__name__, getattr(impl.FSDPEngine._build_lr_scheduler, "_lrstab_original", None) is not None)
        """,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert "OK LengthSurgeOptimizerConfig True" in proc.stdout, proc.stderr


def test_the_clip_rise_is_an_option_in_training_now_that_the_glue_feeds_the_clip_ratio():
    cfg = actor_config(f"{OPTIM}.lr_scheduler_type=length_surge", f"+{OPTIM}.length_surge.cusum_clip_rise=0.5")
    from verl_lrstab.glue.configs import length_surge_options

    assert length_surge_options(cfg.optim.length_surge).cusum_clip_rise == 0.5
