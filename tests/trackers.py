"""Readers of tracker files with the trackers' own libraries, shared by unit and CLI tests."""

import json
import struct
import time


def read_tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_records(path):
    """The records of a .wandb file: W&B's 7-byte header, then the LevelDB log format (32 KiB
    blocks of chunks, each with a 7-byte header: crc32, length, type), each record a protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a chunk header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # still being written
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL chunk, or the LAST of a FIRST, MIDDLE..., LAST series
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def finished_records(path, timeout_s=10.0):
    """The records of a session's file once W&B has written its last ("exit") record: the
    wandb-core process may still be writing the file for a moment after run.finish()."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def run_record(path):
    [run] = [r.run for r in finished_records(path) if r.WhichOneof("record_type") == "run"]
    return run


def wandb_history(path):
    rows = []
    for record in finished_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def comet_archive(path):
    """An offline Comet archive read with comet_ml's own code: unpacked by its
    unzip_offline_archive, experiment.json and each metric and parameter message checked
    against the JSON schemas comet_ml validates archives with before an upload.
    Returns (experiment metadata, metrics as [(name, step, value)], params {name: value},
    texts as [(step, name, text)])."""
    from pathlib import Path

    from comet_ml import schemas
    from comet_ml.offline import unzip_offline_archive

    folder = Path(unzip_offline_archive(str(path)))
    meta = json.loads((folder / "experiment.json").read_text(encoding="utf-8"))
    schemas.get_experiment_file_validator().validate(meta)
    metric_check, param_check = schemas.get_metric_msg_validator(), schemas.get_parameter_msg_validator()
    upload_check = schemas.get_upload_msg_validator()
    metrics, params, texts = [], {}, []
    for line in (folder / "messages.json").read_text(encoding="utf-8").splitlines():
        message = json.loads(line)
        if message["type"] == "metric_msg":
            metric_check.validate(message["payload"])
            m = message["payload"]["metric"]
            metrics.append((m["metricName"], m["step"], m["metricValue"]))
        elif message["type"] == "parameter_msg":
            param_check.validate(message["payload"])
            p = message["payload"]["param"]
            params[p["paramName"]] = p["paramValue"]
        elif message["type"] == "file_upload" and message["payload"]["upload_type"] == "text-sample":
            upload_check.validate(message["payload"])
            u = message["payload"]
            texts.append((u["additional_params"]["step"], u["metadata"]["name"],
                          (folder / u["file_path"]).read_text(encoding="utf-8")))
    return meta, metrics, params, texts
