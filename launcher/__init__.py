"""Control plane of hspmd-elastic: the hspmd-launch CLI, node agents, leader, health sources."""
