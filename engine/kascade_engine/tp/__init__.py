"""Tensor-parallel engine instances: one instance over `tp` ranks, one process per rank (shard.py: the split;
group.py: the process group; step.py: the leader's step message; leader.py: rank 0's engine; rank.py: a
follower rank's process; launch.py: starting and watching the ranks; run.py: a command-line harness;
planes.py: a rank's share of a plan, received on its own data port, then gathered; planload.py: the engine's
load-plan into tensor-parallel targets)."""
