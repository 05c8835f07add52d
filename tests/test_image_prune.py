"""scripts/image_prune.py (what the image leaves out of the CUDA wheels) on a made-up site-packages, its rules
against the wheels installed here, and scripts/runtime_files.py (its reading of /proc/<pid>/maps, and a whole
run on the virtual GPU).

The image itself is checked in tests/test_container.py (nothing left out is there, everything the filler loads
is) and tests/test_container_vgpu.py (the slim image runs in real mode; what it maps is RUNTIME_FILES).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "image_prune.py"


def _load(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def prune() -> ModuleType:
    return _load("image_prune", SCRIPT)


FILES = {
    "demo/__init__.py": b"",
    "demo/lib/libdemo.so.1": b"k" * 10,
    "demo/lib/libdemo.alt.so.1": b"a" * 1000,
    "demo/include/demo.h": b"h" * 100,
    "demo/include/sub/more.h": b"h" * 100,
    "other/include/other.h": b"o",
}


def make_site(root: Path) -> Path:
    """Two distributions: demo-cu12 (all of demo/) and other (other/), each with METADATA and RECORD."""
    site = root / "site-packages"
    for name, prefix in (("demo-cu12", "demo/"), ("other", "other/")):
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        rows = []
        for path, data in FILES.items():
            if path.startswith(prefix):
                (site / path).parent.mkdir(parents=True, exist_ok=True)
                (site / path).write_bytes(data)
                rows.append([path, "sha256=x", str(len(data))])
        rows += [[f"{info.name}/METADATA", "", ""], [f"{info.name}/RECORD", "", ""]]
        with open(info / "RECORD", "w", newline="") as out:
            csv.writer(out, lineterminator="\n").writerows(rows)
    return site


def record(site: Path, dist: str) -> list[str]:
    info = next(site.glob(f"{dist.replace('-', '_')}-*.dist-info"))
    return [row[0] for row in csv.reader((info / "RECORD").read_text().splitlines()) if row]


@pytest.fixture
def demo_rules(prune: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setattr(prune, "RUNTIME_FILES", {"demo-cu12": ("demo/lib/libdemo.so.1",)})
    monkeypatch.setattr(prune, "LEAVE_OUT", (prune.Rule("demo_cu12", "demo/lib/libdemo.alt.so.*", "a second build"),
                                             prune.Rule("demo-cu12", "demo/include/*", "headers")))
    return prune


def test_prune_deletes_the_matches_and_drops_them_from_record(demo_rules: ModuleType, tmp_path: Path) -> None:
    site = make_site(tmp_path)
    deleted = demo_rules.prune(site)
    assert deleted == 1000 + 100 + 100
    assert not (site / "demo/lib/libdemo.alt.so.1").exists()
    assert not (site / "demo/include").exists(), "directories left empty go too"
    assert (site / "demo/lib/libdemo.so.1").read_bytes() == FILES["demo/lib/libdemo.so.1"]
    assert (site / "demo/__init__.py").exists()
    assert (site / "other/include/other.h").exists(), "the rules are per distribution"
    assert [p for p in record(site, "demo-cu12") if p.startswith("demo/")] == ["demo/__init__.py",
                                                                               "demo/lib/libdemo.so.1"]
    assert "other/include/other.h" in record(site, "other")


def test_dry_run_deletes_nothing(demo_rules: ModuleType, tmp_path: Path) -> None:
    site = make_site(tmp_path)
    assert demo_rules.prune(site, dry_run=True) == 1200
    assert all((site / path).exists() for path in FILES)
    assert "demo/include/demo.h" in record(site, "demo-cu12")


@pytest.mark.parametrize("change, message", [
    ("no match", "demo/include/*.hpp matches no file (the wheel changed: measure again)"),
    ("clash", "demo/lib/* would delete demo/lib/libdemo.so.1, which the filler loads"),
    ("missing", "demo/lib/libdemo.so.2 (demo-cu12) is missing: the filler loads it"),
    ("not installed", "absent-cu12 is not installed (rule x/*): measure again"),
])
def test_a_failed_check_deletes_nothing(demo_rules: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                       change: str, message: str) -> None:
    site = make_site(tmp_path)
    rule = demo_rules.Rule
    extra = {"no match": rule("demo-cu12", "demo/include/*.hpp", ""), "clash": rule("demo-cu12", "demo/lib/*", ""),
             "not installed": rule("absent-cu12", "x/*", "")}
    if change == "missing":
        monkeypatch.setattr(demo_rules, "RUNTIME_FILES", {"demo-cu12": ("demo/lib/libdemo.so.2",)})
    else:
        monkeypatch.setattr(demo_rules, "LEAVE_OUT", (*demo_rules.LEAVE_OUT, extra[change]))
    with pytest.raises(demo_rules.PruneError) as error:
        demo_rules.prune(site)
    assert message in str(error.value)
    assert all((site / path).exists() for path in FILES)


def test_command_line_exit_codes(tmp_path: Path) -> None:
    """Exit 2 and one line for a SITE_PACKAGES that is not a directory; exit 1 and one line, nothing deleted,
    when the real rules meet a site-packages without the CUDA wheels."""
    site = make_site(tmp_path)
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nowhere" in bad.stderr, bad.stderr
    wrong = subprocess.run([sys.executable, str(SCRIPT), str(site)], capture_output=True, text=True)
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert wrong.stderr.startswith("image_prune: nothing deleted: ") and "Traceback" not in wrong.stderr
    assert all((site / path).exists() for path in FILES)


def test_the_rules_fit_the_wheels_installed_here(prune: ModuleType) -> None:
    """This environment installs the same requirements.txt as the image: a wheel upgrade that the rules no longer
    fit fails here, before an image is built."""
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "nvidia" / "cuda_nvrtc").is_dir():
        pytest.skip(f"the CUDA wheels of requirements.txt are not installed in {site}")
    plan = prune.plan(site)
    assert sum(len(paths) for rules in plan.values() for _, paths in rules) > 0


def test_runtime_files_reads_the_files_behind_mappings() -> None:
    runtime_files = _load("runtime_files", ROOT / "scripts" / "runtime_files.py")
    maps = ("7f00-7f01 r--p 00000000 08:01 1234   /opt/forge/lib/python3.11/site-packages/nvidia/nvjitlink/lib/"
            "libnvJitLink.so.12\n"
            "7f01-7f02 r-xp 00001000 08:01 1234   /opt/forge/lib/python3.11/site-packages/nvidia/nvjitlink/lib/"
            "libnvJitLink.so.12\n"
            "7f02-7f03 rw-p 00000000 00:00 0 \n"
            "7f03-7f04 rw-s 00000000 00:05 99     /dev/shm/vgpu state (deleted)\n"
            "7f04-7f05 r--p 00000000 08:01 77     /usr/lib/x86_64-linux-gnu/libc.so.6\n"
            "7ffd-7ffe rw-p 00000000 00:00 0      [stack]\n")
    assert runtime_files.mapped_files(maps) == {
        "/opt/forge/lib/python3.11/site-packages/nvidia/nvjitlink/lib/libnvJitLink.so.12",
        "/usr/lib/x86_64-linux-gnu/libc.so.6"}
    assert runtime_files.is_shared_object("/x/libnvrtc.so.12") and runtime_files.is_shared_object("/x/m.so")
    assert not runtime_files.is_shared_object("/x/libdevice.10.bc")
    assert not runtime_files.is_shared_object("/etc/ld.so.cache")


def test_runtime_files_on_the_virtual_gpu_finds_what_the_image_keeps(vgpu: Any, tmp_path: Path,
                                                                     prune: ModuleType) -> None:
    """The measurement itself, in this environment, on the virtual GPU: the filler starts, fills, yields to the
    foreign job, resumes and stops, and of the CUDA wheels and llvmlite it loads exactly RUNTIME_FILES (the
    image's own run is in tests/test_container_vgpu.py)."""
    gpu = vgpu()
    out = tmp_path / "runtime_files.json"
    proc = gpu.run([sys.executable, str(ROOT / "scripts" / "runtime_files.py"), "--json", str(out),
                    "--fill-s", "1", "--after-s", "0.5"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["exit_code"] == 0 and {"start", "yield", "resume", "stop"} <= set(result["events"])
    elsewhere = [p for p in result["shared_objects_outside_distributions"]
                 if any(name in p for name in ("libnvvm", "libnvrtc", "libnvJitLink", "libcudart"))]
    if elsewhere:
        pytest.skip(f"this machine's own CUDA libraries were loaded instead of the wheels': {elsewhere}")
    dists = result["distributions"].values()
    loaded = {p for d in dists for p in d["shared_objects_loaded"] + d["data_files_loaded"]
              if p.startswith(("nvidia/", "llvmlite/"))}
    assert loaded == {p for paths in prune.RUNTIME_FILES.values() for p in paths}
