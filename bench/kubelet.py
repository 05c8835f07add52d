"""A test kubelet: the pod-resources API (forge_load/podresources/api.proto, v1.PodResourcesLister.List) served by
grpcio on a unix socket, answering with whatever assignments the caller sets: the kubelet of the tests
(tests/test_kubelet.py) and of the `announced` scenario (bench/announced.py).

    with TestKubelet(tmp_path / "kubelet.sock") as kubelet:
        kubelet.assign("default", "train", "main", "nvidia.com/gpu", ["GPU-..."])
        kubelet.claim("default", "train", "main", "train-gpu", [("gpu.nvidia.com", "node-1", "gpu-3")])
        kubelet.free("default", "train")

A claim's devices are (driver, pool, device name) triplets, each with the CDI device NVIDIA's driver would name;
`claim(..., None)` lists the claim as the kubelet does while its driver prepares it (no devices yet).
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
        self._claims: dict[tuple[str, str], list[tuple[str, str, list[tuple[str, str, str]] | None]]] = {}
        self.calls = 0
        self._server: Any = None

    def assign(self, namespace: str, pod: str, container: str, resource: str, device_ids: list[str]) -> None:
        with self._lock:
            self._pods.setdefault((namespace, pod), []).append((container, resource, list(device_ids)))

    def claim(self, namespace: str, pod: str, container: str, claim_name: str,
              devices: list[tuple[str, str, str]] | None) -> None:
        """A DRA claim (in the pod's namespace) of the container, with its devices, or None while being prepared;
        claiming again replaces the container's claim of that name (prepared now)."""
        with self._lock:
            claims = self._claims.setdefault((namespace, pod), [])
            claims[:] = [c for c in claims if (c[0], c[1]) != (container, claim_name)]
            claims.append((container, claim_name, None if devices is None else list(devices)))

    def free(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._pods.pop((namespace, pod), None)
            self._claims.pop((namespace, pod), None)

    def List(self, request: object, context: object) -> Any:  # noqa: N802 - the servicer's name
        with self._lock:
            self.calls += 1
            pods = []
            for namespace, pod in dict.fromkeys([*self._pods, *self._claims]):
                names = dict.fromkeys([c[0] for c in self._pods.get((namespace, pod), [])] +
                                      [c[0] for c in self._claims.get((namespace, pod), [])])
                containers = [api_pb2.ContainerResources(
                    name=name,
                    devices=[api_pb2.ContainerDevices(resource_name=resource, device_ids=ids)
                             for container, resource, ids in self._pods.get((namespace, pod), []) if container == name],
                    dynamic_resources=[_dynamic_resource(namespace, claim_name, devices)
                                       for container, claim_name, devices in self._claims.get((namespace, pod), [])
                                       if container == name])
                    for name in names]
                pods.append(api_pb2.PodResources(name=pod, namespace=namespace, containers=containers))
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


def _dynamic_resource(namespace: str, claim_name: str, devices: list[tuple[str, str, str]] | None) -> Any:
    """A claim as the kubelet lists it (its CDI device named as NVIDIA's driver names one: vendor k8s.<driver>, class
    claim, the claim's UID and the device name; the UID made up here)."""
    return api_pb2.DynamicResource(
        claim_name=claim_name, claim_namespace=namespace,
        claim_resources=[api_pb2.ClaimResource(
            cdi_devices=[api_pb2.CDIDevice(name=f"k8s.{driver}/claim=00000000-0000-4000-8000-000000000000-{device}")],
            driver_name=driver, pool_name=pool, device_name=device) for driver, pool, device in devices or []])
