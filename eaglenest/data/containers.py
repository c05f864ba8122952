"""Records of a dataset file or folder, whatever holds them: JSONL, a JSON array, Parquet, or a
folder written by `datasets`' save_to_disk (Arrow stream files, read with pyarrow alone).

Each record comes with where it is, for errors: "file:line" (JSONL, counted from 1, as every
JSONL error of the workflow says), "file: record N" (a JSON array) and "file: row N" (Parquet
and save_to_disk, counted from 0 as `datasets` and pandas index them). Records are read in
batches, never a whole Parquet or Arrow file at once.
"""

import json
from pathlib import Path

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import read_jsonl

BATCH_ROWS = 4096  # Parquet/Arrow rows turned into Python objects at a time


def read_records(path):
    """(where, record) for each record of `path`, in order (see the module's docstring)."""
    path = Path(path)
    if path.is_dir():
        return _saved_dataset_rows(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder")
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix == ".arrow":
        return _arrow_rows(path, [path])
    if _is_json_array(path):
        return _json_array_records(path)
    return read_jsonl(path)


def _is_json_array(path):
    """Whether the file's first non-blank character opens a JSON array (else: JSONL, whatever its
    name: dataset hubs often call JSONL files .json)."""
    with open(path, encoding="utf-8") as f:
        while block := f.read(4096):
            if block.strip():
                return block.lstrip().startswith("[")
    return False


def _json_array_records(path):
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
    for index, record in enumerate(records):
        yield f"{path}: record {index}", record


def _batch_rows(path, batches, first_row=0):
    """(where, row dict) of record batches, rows numbered on from `first_row`."""
    row = first_row
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path}: row {row}", record
            row += 1


def _parquet_rows(path):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is no Parquet
        raise InputError(f"{path}: not a readable Parquet file: {e}") from None
    yield from _batch_rows(path, parquet.iter_batches(batch_size=BATCH_ROWS))


def _arrow_rows(name, files):
    """Rows of Arrow IPC stream files (what save_to_disk writes), numbered on across the files."""
    import pyarrow as pa

    row = 0
    for file in files:
        with pa.memory_map(str(file)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid as e:
                raise InputError(f"{file}: not an Arrow stream file: {e}") from None
            for where, record in _batch_rows(name, _rebatched(reader), row):
                row += 1
                yield where, record


def _rebatched(reader):
    """The reader's batches cut to BATCH_ROWS rows (save_to_disk writes batches of 1,000 rows, but
    another writer's may hold a whole file)."""
    for batch in reader:
        for start in range(0, batch.num_rows, BATCH_ROWS):
            yield batch.slice(start, BATCH_ROWS)


def _saved_dataset_rows(folder):
    """Rows of a folder written by Dataset.save_to_disk: its state.json lists the Arrow files in
    order. A DatasetDict's folder holds one such folder per split: name the split's."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise InputError(f"{folder}: a DatasetDict (splits {', '.join(splits)}): give one split's folder, "
                         f"e.g. {folder / (splits[0] if splits else 'train')}")
    state = folder / "state.json"
    if not state.is_file():
        raise InputError(f"{folder}: a folder, but not one written by datasets' save_to_disk (no state.json)")
    try:
        files = [folder / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{state}: field '_data_files': not save_to_disk's list of Arrow files ({e!r})") from None
    return _arrow_rows(folder, files)
