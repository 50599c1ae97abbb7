"""ddprun's hooks in torch's agent (agent/torch_agent.py) that unit tests can reach without a job."""

from types import SimpleNamespace

from ddprun.agent.torch_agent import AgentHooks, DdprunAgent


def test_the_node_is_marked_stopping_before_the_first_close_of_its_workers_only():
    """torch's poll closes the process context when a worker failed (SIGTERM to the others): exits are
    reported and the node marked first. A second close of the same context (torch's _shutdown after a
    failed rendezvous) must not report the workers that the first close stopped as failures."""
    said, closes = [], []
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_stopping=lambda: said.append("stopping"))
    agent._report_exits = lambda group: said.append("exits")
    agent._pcontext = SimpleNamespace(close=lambda *a, **kw: closes.append(a))
    agent._say_before_close(SimpleNamespace())
    agent._pcontext.close()
    assert said == ["exits", "stopping"] and closes == [()]
    agent._pcontext.close(15, 30)
    assert said == ["exits", "stopping"] and closes == [(), (15, 30)]
