"""Runtime.topology: the planner's topology is parsed once per node list, not once per ScalePlan, and a changed
node list (the node watch builds a new list object after a change) is parsed again."""

from __future__ import annotations

from fakekube import FakeKube

from kascade_devcluster import nodes as devnodes
from kascade_operator.engine_client import EngineClient
from kascade_operator.nodefacts import slim
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings


def test_the_topology_is_parsed_once_per_node_list() -> None:
    rt = Runtime(OperatorSettings(engine_token="t"), FakeKube(), EngineClient("t"), None, None, OperatorMetrics())
    nodes = [slim(devnodes.node_manifest(s, "x")) for s in devnodes.topology_specs(40, 8, 4)]
    t1 = rt.topology(nodes)
    assert len(t1.nodes) == 40 and {n.leaf for n in t1.nodes} == {f"leaf-{i}" for i in range(4)}
    assert rt.topology(nodes) is t1  # the same list: not parsed again
    changed = [*nodes[:-1]]  # a node went: the watch's next list is another object
    t2 = rt.topology(changed)
    assert t2 is not t1 and len(t2.nodes) == 39
    assert rt.topology(list(changed)) == t2  # equal content, another list: parsed again, same topology
