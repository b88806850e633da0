"""palimpsa_jax/evaluation/tables.py: columns line up in a terminal whatever the characters."""

from palimpsa_jax.evaluation import mqar
from palimpsa_jax.evaluation import tables


def test_display_width_counts_terminal_columns():
  assert tables.display_width("runs/mqar") == 9
  assert tables.display_width("runs/模型") == 9  # two wide characters, two columns each
  assert tables.display_width("cafe\u0301") == 4  # a combining accent takes none
  assert tables.shorten("runs/" + "模" * 30, 12) == "..." + "模" * 4
  assert tables.display_width(tables.shorten("a/" + "x" * 50, 40)) == 40


def test_mqar_table_columns_align_with_wide_and_combining_characters():
  def evaluation(name):
    return {"checkpoint": name, "step": 936, "mixer": "palimpsa_d",
            "results": [{"seq_len": 32, "num_kv_pairs": 4, "accuracy": 0.99, "loss": 0.03}]}
  table = mqar.format_table([evaluation(n) for n in ("runs/模型", "runs/cafe\u0301", "runs/x")])
  header, rule, *rows = table.splitlines()
  assert len({tables.display_width(line) for line in (header, rule, *rows)}) == 1
  # Every row's step column ends where the header's does.
  end = tables.display_width(header[:header.index("step") + 4])
  for row in rows:
    assert tables.display_width(row.split(" 936")[0] + " 936") == end
