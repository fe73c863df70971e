"""The CPU backend's ``gloo`` checkpoint engine, as verl's ``CheckpointEngineManager`` drives one: built through
verl's own ``CheckpointEngineRegistry``, prepare -> build_topology -> init_process_group -> send / receive ->
finalize, the actor's rank 0 and a rollout worker in two processes, two syncs in a row."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import torch

import verl_lrstab_cpu  # noqa: F401  (registers the engine once verl.checkpoint_engine imports)


def weights(step: int) -> list:
    gen = torch.Generator().manual_seed(step)
    return [("model.embed.weight", torch.randn(5, 3, generator=gen)),
            ("lm_head.bias", torch.randn(4, generator=gen, dtype=torch.float64)),
            ("step", torch.tensor([step], dtype=torch.int64))]


def _engine(is_master: bool):
    from verl.checkpoint_engine import CheckpointEngineRegistry

    return CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20, is_master=is_master)


def _actor(conn):
    engine = _engine(True)
    for step in (1, 2):
        conn.send(engine.prepare())
        kwargs = conn.recv()
        engine.init_process_group(**kwargs)
        asyncio.run(engine.send_weights(iter(weights(step)), global_steps=step))
        engine.finalize()
    conn.send("done")


def _rollout(conn):
    engine = _engine(False)
    for _ in (1, 2):
        engine.prepare()
        kwargs = conn.recv()
        engine.init_process_group(**kwargs)
        conn.send([(name, t.clone()) for name, t in engine.receive_weights()])
        engine.finalize()


def _recv(conn, timeout: float = 60.0):
    """A message from a child, or a failure (never a hung test: a child that died sends nothing)."""
    if not conn.poll(timeout):
        raise TimeoutError("no message from the child process within 60 s (it failed: see its stderr)")
    return conn.recv()


def test_the_gloo_engine_carries_every_tensor_from_actor_rank_0_to_the_rollout():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get("gloo")
    ctx = mp.get_context("fork")  # the children start at once: verl is imported already
    actor_conn, actor_end = ctx.Pipe()
    rollout_conn, rollout_end = ctx.Pipe()
    procs = [ctx.Process(target=_actor, args=(actor_end,)), ctx.Process(target=_rollout, args=(rollout_end,))]
    for p in procs:
        p.start()
    try:
        for step in (1, 2):
            master = _recv(actor_conn)
            actor_kwargs, rollout_kwargs = cls.build_topology(2, 1, [master, {}])
            assert actor_kwargs["rank"] == [0, -1] and rollout_kwargs["rank"] == [1]  # actor rank 1 sits it out
            actor_conn.send({k: v[0] for k, v in actor_kwargs.items()})
            rollout_conn.send({k: v[0] for k, v in rollout_kwargs.items()})
            received = _recv(rollout_conn)
            sent = weights(step)
            assert [n for n, _ in received] == [n for n, _ in sent]
            for (_, a), (_, b) in zip(received, sent):
                assert a.dtype == b.dtype and torch.equal(a, b)
        assert _recv(actor_conn) == "done"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)


def test_an_actor_rank_outside_the_group_only_walks_the_generator():
    engine = _engine(False)
    engine.init_process_group(rank=-1, world_size=2, master={})
    walked = []

    def gen():
        for item in weights(0):
            walked.append(item[0])
            yield item

    asyncio.run(engine.send_weights(gen()))
    assert walked == [n for n, _ in weights(0)]
