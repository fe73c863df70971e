"""The node probe (``glue/nodes.py``), as Ray runs it on each node: shipped by value (a node without the
package can run it), it says whether verl would load the plugin there. The two-node Ray forms are in
``tests/e2e/test_ray_nodes_e2e.py``."""

from __future__ import annotations

import importlib.metadata
import pickle

from ray import cloudpickle  # what Ray ships a task with
import pytest

from verl_lrstab.glue import nodes


def probe():
    # as Ray ships it: by value, nothing of this package referenced
    blob = cloudpickle.dumps(nodes._by_value(nodes._probe))
    assert b"verl_lrstab.glue" not in blob
    return pickle.loads(blob)()


def test_a_node_where_verl_loads_the_plugin_passes(monkeypatch):
    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    answer = probe()
    assert answer["ok"] and answer["version"] == importlib.metadata.version("verl-lrstab"), answer


@pytest.mark.parametrize("policy, passes", [("none", False), ("verl_lrstab", False), ("lrstab", True),
                                            ("other, lrstab", True), ("AUTO", True)])
def test_the_plugin_switch_is_read_as_verl_reads_it(monkeypatch, policy, passes):
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", policy)
    answer = probe()
    assert answer["ok"] is passes, answer
    if not passes:
        assert f"VERL_USE_EXTERNAL_PLUGINS={policy} leaves the plugin out (its entry point is lrstab)" == \
            answer["error"]


def test_a_package_on_a_path_without_its_entry_point_fails_there(monkeypatch):
    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [ep for ep in real(**kw) if ep.value.split(":")[0] != "verl_lrstab._entry"])
    answer = probe()
    assert not answer["ok"] and "its verl.plugins entry point is not installed" in answer["error"], answer
