"""Roles over several nodes: `topology.placement` and its refusals, and the address the vLLM
adapter group rendezvouses on (learner rank 0's node, never loopback unless the job is local)."""
import socket

import pytest

from colocate.config import ConfigError, load_config
from colocate.engine import vllm_channel
from colocate.preflight import check_placement
from colocate.topology import place_roles


def cfg(**topology):
    return load_config(None, {"topology": topology, "rollout": {"groups_per_step": 8, "batch_size": 64}})


def test_by_node_fills_the_first_nodes_with_inference():
    assert place_roles(cfg(num_inference=2, placement="by_node"), 4, 2) == \
        ["inference", "inference", "learner", "learner"]
    assert place_roles(cfg(num_inference=4, placement="by_node"), 8, 2)[:4] == ["inference"] * 4


def test_interleaved_puts_both_roles_on_every_node():
    assert place_roles(cfg(num_inference=2, placement="interleaved"), 4, 2) == \
        ["inference", "learner", "inference", "learner"]


def test_one_node_ignores_the_placement():
    for placement in ("by_node", "interleaved"):
        assert place_roles(cfg(num_inference=1, placement=placement), 4, 4) == ["inference"] + ["learner"] * 3


@pytest.mark.parametrize("topology,world,local,message", [
    ({"num_inference": 1, "placement": "by_node"}, 4, 2, "do not fill whole nodes"),
    ({"num_inference": 1, "placement": "interleaved"}, 4, 2, "do not split evenly over 2 nodes"),
    ({"num_inference": 2}, 5, 2, "not a whole number of nodes"),
])
def test_a_placement_that_cannot_work_is_one_config_error(topology, world, local, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_placement(cfg(**topology), world, local, 0)
    assert "\n" not in str(info.value)


def routable_address() -> str | None:
    """This machine's source address toward a non-loopback destination (None without a route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: connect() on UDP sends nothing
            return probe.getsockname()[0]
    except OSError:
        return None


def test_a_local_job_uses_loopback():
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}
    assert vllm_channel.node_address(env) == "127.0.0.1"


def test_several_nodes_use_the_address_the_job_reaches_the_rendezvous_by():
    own = routable_address()
    if own is None or own.startswith("127."):
        pytest.skip("no route off this machine")
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}
    assert vllm_channel.node_address(env) == own


def test_the_vllm_group_is_given_learner_rank_0s_node_address(monkeypatch):
    """open_sender listens on, publishes and rendezvouses at `node_address()` (multi-node: not loopback)."""
    seen = {}
    monkeypatch.setattr(vllm_channel, "node_address", lambda: "10.1.2.3")
    monkeypatch.setattr(vllm_channel, "listen_socket", lambda host: (seen.setdefault("listen", host), 4242))
    monkeypatch.setattr(vllm_channel, "exchange_endpoint", lambda topo, endpoint: seen.setdefault("published", endpoint))

    class Group:
        def __init__(self, host, port, rank, world, device, listen=None, timeout_s=0.0):
            seen["group"] = (host, port, rank, world)
            self.device = device
    monkeypatch.setattr(vllm_channel, "StatelessGroup", Group)

    class Topo:
        num_inference, device = 2, "cpu"
    vllm_channel.open_sender(cfg(), Topo(), spec=None)
    assert seen == {"listen": "10.1.2.3", "published": ("10.1.2.3", 4242), "group": ("10.1.2.3", 4242, 0, 3)}
