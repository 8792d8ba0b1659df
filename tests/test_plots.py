"""The PNG plots of a replay summary: three valid images for full, sparse and empty input,
and a clear error without matplotlib."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from tierd.workload.plots import write_plots

# matplotlib is the optional extra `plots`: without it only the error path is testable.
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="needs matplotlib: pip install 'tierd[plots]'",
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAMES = ["hit_ratio.png", "load_latency.png", "occupancy.png"]


def _summary(samples: int, *, loads: dict[str, list[float]] | None = None) -> dict[str, Any]:
    timeline = []
    accesses, cpu_hits, disk_hits = 0, 0, 0
    for i in range(samples):
        accesses += 40 + i
        cpu_hits += 10 + i % 7
        disk_hits += 3 + i % 5
        timeline.append(
            {
                "t": 0.25 * i,
                "requests": 4 * i,
                "accesses": accesses,
                "hits": {"CPU": cpu_hits, "DISK": disk_hits},
                "occupancy": {"cpu": min(16, 2 * i), "disk": min(64, 3 * i)},
            }
        )
    total = accesses or 1
    return {
        "requests": 4 * samples,
        "hit_ratio": (cpu_hits + disk_hits) / total,
        "hit_ratio_by_medium": {"CPU": cpu_hits / total, "DISK": disk_hits / total},
        "tiers": [
            {"name": "cpu", "medium": "CPU", "capacity": 16, "used": min(16, 2 * samples)},
            {"name": "disk", "medium": "DISK", "capacity": 64, "used": min(64, 3 * samples)},
        ],
        "timeline": timeline,
        "load_latency_samples": loads
        if loads is not None
        else {
            "CPU": [0.0001 * (1 + i % 13) for i in range(200)],
            "DISK": [0.002 * (1 + i % 17) for i in range(120)],
        },
    }


def _read_png(path: Path) -> Any:
    import matplotlib.image

    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert image.ndim == 3
    assert image.shape[2] in (3, 4)
    assert 200 <= height <= 2000
    assert 200 <= width <= 2000
    return image


def _check_all(paths: list[Path], out_dir: Path) -> list[Any]:
    assert paths == [out_dir / name for name in NAMES]
    return [_read_png(path) for path in paths]


@needs_matplotlib
def test_full_summary_writes_three_pngs(tmp_path: Path) -> None:
    out_dir = tmp_path / "plots" / "nested"  # created, parents too
    _check_all(write_plots(_summary(30), out_dir), out_dir)


@needs_matplotlib
@pytest.mark.parametrize(
    ("name", "summary"),
    [
        ("one_sample", _summary(1)),
        ("no_loads", _summary(5, loads={})),
        ("empty_medium", _summary(5, loads={"CPU": [], "DISK": [0.001, 0.002]})),
        ("all_media_empty", _summary(5, loads={"GPU": [], "CPU": []})),
        ("zero_latencies", _summary(3, loads={"CPU": [0.0, 0.0, 0.0]})),
        ("empty_timeline", _summary(0)),
        ("empty_dict", {}),
    ],
)
def test_sparse_inputs_still_write_valid_pngs(
    tmp_path: Path, name: str, summary: dict[str, Any]
) -> None:
    out_dir = tmp_path / name
    _check_all(write_plots(summary, out_dir), out_dir)


@needs_matplotlib
def test_tier_without_capacity_or_samples_is_left_out(tmp_path: Path) -> None:
    summary = _summary(4)
    summary["tiers"].append({"name": "gpu", "medium": "GPU", "capacity": 0, "used": 0})
    summary["tiers"].append({"name": "nvme2", "medium": "DISK", "capacity": 8, "used": 0})
    _check_all(write_plots(summary, tmp_path), tmp_path)


@needs_matplotlib
def test_plots_with_data_differ_from_no_data(tmp_path: Path) -> None:
    full = _check_all(write_plots(_summary(20), tmp_path / "full"), tmp_path / "full")
    empty = _check_all(write_plots({}, tmp_path / "empty"), tmp_path / "empty")
    for drawn, blank in zip(full, empty, strict=True):
        assert drawn.shape != blank.shape or (drawn != blank).any()


@needs_matplotlib
def test_rewrites_existing_files(tmp_path: Path) -> None:
    for name in NAMES:
        (tmp_path / name).write_bytes(b"stale")
    _check_all(write_plots(_summary(3), tmp_path), tmp_path)


def test_missing_matplotlib_raises_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes `import matplotlib...` raise ImportError, as if absent.
    for module in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"pip install 'tierd\[plots\]'") as info:
        write_plots(_summary(3), tmp_path / "out")
    assert str(info.value) == "matplotlib is needed for plots: pip install 'tierd[plots]'"
    assert not (tmp_path / "out").exists()
