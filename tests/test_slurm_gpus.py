"""Which GPUs the Slurm prolog holds (deploy/slurm/prolog.sh) and what its syslog line says of them:
SLURM_JOB_GPUS paired entry by entry with CUDA_VISIBLE_DEVICES (a MIG device's or a GPU's UUID held by UUID, an
index by its device minor as before; a missing or unequal variable falls back to the indices, said once), and the
job's line naming what was held and every GPU that was not. As slurmd runs the scripts, with the real forge-load
commands on a virtual GPU; and under a real Slurm as far as its gres.conf expresses MIG devices."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm_harness import ClusterFactory
from tests.test_slurm import (
    EPILOG,
    PROLOG,
    UUIDS,
    Syslog,
    fake_driver,
    forge_load_command,
    hold_files,
    install_scripts,
    start_filler,
    vgpu_forge_load,
    write_settings,
)
from vgpu import Kernel, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory


@pytest.fixture
def syslog(tmp_path: Path) -> Iterator[Syslog]:
    log = Syslog(tmp_path / "syslog")
    yield log
    log.close()


def run_prolog(script: Path, conf: Path, job_id: str, gpus: str, visible: str | None,
               context: str = "prolog_slurmd") -> int:
    """The script as slurmd runs it: a bare environment with Slurm's variables, CUDA_VISIBLE_DEVICES as given."""
    env = {"SLURM_CONF": str(conf), "SLURM_JOB_ID": job_id, "SLURM_JOB_USER": "root", "SLURM_SCRIPT_CONTEXT": context,
           "SLURM_JOB_GPUS": gpus}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run([str(script)], env=env, capture_output=True, timeout=30, check=False).returncode


def settings(tmp_path: Path, gpu: VirtualGpu, syslog: Syslog) -> tuple[Path, Path]:
    """forge-load.conf for the scripts on this virtual GPU (no driver directory: indices go to NVML)."""
    hold_dir = tmp_path / "holds"
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=str(vgpu_forge_load(tmp_path, gpu)),
                          FORGE_HOLD_DIR=str(hold_dir), FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path),
                          FORGE_SLURM_NVIDIA_PROC=str(tmp_path / "no-driver"))
    return conf, hold_dir


def test_the_jobs_line_names_only_what_was_held_and_every_gpu_that_was_not(
        vgpu: VgpuFactory, tmp_path: Path, syslog: Syslog) -> None:
    gpu = vgpu(gpus=2)
    conf, hold_dir = settings(tmp_path, gpu, syslog)
    assert run_prolog(PROLOG, conf, "81", "0,*,7", None) == 0
    assert [h["gpu"] for h in hold_files(hold_dir)] == [gpu.uuids()[0]]
    line = syslog.wait_for("job 81: held")
    assert line.startswith(f"job 81: held GPU {gpu.uuids()[0]} as slurm-81 in "), line
    assert "; not held: '*' (not an index), 7 (no GPU of this host has that index);" in line, line
    assert run_prolog(EPILOG, conf, "81", "0,*,7", None, "epilog_slurmd") == 0
    assert hold_files(hold_dir) == []


MIG_X = "MIG-0a0a0a0a-1111-4222-8333-444444444444"


def driver_settings(tmp_path: Path, syslog: Syslog) -> tuple[Path, Path]:
    """forge-load.conf with a driver directory: minor 0 is UUIDS[1], minor 1 UUIDS[0] (no NVML needed)."""
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()  # as the filler's unit makes it: no wait for a filler to find a new directory
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[1], 1: UUIDS[0]})
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=forge_load_command()[0], FORGE_HOLD_DIR=str(hold_dir),
                          FORGE_SLURM_NVIDIA_PROC=str(driver), FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))
    return conf, hold_dir


@pytest.mark.parametrize(("job_gpus", "visible", "held", "said"), [
    # a MIG device's UUID (AutoDetect=nvml) beside a whole GPU's index: each by what names it
    ("3,1", f"{MIG_X},1", [MIG_X, UUIDS[0]], []),
    # a whole GPU's UUID (Slurm 25.11 on, where it knows one), in any case NVML's spelling
    ("0", UUIDS[1].upper(), [UUIDS[1]], []),
    # indices alone, as Slurm writes them for File= and MultipleFiles= records: by device minor, as before
    ("0,1", "0,1", [UUIDS[1], UUIDS[0]], []),
    # lengths that differ: the indices by device minor, said once
    ("0,1", MIG_X, [UUIDS[1], UUIDS[0]], ["(2) and CUDA_VISIBLE_DEVICES='" + MIG_X + "' (1) do not pair"]),
    # not set (a gres.conf Flags= that leaves it out): the same, said once
    ("1", None, [UUIDS[0]], ["CUDA_VISIBLE_DEVICES is not set"]),
    # Slurm's name of a MIG device on a driver before 470.42.01, its GPU's UUID and instances: that GPU, said once
    ("5", f"MIG-{UUIDS[1]}/7/0", [UUIDS[1]], ["named by GPU and instance (a driver before 470.42.01)"]),
    # anything else: the index, said once
    ("1", "NoDevFiles", [UUIDS[0]], ["neither an index nor a GPU or MIG"]),
])
def test_slurm_job_gpus_is_paired_with_cuda_visible_devices_entry_by_entry(
        tmp_path: Path, syslog: Syslog, job_gpus: str, visible: str | None, held: list[str], said: list[str]) -> None:
    conf, hold_dir = driver_settings(tmp_path, syslog)
    assert run_prolog(PROLOG, conf, "91", job_gpus, visible) == 0
    assert sorted(h["gpu"] for h in hold_files(hold_dir)) == sorted(held)
    line = syslog.wait_for("job 91: held")
    assert line.startswith(f"job 91: held GPU {','.join(held)} as slurm-91 in ") and "not held" not in line, line
    warnings = [ln for ln in syslog.lines if not ln.startswith("job 91: held")]
    assert len(warnings) == len(said) and all(part in ln for part, ln in zip(said, warnings, strict=True)), warnings
    assert run_prolog(EPILOG, conf, "91", job_gpus, visible, "epilog_slurmd") == 0  # releases the same
    assert hold_files(hold_dir) == []


def mig_kernels(gpu: VirtualGpu, gi: int, a_s: float, b_s: float) -> list[Kernel]:
    return [k for k in gpu.kernels() if k.mig == gi and k.end > a_s and k.start < b_s]


def test_the_prolog_given_a_mig_devices_uuid_drains_that_mig_device_while_its_sibling_fills(
        vgpu: VgpuFactory, tmp_path: Path, syslog: Syslog) -> None:
    """A node whose GPU is split into two MIG devices, each a GRES of its own (AutoDetect=nvml): the job's
    SLURM_JOB_GPUS is Slurm's index of its MIG device (whole GPUs first: 1 here) and CUDA_VISIBLE_DEVICES that MIG
    device's UUID. The filler fills both MIG devices; the prolog returns once the job's has drained, and from then
    until the epilog nothing of ours runs there while its sibling fills."""
    gpu = vgpu(gpus=1, mig=2)
    job_mig, sibling = gpu.mig_devices()
    conf, hold_dir = settings(tmp_path, gpu, syslog)
    filler = start_filler(gpu, hold_dir, tmp_path / "filler.log")
    try:
        deadline = time.monotonic() + 120
        while not all(mig_kernels(gpu, m.gi, 0, time.time()) for m in (job_mig, sibling)):
            assert filler.proc.poll() is None and time.monotonic() < deadline, filler.log.read_text()[-3000:]
            time.sleep(0.2)
        assert run_prolog(PROLOG, conf, "95", "1", job_mig.uuid) == 0
        returned_s = time.time()
        line = syslog.wait_for("job 95: held")
        assert line.startswith(f"job 95: held GPU {job_mig.uuid} as slurm-95 in ") and "its filler drained" in line
        time.sleep(2.0)
        released_s = time.time()
        assert run_prolog(EPILOG, conf, "95", "1", job_mig.uuid, "epilog_slurmd") == 0
        assert mig_kernels(gpu, job_mig.gi, returned_s, released_s) == []
        assert sum(k.end - k.start for k in mig_kernels(gpu, sibling.gi, returned_s, released_s)) > 0.3
        deadline = time.monotonic() + 30  # and it fills again after the epilog (FORGE_RESUME_AFTER 2 s)
        while not mig_kernels(gpu, job_mig.gi, released_s, time.time()):
            assert time.monotonic() < deadline, "the MIG device did not fill again after the epilog"
            time.sleep(0.2)
    finally:
        filler.stop()
    assert [h for h in hold_files(hold_dir) if h["holder"] == "slurm-95"] == []
    assert [(h["uuid"], h["holder"]) for h in json_lines(filler.log, "hold")] == [(job_mig.uuid, "slurm-95")]


def json_lines(log: Path, event: str) -> list[dict[str, object]]:
    return [e for e in (json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{"))
            if e.get("event") == event]


# --- a real Slurm ----------------------------------------------------------------------------------------------

# gres.conf as it writes a node with one whole GPU and one GPU in MIG mode split in two, where AutoDetect is not
# used: a MIG device's record names its GPU's device and its GPU and compute instances' capability devices. Slurm
# 22.05's gres.conf has no UniqueId: the prolog gets indices in CUDA_VISIBLE_DEVICES too (AutoDetect=nvml adds
# the MIG UUIDs, which needs NVML, and a real GPU in MIG mode).
MIG_GRES = ("File={dev}/nvidia0",
            "MultipleFiles={dev}/nvidia1,{dev}/nvidia-caps/nvidia-cap21,{dev}/nvidia-caps/nvidia-cap22",
            "MultipleFiles={dev}/nvidia1,{dev}/nvidia-caps/nvidia-cap30,{dev}/nvidia-caps/nvidia-cap31")


@pytest.mark.parametrize("flags", ["", " Flags=amd_gpu_env"])
def test_real_slurm_mig_records_pair_their_indices_and_a_missing_variable_is_said(
        slurm_cluster: ClusterFactory, vgpu: VgpuFactory, tmp_path: Path, syslog: Syslog, flags: str) -> None:
    """Under a real slurmd: three GRES (a GPU and two MIG devices of another) and a job given all three. Slurm
    writes SLURM_JOB_GPUS=0,1,2 and CUDA_VISIBLE_DEVICES=0,1,2 (or, with a Flags= that leaves it out, nothing):
    the indices by device minor, as before (the second GPU held whole for its MIG device at index 1; index 2,
    whose minor no GPU has, goes to NVML, which has no GPU 2 either: not held, and said), and with the variable
    missing, one line more. A 2-GPU virtual GPU is the node's NVML; the driver's directory names its GPUs'
    minors, 0 and 1, in the other order."""
    gpu = vgpu(gpus=2)
    uuids = gpu.uuids()
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    driver = fake_driver(tmp_path / "driver", {0: uuids[1], 1: uuids[0]})
    settings = {"FORGE_LOAD": str(vgpu_forge_load(tmp_path, gpu)), "FORGE_HOLD_DIR": str(hold_dir),
                "FORGE_SLURM_NVIDIA_PROC": str(driver), "FORGE_SLURM_SYSLOG_SOCKET": str(syslog.path)}
    etc = tmp_path / "node-etc"
    prolog, epilog = install_scripts(etc)
    cluster = slurm_cluster(prolog=prolog, epilog=epilog, settings=settings,
                            gres=[record + flags for record in MIG_GRES])
    proc = cluster.srun(["sh", "-c", 'echo "JOB=$SLURM_JOB_ID STEP_GPUS=$SLURM_STEP_GPUS"; '
                         f'for f in {hold_dir}/hold.*.json; do cat "$f"; echo; done'], gres="gpu:3")
    out, err = proc.communicate(timeout=60)
    cluster.wait_idle(30)  # the epilog has run
    assert proc.returncode == 0, f"srun exited {proc.returncode}: {err}\n{out}\n{syslog.lines}"
    assert cluster.node_reason() in ("", "none"), cluster.node_reason()
    job_id = out.split("JOB=")[1].split()[0]
    assert sorted(h["gpu"] for h in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))) == \
        sorted(uuids)
    line = syslog.wait_for(f"job {job_id}: held")
    assert line.startswith(f"job {job_id}: held GPU {uuids[1]},{uuids[0]} as slurm-{job_id} in "), line
    assert "; not held: 2 (no GPU of this host has that index);" in line, line
    missing_said = [ln for ln in syslog.lines if "CUDA_VISIBLE_DEVICES is not set" in ln and f"job {job_id}:" in ln]
    assert len(missing_said) == (1 if flags else 0), syslog.lines
    assert not [ln for ln in syslog.lines if "do not pair" in ln]
    syslog.wait_for(f"job {job_id}: released")
    assert hold_files(hold_dir) == []
