"""A test kubelet: the pod-resources API (forge_load/podresources/api.proto, v1.PodResourcesLister.List) served by
grpcio on a unix socket, answering with whatever assignments the caller sets: the kubelet of the tests
(tests/test_kubelet.py) and of the `announced` scenario (bench/announced.py).

    with TestKubelet(tmp_path / "kubelet.sock") as kubelet:
        kubelet.assign("default", "train", "main", "nvidia.com/gpu", ["GPU-..."])
        kubelet.free("default", "train")
"""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from forge_load.podresources import api_pb2, api_pb2_grpc


class TestKubelet(api_pb2_grpc.PodResourcesListerServicer):
    __test__ = False  # not a test class for pytest

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], list[tuple[str, str, list[str]]]] = {}
        self.calls = 0
        self._server: Any = None

    def assign(self, namespace: str, pod: str, container: str, resource: str, device_ids: list[str]) -> None:
        with self._lock:
            self._pods.setdefault((namespace, pod), []).append((container, resource, list(device_ids)))

    def free(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._pods.pop((namespace, pod), None)

    def List(self, request: object, context: object) -> Any:  # noqa: N802 - the servicer's name
        with self._lock:
            self.calls += 1
            pods = [api_pb2.PodResources(
                name=pod, namespace=namespace,
                containers=[api_pb2.ContainerResources(
                    name=container, devices=[api_pb2.ContainerDevices(resource_name=resource, device_ids=ids)])
                    for container, resource, ids in containers])
                for (namespace, pod), containers in self._pods.items()]
        return api_pb2.ListPodResourcesResponse(pod_resources=pods)

    def start(self) -> TestKubelet:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None

    def __enter__(self) -> TestKubelet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
