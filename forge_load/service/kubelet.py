"""Holds for what the kubelet has assigned: the filler asks the kubelet's pod-resources API (v1
PodResourcesLister.List, over its unix socket) which device ids each container has, and which devices its dynamic
resource allocation (DRA) claims hold, and holds every GPU assigned to a container that is not ours, until the
assignment is gone (docs/kubernetes-holds.md).

The holds live in this process only (a HoldBoard, read by every GPU's HoldWatch like the hold directory's);
no file is written. The client runs in a thread of its own: a kubelet that hangs stalls nothing else, a call
waits at most CALL_TIMEOUT_S. List has no watch, so it is asked every POLL_S (a GPU assigned is held within
POLL_S plus one call); after a failure the wait doubles up to BACKOFF_MAX_S, and the loss and the recovery are
each said in one line. grpcio is imported only here, and only when FORGE_KUBELET_SOCKET is set.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from forge_load.gpu.nvml_values import MinorGpu
from forge_load.log import internal_error
from forge_load.steering.hold_watch import HoldBoard
from forge_load.steering.holds import GPU_UUID_RE, Hold, canonical_gpu_uuid, valid_holder

POLL_S = 0.25  # List every quarter second: a quarter of the 0.5-s goal, a few calls a second the kubelet allows
BACKOFF_MAX_S = 8.0  # after failures, List at least this often: a restarted kubelet is found again soon
CALL_TIMEOUT_S = 2.0
MAX_MESSAGE_BYTES = 16 << 20  # List answers for every pod on the node; gRPC's default limit is 4 MiB
NVIDIA_PREFIX = "nvidia.com/"  # the NVIDIA device plugin's resources (gpu, mig-1g.10gb, gpu.shared, ...)
DRA_DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver for GPUs: its claims' devices are gpu-<minor> and MIG names
DRA_CDI_VENDOR = "k8s.gpu.nvidia.com/"  # its CDI devices' names, which Kubernetes before 1.31 lists alone
DRA_RETRY_S = 5.0  # a DRA device name NVML did not know is looked up again after this long (a MIG device made late)
DRA_KEEP_S = 30.0  # what a DRA device name was found to be is trusted this long (MIG devices are remade)
HOLDER_PREFIX = "k8s-"
_REPLICA_SEP = "::"  # the NVIDIA device plugin's time-slicing and MPS replica ids: <id>::<n>
_NOT_HOLDER = re.compile(r"[^A-Za-z0-9_.-]", re.ASCII)


@dataclass(frozen=True)
class Assignment:
    """One device the kubelet has assigned to one container: a device plugin's device id of a resource, or a device
    of a DRA claim (`claim` its "namespace/name", `resource` its driver, `device_id` the driver's device name; both
    empty while the claim is being prepared)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str
    claim: str | None = None


def assignments(response: Any) -> list[Assignment]:
    """Every (container, device) of a ListPodResourcesResponse: the device plugins' ids, then the claims' devices."""
    found: list[Assignment] = []
    for pod in response.pod_resources:
        namespace, name = pod.namespace, pod.name
        for container in pod.containers:
            found.extend([Assignment(namespace, name, container.name, devices.resource_name, device_id)
                          for devices in container.devices for device_id in devices.device_ids])
            for claim in container.dynamic_resources:
                found.extend(_claim_assignments(namespace, name, container.name, claim))
    return found


def _claim_assignments(namespace: str, pod: str, container: str, claim: Any) -> list[Assignment]:
    """A claim's devices; one with no driver and device while it is being prepared (which driver is unknown)."""
    name = f"{claim.claim_namespace}/{claim.claim_name}"
    if not claim.claim_resources:
        return [Assignment(namespace, pod, container, "", "", name)]
    found = []
    for device in claim.claim_resources:
        driver = device.driver_name
        if not driver and any(c.name.startswith(DRA_CDI_VENDOR) for c in device.cdi_devices):
            driver = DRA_DRIVER  # Kubernetes 1.27 to 1.30 list the CDI devices alone
        found.append(Assignment(namespace, pod, container, driver, device.device_name, name))
    return found


@dataclass(frozen=True)
class DraName:
    """A device name of NVIDIA's DRA driver (docs/design.md §13): `gpu-<minor>`, or a MIG device on the GPU of that
    minor by its GPU instance's profile ID and placement start (and size, in the older names)."""

    minor: int
    profile_id: int | None = None
    start: int | None = None
    size: int | None = None


_DRA_GPU = re.compile(r"gpu-(\d+)", re.ASCII)
_DRA_MIG_SIZED = re.compile(r"gpu-(\d+)-mig-(\d+)-(\d+)-(\d+)", re.ASCII)  # v25.3 to v25.8: profile ID, start, size
_DRA_MIG_NAMED = re.compile(r"gpu-(\d+)-mig-[a-z0-9][a-z0-9-]*-(\d+)-(\d+)", re.ASCII)  # v25.12 on: profile, ID, start


def dra_name(device_name: str) -> DraName | None:
    """The GPU or MIG device a DRA device name of NVIDIA's driver names; None for a name of no known form."""
    if match := _DRA_GPU.fullmatch(device_name):
        return DraName(int(match[1]))
    if match := _DRA_MIG_SIZED.fullmatch(device_name):  # all digits: never a profile name, which has letters
        return DraName(int(match[1]), int(match[2]), int(match[3]), int(match[4]))
    if match := _DRA_MIG_NAMED.fullmatch(device_name):
        return DraName(int(match[1]), int(match[2]), int(match[3]))
    return None


_DRA_VFIO = re.compile(r"gpu-vfio-\d+", re.ASCII)  # a GPU bound to vfio-pci for a VM: NVML does not show it
EXACT, ITS_GPU, EVERY_GPU, NONE = "exact", "its GPU", "every GPU", "none"  # how a DRA name is held (DraHold.how)


@dataclass(frozen=True)
class DraHold:
    """What a DRA device name holds: `uuids`, and `how`: EXACT (the GPU or MIG device it names), ITS_GPU (a MIG name
    whose GPU instance no MIG device of its GPU has: the whole GPU, the job's MIG device one of them), EVERY_GPU
    (a name NVML does not know, or a claim still being prepared: fail safe) or NONE (a GPU passed to a VM, which
    NVML and so no filler of ours sees)."""

    uuids: tuple[str, ...]
    how: str


def dra_hold(device_name: str, gpus: Iterable[MinorGpu]) -> DraHold:
    """What a DRA device name of NVIDIA's driver holds among these GPUs (NVML's, by minor number)."""
    gpus = list(gpus)
    if _DRA_VFIO.fullmatch(device_name):
        return DraHold((), NONE)
    name = dra_name(device_name)
    for gpu in gpus:
        if name is None or gpu.minor != name.minor:
            continue
        if name.profile_id is None:
            return DraHold((gpu.uuid,), EXACT)
        for mig in gpu.migs:
            if (mig.profile_id, mig.start) == (name.profile_id, name.start) and name.size in (None, mig.size):
                return DraHold((mig.uuid,), EXACT)
        return DraHold((gpu.uuid,), ITS_GPU)
    return DraHold(tuple(gpu.uuid for gpu in gpus), EVERY_GPU)


def base_device_id(device_id: str) -> str:
    """The device a replica id shares (`GPU-...::3` -> `GPU-...`); any other id as it is."""
    return device_id.split(_REPLICA_SEP, 1)[0]


def holder_name(namespace: str, pod: str, container: str) -> str:
    """`k8s-<namespace>_<pod>_<container>` in the holders' characters ([A-Za-z0-9_.-], 64 at most): Kubernetes names
    hold no `_`, so it separates them; a name too long keeps its start and a hash of the whole."""
    name = _NOT_HOLDER.sub("-", f"{HOLDER_PREFIX}{namespace}_{pod}_{container}")
    if len(name) > 64:
        digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:10]
        name = f"{name[:53]}-{digest}"
    assert valid_holder(name), name
    return name


Resolve = Callable[[str], tuple[str, ...]]  # a device id (no replica suffix) -> the UUIDs it names; () unknown


def nvml_resolver(nvml: Any = None) -> Resolve:
    """Device ids through NVML (forge_load/gpu/nvml.py), each asked once: a GPU UUID names itself; a MIG device its own
    UUID (not its GPU's, whose hold would hold its siblings too); an index that GPU's. An id NVML does not know names
    every GPU NVML shows (fail safe: an assignment not understood is not filled beside)."""
    from forge_load.gpu import nvml as nvml_module

    cache: dict[str, tuple[str, ...]] = {}

    def resolve(device_id: str) -> tuple[str, ...]:
        device_id = canonical_gpu_uuid(device_id)  # a UUID in capitals is NVML's own in lower case
        if device_id.startswith("GPU-"):
            return (canonical_gpu_uuid(device_id),)
        if device_id not in cache:
            uuids = nvml_module.device_id_uuids(device_id, nvml)
            cache[device_id] = uuids or tuple(nvml_module.device_uuids(nvml))
        return cache[device_id]

    return resolve


ResolveDra = Callable[[str], DraHold]  # a DRA device name of NVIDIA's driver ("" while being prepared) -> its hold


def nvml_dra_resolver(nvml: Any = None, clock: Callable[[], float] = time.monotonic) -> ResolveDra:
    """DRA device names of NVIDIA's driver through NVML (forge_load/gpu/nvml_mig.py: the GPUs by minor number, their
    MIG devices by GPU instance), read again at most once a second, and only for a name not known a moment ago: what
    a name holds is kept DRA_KEEP_S (MIG devices are remade), a fail safe DRA_RETRY_S (a MIG device made late)."""
    from forge_load.gpu import nvml as nvml_module
    from forge_load.gpu import nvml_mig

    gpus: list[MinorGpu] = []
    read_s = -math.inf
    cache: dict[str, tuple[float, DraHold]] = {}

    def resolve(device_name: str) -> DraHold:
        nonlocal gpus, read_s
        now_s = clock()
        kept = cache.get(device_name)
        if kept is not None and now_s < kept[0]:
            return kept[1]
        if now_s - read_s >= 1.0:
            gpus, read_s = nvml_mig.gpus_by_minor(nvml), now_s
        held = dra_hold(device_name, gpus)
        if not held.uuids and held.how != NONE:  # NVML names no GPU by minor: every GPU it shows at all
            held = DraHold(tuple(nvml_module.device_uuids(nvml)), EVERY_GPU)
        cache[device_name] = (now_s + (DRA_KEEP_S if held.how == EXACT else DRA_RETRY_S), held)
        return held

    return resolve


def simulated_dra_resolver(device_name: str) -> DraHold:
    """The simulated GPU has no minor numbers: no DRA name names one of its GPUs."""
    return DraHold((), EVERY_GPU)


def simulated_resolver(device_id: str) -> tuple[str, ...]:
    """The simulated GPU has no NVML: its UUIDs name themselves, and nothing else names any GPU."""
    return (canonical_gpu_uuid(device_id),) if GPU_UUID_RE.fullmatch(device_id) else ()


class KubeletHolds:
    """Polls List and keeps `board` holding what it says. `own_pod` (namespace, name): this filler's pod, never
    held for (the DaemonSet passes it by the downward API). `say` gets the few lines worth a log line."""

    def __init__(self, socket_path: str, board: HoldBoard, say: Callable[[str], object], resolve: Resolve,
                 own_pod: tuple[str, str] | None = None, wall_clock: Callable[[], float] = time.time,
                 poll_s: float = POLL_S, list_pods: Callable[[], Any] | None = None,
                 resolve_dra: ResolveDra = simulated_dra_resolver) -> None:
        self.socket_path = socket_path
        self.board = board
        self.say = say
        self.resolve = resolve
        self.resolve_dra = resolve_dra
        self.own_pod = own_pod
        self.wall_clock = wall_clock
        self.poll_s = poll_s
        self._list = list_pods or self._grpc_list
        self._channel: Any = None
        self._stub: Any = None
        self._since: dict[tuple[str, str], float] = {}  # (holder, GPU UUID) -> when first seen
        self._said_ids: set[str] = set()
        self._said_claims: dict[tuple[str, str], tuple[str, ...]] = {}  # (claim, device name) -> what it holds
        self.reachable: bool | None = None  # None: not asked yet
        self.polls = 0

    # --- one poll ---

    def _grpc_list(self) -> Any:
        import grpc

        from forge_load.podresources import api_pb2, api_pb2_grpc

        if self._stub is None:
            self._channel = grpc.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=CALL_TIMEOUT_S)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()  # a new channel after a failure: gRPC's own reconnect backoff grows to minutes
        self._channel = self._stub = None

    def _claim_uuids(self, item: Assignment) -> tuple[str, ...] | None:
        """The UUIDs a claim's device holds; None for another driver's device. Said once per claim and device, and
        again when what it holds changes."""
        if item.resource not in ("", DRA_DRIVER):
            return None  # another driver's device: not one of NVIDIA's GPUs
        key = (item.claim or "", item.device_id)
        what = f"claim {item.claim} device {item.device_id} ({item.resource})" if item.resource else \
            f"claim {item.claim} is being prepared (its driver and devices not listed yet)"
        try:
            held = self.resolve_dra(item.device_id)
        except Exception as error:  # noqa: BLE001 - NVML gone: said once, the claim holds nothing
            if self._said_claims.get(key) != ():
                self._said_claims[key] = ()
                self.say(f"{what} cannot be looked up: {error}")
            return ()
        if self._said_claims.get(key) != held.uuids:
            self._said_claims[key] = held.uuids
            shown = ", ".join(held.uuids) or "none"
            if held.how == EXACT:
                self.say(f"{what} is {shown}")
            elif held.how == NONE:
                self.say(f"{what} is a GPU passed to a virtual machine (vfio), which no filler here sees: "
                         "nothing held")
            elif held.how == ITS_GPU:
                self.say(f"{what}: no MIG device of that GPU instance on its GPU (yet), the whole GPU held "
                         f"(fail safe): {shown}")
            else:
                named = "" if not item.resource else " names no GPU NVML shows"
                self.say(f"{what}{named}: every GPU held (fail safe): {shown}")
        return held.uuids

    def holds_of(self, found: Iterable[Assignment], now_unix_s: float) -> list[Hold]:
        holds: dict[tuple[str, str], Hold] = {}
        for item in found:
            if self.own_pod is not None and item.pod == self.own_pod[1] and self.own_pod[0] in ("", item.namespace):
                continue  # ours (a namespace not given: any pod of our name)
            if item.claim is not None:
                claimed = self._claim_uuids(item)
                if claimed is None:
                    continue
                holder = holder_name(item.namespace, item.pod, item.container)
                shown = f"{item.device_id}" if item.device_id else "being prepared"
                reason = (f"Kubernetes {item.namespace}/{item.pod} container {item.container} "
                          f"(claim {item.claim}, {shown})")
                for uuid in claimed:
                    since = self._since.setdefault((holder, uuid), now_unix_s)
                    holds.setdefault((holder, uuid), Hold(uuid, holder, reason, since))
                continue
            device_id = base_device_id(item.device_id)
            if not (item.resource.startswith(NVIDIA_PREFIX) or GPU_UUID_RE.fullmatch(device_id)):
                continue  # another vendor's devices, and ids that are no GPU's
            try:
                uuids = self.resolve(device_id)
            except Exception as error:  # noqa: BLE001 - NVML gone: said once, the id holds nothing
                uuids = ()
                if device_id not in self._said_ids:
                    self._said_ids.add(device_id)
                    self.say(f"device id {device_id} ({item.resource}) cannot be looked up: {error}")
            if device_id not in self._said_ids and device_id[:4].upper() != "GPU-":
                self._said_ids.add(device_id)
                shown = ", ".join(uuids) if uuids else "no GPU"
                self.say(f"device id {device_id} ({item.resource}) is {shown}")
            holder = holder_name(item.namespace, item.pod, item.container)
            reason = f"Kubernetes {item.namespace}/{item.pod} container {item.container} ({item.resource})"
            for uuid in uuids:
                since = self._since.setdefault((holder, uuid), now_unix_s)
                holds[(holder, uuid)] = Hold(uuid, holder, reason, since)
        for key in set(self._since) - set(holds):
            del self._since[key]  # gone: when it comes back, it is a new hold
        return list(holds.values())

    def poll(self) -> bool:
        """One List, and the board set from it; False when the kubelet could not be asked (the board kept)."""
        self.polls += 1
        try:
            response = self._list()
        except Exception as error:  # noqa: BLE001 - grpc.RpcError and whatever a broken channel raises
            self._close_channel()
            if self.reachable is not False:
                self.say(f"pod-resources at {self.socket_path} cannot be reached ({_why(error)}): "
                         "no holds from it until it can (the holds it gave stay; NVML detection goes on)")
            self.reachable = False
            return False
        if self.reachable is False:
            self.say(f"pod-resources at {self.socket_path} reached again")
        self.reachable = True
        self.board.replace(self.holds_of(assignments(response), self.wall_clock()))
        return True

    # --- the thread ---

    def run(self, stop: threading.Event) -> None:
        wait_s = self.poll_s
        said_bug = False
        try:
            while not stop.is_set():
                try:
                    ok = self.poll()
                except Exception as error:  # noqa: BLE001 - a bug: said once; the fillers and their NVML go on
                    ok = False
                    if not said_bug:
                        said_bug = True
                        self.say(internal_error(error))
                wait_s = self.poll_s if ok else min(max(wait_s * 2, self.poll_s), BACKOFF_MAX_S)
                stop.wait(wait_s)
        finally:
            self._close_channel()

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="kubelet", daemon=True)
        thread.start()
        return thread


def _why(error: BaseException) -> str:
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):  # grpc.RpcError
        try:
            text = f"{code().name}: {details()}"
            return text if len(text) <= 200 else text[:197] + "..."
        except Exception:  # noqa: BLE001 - an RpcError that is no Call: its text will do
            pass
    return f"{type(error).__name__}: {error}"
