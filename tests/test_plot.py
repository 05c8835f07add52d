"""`forge-load plot` (forge_load/plot/): the log read back, JSON and key=value, behind collectors' prefixes; the
picture a valid PNG or SVG holding the expected series; bad input one line and exit 2; matplotlib missing one line
and exit 1."""

from __future__ import annotations

import builtins
import io
import json
import math
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from forge_load.commands import plot as command
from forge_load.config.load import load_config
from forge_load.plot.lines import parse_line
from forge_load.plot.logs import read_log
from forge_load.service.loop import run_simulated

if TYPE_CHECKING:
    from forge_load.plot.series import Curve

ROOT = Path(__file__).resolve().parent.parent

TEXT = [
    't=0.00 event=start state=filling target=0.500 gpu_mem_mib=512.0 gpu=0 uuid=GPU-1 signals=process,memory',
    't=5.00 event=status state=filling target=0.500 util=0.510 own=0.500 foreign=0.010 multiplier=746 gpu=0 '
    'uuid=GPU-1 power_w=383.7',
    't=7.00 event=yield state=yielding target=0.500 util=0.900 own=0.000 foreign=0.900 multiplier=0 gpu=0 '
    'uuid=GPU-1 reason="process 40000 on the GPU; 2048 MiB"',
    't=7.08 event=drained state=yielding target=0.500 gpu=0 uuid=GPU-1 last_kernel_end_t=7.05',
    't=10.00 event=status state=yielding target=0.500 util=0.900 own=0.000 foreign=0.900 multiplier=0 gpu=0 '
    'uuid=GPU-1 power_w=600.0',
    't=12.00 event=resume state=filling target=0.500 gpu=0 uuid=GPU-1 reason="no foreign activity for 3.0 s"',
    't=14.00 event=pause state=paused target=0.500 gpu=0 uuid=GPU-1 reason="SIGUSR1 (SIGUSR2 resumes)"',
    't=15.00 event=status state=paused target=0.500 util=0.000 own=0.000 foreign=0.000 multiplier=0 gpu=0 '
    'uuid=GPU-1 power_w=70.0',
    't=16.00 event=unpause state=filling target=0.500 gpu=0 uuid=GPU-1 reason=SIGUSR2',
    't=20.00 event=stop state=filling target=0.500 gpu=0 uuid=GPU-1 reason="duration reached" yields=1',
]


def as_json(line: str) -> str:
    record = parse_line(line)
    assert record is not None
    fields: dict[str, object] = {}
    for key, value in record.items():
        try:
            fields[key] = float(value) if key not in ("gpu", "uuid") and isinstance(value, str) else value
        except ValueError:
            fields[key] = value
    return json.dumps(fields, separators=(",", ":"))


def points(curve: Curve) -> list[tuple[float, float | None]]:
    """A curve's points, a gap (NaN: nothing known before it) as None, so that lists compare."""
    return [(t, None if math.isnan(v) else v) for t, v in curve.points()]


def check_series(lines: list[str]) -> None:
    run = read_log(lines)
    assert list(run.gpus) == ["0"]
    gpu = run.gpus["0"]
    # each status line's mean stands for the interval that ends at it; the first interval begins at the start
    assert points(gpu.util) == [(0.0, None), (5.0, 0.51), (10.0, 0.9), (15.0, 0.0)]
    assert points(gpu.own) == [(0.0, None), (5.0, 0.5), (10.0, 0.0), (15.0, 0.0)]
    assert points(gpu.foreign) == [(0.0, None), (5.0, 0.01), (10.0, 0.9), (15.0, 0.0)]
    assert points(gpu.power_w) == [(0.0, None), (5.0, 383.7), (10.0, 600.0), (15.0, 70.0)]
    assert gpu.spans == [("yielding", 7.0, 12.0), ("paused", 14.0, 16.0)]
    assert {value for _, value in gpu.target.points()} == {0.5} and gpu.end_t == 20.0


def test_key_value_lines() -> None:
    check_series(TEXT)


def test_json_lines() -> None:
    check_series([as_json(line) for line in TEXT])


@pytest.mark.parametrize("prefix", [
    "2026-11-27T03:41:07.123456789Z ",  # docker logs -t
    "forge_load_gpu_0  | ",  # docker compose logs
    "[pod/forge-load-abcde/forge-load] ",  # kubectl logs --prefix
    "Nov 27 03:41:07 node7 forge-load[4242]: ",  # journalctl
])
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_collectors_prefixes_are_skipped(prefix: str, fmt: str) -> None:
    lines = TEXT if fmt == "text" else [as_json(line) for line in TEXT]
    check_series([prefix + line for line in lines])


def test_lines_that_are_not_the_fillers_are_counted_and_left_out() -> None:
    noise = ["forge-load: warning: FORGE_FOO is not a setting", "", "Traceback (most recent call last):",
             '{"not": "ours"}', "at=5 event=x"]
    run = read_log(noise + TEXT)
    assert run.skipped == 4 and run.lines == len(TEXT) + 4
    check_series(noise + TEXT)


def test_a_restarted_filler_continues_after_the_last_run() -> None:
    run = read_log(TEXT + TEXT)
    gpu = run.gpus["0"]
    assert gpu.restarts_t == [20.0] and gpu.end_t == 40.0
    assert gpu.spans[2:] == [("yielding", 27.0, 32.0), ("paused", 34.0, 36.0)]


def test_several_gpus_each_its_series() -> None:
    other = [line.replace("gpu=0", "gpu=1") for line in TEXT]
    run = read_log([line for pair in zip(TEXT, other) for line in pair])
    assert list(run.gpus) == ["0", "1"] and run.gpus["1"].spans == run.gpus["0"].spans


def write_log(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "run.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_svg_holds_every_series(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.svg"
    assert command.main([str(write_log(tmp_path, TEXT)), "-o", str(out)]) == 0
    ids = {element.get("id") for element in ET.parse(out).iter() if element.get("id")}
    assert {"target", "util", "own", "foreign", "power_w", "span-yielding", "span-paused"} <= ids
    assert "span-held" not in ids
    assert capsys.readouterr().out == f"forge-load plot: wrote {out} (GPU 0: {len(TEXT)} lines)\n"


def test_png_by_default_beside_the_log(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path, [as_json(line) for line in TEXT])
    assert command.main([str(log)]) == 0
    data = (tmp_path / "run.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 420)  # 10 in x (1 + 3.2) in at 100 dpi: one GPU's panel


def test_stdin(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.svg"
    assert command.main(["-", "-o", str(out)], stdin=io.StringIO("\n".join(TEXT))) == 0
    assert out.read_bytes().startswith(b"<?xml")


def test_a_simulated_run_drawn_through_the_command_line(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "60", "--sim-foreign", "20-30",
                          "--log-interval", "2", "--resume-after", "5"], env={"FORGE_LOG_FORMAT": "json"})
    log = tmp_path / "sim.log"
    with log.open("w") as stream:
        run_simulated(config, stream)
    out = tmp_path / "sim.svg"
    done = subprocess.run([sys.executable, "-m", "forge_load", "plot", str(log), "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    ids = {element.get("id") for element in ET.parse(out).iter() if element.get("id")}
    assert {"target", "util", "own", "foreign", "power_w", "span-yielding"} <= ids


@pytest.mark.parametrize(("argv", "message"), [
    (["{log}", "-o", "x.jpg"], "-o='x.jpg': expected a file name ending in .png or .svg"),
    (["missing.log"], "LOG='missing.log': cannot be read (No such file or directory): expected a log "
                            "file, or - for stdin"),
    (["{log}", "--gpu", "7"], "--gpu='7': expected one of the log's GPUs, or a list of them: 0"),
    (["{empty}"], "LOG='{empty}': 1 lines, none of them a filler's line with numbers: expected key=value or JSON "
                  "lines as forge-load writes them (t=... event=...)"),
    ([], "the following arguments are required: LOG (see --help)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                         message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # names short enough to be shown whole, wherever the temporary directory is
    log = write_log(tmp_path, TEXT)
    empty = tmp_path / "empty.log"
    empty.write_text("hello\n")
    fill = {"log": str(log), "tmp": str(tmp_path), "empty": empty.name}
    assert command.main([arg.format(**fill) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err == f"forge-load plot: {message.format(**fill)}\n"


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert command.main([str(write_log(tmp_path, TEXT)), "-o", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == ("forge-load plot: matplotlib is not installed: pip install 'forge-load[plot]' "
                                       "(or: pip install matplotlib)\n")
    assert not (tmp_path / "x.png").exists()


def test_the_commands_other_than_plot_never_import_matplotlib() -> None:
    code = ("import sys; from forge_load.commands import plot; from forge_load.plot import logs; "
            "import forge_load.plot.draw; import forge_load.cli; assert 'matplotlib' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_held_span_and_a_boosted_target() -> None:
    lines = ['t=0.00 event=start state=filling target=0.500 gpu=0',
             't=2.00 event=hold state=held target=0.500 gpu=0 reason="held by slurm-7"',
             't=5.00 event=release state=filling target=0.500 gpu=0',
             't=9.00 event=boost state=boosted target=0.600 gpu=0',
             't=12.00 event=stop state=boosted target=0.600 gpu=0']
    gpu = read_log(lines).gpus["0"]
    assert gpu.spans == [("held", 2.0, 5.0)]
    assert gpu.target.points() == [(0.0, 0.5), (9.0, 0.6)]  # a target is kept where it changes


def summary(run: Any) -> object:
    """Everything read from a log, to compare two ways of reading it (a gap's NaN as None)."""
    def curve(c: Curve) -> list[tuple[float, float | None]]:
        return points(c)

    return (run.lines, run.skipped, run.impossible, run.beyond, {
        key: (s.gpu, s.uuid, s.metric, s.end_t, s.spans, s.restarts_t, curve(s.target),
              {name: curve(c) for name, c in s.curves()}) for key, s in run.gpus.items()})


def simulated_log(fmt: str, seconds: int = 300) -> str:
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", str(seconds), "--sim-foreign", "60-90",
                          "--log-interval", "1", "--resume-after", "20"], env={"FORGE_LOG_FORMAT": fmt})
    out = io.StringIO()
    run_simulated(config, out)
    return out.getvalue()


def two_gpus(text: str) -> str:
    """A JSON log of one GPU, and a second GPU's beside it, line for line."""
    lines = text.splitlines()
    other = [line.replace('"gpu":0', '"gpu":1').replace('000000"', '000001"') for line in lines]
    return "".join(f"{a}\n{b}\n" for a, b in zip(lines, other))


def corrupt(text: str) -> str:
    """A key=value log with a few numbers no filler writes, and a few `-`."""
    text = re.sub(r"util=0\.\d+", "util=-", text, count=5)
    text = re.sub(r"power_w=\d+\.\d", "power_w=1e30", text, count=3)  # whatever the model draws
    return re.sub(r"own=0\.49\d", "own=nan", text, count=2)


@pytest.mark.parametrize("name", ["text", "json", "two gpus", "prefixed", "corrupt", "held metric", "crlf"])
def test_a_file_read_in_blocks_reads_as_its_lines_do(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_file() reads most status lines by their shape, in batches: the same series as read_log(), line by line."""
    from forge_load.plot import logs

    text = {"text": lambda: simulated_log("text"), "json": lambda: simulated_log("json"),
            "two gpus": lambda: two_gpus(simulated_log("json", 120)),
            "prefixed": lambda: "".join(f"2026-11-27T03:41:07.{i:09d}Z {line}\n"
                                        for i, line in enumerate(simulated_log("text", 60).splitlines())),
            "corrupt": lambda: corrupt(simulated_log("text", 100)),
            "held metric": lambda: simulated_log("text", 100).replace(" gpu=0", " sm_activity=0.5 "
                                                                     "sm_activity_own=0.49 gpu=0"),
            "crlf": lambda: simulated_log("json", 60).replace("\n", "\r\n")}[name]()
    monkeypatch.setattr(logs, "_BLOCK_BYTES", 4096)  # lines cut across blocks too
    from_blocks = logs.read_file(io.BytesIO(text.encode()))
    assert summary(from_blocks) == summary(read_log(text.splitlines()))
    assert from_blocks.lines > 50
    if name == "two gpus":
        assert list(from_blocks.gpus) == ["0", "1"]
    if name == "corrupt":
        assert from_blocks.impossible == sum("=1e30" in line or "=nan" in line for line in text.splitlines()) > 2
        status_t = [float(line.split()[0][2:]) for line in text.splitlines() if " event=status " in line]
        known_t = [t for t, value in points(from_blocks.gpus["0"].util) if value is not None]
        assert min(known_t) >= status_t[4]  # five `-` first: known from the sixth line's interval on
