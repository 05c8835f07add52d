"""The service around the loop: main and its run loops, the health check and heartbeat, the metrics server, the
process title, the process's signals, the hold commands and the kubelet's holds."""
