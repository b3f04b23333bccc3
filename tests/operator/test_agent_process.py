"""The test harness's agent processes (`lorafleet_dev.agents.AgentProcess`): a port that another
process takes between `free_port` choosing it and the agent binding it costs a start on new
ports, not a failed test module (CI once lost five operator tests to that race: the agent exited
with "Address already in use" after its health had briefly said SERVING)."""

from __future__ import annotations

import socket

from lorafleet_dev.agents import AgentProcess
from tests.operator.agents import agent_spec, serving


def test_a_first_start_that_lost_its_port_starts_again_on_new_ports(tmp_path):
    spec, _ = agent_spec(tmp_path, tp=1, dp=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lost = taken.getsockname()[1]
        process = AgentProcess("agent-0", spec, tmp_path / "logs", metrics_port=lost)
        with serving([process]):
            assert process.metrics_port != lost and process.serving()
            assert "Address already in use" in process.log_path.read_text(), "the first start did lose the port"
