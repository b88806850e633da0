"""eval.py's suites and generate.py's loading accept a conversion output as a checkpoint."""

import importlib.util
import json
import pathlib
import shutil
import types

import ml_collections
import numpy as np
import pytest

from tests.conversion import mamba2_fixtures as fx
from palimpsa_jax.conversion import command
from palimpsa_jax.data import tokenizer as tokenizer_lib
from palimpsa_jax.evaluation import generation
from palimpsa_jax.evaluation import lm as lm_lib
from palimpsa_jax.evaluation import suites

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

REPO = pathlib.Path(__file__).parents[2]
VOCAB = 300
DOCS = [f"Document {i}: " + " ".join(["alpha", "beta", "gamma"][: 1 + i % 3]) * 3
        for i in range(8)]


def _tiny(vocab_size: int) -> ml_collections.ConfigDict:
  config = fx.tiny_config()
  config.vocab_size = vocab_size
  return config


@pytest.fixture(name="lm", scope="module")
def _lm(tmp_path_factory):
  """A Mamba2 LM workdir (a bpe tokenizer, context 16) and its zero-init conversion."""
  root = tmp_path_factory.mktemp("lm")
  files = root / "docs.jsonl"
  files.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  workdir, dest = root / "run", root / "conv"
  workdir.mkdir()
  tokenizer = tokenizer_lib.load_or_train_tokenizer(f"bpe:{VOCAB}", str(files), str(workdir))
  config = _tiny(VOCAB)
  params = fx.random_params(config, seed=2)
  fx.write_workdir(str(workdir), config, params, ml_collections.ConfigDict(
      {"task": "lm", "seq_len": 16, "seed": 0, "data": {"tokenizer": f"bpe:{VOCAB}"}}))
  command.run_conversion(str(workdir), str(dest), "0", "zero", verbose=False)
  return types.SimpleNamespace(files=str(files), workdir=str(workdir), dest=str(dest),
                               config=config, params=params, tokenizer=tokenizer, root=root)


def test_lm_suites_on_a_zero_init_conversion_match_its_source(lm):
  options = {"files": lm.files, "batch_size": 2}
  source = suites.SUITES["lm"]({**options, "checkpoint": [lm.workdir]})["checkpoints"][lm.workdir]
  converted = suites.SUITES["lm"]({**options, "checkpoint": [lm.dest]})["checkpoints"][lm.dest]
  assert converted["step"] == 0 and converted["seq_len"] == 16
  assert converted["tokens"] == source["tokens"]
  np.testing.assert_allclose(converted["perplexity"], source["perplexity"], rtol=1e-5)
  curves = suites.SUITES["long_context"]({**options, "checkpoint": [lm.dest], "max_length": 16})
  assert curves["checkpoints"][lm.dest]["step"] == 0


def test_generation_from_a_conversion_matches_its_source(lm):
  sampling = generation.Sampling(max_new_tokens=4, temperature=0.0)
  texts = []
  for checkpoint in (lm.workdir, lm.dest):
    model, _, _, tokenizer = lm_lib.load_checkpoint(checkpoint)
    texts.append(generation.sample(model, tokenizer, "Document", sampling, lambda _: None)[0])
  assert texts[0] == texts[1]


def test_commonsense_model_loads_a_conversion(lm):
  pytest.importorskip("lm_eval")
  from palimpsa_jax.evaluation import commonsense  # pylint: disable=g-import-not-at-top
  assert commonsense.PalimpsaLM(checkpoint=lm.dest).max_length == 16


def test_hugging_face_conversion_uses_the_tokenizer_beside_its_source(lm, tmp_path):
  folder = str(tmp_path / "mamba2")
  fx.write_hf_checkpoint(folder, fx.to_hf_tensors(lm.params, lm.config, "mamba_ssm"),
                         {"ssm_cfg": {"ngroups": fx.NUM_GROUPS}})
  dest = str(tmp_path / "conv")
  command.run_conversion(folder, dest, "0", "zero", verbose=False)
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    lm_lib.load_checkpoint(dest)
  shutil.copy(tokenizer_lib.bpe_tokenizer_path(lm.workdir, VOCAB), folder + "/tokenizer.json")
  _, config, step, tokenizer = lm_lib.load_checkpoint(dest)
  assert (step, config.seq_len) == (0, 2048) and tokenizer.path == folder + "/tokenizer.json"
  result = suites.SUITES["lm"]({"checkpoint": [dest], "files": lm.files, "max_length": 16})
  result = result["checkpoints"][dest]
  source = suites.SUITES["lm"]({"checkpoint": [lm.workdir], "files": lm.files})
  source = source["checkpoints"][lm.workdir]
  np.testing.assert_allclose(result["perplexity"], source["perplexity"], rtol=1e-5)


def test_mqar_suite_on_a_conversion_matches_its_source(tmp_path):
  spec = importlib.util.spec_from_file_location("mqar_config", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  run_config = module.get_config("seq_len=16,num_kv_pairs=2")
  config = _tiny(run_config.model.vocab_size)
  workdir, dest = str(tmp_path / "run"), str(tmp_path / "conv")
  fx.write_workdir(workdir, config, fx.random_params(config, seed=3), run_config)
  command.run_conversion(workdir, dest, "0", "zero", verbose=False)
  options = {"num_examples": 64, "output": str(tmp_path / "out.json")}
  source = suites.SUITES["mqar"]({**options, "checkpoint": [workdir]})
  converted = suites.SUITES["mqar"]({**options, "checkpoint": [dest]})
  (before,), (after,) = source["evaluations"], converted["evaluations"]
  assert after["step"] == 0 and after["mixer"] == "mamba2+metaplastic[0]"
  np.testing.assert_allclose(after["results"][0]["loss"], before["results"][0]["loss"], rtol=1e-5)
  assert after["results"][0]["accuracy"] == before["results"][0]["accuracy"]

