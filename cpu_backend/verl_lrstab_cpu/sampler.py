"""A V1 replay buffer that hands the trainer each batch in a content-defined order.

verl's V1 trainer (``trainer.use_v1=true``, sync mode) trains on the samples in the order
they reached TransferQueue, i.e. the order in which the agent loop happened to finish
them, and its sample keys start with a random ``uuid4``. The loss and the weight
gradients sum over the batch's rows, so a different row order rounds differently
(measured on the CPU backend: two runs with identical samples already differ in
``actor/pg_loss`` at step 1, ~6e-8 relative) and the runs drift apart until a sampled
token flips. V0 keeps the dataloader's order and has no such drift. A second, rarer
timing dependence: two prompts of a batch with the same text (the dataset repeats a few)
get their ``2n`` samples from the rollout as identical requests, so which sample lands
in which group depends on arrival order too.

:class:`ContentOrderedReplayBuffer` is verl's own sync ``ReplayBuffer`` with one change:
the selected batch is sorted by its content (groups by their prompt and sorted responses,
rows within a group by their response), so the same samples give the same batch
whatever the timing. Rows left tied are identical in content and advantage, so their
order does not matter. Groups of the same prompt pool their samples and split them
again by a pseudo-random shuffle seeded by the pooled content (:func:`regroup`; the
groups stay i.i.d. draws, their ``uid`` is rewritten in TransferQueue). Select it with
verl's own extension point::

    trainer.v1.sampler.custom_sampler.path=pkg://verl_lrstab_cpu.sampler
    trainer.v1.sampler.custom_sampler.name=ContentOrderedReplayBuffer

Cost: one extra TransferQueue read of the batch's prompt and response ids per step.
verl hands a custom sampler no DAPO / failed-group refill settings, so it refuses the
async trainer modes it does not cover.
"""

from __future__ import annotations

import logging
import random

import transfer_queue as tq
from tensordict import NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from .generation import request_seed

logger = logging.getLogger(__name__)


def _rows(values) -> list[tuple[int, ...]]:
    """Token ids of each row of a (jagged or padded) TransferQueue tensor field."""
    rows = values.unbind(0) if getattr(values, "is_nested", False) else list(values)
    return [tuple(int(t) for t in row.reshape(-1).tolist()) for row in rows]


def _strings(values) -> list[str]:
    """A non-tensor TransferQueue field (NonTensorStack or the list tensordict hands out) as strings."""
    return [str(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def content_order(uids: list[str], prompts: list[tuple], responses: list[tuple]) -> list[int]:
    """Row indices in content order: groups by (prompt, sorted responses), then rows by response.

    Args:
        uids: group id of each row (verl's ``uid``, random per run: used only to group).
        prompts, responses: token ids of each row.

    Returns:
        A permutation of ``range(len(uids))`` that depends only on the rows' content.
    """
    members: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        members.setdefault(uid, []).append(i)
    signature = {uid: (prompts[rows[0]], tuple(sorted(responses[i] for i in rows))) for uid, rows in members.items()}
    return sorted(range(len(uids)), key=lambda i: (signature[uids[i]], responses[i]))


def regroup(uids: list[str], prompts: list[tuple], responses: list[tuple]) -> list[str]:
    """Each row's group after re-splitting the samples of groups that share a prompt.

    The pooled samples are sorted, shuffled by a generator seeded from the pooled content and
    dealt back in the groups' sizes: the split depends on the content only, and is as random
    as an arrival order.

    Returns:
        The new ``uid`` of every row (unchanged for a prompt with one group).
    """
    members: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        members.setdefault(uid, []).append(i)
    by_prompt: dict[tuple, list[str]] = {}
    for uid, rows in members.items():
        by_prompt.setdefault(prompts[rows[0]], []).append(uid)
    new = list(uids)
    for prompt, group in by_prompt.items():
        if len(group) < 2:
            continue
        pool = sorted((i for uid in group for i in members[uid]), key=lambda i: responses[i])
        random.Random(request_seed("regroup", prompt, [responses[i] for i in pool])).shuffle(pool)
        start = 0
        for uid, size in zip(sorted(group), sorted(len(members[u]) for u in group)):
            for i in pool[start : start + size]:
                new[i] = uid
            start += size
    return new


class ContentOrderedReplayBuffer(ReplayBuffer):
    """verl's sync ``ReplayBuffer``; each batch comes out in :func:`content_order`."""

    def _validate_mode_config(self) -> None:
        if self.trainer_mode != "sync":
            raise ValueError(
                f"{type(self).__name__} (trainer.v1.sampler.custom_sampler) supports trainer.v1 mode 'sync' "
                f"only, got {self.trainer_mode!r}"
            )
        super()._validate_mode_config()

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot) -> KVBatchMeta:
        batch = super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)
        if len(batch.keys) < 2:
            return batch
        data = tq.kv_batch_get(keys=batch.keys, partition_id=partition_id, select_fields=["uid", "prompts", "responses"])
        uids, prompts, responses = _strings(data["uid"]), _rows(data["prompts"]), _rows(data["responses"])
        if partition_id != "val":
            new = regroup(uids, prompts, responses)
            changed = [i for i, (a, b) in enumerate(zip(uids, new)) if a != b]
            if changed:
                fields = TensorDict({"uid": NonTensorStack(*[new[i] for i in changed])}, batch_size=[len(changed)])
                tq.kv_batch_put(keys=[batch.keys[i] for i in changed], partition_id=partition_id, fields=fields)
                logger.info("verl_lrstab: %d samples of repeated prompts moved to another group (content order)",
                            len(changed))
            uids = new
        batch.reorder(content_order(uids, prompts, responses))
        return batch
