"""train_and_evaluate end to end on a tiny model: loss, metrics, resume, meshes, errors."""

import json
import os
import pathlib
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ml_collections
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import trainer
from tests.training import tiny_lm

REPO = pathlib.Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["train/loss"] for r in metrics_lib.read_metrics(workdir)
          if "train/loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One uninterrupted 16-step run (shared by the resume tests)."""
  with pytest.MonkeyPatch.context() as patcher:
    tiny_lm.use_tiny_model(patcher)
    workdir = str(tmp_path_factory.mktemp("uninterrupted"))
    summary = trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(16), workdir)
  return workdir, summary


def test_smoke_loss_falls_and_metrics_written(tmp_path, capsys):
  config = tiny_lm.tiny_mqar_config(**{"optimizer.learning_rate": 3e-2},
                                    log_every_steps=4)
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  records = metrics_lib.read_metrics(str(tmp_path))
  losses = [r["train/loss"] for r in records if "train/loss" in r]
  assert losses[-1] < losses[0] - 0.05
  for key in ("step", "train/loss", "train/grad_norm", "train/lr",
              "perf/tokens_per_sec"):
    assert key in next(r for r in records if "train/loss" in r)
  # The first step's record holds the start-up timings, once.
  assert records[0]["step"] == 1 and records[0]["perf/compile_s"] > 0
  assert records[0]["perf/time_to_first_step_s"] >= records[0]["perf/compile_s"]
  assert sum("perf/compile_s" in r for r in records) == 1
  evals = [r for r in records if "eval/accuracy" in r]
  assert evals and all("eval/loss" in r for r in evals)
  assert summary["final_step"] == summary["total_steps"] == 32
  assert summary["best_accuracy"] == max(r["eval/accuracy"] for r in evals)
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["best_step"] == summary["best_step"]
  out = capsys.readouterr().out
  assert "steps/s" in out and "ETA" in out
  assert out.strip().splitlines()[-1].startswith("final: best eval accuracy")
  assert checkpoint_lib.load_config(str(tmp_path)).data.num_kv_pairs == 2
  (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
  assert events.stat().st_size > 100


def test_resume_reproduces_uninterrupted_run(tmp_path, uninterrupted):
  """8 steps, then the same command with total_steps=16 == 16 uninterrupted steps."""
  workdir, _ = uninterrupted
  trainer.train_and_evaluate(
      tiny_lm.resumable_mqar_config(8, async_checkpointing=True), str(tmp_path))
  summary = trainer.train_and_evaluate(
      tiny_lm.resumable_mqar_config(16, async_checkpointing=True), str(tmp_path))
  assert summary["final_step"] == 16
  assert _losses(str(tmp_path)) == _losses(workdir)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "16"]

  # Preempted after the (async) checkpoint at step 12: the rerun resumes there.
  shutil.rmtree(tmp_path / "checkpoints" / "16")
  records = [r for r in metrics_lib.read_metrics(str(tmp_path)) if r["step"] <= 12]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  trainer.train_and_evaluate(
      tiny_lm.resumable_mqar_config(16, async_checkpointing=True), str(tmp_path))
  assert _losses(str(tmp_path)) == _losses(workdir)


def test_load_model_restores_trained_parameters(uninterrupted):
  workdir, _ = uninterrupted
  model, config, step = checkpoint_lib.load_model(workdir)
  assert step == 16 and config.seq_len == 16
  tokens = jnp.zeros((1, config.seq_len), jnp.int32)
  assert model(tokens).shape == (1, 16, tiny_lm.VOCAB)
  earlier, _, step = checkpoint_lib.load_model(
      os.path.join(workdir, "checkpoints", "12"))
  assert step == 12
  assert not np.allclose(nnx.state(earlier, nnx.Param)["mix"]["kernel"][...],
                         nnx.state(model, nnx.Param)["mix"]["kernel"][...])
  with pytest.raises(FileNotFoundError, match="nowhere' does not exist"):
    checkpoint_lib.load_model(os.path.join(workdir, "nowhere"))
  with pytest.raises(FileNotFoundError, match="workdir written by train.py"):
    checkpoint_lib.load_model(os.path.join(workdir, "checkpoints"))


_MULTI_DEVICE_RUN = """
import jax, pytest
from palimpsa_jax.training import trainer
from tests.training import tiny_lm
tiny_lm.use_tiny_model(pytest.MonkeyPatch())
assert jax.device_count() == {devices}
config = tiny_lm.resumable_mqar_config(8)
config.mesh.data, config.mesh.fsdp, config.mesh.tensor = {mesh}
trainer.train_and_evaluate(config, {workdir!r})
"""


def _run_on_fake_devices(run_on_cpu_devices, workdir, devices, mesh):
  """8 training steps in a subprocess with `devices` CPU devices and `mesh`."""
  script = _MULTI_DEVICE_RUN.format(workdir=str(workdir), devices=devices, mesh=mesh)
  result = run_on_cpu_devices(script, devices)
  assert result.returncode == 0, result.stderr[-3000:]


def test_four_fake_devices_match_one_and_resume_on_one(tmp_path, uninterrupted,
                                                       run_on_cpu_devices):
  """Run 8 steps on a 2x2 (fsdp x tensor) mesh of 4 CPU devices, resume on 1."""
  _run_on_fake_devices(run_on_cpu_devices, tmp_path, 4, (1, 2, 2))
  four_device = _losses(str(tmp_path))
  reference = _losses(uninterrupted[0])
  assert sorted(four_device) == [2, 4, 6, 8]
  for step, loss in four_device.items():
    assert loss == pytest.approx(reference[step], abs=1e-5)
  trainer.train_and_evaluate(tiny_lm.resumable_mqar_config(16), str(tmp_path))
  resumed = _losses(str(tmp_path))
  for step in range(10, 17, 2):
    assert resumed[step] == pytest.approx(reference[step], abs=1e-5)


def test_eight_fake_devices_match_one(tmp_path, uninterrupted, run_on_cpu_devices):
  """data x fsdp x tensor = 2 x 2 x 2 over 8 CPU devices."""
  _run_on_fake_devices(run_on_cpu_devices, tmp_path, 8, (2, 2, 2))
  reference = _losses(uninterrupted[0])
  eight_device = _losses(str(tmp_path))
  assert sorted(eight_device) == [2, 4, 6, 8]
  for step, loss in eight_device.items():
    assert loss == pytest.approx(reference[step], abs=1e-5)


class _NanLM(tiny_lm.TinyLM):

  def _hidden(self, tokens, positions):
    return super()._hidden(tokens, positions) * jnp.nan


def test_non_finite_loss_stops_with_clear_error(tmp_path, monkeypatch):
  monkeypatch.setattr(state_lib, "run_model_fn", lambda config: lambda rngs: _NanLM(
      config.model.vocab_size, config.model.width, rngs))
  config = tiny_lm.tiny_mqar_config(log_every_steps=2)
  with pytest.raises(trainer.NonFiniteError, match="non-finite loss or gradient"):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / "checkpoints").exists() or not os.listdir(
      tmp_path / "checkpoints")


def test_non_finite_check_runs_before_evaluation(tmp_path, monkeypatch):
  monkeypatch.setattr(state_lib, "run_model_fn", lambda config: lambda rngs: _NanLM(
      config.model.vocab_size, config.model.width, rngs))
  config = tiny_lm.tiny_mqar_config(log_every_steps=1000, eval_every_steps=2,
                                    checkpoint_every_steps=1000)
  with pytest.raises(trainer.NonFiniteError, match="at or before step 2"):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / "metrics.jsonl").exists() or not any(
      "eval/loss" in record for record in metrics_lib.read_metrics(str(tmp_path)))


@pytest.mark.parametrize("field, value, match", [
    ("task", "vision", "config.task"),
    ("batch_size", 0, "config.batch_size"),
    ("grad_accum_steps", 3, "multiple of grad_accum_steps"),
    ("optimizer.learning_rate", -1.0, "learning_rate"),
    ("mesh.data", 3, "devices"),
    ("init_on_host", "yes", "config.init_on_host"),
])
def test_bad_config_values(tmp_path, field, value, match):
  config = tiny_lm.tiny_mqar_config(**{field: value})
  with pytest.raises(ValueError, match=match):
    trainer.train_and_evaluate(config, str(tmp_path))


def test_batch_must_split_over_the_batch_shards(monkeypatch):
  monkeypatch.setattr(jax, "device_count", lambda: 4)
  config = tiny_lm.tiny_mqar_config(batch_size=6)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  with pytest.raises(ValueError, match="data x fsdp = 4 batch shards"):
    trainer.validate_config(config)
  config.batch_size = 8
  trainer.validate_config(config)
  config.eval_batch_size = 6
  with pytest.raises(ValueError, match="config.eval_batch_size=6 must split evenly"):
    trainer.validate_config(config)


@pytest.mark.parametrize("batch, shards, device_batch, expected", [
    (128, 1, 8, 16),   # 170m on one GPU: 16 microbatches of 8
    (128, 8, 8, 2),
    (128, 16, 8, 1),
    (12, 2, 4, 2),     # 3 per device: 4 would not divide the batch
    (16, 1, 16, 1),
])
def test_auto_grad_accum_steps(batch, shards, device_batch, expected):
  config = tiny_lm.tiny_mqar_config(batch_size=batch, grad_accum_steps=None,
                                    device_batch=device_batch)
  assert trainer.grad_accum_steps(config, shards) == expected
  config.grad_accum_steps = 4
  assert trainer.grad_accum_steps(config, shards) == 4


def test_auto_grad_accum_steps_errors():
  config = tiny_lm.tiny_mqar_config(batch_size=12, grad_accum_steps=None)
  with pytest.raises(ValueError, match="needs config.device_batch"):
    trainer.grad_accum_steps(config, 1)
  config.device_batch = 1
  with pytest.raises(ValueError, match="cannot be split"):
    trainer.grad_accum_steps(config, 8)
  config.grad_accum_steps = 0
  with pytest.raises(ValueError, match=r"positive int, or None \(auto"):
    trainer.validate_config(config)


def test_lm_task_needs_total_steps(tmp_path):
  config = tiny_lm.tiny_mqar_config(task="lm", total_steps=None, num_epochs=2)
  with pytest.raises(ValueError, match="config.total_steps must be > 0"):
    trainer.train_and_evaluate(config, str(tmp_path))


def test_lm_targets_stop_at_document_boundaries_and_padding():
  batch = {"tokens": np.array([[5, 6, 7, 8, 9]]),
           "segment_ids": np.array([[0, 0, 1, 1, 1]]),
           "mask": np.array([[1, 1, 1, 1, 0]])}
  out = tasks_lib.with_lm_targets(batch)
  assert sorted(out) == ["segment_ids", "targets", "tokens"]
  np.testing.assert_array_equal(out["targets"], [[6, -100, 8, -100, -100]])


def _write_text_docs(root) -> None:
  """root/{train,valid}/doc<i>.txt: 12 documents each, of 60 words."""
  words = ["memory", "plastic", "prior", "state", "forget", "learn", "token"]
  for split in ("train", "valid"):
    (root / split).mkdir()
    for i in range(12):
      text = " ".join(words[(i * j) % len(words)] for j in range(60))
      (root / split / f"doc{i}.txt").write_text(text)


def test_lm_task_trains_on_text_files(tmp_path):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("lm_config", REPO / "configs" / "lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(
      "model=palimpsa_d,size=tiny,seq_len=32,batch_size=4,total_steps=6,warmup_steps=2")
  config.model = ml_collections.ConfigDict({"vocab_size": 300, "width": 16})
  _write_text_docs(tmp_path)
  config.data.train_files = str(tmp_path / "train" / "*.txt")
  config.data.eval_files = str(tmp_path / "valid" / "*.txt")
  config.data.tokenizer = "bpe:300"
  config.data.eval_batches = 2
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 3
  config.async_checkpointing = False
  config.log_diagnostics = False
  workdir = tmp_path / "run"
  summary = trainer.train_and_evaluate(config, str(workdir))
  assert summary["final_step"] == 6 and (workdir / "tokenizer_bpe300.json").exists()
  records = metrics_lib.read_metrics(str(workdir))
  assert [r["step"] for r in records] == [1, 3, 6]  # 1: the start-up timings
  assert all(np.isfinite(r["eval/loss"]) for r in records[1:])
  config.model.vocab_size = 100
  with pytest.raises(ValueError, match="vocab_size=100"):
    trainer.train_and_evaluate(config, str(tmp_path / "run2"))
  assert not (tmp_path / "run2").exists()  # refused before the tokenizer was trained
  config.model.vocab_size = 300
  (tmp_path / "empty.txt").write_text("")
  config.data.train_files = str(tmp_path / "empty.txt")
  with pytest.raises(text_lib.DataError, match=(
      r"config.data.train_files='.*empty.txt': the 1 matched file\(s\) hold no text")):
    trainer.train_and_evaluate(config, str(tmp_path / "run3"))
  assert not (tmp_path / "run3").exists()


def test_lm_task_batches_hold_targets_and_its_iterator_resumes_exactly(tmp_path):
  _write_text_docs(tmp_path)
  config = tiny_lm.tiny_mqar_config(total_steps=4)
  config.task, config.seq_len, config.batch_size, config.eval_batch_size = "lm", 32, 4, 4
  config.model.vocab_size = 300
  config.data = ml_collections.ConfigDict(dict(
      train_files=str(tmp_path / "train" / "*.txt"),
      eval_files=str(tmp_path / "valid" / "*.txt"), tokenizer="bpe:300", eval_batches=2))
  task = tasks_lib.make_task(config, str(tmp_path))
  eval_batches = list(task.eval_batches())
  assert len(eval_batches) == 2
  for batch in [next(task.train_iterator), *eval_batches]:
    assert "mask" not in batch  # consumed by the targets
    scored = batch["targets"][:, :-1] != -100
    assert scored.any() and (batch["targets"][:, -1] == -100).all()
    np.testing.assert_array_equal(batch["targets"][:, :-1][scored],
                                  batch["tokens"][:, 1:][scored])  # the next token
  state = task.train_iterator.get_state()
  expected = [next(task.train_iterator) for _ in range(3)]
  again = tasks_lib.make_task(config, str(tmp_path))
  again.train_iterator.set_state(state)
  for want, got in zip(expected, [next(again.train_iterator) for _ in range(3)]):
    assert sorted(want) == sorted(got) == ["segment_ids", "targets", "tokens"]
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])


def test_lm_task_trains_on_prepared_token_shards(tmp_path):
  from palimpsa_jax.data import prepare  # pylint: disable=g-import-not-at-top
  _write_text_docs(tmp_path)
  prepare.main(["--files", str(tmp_path / "train" / "*.txt"), "--tokenizer", "bpe:300",
                "--output", str(tmp_path / "tokens_train")])
  prepare.main(["--files", str(tmp_path / "valid" / "*.txt"), "--tokenizer",
                str(tmp_path / "tokens_train" / "tokenizer.json"),
                "--output", str(tmp_path / "tokens_valid")])
  config = tiny_lm.tiny_mqar_config(total_steps=4, log_every_steps=2, eval_every_steps=4,
                                    checkpoint_every_steps=4)
  config.task, config.seq_len, config.batch_size, config.eval_batch_size = "lm", 32, 4, 4
  config.model.vocab_size = 300
  config.data = ml_collections.ConfigDict(dict(
      train_files=str(tmp_path / "tokens_train" / "*.npy"),
      eval_files=str(tmp_path / "tokens_valid" / "*.npy"), tokenizer="bpe:300",
      eval_batches=2))
  workdir = tmp_path / "run"
  summary = trainer.train_and_evaluate(config, str(workdir))
  assert summary["final_step"] == 4 and (workdir / "tokenizer_bpe300.json").exists()
  assert np.isfinite(summary["last_eval"]["eval/loss"])


@pytest.mark.parametrize("overrides", [
    dict(grad_accum_steps=2),
    dict(grad_accum_steps=None, device_batch=8),  # auto: 16 sequences -> 2 x 8
])
def test_gradient_accumulation_matches_full_batch(tmp_path, uninterrupted, overrides):
  config = tiny_lm.resumable_mqar_config(4, **overrides)
  trainer.train_and_evaluate(config, str(tmp_path))
  reference = _losses(uninterrupted[0])
  for step, loss in _losses(str(tmp_path)).items():
    assert loss == pytest.approx(reference[step], abs=1e-6)


def test_early_stop_and_no_retraining_on_rerun(tmp_path):
  config = tiny_lm.tiny_mqar_config(early_stop_accuracy=0.01, eval_every_steps=2)
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["stopped_early"] and summary["final_step"] < 32
  again = trainer.train_and_evaluate(config, str(tmp_path))
  assert again["stopped_early"] and again["final_step"] == summary["final_step"]


def _mqar(arg: str) -> ml_collections.ConfigDict:
  """configs/mqar.py's config (the project's model) for a few-second run."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("mqar_config", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(
      "seq_len=16,num_kv_pairs=2,vocab_size=32,d_model=16,num_heads=2,num_train_examples=64,"
      f"num_test_examples=32,batch_size=16,total_steps=2,{arg}")


def _tree(directory: pathlib.Path) -> dict[str, bytes | None]:
  """Every file's bytes and every folder (None) under `directory`."""
  return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
          for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("field, value, match", [
    ("implementation", "foo", "config.model cannot be built and run: implementation must be "
                              "one of .*got 'foo'"),
    # configs/mqar.py refuses these as config arguments; set afterwards (--config.model.dtype),
    # train_and_evaluate refuses them.
    ("dtype", "float8", "config.model.dtype must be a floating dtype name"),
    ("chunk_size", 0, "config.model.chunk_size must be a positive int"),
])
def test_a_refused_start_writes_nothing(tmp_path, monkeypatch, field, value, match):
  monkeypatch.undo()  # the project's model, which refuses these
  config = _mqar("implementation=auto")
  config.model[field] = value
  with pytest.raises(ValueError, match=match):
    trainer.train_and_evaluate(config, str(tmp_path / "new"))
  assert not (tmp_path / "new").exists()
  workdir = tmp_path / "run"  # a workdir that holds a run is left byte for byte as it was
  trainer.train_and_evaluate(_mqar("implementation=auto"), str(workdir))
  before = _tree(workdir)
  with pytest.raises(ValueError, match=match):
    trainer.train_and_evaluate(config, str(workdir))
  assert _tree(workdir) == before
