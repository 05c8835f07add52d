"""The service around the loop: main and its run loops, the heartbeat, the metrics server, the process title, the
process's signals and the kubelet's holds. The commands that start it or ask it are above it: forge_load/commands/."""
