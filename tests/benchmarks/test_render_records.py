"""benchmarks/render_records.py: the docs match the records, and each row is the newest."""

import json

import pytest

from benchmarks import render_records
from benchmarks import results as results_lib

_TABLE = "| model | implementation | scanned | step ms (median) | tokens/s |\n|---|---|---|---|---|\n"


def _record(date, rows, size="170m", **extra):
  return {"benchmark": "train_throughput", "title": "t", "date": date, "device": "NVIDIA H200",
          "num_devices": 1, "backend": "gpu", "versions": {"jax": "0.11.2"}, "git_ref": None,
          "command": "python -m benchmarks.step.throughput", "notes": [], "figures": None,
          "settings": {"size": size, "batch_size": 4, "seq_len": 4096, "remat": False,
                       "context_parallel": False, **extra},
          "table": results_lib.parse_table(_TABLE + "\n".join(rows))}


def test_the_docs_are_rendered_from_the_current_records():
  records = results_lib.load_records()
  stale = [str(path) for path in render_records.documents()
           if render_records.render_text(path.read_text(), records) != path.read_text()]
  assert not stale, f"run `python -m benchmarks.render_records`; out of date: {stale}"


def test_every_view_is_used_in_a_document():
  text = "".join(path.read_text() for path in render_records.documents())
  assert {name for name in render_records.VIEWS if f"<!-- records:{name} -->" not in text} == set()


def test_each_row_comes_from_the_newest_record_that_has_it(tmp_path):
  for record in [_record("2026-12-01 06:18 UTC", ["| palimpsa_d | auto | no | 121.5 | 134,894 |",
                                                  "| mamba2 | auto | no | 165.9 | 98,758 |"]),
                 _record("2026-11-30 09:25 UTC", ["| palimpsa_d | auto | no | 158.9 | 103,106 |",
                                                  "| not_palimpsa | auto | no | 108.9 | 150,483 |"]),
                 _record("2026-12-01 19:00 UTC", ["| palimpsa_d | auto | no | 1.0 | 9 |"],
                         context_parallel=True),
                 _record("2026-12-02 10:00 UTC", ["| mamba2 | auto | no | 160.0 | 102,400 |"],
                         size="760m")]:
    results_lib.write_record(record, tmp_path)
  table = render_records.train_throughput_170m(results_lib.load_records(tmp_path))
  lines = {line.split(" | ")[1]: line for line in table.splitlines()[2:]}
  assert set(lines) == {"palimpsa_d", "mamba2", "not_palimpsa"}
  assert "| 134,894 |" in lines["palimpsa_d"] and "2026-12-01 06:18" in lines["palimpsa_d"]
  assert "| 98,758 |" in lines["mamba2"]  # Not the 760m record, though newer.
  assert "2026-11-30 09:25" in lines["not_palimpsa"]


def test_a_queued_step_time_is_shown_over_the_synced_one_and_says_so(tmp_path):
  record = _record("2026-12-02 18:42 UTC", [])
  record["table"] = results_lib.parse_table(
      "| model | implementation | scanned | step ms (queued) | tokens/s | synced step ms (median) |"
      "\n|---|---|---|---|---|---|\n| palimpsa_d | auto | no | 109.1 | 150,153 | 142.8 |")
  results_lib.write_record(record, tmp_path)
  (line,) = render_records.train_throughput_170m(
      results_lib.load_records(tmp_path)).splitlines()[2:]
  assert "| 109.1 | queued | 150,153 |" in line and "142.8" not in line


def test_render_text_replaces_only_the_block_and_rejects_unknown_views(tmp_path):
  results_lib.write_record(_record("2026-12-01 06:18 UTC",
                                   ["| mamba2 | auto | no | 165.9 | 98,758 |"]), tmp_path)
  records = results_lib.load_records(tmp_path)
  text = "before\n<!-- records:train_throughput_170m -->\nold\n<!-- /records -->\nafter\n"
  rendered = render_records.render_text(text, records)
  assert rendered.startswith("before\n<!-- records:train_throughput_170m -->\n| size |")
  assert "\nold\n" not in rendered
  assert rendered.endswith("| 165.9 | synced | 98,758 | - | - | - | - | 2026-12-01 06:18, H200 |\n"
                           "<!-- /records -->\nafter\n")
  assert render_records.render_text(rendered, records) == rendered
  with pytest.raises(ValueError, match="unknown records view 'nope'"):
    render_records.render_text("<!-- records:nope -->\n<!-- /records -->", records)


def test_write_record_never_overwrites_and_keeps_rows_on_one_line(tmp_path):
  record = _record("2026-12-01 06:18 UTC", ["| mamba2 | auto | no | 165.9 | 98,758 |"])
  first, second = (results_lib.write_record(record, tmp_path) for _ in range(2))
  assert (first.name, second.name) == ("train_throughput_2026-12-01T0618.json",
                                       "train_throughput_2026-12-01T0618_2.json")
  assert '["mamba2", "auto", "no", "165.9", "98,758"]' in first.read_text()
  assert json.loads(first.read_text()) == record


def test_parse_table_rejects_a_ragged_row():
  with pytest.raises(ValueError, match="2 cells, the header 3"):
    results_lib.parse_table("| a | b | c |\n|---|---|---|\n| 1 | 2 |")
