"""Records of a dataset file or folder, whatever holds them: JSONL, a JSON array, Parquet, or a
folder written by `datasets`' save_to_disk (Arrow stream files, read with pyarrow alone).

Each record comes with where it is, for errors: "file:line" (JSONL, counted from 1, as every
JSONL error of the workflow says), "file: record N" (a JSON array) and "file: row N" (Parquet
and save_to_disk, counted from 0 as `datasets` and pandas index them). Records are read in
batches, never a whole Parquet or Arrow file at once, and a JSON array one record at a time.
Whatever is wrong with a file (not UTF-8 text, malformed JSON, a missing Arrow file) is an
InputError of one line naming it.
"""

import json
from pathlib import Path

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import read_jsonl

BATCH_ROWS = 4096  # Parquet/Arrow rows turned into Python objects at a time
JSON_CHUNK = 1 << 20  # characters of a JSON array read at a time (more while one record is longer)


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
    try:
        with open(path, encoding="utf-8") as f:
            while block := f.read(4096):
                if block.strip():
                    return block.lstrip().startswith("[")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text, so neither JSON nor JSONL (Parquet and Arrow files are told by "
                         "their suffix: name it .parquet or .arrow)") from None
    return False


def _json_array_records(path):
    """The records of a file holding one JSON array, decoded one at a time from chunks of the
    file (json.load would hold every record at once: ShareGPT's array is 670 MB)."""
    with open(path, encoding="utf-8") as f:
        text = _JsonText(path, f)
        text.expect("[")
        index = 0
        if text.peek() == "]":
            text.expect("]")
        else:
            while True:
                yield f"{path}: record {index}", text.value()
                index += 1
                if text.expect(",]") == "]":
                    break
        if text.peek() is not None:
            text.fail(text.pos, "Extra data after the array")


class _JsonText:
    """A JSON file read in chunks: the unread text is `buffer[pos:]`, whose start is at `line`
    (from 1) and `column` (from 0) of the file; errors say file:line and column as json.load's."""

    def __init__(self, path, file):
        self.path, self.file = path, file
        self.buffer, self.pos, self.line, self.column, self.ended = "", 0, 1, 0, False
        self.decoder = json.JSONDecoder()

    def more(self):
        """Read a chunk (at least as long as the text held), dropping what was read; False at the end."""
        consumed = self.buffer[: self.pos]
        newlines = consumed.count("\n")
        self.line += newlines
        self.column = len(consumed) - consumed.rfind("\n") - 1 if newlines else self.column + len(consumed)
        try:
            chunk = self.file.read(max(JSON_CHUNK, len(self.buffer)))
        except UnicodeDecodeError:
            raise InputError(f"{self.path}: not UTF-8 text after line {self.line}") from None
        self.buffer, self.pos = self.buffer[self.pos:] + chunk, 0
        self.ended = not chunk
        return bool(chunk)

    def fail(self, index, problem):
        """InputError at buffer[index], worded as every malformed JSON of the workflow."""
        before = self.buffer[:index]
        newlines = before.count("\n")
        column = index - before.rfind("\n") if newlines else self.column + index + 1
        raise InputError(f"{self.path}:{self.line + newlines}: malformed JSON: {problem} (column {column})")

    def peek(self):
        """The next non-blank character, not consumed (None at the end of the file)."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buffer):
                return self.buffer[self.pos]
            if not self.more():
                return None

    def expect(self, characters):
        """Consume the next non-blank character, which must be one of `characters`; returns it."""
        found = self.peek()
        if found is None or found not in characters:
            self.fail(self.pos, f"Expecting {' or '.join(repr(c) for c in characters)}"
                                + ("" if found is None else f", got {found!r}"))
        self.pos += 1
        return found

    def value(self):
        """Decode the next JSON value, reading on while it runs past the text held: an object,
        array or string is whole at its closing character, a number or literal only where a
        delimiter follows it ("12" may go on as "123", "1.5" as "1.5e3" in the next chunk). An
        error that more text leaves where it was is the record's own (but an unterminated string,
        which may be longer than the text held): the rest of the file is not read for it."""
        self.peek()
        last = None
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
                if self.ended or isinstance(value, (dict, list, str)) or self.buffer[end:end + 1] in tuple(",]} \t\r\n"):
                    self.pos = end
                    return value
            except json.JSONDecodeError as e:
                error = (e.msg, e.pos - self.pos)  # where in the record
                if self.ended or (error == last and not e.msg.startswith("Unterminated string")):
                    self.fail(e.pos, e.msg)
                last = error
            self.more()


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


def _json_file(path):
    """The value of a small JSON file (save_to_disk's state.json and dataset_dict.json)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno})") from None


def _saved_dataset_rows(folder):
    """Rows of a folder written by Dataset.save_to_disk: its state.json lists the Arrow files in
    order, each checked to be there before any is read. A DatasetDict's folder holds one such
    folder per split: name the split's."""
    dataset_dict = folder / "dataset_dict.json"
    if dataset_dict.is_file():
        splits = _json_file(dataset_dict)
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
            raise InputError(f"{dataset_dict}: field 'splits': missing, or not a list of split names")
        raise InputError(f"{folder}: a DatasetDict (splits {', '.join(splits)}): give one split's folder, "
                         f"e.g. {folder / (splits[0] if splits else 'train')}")
    state = folder / "state.json"
    if not state.is_file():
        raise InputError(f"{folder}: a folder, but not one written by datasets' save_to_disk (no state.json)")
    try:
        files = [folder / entry["filename"] for entry in _json_file(state)["_data_files"]]
    except (KeyError, TypeError) as e:
        raise InputError(f"{state}: field '_data_files': not save_to_disk's list of Arrow files ({e!r})") from None
    for file in files:
        if not file.is_file():
            raise InputError(f"{state}: field '_data_files': {file.name} is not in {folder}")
    return _arrow_rows(folder, files)
