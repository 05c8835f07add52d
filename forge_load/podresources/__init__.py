"""The kubelet's pod-resources API (v1), as service/kubelet.py reads it: api.proto and the modules grpcio-tools
generated from it (committed, so that no build needs protoc; api.proto's header says how to make them again)."""
