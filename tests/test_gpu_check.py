"""bench/gpu_check.py, the script a session lent a GPU runs, runs here on the CPU: its parity part
(every architecture in bfloat16 against CPU float32, against transformers in bfloat16, and replayed
from its token bucket's graph against its eager forward) and its JSON file. The GPU's own kernels
and figures need the device; this keeps the script from rotting between the sessions that have one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "deberta-v2", "modernbert", "nomic-bert"}


def test_the_gpu_check_script_runs_its_parity_on_the_cpu_and_writes_its_json(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "run",
            "--device",
            "cpu",
            "--skip-bench",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["architecture"]: row for row in record["parity"]}
    assert FAMILIES <= set(rows) and any(name.startswith("qwen3") for name in rows)
    for name, row in rows.items():
        assert row["bfloat16_ok"], (name, row)
        assert 0.999 <= row["bfloat16_vs_transformers"] <= 1.0 + 1e-6, (name, row)
        assert row["bfloat16"] < 0.999999, (name, "bfloat16 really ran")
        # Replayed from its token bucket's graph (on the CPU a capture that re-runs): the same states.
        if name == "deberta-v2":  # `graphable = False`: never captured, as the server runs it
            assert row["bfloat16_graph"].startswith("eager"), row
        else:
            assert isinstance(row["bfloat16_graph"], float) and row["bfloat16_graph"] >= 0.999, (name, row)
    assert record["bf16_peak_flops"] > 0
