"""Holds for what the kubelet assigns (service/kubelet.py, docs/kubernetes-holds.md): the device ids as the NVIDIA
device plugin writes them, the real protocol against a test kubelet on a unix socket, and the filler holding a
GPU the kubelet assigned (virtual time on the simulated GPU; real time on the virtual GPU below)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from simrun import step_with

from bench.kubelet import TestKubelet
from forge_load.config.load import load_config
from forge_load.control.filler import Controls
from forge_load.service import kubelet
from forge_load.service.kubelet import (
    EVERY_GPU,
    EXACT,
    ITS_GPU,
    NONE,
    Assignment,
    DraName,
    KubeletHolds,
    dra_name,
    holder_name,
    nvml_dra_resolver,
    nvml_resolver,
)
from forge_load.service.loop import run_simulated
from forge_load.steering.hold_watch import HoldBoard, HoldWatch
from forge_load.steering.holds import HOLDER_RE, Hold
from tests.fake_pynvml import FakeDevice, FakeNvml
from tests.host_paths import settings_free
from tests.test_real_path import ROOT, finish, forge, wait_for
from vgpu.pytest_plugin import VgpuFactory

GPU_A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"
MIG_A1 = "MIG-aaaaaaaa-0001-4000-8000-000000000000"
MIG_B0 = "MIG-bbbbbbbb-0000-4000-8000-000000000000"
SIM_UUID = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU 0, seed 0


def client(board: HoldBoard, lines: list[str], resolve: kubelet.Resolve = kubelet.simulated_resolver,
           socket_path: str = "/nonexistent", **kwargs: object) -> KubeletHolds:
    return KubeletHolds(socket_path, board, lines.append, resolve, wall_clock=lambda: 1000.0, **kwargs)  # type: ignore[arg-type]


def held(board: HoldBoard, *uuids: str) -> dict[str, list[str]]:
    return {uuid: [h.holder for h in board.holds_for(uuid)] for uuid in uuids}


# --- names and ids ---------------------------------------------------------------------------------------------

def test_holder_names_are_in_the_holders_characters_and_long_ones_stay_apart() -> None:
    assert holder_name("default", "train-0", "main") == "k8s-default_train-0_main"
    assert holder_name("ml", "job.v1", "c") == "k8s-ml_job.v1_c"
    long_a = holder_name("team-" + "a" * 60, "pod-" + "x" * 200, "main")
    long_b = holder_name("team-" + "a" * 60, "pod-" + "x" * 199 + "y", "main")
    assert HOLDER_RE.fullmatch(long_a) and HOLDER_RE.fullmatch(long_b) and long_a != long_b


def test_replica_ids_hold_their_gpu_our_pod_and_other_devices_do_not() -> None:
    board, lines = HoldBoard(), []
    watch = client(board, lines, own_pod=("forge-load", "forge-load-abcde"))
    found = [Assignment("ml", "a", "main", "nvidia.com/gpu", f"{GPU_A}::3"),  # time-slicing replica
             Assignment("ml", "b", "main", "nvidia.com/gpu.shared", f"{GPU_A}::0"),
             Assignment("forge-load", "forge-load-abcde", "forge-load", "nvidia.com/gpu", GPU_B),  # ours
             Assignment("ml", "c", "main", "example.com/fpga", "fpga-0"),  # no GPU
             Assignment("ml", "c", "main", "example.com/fpga", "0")]  # an index, but not the NVIDIA plugin's
    board.replace(watch.holds_of(found, 1000.0))
    assert held(board, GPU_A, GPU_B) == {GPU_A: ["k8s-ml_a_main", "k8s-ml_b_main"], GPU_B: []}
    (hold, _) = board.holds_for(GPU_A)
    assert hold == Hold(GPU_A, "k8s-ml_a_main", "Kubernetes ml/a container main (nvidia.com/gpu)", 1000.0, None)
    assert lines == []


def test_our_pod_without_a_namespace_is_known_by_its_name() -> None:
    board, lines = HoldBoard(), []
    watch = client(board, lines, own_pod=("", "forge-load-abcde"))
    board.replace(watch.holds_of([Assignment("forge-load", "forge-load-abcde", "c", "nvidia.com/gpu", GPU_A),
                                  Assignment("ml", "forge-load-abcdf", "c", "nvidia.com/gpu", GPU_B)], 1.0))
    assert held(board, GPU_A, GPU_B) == {GPU_A: [], GPU_B: ["k8s-ml_forge-load-abcdf_c"]}


def test_mig_and_index_ids_map_to_their_gpu_through_nvml() -> None:
    mig_a0 = FakeDevice(uuid="MIG-aaaaaaaa-0000-4000-8000-000000000000")
    fake = FakeNvml([FakeDevice(uuid=GPU_A, mig_mode=1, migs=[mig_a0, FakeDevice(uuid=MIG_A1)]),
                     FakeDevice(uuid=GPU_B, mig_mode=1, migs=[FakeDevice(uuid=MIG_B0)])])
    resolve = nvml_resolver(fake.module)
    # A MIG device's id names that MIG device only: a hold on its GPU would hold its siblings too (a MIG device's
    # filler honours its GPU's holds, docs/holds.md)
    assert resolve(MIG_A1) == (MIG_A1,)
    assert resolve("1") == (GPU_B,)
    assert resolve("1:0") == (MIG_B0,)  # the device plugin's index ids for MIG devices
    assert resolve(GPU_B) == (GPU_B,)
    assert fake.init_count == fake.shutdown_count  # NVML left as found
    board, lines = HoldBoard(), []
    watch = client(board, lines, resolve)
    board.replace(watch.holds_of([Assignment("ml", "m", "main", "nvidia.com/mig-1g.10gb", f"{MIG_A1}::1")], 5.0))
    assert held(board, GPU_A, MIG_A1, GPU_B) == {GPU_A: [], MIG_A1: ["k8s-ml_m_main"], GPU_B: []}
    # The filler of the sibling MIG device, which honours its GPU's holds too, is not held: a MIG device's
    # assignment holds that MIG device, not its neighbours
    sibling = HoldWatch("/nonexistent", mig_a0.uuid, board=board, whole_gpu_uuid=GPU_A)
    sibling.check(0.0, 5.0)
    assert sibling.holders == ()
    assigned = HoldWatch("/nonexistent", MIG_A1, board=board, whole_gpu_uuid=GPU_A)
    assigned.check(0.0, 5.0)
    assert assigned.holders == ("k8s-ml_m_main",)
    assert lines == [f"device id {MIG_A1} (nvidia.com/mig-1g.10gb) is {MIG_A1}"]


def test_an_nvidia_id_nvml_does_not_know_holds_every_gpu() -> None:
    fake = FakeNvml([FakeDevice(uuid=GPU_A), FakeDevice(uuid=GPU_B)])
    board, lines = HoldBoard(), []
    watch = client(board, lines, nvml_resolver(fake.module))
    for _ in range(2):
        board.replace(watch.holds_of([Assignment("ml", "x", "main", "nvidia.com/gpu", "7")], 5.0))
    assert held(board, GPU_A, GPU_B) == {GPU_A: ["k8s-ml_x_main"], GPU_B: ["k8s-ml_x_main"]}
    assert lines == [f"device id 7 (nvidia.com/gpu) is {GPU_A}, {GPU_B}"]  # once


def test_a_hold_keeps_its_since_while_assigned_and_is_new_when_it_comes_back() -> None:
    board, lines = HoldBoard(), []
    now = [1.0]
    watch = KubeletHolds("/nonexistent", board, lines.append, kubelet.simulated_resolver, wall_clock=lambda: now[0])
    found = [Assignment("ml", "a", "main", "nvidia.com/gpu", GPU_A)]
    board.replace(watch.holds_of(found, 1.0))
    assert not board.replace(watch.holds_of(found, 2.0))  # the same hold: no change
    board.replace(watch.holds_of([], 3.0))
    board.replace(watch.holds_of(found, 4.0))
    assert [h.since_unix_s for h in board.holds_for(GPU_A)] == [4.0]


# --- DRA claims ------------------------------------------------------------------------------------------------

MIG_B1 = "MIG-bbbbbbbb-0001-4000-8000-000000000000"


def dra_gpus() -> FakeNvml:
    """GPU A (index 0) is minor 5; GPU B (index 1) minor 2, in MIG mode with two 3g.40gb GPU instances (IDs 1 and
    2, profile 9) at memory slices 0 and 4."""
    return FakeNvml([FakeDevice(uuid=GPU_A, minor=5),
                     FakeDevice(uuid=GPU_B, minor=2, mig_mode=1,
                                migs=[FakeDevice(uuid=MIG_B0, gpu_instance=(1, 9, 0, 4)),
                                      FakeDevice(uuid=MIG_B1, gpu_instance=(2, 9, 4, 4))])])


def test_dra_device_names_of_nvidias_driver_in_both_forms() -> None:
    assert dra_name("gpu-5") == DraName(5)
    assert dra_name("gpu-2-mig-9-4-4") == DraName(2, 9, 4, 4)  # v25.3 to v25.8: profile ID, start, size
    assert dra_name("gpu-2-mig-3g40gb-9-4") == DraName(2, 9, 4)  # v25.12 on: profile name, ID, start
    assert dra_name("gpu-0-mig-1g10gb-me-20-6") == DraName(0, 20, 6)  # "1g.10gb+me", made a DNS label
    for other in ("gpu-vfio-0", "gpu-", "gpu-2-mig-9-4", "GPU-5", "imex-channel-0", "gpu-2-mig--9-4", ""):
        assert dra_name(other) is None, other


def test_dra_names_are_resolved_by_minor_number_and_gpu_instance_through_nvml() -> None:
    fake = dra_gpus()
    now = [0.0]
    resolve = nvml_dra_resolver(fake.module, clock=lambda: now[0])
    every = (GPU_A, GPU_B)
    assert [(n, (h := resolve(n)).uuids, h.how) for n in (
        "gpu-5", "gpu-2", "gpu-2-mig-9-4-4", "gpu-2-mig-3g40gb-9-0", "gpu-2-mig-9-4-2", "gpu-2-mig-1g10gb-19-6",
        "gpu-0", "", "gpu-vfio-0", "nonsense")] == [
        ("gpu-5", (GPU_A,), EXACT),  # minor 5 is index 0: the name's number is never the index
        ("gpu-2", (GPU_B,), EXACT),
        ("gpu-2-mig-9-4-4", (MIG_B1,), EXACT),
        ("gpu-2-mig-3g40gb-9-0", (MIG_B0,), EXACT),
        ("gpu-2-mig-9-4-2", (GPU_B,), ITS_GPU),  # no such placement on GPU minor 2: that GPU, every MIG device of it
        ("gpu-2-mig-1g10gb-19-6", (GPU_B,), ITS_GPU),
        ("gpu-0", every, EVERY_GPU),  # no GPU of that minor: fail safe
        ("", every, EVERY_GPU),  # a claim being prepared
        ("gpu-vfio-0", (), NONE),  # passed to a VM: NVML, and so no filler, sees it
        ("nonsense", every, EVERY_GPU)]
    assert fake.init_count == fake.shutdown_count
    reads = len(fake.called("nvmlDeviceGetCount"))
    assert reads == 1  # NVML read once for all those names: within a second of each other
    now[0] = 6.0  # past the fail safe's 5 s, within the found name's 30 s
    resolve("gpu-5")
    resolve("gpu-2-mig-9-4-2")
    assert len(fake.called("nvmlDeviceGetCount")) == reads + 1  # a name found is kept; a fail safe asked again


def test_a_mig_name_whose_gpu_instance_nvml_keeps_to_itself_holds_its_whole_gpu() -> None:
    import pynvml

    fake = dra_gpus()
    fake.devices[1].errors["nvmlDeviceGetGpuInstanceById"] = pynvml.NVMLError_NoPermission  # "privileged user"
    held_by = nvml_dra_resolver(fake.module)("gpu-2-mig-9-4-4")
    assert (held_by.uuids, held_by.how) == ((GPU_B,), ITS_GPU)


def claim(pod: str, device: str, driver: str = "gpu.nvidia.com", container: str = "main") -> Assignment:
    return Assignment("ml", pod, container, driver if device else "", device, f"ml/{pod}-gpu")


def test_a_claims_gpu_is_held_by_its_container_other_drivers_are_not_read_and_each_is_said_once() -> None:
    board, lines = HoldBoard(), []
    watch = client(board, lines, own_pod=("forge-load", "forge-load-x"),
                   resolve_dra=nvml_dra_resolver(dra_gpus().module))
    found = [claim("a", "gpu-5"),
             claim("m", "gpu-2-mig-3g40gb-9-4"),
             claim("n", "eth-0", driver="dra.net"),  # another driver's device
             Assignment("forge-load", "forge-load-x", "forge-load", "gpu.nvidia.com", "gpu-2", "forge-load/own")]
    for _ in range(3):
        board.replace(watch.holds_of(found, 7.0))
    assert held(board, GPU_A, GPU_B, MIG_B0, MIG_B1) == {GPU_A: ["k8s-ml_a_main"], GPU_B: [], MIG_B0: [],
                                                         MIG_B1: ["k8s-ml_m_main"]}
    (hold,) = board.holds_for(GPU_A)
    assert hold == Hold(GPU_A, "k8s-ml_a_main", "Kubernetes ml/a container main (claim ml/a-gpu, gpu-5)", 7.0, None)
    assert lines == [f"claim ml/a-gpu device gpu-5 (gpu.nvidia.com) is {GPU_A}",
                     f"claim ml/m-gpu device gpu-2-mig-3g40gb-9-4 (gpu.nvidia.com) is {MIG_B1}"]
    # The claim's MIG device only: the filler of its sibling goes on
    sibling = HoldWatch("/nonexistent", MIG_B0, board=board, whole_gpu_uuid=GPU_B)
    sibling.check(0.0, 7.0)
    assert sibling.holders == ()


def test_a_claim_being_prepared_or_naming_no_gpu_holds_every_gpu_said_once_then_what_it_names() -> None:
    board, lines = HoldBoard(), []
    watch = client(board, lines, resolve_dra=nvml_dra_resolver(dra_gpus().module))
    for _ in range(2):
        board.replace(watch.holds_of([claim("p", ""), claim("u", "gpu-9")], 1.0))
    assert held(board, GPU_A, GPU_B) == {GPU_A: ["k8s-ml_p_main", "k8s-ml_u_main"],
                                         GPU_B: ["k8s-ml_p_main", "k8s-ml_u_main"]}
    assert lines == [
        f"claim ml/p-gpu is being prepared (its driver and devices not listed yet): every GPU held (fail safe): "
        f"{GPU_A}, {GPU_B}",
        f"claim ml/u-gpu device gpu-9 (gpu.nvidia.com) names no GPU NVML shows: every GPU held (fail safe): "
        f"{GPU_A}, {GPU_B}"]
    board.replace(watch.holds_of([claim("p", "gpu-5")], 2.0))  # prepared: its GPU alone
    assert held(board, GPU_A, GPU_B) == {GPU_A: ["k8s-ml_p_main"], GPU_B: []}
    assert [h.since_unix_s for h in board.holds_for(GPU_A)] == [1.0]  # the same hold, kept since it began


def wire(number: int, *parts: bytes | str) -> bytes:
    """A length-delimited protobuf field (string or message) by its number, as the kubelet's encoder writes it."""
    payload = b"".join(p.encode() if isinstance(p, str) else p for p in parts)
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


# The field numbers of the kubelet's pkg/apis/podresources/v1/api.proto (kubernetes/kubelet v0.35.0), and its
# DynamicResource's class_name (1), which Kubernetes 1.27 to 1.30 still sent.
KUBELET_CLAIM_WIRE = wire(1, wire(1, "p"), wire(2, "ml"), wire(3, wire(1, "c"), wire(5, (
    wire(1, "x") + wire(2, "k") + wire(3, "ml") +
    wire(4, wire(1, wire(1, "v/c=d")), wire(2, "gpu.nvidia.com"), wire(3, "n1"), wire(4, "gpu-5"), wire(5, "s"))))))


def test_the_claims_fields_are_the_kubelets_own_numbers() -> None:
    from forge_load.podresources import api_pb2

    response = api_pb2.ListPodResourcesResponse.FromString(KUBELET_CLAIM_WIRE)
    assert kubelet.assignments(response) == [Assignment("ml", "p", "c", "gpu.nvidia.com", "gpu-5", "ml/k")]
    (resource,) = response.pod_resources[0].containers[0].dynamic_resources[0].claim_resources
    assert (resource.pool_name, resource.share_id, resource.cdi_devices[0].name) == ("n1", "s", "v/c=d")


def test_before_kubernetes_1_31_a_claim_of_nvidias_driver_is_known_by_its_cdi_device() -> None:
    from forge_load.podresources import api_pb2

    claim_resource = api_pb2.ClaimResource(cdi_devices=[api_pb2.CDIDevice(name="k8s.gpu.nvidia.com/claim=u-gpu-0")])
    other = api_pb2.ClaimResource(cdi_devices=[api_pb2.CDIDevice(name="vendor.example/nic=x")])
    response = api_pb2.ListPodResourcesResponse(pod_resources=[api_pb2.PodResources(
        name="p", namespace="ml", containers=[api_pb2.ContainerResources(name="c", dynamic_resources=[
            api_pb2.DynamicResource(claim_name="k", claim_namespace="ml", claim_resources=[claim_resource, other])])])])
    assert kubelet.assignments(response) == [Assignment("ml", "p", "c", "gpu.nvidia.com", "", "ml/k"),
                                             Assignment("ml", "p", "c", "", "", "ml/k")]


# --- the protocol, against a test kubelet ----------------------------------------------------------------------

def test_the_test_kubelet_assigns_and_frees_over_the_real_protocol(tmp_path: Path) -> None:
    socket_path = tmp_path / "kubelet.sock"
    board, lines = HoldBoard(), []
    with TestKubelet(socket_path) as server:
        watch = client(board, lines, socket_path=str(socket_path))
        assert watch.poll() and held(board, GPU_A) == {GPU_A: []}
        server.assign("ml", "train", "main", "nvidia.com/gpu", [GPU_A])
        server.assign("ml", "train", "side", "nvidia.com/gpu", [f"{GPU_B}::1"])
        assert watch.poll()
        assert held(board, GPU_A, GPU_B) == {GPU_A: ["k8s-ml_train_main"], GPU_B: ["k8s-ml_train_side"]}
        server.free("ml", "train")
        assert watch.poll() and held(board, GPU_A, GPU_B) == {GPU_A: [], GPU_B: []}
        assert server.calls == 3
    assert lines == []


def test_the_test_kubelet_lists_a_claim_being_prepared_then_its_device_over_the_real_protocol(tmp_path: Path) -> None:
    socket_path = tmp_path / "kubelet.sock"
    board, lines = HoldBoard(), []
    with TestKubelet(socket_path) as server:
        watch = client(board, lines, socket_path=str(socket_path), resolve_dra=nvml_dra_resolver(dra_gpus().module))
        server.claim("ml", "train", "main", "train-gpu", None)  # NodePrepareResources not done yet
        assert watch.poll() and held(board, GPU_A, GPU_B) == {GPU_A: ["k8s-ml_train_main"],
                                                              GPU_B: ["k8s-ml_train_main"]}
        server.claim("ml", "train", "main", "train-gpu", [("gpu.nvidia.com", "node-1", "gpu-2-mig-9-0-4")])
        server.claim("ml", "train", "side", "nic", [("dra.net", "node-1", "eth-0")])
        assert watch.poll() and held(board, GPU_A, GPU_B, MIG_B0) == {GPU_A: [], GPU_B: [],
                                                                      MIG_B0: ["k8s-ml_train_main"]}
        server.free("ml", "train")
        assert watch.poll() and held(board, MIG_B0) == {MIG_B0: []}
    assert [line.split(" (")[0] for line in lines] == ["claim ml/train-gpu is being prepared",
                                                       "claim ml/train-gpu device gpu-2-mig-9-0-4"]


def test_an_unreachable_kubelet_is_said_once_its_holds_stay_and_it_is_found_again(tmp_path: Path) -> None:
    socket_path = tmp_path / "kubelet.sock"
    board, lines = HoldBoard(), []
    watch = client(board, lines, socket_path=str(socket_path))
    server = TestKubelet(socket_path).start()
    server.assign("ml", "train", "main", "nvidia.com/gpu", [GPU_A])
    assert watch.poll()
    server.stop()
    assert [watch.poll() for _ in range(3)] == [False, False, False]
    assert len(lines) == 1 and lines[0].startswith(f"pod-resources at {socket_path} cannot be reached (")
    assert held(board, GPU_A) == {GPU_A: ["k8s-ml_train_main"]}  # kept: the idle age-out ends it if it is stale
    with TestKubelet(socket_path) as again:  # a restarted kubelet: nothing assigned any more
        assert watch.poll()
        assert again.calls == 1
    assert lines[1:] == [f"pod-resources at {socket_path} reached again"]
    assert held(board, GPU_A) == {GPU_A: []}


def test_the_thread_backs_off_after_failures_and_stops_on_the_stop_event(tmp_path: Path) -> None:
    board, lines = HoldBoard(), []
    watch = client(board, lines, socket_path=str(tmp_path / "none.sock"), poll_s=0.01)
    stop = threading.Event()
    thread = watch.start(stop)
    time.sleep(0.5)  # 0.02 + 0.04 + 0.08 + 0.16: five or six calls; without the backoff about fifty
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert 2 <= watch.polls <= 8 and len(lines) == 1


def test_a_bug_in_a_poll_is_said_once_and_the_thread_goes_on(tmp_path: Path) -> None:
    board, lines = HoldBoard(), []
    calls: list[int] = []

    def broken() -> object:
        calls.append(1)
        raise_at = len(calls) <= 3
        return None if raise_at else type("Response", (), {"pod_resources": []})()  # None has no pod_resources

    watch = client(board, lines, poll_s=0.01, list_pods=broken)
    stop = threading.Event()
    thread = watch.start(stop)
    deadline_s = time.monotonic() + 10
    while len(calls) < 5 and time.monotonic() < deadline_s:
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=5)
    assert len(calls) >= 5  # went on after the bug
    assert [line.split(":")[0] for line in lines] == ["internal error, please report"]


def test_the_committed_stubs_are_what_the_proto_generates(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    proto = "forge_load/podresources/api.proto"
    code = protoc.main(["protoc", f"-I{ROOT}", f"-I{Path(protoc.__file__).parent / '_proto'}",
                        f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
                        str(ROOT / proto)])
    assert code == 0
    for name in ("api_pb2.py", "api_pb2_grpc.py", "api_pb2.pyi"):
        generated = (tmp_path / "forge_load" / "podresources" / name).read_text()
        assert generated == (ROOT / "forge_load" / "podresources" / name).read_text(), name


# --- the filler, in virtual time on the simulated GPU ------------------------------------------------------------

def simulated(board: HoldBoard, flags: str, actions: list[tuple[float, Callable[[], object]]]
              ) -> tuple[list[dict[str, object]], list[tuple[float, str]]]:
    """A simulated run whose board changes at virtual times (as the kubelet thread would); its lines, and the
    state after every step."""
    states: list[tuple[float, str]] = []
    config = load_config(f"--simulate --sim-speed 0 --log-format json {flags}".split(), env={})
    on_start = step_with(actions, lambda rt, now_s: states.append((now_s, rt.filler.state.value)))
    out = io.StringIO()
    run_simulated(config, out, on_start=on_start, controls=Controls(board=board), wall_start_s=0.0)
    return [json.loads(line) for line in out.getvalue().splitlines()], states


def assign(board: HoldBoard, at_s: float) -> Callable[[], object]:
    return lambda: board.replace([Hold(SIM_UUID, "k8s-ml_train_main", "Kubernetes ml/train container main", at_s)])


def test_a_gpu_the_kubelet_assigned_is_held_at_once_and_fills_again_once_freed(tmp_path: Path) -> None:
    board = HoldBoard()
    # Polls every 0.5 s; the board changes between two: the filler's next step sees it, not its next reading.
    events, states = simulated(board, f"--duration 6 --poll-interval 0.5 --hold-dir {tmp_path}",
                               [(2.05, assign(board, 2.05)), (4.05, lambda: board.replace([]))])
    (hold,), (release,) = [e for e in events if e["event"] == "hold"], [e for e in events if e["event"] == "release"]
    assert (hold["holder"], hold["state"], hold["reason"]) == ("k8s-ml_train_main", "held",
                                                               "Kubernetes ml/train container main")
    assert 2.05 <= float(hold["t"]) < 2.25  # a step of the Worker's, before the reading due at 2.5
    assert 4.05 <= float(release["t"]) <= 4.5  # held, the filler steps only at readings (the kubelet's thread
    # wakes it in real time: tests below)
    assert (release["reason"], release["state"]) == ("released", "filling")
    assert {s for t, s in states if float(hold["t"]) <= t < 4.05} == {"held"}
    assert {s for t, s in states if t > 4.5} == {"filling"}


def test_a_kubelet_hold_over_an_idle_gpu_ages_out(tmp_path: Path) -> None:
    """List keeps finished pods for a while: the idle age-out ends such a hold."""
    board = HoldBoard()
    events, _ = simulated(board, f"--duration 6 --hold-dir {tmp_path} --hold-idle-age-out 2",
                          [(1.0, assign(board, 1.0))])
    (release,) = [e for e in events if e["event"] == "release"]
    assert release["reason"] == "aged out" and 3.0 <= float(release["t"]) < 3.2


def test_an_unreachable_socket_is_one_line_and_the_filler_keeps_filling(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "forge_load", "--simulate", "--duration", "3", "--log-format", "json",
                           "--log-interval", "0.5", "--kubelet-socket", str(tmp_path / "kubelet.sock"),
                           "--hold-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                          env=settings_free())
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    lines = [e for e in events if e["event"] == "kubelet"]
    assert lines[0]["socket"] == str(tmp_path / "kubelet.sock")
    assert [str(e["reason"]).split(" (")[0] for e in lines[1:]] == [
        f"pod-resources at {tmp_path / 'kubelet.sock'} cannot be reached"]
    assert [e["state"] for e in events if e["event"] == "status"][-3:] == ["filling"] * 3


# --- the filler on the virtual GPU, real time, against the test kubelet -------------------------------------------

def test_the_filler_holds_within_half_a_second_what_the_test_kubelet_assigns(vgpu: VgpuFactory,
                                                                            tmp_path: Path) -> None:
    gpu = vgpu(gpus=2)
    uuids = gpu.uuids()
    socket_path = tmp_path / "kubelet.sock"
    with TestKubelet(socket_path) as server:
        run = forge(gpu, "--gpus", "all", "--duration", "8", "--log-interval", "0.5", "--hold-dir", str(tmp_path),
                    env={"FORGE_TARGET": "0.5", "FORGE_KUBELET_SOCKET": str(socket_path),
                         "POD_NAMESPACE": "forge-load", "POD_NAME": "forge-load-x1"})
        try:
            for _ in range(4):
                wait_for(run, "status")  # both GPUs filling
            server.assign("forge-load", "forge-load-x1", "forge-load", "nvidia.com/gpu", [uuids[1]])  # ours
            assigned_s = time.time()
            server.assign("ml", "train", "main", "nvidia.com/gpu", [uuids[0]])
            time.sleep(2.5)
            freed_s = time.time()
            server.free("ml", "train")
            assert finish(run) == 0, run.stderr[-3000:]
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.communicate(timeout=30)
    gpu0 = run.kernels(device=0)
    # GPU 0: no kernel of ours launched from half a second after the assignment until it was freed ...
    assert [k for k in gpu0 if assigned_s + 0.5 < k.submit < freed_s] == []
    assert any(k.start > freed_s for k in gpu0)  # ... and it filled again once freed
    # GPU 1 (assigned to our own pod) kept filling throughout.
    assert len([k for k in run.kernels(device=1) if assigned_s < k.start < freed_s]) > 10
    (hold,), (release,) = run.of("hold"), run.of("release")
    assert (hold["gpu"], hold["holder"], hold["state"]) == (0, "k8s-ml_train_main", "held")
    assert (release["gpu"], release["reason"], release["state"]) == (0, "released", "filling")
    start0 = next(e for e in run.of("start") if e["gpu"] == 0)
    held_after_s = float(start0["wall_time"]) + float(hold["t"]) - assigned_s
    assert held_after_s < 0.5
    print(f"held {held_after_s:.3f} s after the test kubelet assigned the GPU (virtual GPU, this machine)")


DRA_ON_VGPU = r'''
import json, sys
from forge_load.service.kubelet import nvml_dra_resolver
resolve = nvml_dra_resolver()
print(json.dumps({name: [list((held := resolve(name)).uuids), held.how] for name in json.loads(sys.argv[1])}))
'''


def test_dra_names_resolve_through_the_real_pynvml_on_the_virtual_gpu(vgpu: VgpuFactory) -> None:
    gpu = vgpu(gpus=2, mig=3, minors=[4, 1])  # index 0 is minor 4, index 1 minor 1
    migs = gpu.mig_devices()
    by_name = {"gpu-4": gpu.uuids()[0], "gpu-1": gpu.uuids()[1]}
    for m in migs:
        minor = gpu.minors()[m.gpu]
        by_name[f"gpu-{minor}-mig-{m.profile_id}-{m.placement[0]}-{m.placement[1]}"] = m.uuid
        by_name[f"gpu-{minor}-mig-{m.profile.replace('.', '')}-{m.profile_id}-{m.placement[0]}"] = m.uuid
    proc = gpu.run([sys.executable, "-c", DRA_ON_VGPU, json.dumps([*by_name, "gpu-0"])], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found.pop("gpu-0") == [gpu.uuids(), "every GPU"]  # index 0 is not minor 0: no GPU of that minor
    assert found == {name: [[uuid], "exact"] for name, uuid in by_name.items()}
    assert len(found) == 2 + 2 * 6


@pytest.mark.parametrize("prepared_first", [False, True])
def test_the_filler_holds_the_gpu_of_the_minor_a_claim_names(vgpu: VgpuFactory, tmp_path: Path,
                                                             prepared_first: bool) -> None:
    """Minor numbers unlike the indices: the claim's gpu-0 is the GPU NVML calls 1. Listed prepared, it is held within
    half a second, and GPU 0 fills throughout; listed first while being prepared, every GPU is held until it names
    its device, and from then on only that GPU."""
    gpu = vgpu(gpus=2, minors=[1, 0])
    uuids = gpu.uuids()
    socket_path = tmp_path / "kubelet.sock"
    with TestKubelet(socket_path) as server:
        run = forge(gpu, "--gpus", "all", "--duration", "8", "--log-interval", "0.5", "--hold-dir", str(tmp_path),
                    env={"FORGE_TARGET": "0.5", "FORGE_KUBELET_SOCKET": str(socket_path)})
        try:
            for _ in range(4):
                wait_for(run, "status")  # both GPUs filling
            if prepared_first:
                server.claim("ml", "train", "main", "train-gpu", None)  # NodePrepareResources under way
                time.sleep(0.6)
            claimed_s = time.time()
            server.claim("ml", "train", "main", "train-gpu", [("gpu.nvidia.com", "node-1", "gpu-0")])
            time.sleep(2.5)
            freed_s = time.time()
            server.free("ml", "train")
            assert finish(run) == 0, run.stderr[-3000:]
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.communicate(timeout=30)
    gpu1 = run.kernels(device=1)
    # GPU 1 (minor 0): nothing of ours from half a second after the claim was listed until it was freed ...
    assert [k for k in gpu1 if claimed_s + (0.0 if prepared_first else 0.5) < k.submit < freed_s] == []
    assert any(k.start > freed_s for k in gpu1)  # ... and it filled again
    # GPU 0 (minor 1) filled while GPU 1 was held
    assert len([k for k in run.kernels(device=0) if claimed_s + 0.5 < k.start < freed_s]) > 10
    said = [e["reason"] for e in run.of("kubelet") if "reason" in e]
    assert said[-1] == f"claim ml/train-gpu device gpu-0 (gpu.nvidia.com) is {uuids[1]}"
    assert said[:-1] == ([f"claim ml/train-gpu is being prepared (its driver and devices not listed yet): every GPU "
                          f"held (fail safe): {uuids[0]}, {uuids[1]}"] if prepared_first else [])
    holds = {(e["gpu"], e["holder"]) for e in run.of("hold")}
    assert holds == ({(0, "k8s-ml_train_main"), (1, "k8s-ml_train_main")} if prepared_first
                     else {(1, "k8s-ml_train_main")})
    if not prepared_first:
        (hold,) = run.of("hold")
        start1 = next(e for e in run.of("start") if e["gpu"] == 1)
        held_after_s = float(start1["wall_time"]) + float(hold["t"]) - claimed_s
        assert held_after_s < 0.5
        print(f"held {held_after_s:.3f} s after the test kubelet listed the claim (virtual GPU, this machine)")
