"""Multi-node launch: ``torchrun --nnodes 2 --nproc-per-node 2`` with c10d rendezvous on loopback.

Two torchrun agents (``--node-rank 0`` and ``1``) play two nodes of one job; the four ranks compile the
test GPT on a (2, 2) mesh, whose first axis spans the nodes (each rank's axis-0 coordinate is its
node), and train 3 steps: losses and parameters equal a single-device copy's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from autoshard.testing.ranks import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_node_script.py")


def test_two_nodes_on_loopback_equal_one_device(tmp_path):
    port = free_port()
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "autoshard-two-nodes", "--max-restarts", "0", SCRIPT, str(tmp_path)]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}))
    outs = [a.communicate(timeout=300)[0] for a in agents]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-3000:]
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    assert sorted((r["node"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["coordinate"][0] == r["node"], f"mesh axis 0 does not span the nodes: {r}"
        for got, want in r["losses"]:
            assert abs(got - want) <= 1e-4 * abs(want) + 1e-5, r["losses"]
        assert r["worst_param_error"] < 1e-4
