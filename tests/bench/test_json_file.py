"""adaspec.bench.json_file.read_json: a result JSON read plain, .xz or .gz, the same document."""
import gzip
import json
import lzma

import pytest

from adaspec.bench.json_file import read_json

DOC = {"rows": [{"arm": "none", "concurrency": 1, "output_throughput": 697.6}], "cost_tables": {}}


@pytest.mark.parametrize("name, opener", [("s.json", open), ("s.json.xz", lzma.open), ("s.json.gz", gzip.open)])
def test_every_form_reads_the_same_document(tmp_path, name, opener):
    with opener(tmp_path / name, "wt") as f:
        f.write(json.dumps(DOC))
    assert read_json(tmp_path / name) == DOC
    assert read_json(str(tmp_path / name)) == DOC


def test_a_compressed_file_under_a_plain_name_is_an_error_not_garbage(tmp_path):
    with lzma.open(tmp_path / "s.json", "wt") as f:
        f.write(json.dumps(DOC))
    with pytest.raises(UnicodeDecodeError):
        read_json(tmp_path / "s.json")
