"""Reading back what a run's trackers and profiler wrote, for the tracking tests.

W&B's transaction log (run-<id>.wandb): wandb 0.31 has no Python reader of its own any more
(wandb-core, in Go, writes the file); the format is its LevelDB-style log, the records
wandb's own `Record` protobufs.
"""

import json
import math
import struct
import zlib
from pathlib import Path

from tests.conftest import read_metrics


def wandb_offline_env(root: Path) -> dict:
    """The environment of an offline W&B run whose every file (wandb-core's debug logs in its
    cache folder included) lands under `root`."""
    return {"WANDB_MODE": "offline",
            **{f"WANDB_{name}_DIR": str(root / f"wandb-{name.lower()}") for name in ("CONFIG", "CACHE", "DATA")}}


def only_run_log(run_dir: Path) -> Path:
    """The transaction log of the one offline W&B run in `run_dir`."""
    [log] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return log


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log: a header (':W&B', magic 0xBEE1, version 0), then
    LevelDB-style log blocks of 32 KiB whose chunks (CRC-32 seeded with the chunk type, length,
    type: full/first/middle/last) carry serialized `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pending += chunk
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list) -> dict[int, dict]:
    """step -> {metric: value} of the logged history (W&B's own _step/_runtime/_timestamp left out)."""
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def assert_holds_the_jsonl_scalars(records: list, run_dir: Path, steps: list[int]) -> None:
    """The W&B history has exactly metrics.jsonl's steps, keys and values."""
    history = wandb_history(records)
    logged = {row.pop("step"): row for row in read_metrics(run_dir)}
    assert sorted(history) == sorted(logged) == steps
    for step, row in logged.items():
        assert set(history[step]) == set(row), step
        for key, value in row.items():
            assert math.isclose(history[step][key], value, rel_tol=1e-12), (step, key, history[step][key], value)


def profiled_steps(run_dir: Path, rank: int) -> list[str]:
    """The `step N` annotations in a rank's Chrome trace (hpsft/utils/profiling.py), sorted."""
    trace = json.loads((run_dir / "profile" / f"rank{rank}_trace.json").read_text())
    return sorted(event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("step "))
